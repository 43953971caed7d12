"""Sparse optimizer maths against independent float64 numpy formulas.

The other optimizer tests compare the FFI kernels with the package's own reference `update`
(and the collection reference imports that `update` too), so one wrong formula in both passes
them. Here every path is compared with formulas written out below, over several steps with
duplicate rows (merged: summed before the update), padding (-1) and ids >= V, rows touched
in some steps only (lazy: untouched rows and their slots never move) and rows first touched
late (Adam's bias correction uses the table-wide update count, not a per-row one):

- the reference update: `ops.sparse_update(..., backend="reference")`;
- the fused kernel: `ops.sparse_update` (FFI);
- the fused backward + update, kernel and reference: `ops.lookup_pool_backward_update`.

And once against optax's dense `optax.adagrad` / `optax.adam` on a table whose rows are all
touched every step, where lazy and dense updates coincide. Epsilon conventions:
optax's Adam is `lr * m_hat / (sqrt(v_hat + eps_root) + eps)`, ours with `eps_root = 0`: the
same eps, used as is. optax's Adagrad is `g * rsqrt(acc + eps)` (eps inside the root, and 0
where acc == 0), ours `g / (sqrt(acc) + eps)`: they agree exactly only with eps = 0 on both
sides, with a positive initial accumulator so no root is 0.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from embark_jax import ops
from embark_jax.ops import optimizers as O

V, D, S = 12, 4, 5  # vocab, dim, bags per step

# --- the independent formulas (float64) ---------------------------------------------------


def merge_rows(rows, grads, vocab):
    """{row: summed gradient} over the valid rows (duplicates summed; -1 and >= V dropped)."""
    out = {}
    for r, g in zip(np.asarray(rows).tolist(), np.asarray(grads, np.float64), strict=True):
        if 0 <= r < vocab:
            out[r] = out.get(r, 0.0) + g
    return out


class NumpyAdagrad:
    def __init__(self, table, lr, eps, initial_accumulator):
        self.w = np.asarray(table, np.float64).copy()
        self.acc = np.full(self.w.shape, initial_accumulator, np.float64)
        self.lr, self.eps = lr, eps

    def step(self, merged):
        for r, g in merged.items():
            self.acc[r] += g * g
            self.w[r] -= self.lr * g / (np.sqrt(self.acc[r]) + self.eps)

    def slots(self):
        return {"accumulator": self.acc}


class NumpyRowWiseAdagrad(NumpyAdagrad):
    def __init__(self, table, lr, eps, initial_accumulator):
        super().__init__(table, lr, eps, initial_accumulator)
        self.acc = np.full(self.w.shape[0], initial_accumulator, np.float64)

    def step(self, merged):
        for r, g in merged.items():
            self.acc[r] += np.mean(g * g)  # one accumulator per row: mean of g^2 over columns
            self.w[r] -= self.lr * g / (np.sqrt(self.acc[r]) + self.eps)


class NumpyLazyAdam:
    def __init__(self, table, lr, b1, b2, eps):
        self.w = np.asarray(table, np.float64).copy()
        self.m, self.v = np.zeros_like(self.w), np.zeros_like(self.w)
        self.t = 0
        self.lr, self.b1, self.b2, self.eps = lr, b1, b2, eps

    def step(self, merged):
        self.t += 1  # table-wide: counts every update of the table, touched rows or not
        for r, g in merged.items():
            self.m[r] = self.b1 * self.m[r] + (1 - self.b1) * g
            self.v[r] = self.b2 * self.v[r] + (1 - self.b2) * g * g
            m_hat = self.m[r] / (1 - self.b1**self.t)
            v_hat = self.v[r] / (1 - self.b2**self.t)
            self.w[r] -= self.lr * m_hat / (np.sqrt(v_hat) + self.eps)

    def slots(self):
        return {"m": self.m, "v": self.v, "count": np.array(self.t)}


def numpy_twin(opt, table):
    if isinstance(opt, O.Adam):
        return NumpyLazyAdam(table, opt.learning_rate, opt.b1, opt.b2, opt.eps)
    cls = NumpyRowWiseAdagrad if isinstance(opt, O.RowWiseAdagrad) else NumpyAdagrad
    return cls(table, opt.learning_rate, opt.eps, opt.initial_accumulator)


# --- the steps: bags of ids (mean combiner, weighted) and their per-id gradients -----------

# per step: ids [S*H] (H = 3 slots per bag); -1 is padding, ids >= V are padding too.
# Row 5 is touched in step 1 only; rows 9 and 0 first in step 3 (bias correction at t = 3);
# rows 2, 4, 6, 8, 10, 11 never. Duplicates inside a bag and across bags.
STEP_IDS = [
    [1, 3, 3, -1, 5, 12, 7, 7, 1, 3, -1, -1, 5, 1, 15],
    [3, 7, 1, 1, -1, 15, 3, 3, 3, -1, -1, -1, 7, 12, 1],
    [9, 3, 9, 0, -1, -1, 9, 9, 1, 3, 0, 12, -1, -1, -1],
]
H = 3


def step_inputs(step):
    """(ids [S*H], segment ids, weights, pooled output grads [S, D]) of one step."""
    rng = np.random.default_rng(100 + step)
    ids = np.array(STEP_IDS[step], np.int32)
    seg = np.repeat(np.arange(S), H).astype(np.int32)
    w = rng.uniform(0.25, 2.0, size=ids.shape).astype(np.float32)
    cot = rng.normal(size=(S, D)).astype(np.float32)
    return ids, seg, w, cot


def per_id_grads(ids, seg, w, cot):
    """Each id's gradient under the mean combiner, written out: w_i / (sum of the weights of
    the valid ids of its bag) * the bag's output gradient; 0 for padding."""
    valid = (ids >= 0) & (ids < V)
    denom = np.zeros(S)
    for i in np.flatnonzero(valid):
        denom[seg[i]] += w[i]
    g = np.zeros((ids.shape[0], D))
    for i in np.flatnonzero(valid):
        g[i] = w[i] / denom[seg[i]] * cot[seg[i]].astype(np.float64)
    return g


