"""The native side of the ABI: targets register on first use (not at import), and a handler
called with operands that break its contract says which operand, and what it expected."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from embark_jax import ops
from embark_jax.ops import _ffi, abi, native
from embark_jax.ops import optimizers as O
from embark_jax.ops import update as U

pytestmark = pytest.mark.smoke


def _run(code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_importing_ops_loads_no_native_code_and_no_backend():
    """`import embark_jax.ops` neither loads the extension nor starts a JAX backend (the
    device count can still be set); the first kernel call registers the targets."""
    out = _run(
        """
        import sys
        import jax
        import embark_jax.ops as ops
        from embark_jax.ops import native
        print("LOADED", "embark_jax._ffi_cpu" in sys.modules, native._REGISTERED)
        jax.config.update("jax_num_cpu_devices", 8)
        import jax.numpy as jnp
        out = ops.segment_sum(jnp.ones((4, 2)), jnp.array([0, 1, 1, 3]), 4)
        print("SUM", out[:, 0].tolist(), jax.device_count())
        print("AFTER", "embark_jax._ffi_cpu" in sys.modules, sorted(native._REGISTERED))
        """
    )
    assert "LOADED False {}" in out, out
    assert "SUM [1.0, 2.0, 0.0, 1.0] 8" in out, out
    # with a JAX CUDA plugin (the GPU check) the CUDA targets register too
    assert "AFTER True ['cpu']" in out or "AFTER True ['CUDA', 'cpu']" in out, out


def test_reference_ops_never_load_native_code():
    out = _run(
        """
        import sys
        import jax.numpy as jnp
        from embark_jax import ops
        ops.segment_sum(jnp.ones((4, 2)), jnp.array([0, 1, 1, 3]), 4, backend="reference")
        print("LOADED", "embark_jax._ffi_cpu" in sys.modules)
        """
    )
    assert "LOADED False" in out, out


def test_build_info_registers_and_registration_is_idempotent():
    out = _run(
        """
        from embark_jax.ops import native
        info = native.build_info()
        native.ensure_registered()
        native.ensure_registered()
        print("CPU", info["registered"]["cpu"] == native.registered_targets()["cpu"])
        """
    )
    assert "CPU True" in out, out


def test_ensure_registered_is_cheap_after_the_first_call():
    native.ensure_registered()
    before = dict(native.registered_targets())
    native.ensure_registered()
    assert native.registered_targets() == before
    assert set(before["cpu"]) == set(abi.TARGETS)


def test_cuda_module_registers_the_abi_targets():
    """Both backends' registrations come from the ABI list (skipped in a CPU-only build; the
    CUDA module imports without a GPU)."""
    if not native.build_info()["cuda_built"]:
        pytest.skip("CUDA kernels not built")
    from embark_jax import _ffi_cuda

    assert sorted(_ffi_cuda.registrations()) == sorted(abi.TARGETS)


# --- handler error messages ---------------------------------------------------------------


def _fails(match: str, fn, *args):
    with pytest.raises(Exception, match=match):
        jax.block_until_ready(fn(*args))


def test_sparse_update_names_the_short_slot():
    table = jnp.zeros((10, 16), jnp.float32)
    small = jnp.zeros((1,), jnp.float32)
    rows = jnp.array([1, 2], jnp.int32)
    grads = jnp.ones((2, 16), jnp.float32)
    hp = U.kernel_hparams(O.Adagrad(learning_rate=0.1, eps=1e-8), None)
    _fails(
        r"sparse_update: slot_a must have at least 160 elements \(ADAGRAD on a \[10, 16\] "
        r"table\), got shape \[1\]",
        lambda: _ffi.sparse_update(table, small, small, rows, grads, hp, abi.OptimizerId.ADAGRAD),
    )
    _fails(
        r"sparse_update: attribute optimizer must be one of 0 \(SGD\), 1 \(ADAGRAD\), "
        r"2 \(ROW_WISE_ADAGRAD\), 3 \(ADAM\), got 9",
        lambda: _ffi.sparse_update(table, small, small, rows, grads, hp, 9),
    )
    _fails(
        r"sparse_update: hparams must have at least 7 elements .*got shape \[2\]",
        lambda: _ffi.sparse_update(table, small, small, rows, grads, hp[:2], 0),
    )
    _fails(
        r"sparse_update: rows must have 2 elements .*got shape \[3\]",
        lambda: _ffi.sparse_update(table, small, small, jnp.arange(3), grads, hp, 0),
    )


def test_lookup_pool_names_operand_and_dtype():
    ids = jnp.array([0, 1], jnp.int32)
    seg = jnp.array([0, 0], jnp.int32)
    w = jnp.ones((2,), jnp.float32)
    _fails(
        r"lookup_pool: table must be float32 or bfloat16, got int32",
        lambda: _ffi.lookup_pool(
            jnp.zeros((4, 3), jnp.int32), ids, seg, w, 1, "sum", jnp.float32, True
        ),
    )
    _fails(
        r"lookup_pool: weights must have 2 elements \(\[N\], one per id, or \[0\]\), got shape "
        r"\[3\]",
        lambda: _ffi.lookup_pool(
            jnp.zeros((4, 3)), ids, seg, jnp.ones((3,)), 1, "sum", jnp.float32, True
        ),
    )
    # [0] is the unweighted form (every weight 1), not an error
    table = jnp.arange(12, dtype=jnp.float32).reshape(4, 3)
    got = _ffi.lookup_pool(table, ids, seg, jnp.zeros((0,)), 1, "mean", jnp.float32, True)
    np.testing.assert_allclose(np.asarray(got), [[1.5, 2.5, 3.5]])
    with pytest.raises(
        ValueError, match=r"lookup_pool: weights must be \[N\] = \(2,\), got \(0,\)"
    ):
        ops.lookup_pool(table, ids, seg, 1, jnp.zeros((0,)))


def test_segment_sum_and_unique_name_the_operand():
    _fails(
        r"segment_sum: segment_ids must be int32 or int64, got float32",
        lambda: _ffi.segment_sum(jnp.ones((3, 2)), jnp.zeros((3,), jnp.float32), 2),
    )
    _fails(
        r"unique: ids must be int32 or int64, got float32",
        lambda: _ffi.unique(jnp.zeros((3,), jnp.float32), 4),
    )


def test_sparse_grad_names_the_mismatched_width():
    grads = jnp.ones((2, 5), jnp.float32)
    ids = jnp.array([3, 3, 1], jnp.int32)
    seg = jnp.array([0, 1, 1], jnp.int32)
    scale = jnp.ones((2,), jnp.float32)
    _fails(
        r"sparse_grad: scale must have 3 elements \(\[N\], one per id\), got shape \[2\]",
        lambda: _ffi.sparse_grad(grads, ids, seg, scale, 4, False),
    )


def test_valid_calls_still_succeed():
    """The checks accept what the ops pass (the kernels' own tests cover the values)."""
    rows, grads_out, num = _ffi.sparse_grad(
        jnp.ones((2, 5)), jnp.array([3, 3, 1]), jnp.array([0, 1, 1]), jnp.ones((3,)), 4, False
    )
    assert np.asarray(rows).tolist() == [1, 3, -1, -1] and int(num) == 2
    np.testing.assert_allclose(np.asarray(grads_out)[:2], [[1.0] * 5, [2.0] * 5])


# The checks below guard writes past the end of a buffer, on both backends alike (one shared
# header, embark_operands.h): each test calls the target directly with one result sized wrong.


def _optimizer_outputs(table, slot_a, slot_b):
    return (
        _ffi.result_type(table, table.shape, table.dtype),
        _ffi.result_type(slot_a, slot_a.shape, jnp.float32),
        _ffi.result_type(slot_b, slot_b.shape, jnp.float32),
    )


def test_lookup_pool_none_needs_a_row_per_id():
    ids = jnp.array([0, 1, 2], jnp.int32)
    _fails(
        r"lookup_pool: output: combiner NONE gives a row per id: 3 rows expected, got 2",
        lambda: _ffi.lookup_pool(
            jnp.zeros((5, 4)),
            ids,
            jnp.zeros((3,), jnp.int32),
            jnp.ones((3,)),
            2,
            "none",
            jnp.float32,
            False,
        ),
    )


def test_sparse_grad_row_grads_must_match_the_capacity():
    ids = jnp.array([3, 3, 1], jnp.int32)
    call = _ffi._call(
        abi.Target.SPARSE_GRAD,
        (
            _ffi.result_type(ids, (4,), ids.dtype),
            _ffi.result_type(ids, (3, 5), jnp.float32),  # 3 rows for a capacity of 4
            _ffi.result_type(ids, (), jnp.int32),
            _ffi._dedup_workspace(ids),
        ),
    )
    _fails(
        r"sparse_grad: row_grads must have dimension 0 = 4 \(C, the capacity of unique_rows\), "
        r"got shape \[3, 5\]",
        lambda: call(
            jnp.ones((2, 5)), ids, jnp.array([0, 1, 1]), jnp.ones((3,)), per_id=np.int64(0)
        ),
    )


def test_row_wise_slot_with_the_elementwise_kernel_is_refused():
    """A RowWiseAdagrad slot [V] passed with the Adagrad kernel id would be written V*D."""
    table = jnp.zeros((10, 16), jnp.float32)
    per_row, unused = jnp.zeros((10,), jnp.float32), jnp.zeros((1,), jnp.float32)
    hp = U.kernel_hparams(O.Adagrad(learning_rate=0.1, eps=1e-8), None)
    ids = jnp.array([1, 2], jnp.int32)
    _fails(
        r"sparse_grad_update: slot_a must have at least 160 elements \(ADAGRAD on a \[10, 16\] "
        r"table\), got shape \[10\]",
        lambda: _ffi.sparse_grad_update(
            table,
            per_row,
            unused,
            jnp.ones((2, 16)),
            ids,
            jnp.array([0, 1]),
            jnp.ones((2,)),
            hp,
            abi.OptimizerId.ADAGRAD,
            False,
        ),
    )
    _fails(
        r"sparse_grad_update: hparams must have at least 7 elements .*got shape \[3\]",
        lambda: _ffi.sparse_grad_update(
            table,
            per_row,
            unused,
            jnp.ones((2, 16)),
            ids,
            jnp.array([0, 1]),
            jnp.ones((2,)),
            hp[:3],
            abi.OptimizerId.ROW_WISE_ADAGRAD,
            False,
        ),
    )
    # the same slot with its own kernel id is accepted
    out = _ffi.sparse_grad_update(
        table,
        per_row,
        unused,
        jnp.ones((2, 16)),
        ids,
        jnp.array([0, 1]),
        jnp.ones((2,)),
        hp,
        abi.OptimizerId.ROW_WISE_ADAGRAD,
        False,
    )
    assert int(out[3]) == 2


def test_aliased_outputs_must_match_their_inputs():
    """The table and slot outputs are the inputs updated in place: a smaller output would be
    copied into and updated past its end when XLA does not alias it."""
    table = jnp.zeros((10, 16), jnp.float32)
    slot, unused = jnp.zeros((160,), jnp.float32), jnp.zeros((1,), jnp.float32)
    hp = U.kernel_hparams(O.Adagrad(learning_rate=0.1, eps=1e-8), None)
    rows, grads = jnp.array([1, 2], jnp.int32), jnp.ones((2, 16), jnp.float32)
    small_table = jnp.zeros((4, 16), jnp.float32)
    update = _ffi._call(abi.Target.SPARSE_UPDATE, _optimizer_outputs(small_table, slot, unused))
    _fails(
        r"sparse_update: table output must have shape \[10, 16\] \(the table's: it is updated "
        r"in place\), got shape \[4, 16\]",
        lambda: update(table, slot, unused, rows, grads, hp, optimizer=np.int64(1)),
    )
    bf16_table = _ffi._call(
        abi.Target.SPARSE_UPDATE,
        _optimizer_outputs(table.astype(jnp.bfloat16), slot, unused),
    )
    _fails(
        r"sparse_update: table output must be float32 \(the table's dtype\), got bfloat16",
        lambda: bf16_table(table, slot, unused, rows, grads, hp, optimizer=np.int64(1)),
    )
    ids = jnp.array([1, 2], jnp.int32)
    fused = _ffi._call(
        abi.Target.SPARSE_GRAD_UPDATE,
        (
            *_optimizer_outputs(table, jnp.zeros((16,)), unused),
            _ffi.result_type(ids, (), jnp.int32),
            _ffi._dedup_workspace(ids),
        ),
    )
    _fails(
        r"sparse_grad_update: slot_a output must have shape \[160\] \(slot_a's: it is updated "
        r"in place\), got shape \[16\]",
        lambda: fused(
            table,
            slot,
            unused,
            grads,
            ids,
            jnp.array([0, 1]),
            jnp.ones((2,)),
            hp,
            optimizer=np.int64(1),
            per_id=np.int64(0),
        ),
    )


def test_num_unique_must_be_a_scalar():
    ids = jnp.array([3, 3, 1], jnp.int32)
    call = _ffi._call(
        abi.Target.UNIQUE,
        (
            _ffi.result_type(ids, (4,), ids.dtype),
            _ffi.result_type(ids, (3,), jnp.int32),
            _ffi.result_type(ids, (4,), jnp.int32),
            _ffi.result_type(ids, (0,), jnp.int32),  # nowhere to write the count
            _ffi._dedup_workspace(ids),
        ),
    )
    _fails(r"unique: num_unique must have 1 elements \(a scalar\), got shape \[0\]", call, ids)
