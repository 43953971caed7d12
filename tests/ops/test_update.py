"""The undoable update (`stage_backward_update` + `commit_update`) against the fused in-place
one (`lookup_pool_backward_update`), kernels and reference: its staged slots (min(N, V)),
the verdict, the ordering operands, and the kernel's handling of ids past the table."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from embark_jax import ops
from embark_jax.ops import _ffi
from embark_jax.ops import optimizers as O
from embark_jax.ops.update import kernel_hparams, kernel_slots

V, D, S = 6, 8, 5  # rows, dim, bags: N = 20 ids > V, so the staged slots are V


def inputs(seed=0):
    rng = np.random.default_rng(seed)
    table = jnp.asarray(rng.normal(size=(V, D)), jnp.float32)
    ids = rng.integers(-1, V, 20).astype(np.int32)  # duplicates and padding
    seg = np.sort(rng.integers(0, S, 20)).astype(np.int32)
    grads = jnp.asarray(rng.normal(size=(S, D)), jnp.float32)
    return table, jnp.asarray(ids), jnp.asarray(seg), grads


@pytest.mark.parametrize("backend", ["ffi", "reference"])
@pytest.mark.parametrize("opt", [O.SGD(learning_rate=0.1), O.RowWiseAdagrad(learning_rate=0.1)])
def test_stage_then_commit_is_the_fused_update(backend, opt):
    table, ids, seg, grads = inputs()
    state = opt.init(table)
    want_t, want_s, _ = ops.lookup_pool_backward_update(
        table, state, grads, ids, seg, optimizer=opt, backend=backend
    )
    marker = ops.read_marker(grads, table)  # ordering operands: never read
    staged = ops.stage_backward_update(
        table, state, grads, ids, seg, optimizer=opt, after=marker, backend=backend
    )
    assert staged.rows.shape == (V,) and staged.values.shape == (V, D)
    distinct = np.unique(np.asarray(ids)[np.asarray(ids) >= 0])
    np.testing.assert_array_equal(np.asarray(staged.rows)[: len(distinct)], distinct)
    assert (np.asarray(staged.rows)[len(distinct) :] == -1).all()
    assert int(staged.num_unique) == len(distinct) and bool(staged.finite)
    # the update is applied already; the saved rows are the previous ones
    np.testing.assert_array_equal(np.asarray(staged.table), np.asarray(want_t))
    np.testing.assert_array_equal(
        np.asarray(staged.values)[: len(distinct)], np.asarray(table)[distinct]
    )
    got_t, got_s = ops.commit_update(staged, True, optimizer=opt, backend=backend)
    np.testing.assert_array_equal(np.asarray(got_t), np.asarray(want_t))
    for a, b in zip(opt.slot_arrays(got_s), opt.slot_arrays(want_s), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    kept_t, kept_s = ops.commit_update(staged, False, optimizer=opt, backend=backend)
    np.testing.assert_array_equal(np.asarray(kept_t), np.asarray(table))
    for a, b in zip(opt.slot_arrays(kept_s), opt.slot_arrays(state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("backend", ["ffi", "reference"])
def test_a_donated_block_is_updated_and_undone_in_place(backend):
    """A `[1, V, D]` block (a shard_map block) donated to one jit that stages and undoes:
    the result is the input bit for bit, in the input's buffer (no whole-table copy)."""
    table, ids, seg, grads = inputs()
    opt = O.Adam(learning_rate=0.1)
    block = table[None]
    state = jax.tree.map(lambda x: x[None], opt.init(table))

    def step(block, state, keep):
        staged = ops.stage_backward_update(
            block, state, grads, ids, seg, optimizer=opt, backend=backend
        )
        return ops.commit_update(staged, keep, optimizer=opt, backend=backend)

    run = jax.jit(step, donate_argnums=(0, 1))
    text = run.lower(block, state, False).compile().as_text()
    copies = [line for line in text.splitlines() if " copy(" in line and f"{V},{D}]" in line]
    assert not copies, copies
    undone, s = run(jnp.array(block), jax.tree.map(jnp.array, state), False)
    np.testing.assert_array_equal(np.asarray(undone), np.asarray(block))
    assert int(s.count[0]) == 0  # Adam counts kept updates only
    kept, s = run(jnp.array(block), jax.tree.map(jnp.array, state), True)
    assert not np.array_equal(np.asarray(kept), np.asarray(block)) and int(s.count[0]) == 1


def test_the_stage_kernel_drops_ids_past_the_table_within_min_n_v_slots():
    """Called directly (the public wrapper masks them first), ids >= V sort after every row
    of the table and take no staged slot: min(N, V) slots hold every distinct row."""
    opt = O.SGD(learning_rate=1.0)
    table = jnp.zeros((4, 2), jnp.float32)
    ids = jnp.asarray([3, 9, 0, 7, 3, 1, 2, 8], jnp.int32)  # rows 0..3 and three past V
    seg = jnp.arange(8, dtype=jnp.int32)
    grads = jnp.ones((8, 2), jnp.float32)
    slot_a, slot_b = kernel_slots(opt, opt.init(table))
    rows, values, _, _, num_unique, finite, new_table, _, _ = _ffi.sparse_grad_stage(
        table,
        slot_a,
        slot_b,
        (grads,),
        ids,
        seg,
        jnp.ones((8,), jnp.float32),
        kernel_hparams(opt, opt.init(table), None, None),
        opt.kernel_id,
        False,
        (0, 0),
    )
    np.testing.assert_array_equal(np.asarray(rows), [0, 1, 2, 3])
    np.testing.assert_array_equal(np.asarray(values), np.zeros((4, 2)))  # the previous rows
    np.testing.assert_array_equal(np.asarray(new_table)[:, 0], [-1, -1, -1, -2])
    assert int(num_unique) == 4 and int(finite) == 1