def initial_table():
    return np.random.default_rng(7).normal(size=(V, D)).astype(np.float32)


OPTIMIZERS = {
    "adagrad": O.Adagrad(learning_rate=0.1, initial_accumulator=0.1),
    "adagrad-acc0": O.Adagrad(learning_rate=0.1, eps=1e-3),
    "rowwise-adagrad": O.RowWiseAdagrad(learning_rate=0.2, initial_accumulator=0.05),
    "lazy-adam": O.Adam(learning_rate=0.05, b1=0.8, b2=0.95, eps=1e-6),
}


def _sparse_update(backend, opt):
    def run(table, state, ids, seg, w, cot):
        rows = jnp.asarray(ids)
        grads = jnp.asarray(per_id_grads(ids, seg, w, cot), jnp.float32)
        return ops.sparse_update(table, state, rows, grads, opt, backend=backend)

    if backend == "reference":
        return run
    jitted = jax.jit(lambda t, s, r, g: ops.sparse_update(t, s, r, g, opt))

    def run_ffi(table, state, ids, seg, w, cot):
        grads = jnp.asarray(per_id_grads(ids, seg, w, cot), jnp.float32)
        return jitted(table, state, jnp.asarray(ids), grads)

    return run_ffi


def _fused(backend, opt):
    fused = functools.partial(
        ops.lookup_pool_backward_update, optimizer=opt, combiner="mean", backend=backend
    )
    fn = jax.jit(fused) if backend is None else fused

    def run(table, state, ids, seg, w, cot):
        t, s, n = fn(table, state, jnp.asarray(cot), jnp.asarray(ids), jnp.asarray(seg), w)
        assert int(n) == len({x for x in ids.tolist() if 0 <= x < V})
        return t, s

    return run


PATHS = {
    "reference": lambda opt: _sparse_update("reference", opt),
    "kernel": lambda opt: _sparse_update(None, opt),
    "fused-reference": lambda opt: _fused("reference", opt),
    "fused-kernel": lambda opt: _fused(None, opt),
}


