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

from embark_jax.ops import _ffi, abi, native

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
    assert "AFTER True ['cpu']" in out, out


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
    hp = jnp.array([0.1, 1e-8, 0.0, 0.0], jnp.float32)
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
        r"sparse_update: hparams must have at least 4 elements .*got shape \[2\]",
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
        r"lookup_pool: weights must have 2 elements \(\[N\], one per id\), got shape \[3\]",
        lambda: _ffi.lookup_pool(
            jnp.zeros((4, 3)), ids, seg, jnp.ones((3,)), 1, "sum", jnp.float32, True
        ),
    )


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