@pytest.mark.parametrize("backend", ["ffi", "reference"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("combiner", ["sum", "none"])
@pytest.mark.parametrize("cuts", ["empty-middle", "equal", "equal-last-short", "last-long"])
def test_gradient_pieces_stage_as_their_concatenation(backend, dtype, combiner, cuts):
    """The output gradient in pieces (bags, or ids for `none`) stages exactly the rows its
    concatenation stages: the kernel reads each piece where it is, finding the piece of a
    row by a division where the pieces but the last are one size, else by a search."""
    table, ids, seg, _ = inputs(1)
    opt = O.RowWiseAdagrad(learning_rate=0.1)
    n_out = S if combiner == "sum" else ids.shape[0]
    grads = jnp.asarray(np.random.default_rng(2).normal(size=(n_out, D)), dtype)
    cut = {
        "empty-middle": [2, 2, n_out],
        "equal": list(range(1, n_out + 1)),
        "equal-last-short": [*range(3, n_out, 3), n_out],
        "last-long": [1, 2, n_out],
    }[cuts]
    pieces = [grads[a:b] for a, b in zip([0, *cut[:-1]], cut, strict=True)]
    kw = dict(optimizer=opt, combiner=combiner, backend=backend)
    whole = ops.stage_backward_update(table, opt.init(table), grads, ids, seg, **kw)
    split = ops.stage_backward_update(table, opt.init(table), pieces, ids, seg, **kw)
    # row-wise Adagrad uses one slot operand (the other is an unwritten [1] dummy)
    for field in ("table", "rows", "values", "finite", "num_unique"):
        np.testing.assert_array_equal(getattr(whole, field), getattr(split, field))
    np.testing.assert_array_equal(whole.slots[0], split.slots[0])


def test_gradient_pieces_of_another_width_or_dtype_are_refused_in_one_line():
    table, ids, seg, grads = inputs()
    opt = O.SGD(learning_rate=0.1)
    for bad in (
        [grads, grads[:, :3]],
        [grads, grads.astype(jnp.bfloat16)],
        [],
        [grads, None],
        [grads.astype(jnp.int32)],
        None,
        {"a": grads},
    ):
        with pytest.raises(ValueError, match=r"stage_backward_update: output_grads") as err:
            ops.stage_backward_update(table, opt.init(table), bad, ids, seg, optimizer=opt)
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("backend", ["ffi", "reference"])
def test_an_integer_verdict_keeps_on_nonzero_on_both_backends(backend):
    """`commit` 1 / 0 (ints) keep / undo like True / False: the rows and Adam's count agree."""
    table, ids, seg, grads = inputs()
    opt = O.Adam(learning_rate=0.1)
    state = opt.init(table)
    staged = ops.stage_backward_update(
        table, state, grads, ids, seg, optimizer=opt, backend=backend
    )
    kept_t, kept_s = ops.commit_update(staged, 1, optimizer=opt, backend=backend)
    np.testing.assert_array_equal(np.asarray(kept_t), np.asarray(staged.table))
    assert int(kept_s.count) == 1
    undone_t, undone_s = ops.commit_update(staged, jnp.int32(0), optimizer=opt, backend=backend)
    np.testing.assert_array_equal(np.asarray(undone_t), np.asarray(table))
    assert int(undone_s.count) == 0
    for bad in (1.0, jnp.ones((2,), bool)):
        with pytest.raises(ValueError, match=r"commit_update: commit must be a bool scalar") as err:
            ops.commit_update(staged, bad, optimizer=opt, backend=backend)
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("backend", ["ffi", "reference"])
def test_an_empty_batch_stages_nothing(backend):
    table, _, _, _ = inputs()
    opt = O.RowWiseAdagrad(learning_rate=0.1)
    state = opt.init(table)
    none = jnp.zeros((0,), jnp.int32)
    staged = ops.stage_backward_update(
        table, state, jnp.zeros((S, D)), none, none, optimizer=opt, backend=backend
    )
    assert staged.rows.shape == (0,) and bool(staged.finite) and int(staged.num_unique) == 0
    got, _ = ops.commit_update(staged, True, optimizer=opt, backend=backend)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(table))


def test_a_table_it_cannot_update_in_place_is_refused_in_one_line():
    table, ids, seg, grads = inputs()
    opt = O.SGD(learning_rate=0.1)
    cases = [
        (jnp.stack([table, table]), opt.init(table), None, r"table must be \[V, D\] or a block"),
        (table.astype(jnp.int32), opt.init(table), None, r"table must be a float type"),
        (table, opt.init(table), (grads, grads), r"staging must be an ops.Staging of 3 arrays"),
    ]
    for t, state, staging, match in cases:
        with pytest.raises(ValueError, match=f"stage_backward_update: {match}") as err:
            ops.stage_backward_update(t, state, grads, ids, seg, optimizer=opt, staging=staging)
        assert "\n" not in str(err.value)