def state_slots(opt, state):
    if isinstance(opt, O.Adam):
        return {"m": state.m, "v": state.v, "count": state.count}
    return {"accumulator": state.accumulator}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_matches_numpy_formula(name, path):
    opt = OPTIMIZERS[name]
    table0 = initial_table()
    want = numpy_twin(opt, table0)
    run = PATHS[path](opt)
    table, state = jnp.asarray(table0), opt.init(jnp.asarray(table0))
    for step in range(len(STEP_IDS)):
        ids, seg, w, cot = step_inputs(step)
        table, state = run(table, state, ids, seg, w, cot)
        want.step(merge_rows(ids, per_id_grads(ids, seg, w, cot), V))
        msg = f"{name} via {path}, step {step + 1}"
        np.testing.assert_allclose(np.asarray(table), want.w, rtol=1e-5, atol=1e-6, err_msg=msg)
        got_slots = state_slots(opt, state)
        for k, v in want.slots().items():
            np.testing.assert_allclose(
                np.asarray(got_slots[k]), v, rtol=1e-5, atol=1e-7, err_msg=f"{msg}: {k}"
            )
    # lazy: never-touched rows are bit-identical to the start
    never = [2, 4, 6, 8, 10, 11]
    np.testing.assert_array_equal(np.asarray(table)[never], table0[never])
    # and the rows that were touched moved (the check above is not vacuous)
    assert not np.allclose(np.asarray(table)[[0, 1, 3, 5, 7, 9]], table0[[0, 1, 3, 5, 7, 9]])


def test_adam_bias_correction_uses_the_table_wide_count():
    """Row 9 is first touched at step 3: its update uses t = 3. With a per-row count (t = 1)
    the first moment would be corrected by 1 / (1 - b1) instead of 1 / (1 - b1^3)."""
    opt = OPTIMIZERS["lazy-adam"]
    table0 = initial_table()
    table, state = jnp.asarray(table0), opt.init(jnp.asarray(table0))
    run = PATHS["kernel"](opt)
    for step in range(3):
        table, state = run(table, state, *step_inputs(step))
    assert int(state.count) == 3
    ids, seg, w, cot = step_inputs(2)
    g9 = merge_rows(ids, per_id_grads(ids, seg, w, cot), V)[9]
    m, v = (1 - opt.b1) * g9, (1 - opt.b2) * g9 * g9

    def moved(t):
        m_hat, v_hat = m / (1 - opt.b1**t), v / (1 - opt.b2**t)
        return table0[9] - opt.learning_rate * m_hat / (np.sqrt(v_hat) + opt.eps)

    np.testing.assert_allclose(np.asarray(table)[9], moved(3), rtol=1e-5, atol=1e-6)
    assert not np.allclose(moved(3), moved(1), rtol=1e-3, atol=1e-4)


# --- once against optax, dense, every row touched every step -------------------------------

OPTAX_PAIRS = {
    # eps = 0 on both sides: optax puts eps inside the root (rsqrt(acc + eps)), we add it
    # to sqrt(acc); a positive initial accumulator keeps every root > 0.
    "adagrad": (
        O.Adagrad(learning_rate=0.3, initial_accumulator=0.1, eps=0.0),
        optax.adagrad(0.3, initial_accumulator_value=0.1, eps=0.0),
    ),
    # same convention (eps added to sqrt(v_hat); eps_root = 0), same eps
    "adam": (
        O.Adam(learning_rate=0.05, b1=0.8, b2=0.95, eps=1e-6),
        optax.adam(0.05, b1=0.8, b2=0.95, eps=1e-6, eps_root=0.0),
    ),
}


@pytest.mark.parametrize("backend", ["reference", None], ids=["reference", "kernel"])
@pytest.mark.parametrize("name", list(OPTAX_PAIRS))
def test_dense_rows_match_optax(name, backend):
    ours, theirs = OPTAX_PAIRS[name]
    v, d = 6, 3
    rng = np.random.default_rng(11)
    table0 = rng.normal(size=(v, d)).astype(np.float32)
    params, opt_state = jnp.asarray(table0), theirs.init(jnp.asarray(table0))
    table, state = jnp.asarray(table0), ours.init(jnp.asarray(table0))
    update = jax.jit(lambda t, s, r, g: ops.sparse_update(t, s, r, g, ours, backend=backend))
    for _ in range(4):
        # every row at least once, some twice (merged), in shuffled order
        rows = rng.permutation(np.concatenate([np.arange(v), rng.integers(0, v, size=3)]))
        grads = rng.normal(size=(rows.shape[0], d)).astype(np.float32)
        dense = np.zeros((v, d), np.float32)
        np.add.at(dense, rows, grads)
        upd, opt_state = theirs.update(jnp.asarray(dense), opt_state, params)
        params = optax.apply_updates(params, upd)
        table, state = update(table, state, jnp.asarray(rows, jnp.int32), jnp.asarray(grads))
        np.testing.assert_allclose(np.asarray(table), np.asarray(params), rtol=1e-5, atol=1e-6)
    assert not np.allclose(np.asarray(table), table0)
