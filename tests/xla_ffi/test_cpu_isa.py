"""The CPU kernels' SIMD paths (AVX-512 with and without BF16, AVX2, portable scalar) and pool.

Every path this CPU supports is forced in turn (`native.set_cpu_isa`) and compared with the
jnp reference on widths that exercise full register blocks, several blocks and the scalar
tail; a wheel built here must also run on a CPU without AVX-512, which is the scalar and AVX2
paths' job. The pool is checked single-threaded (EMBARK_CPU_THREADS=1, a fresh process) and
under concurrent callers.
"""

import os
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from embark_jax import ops
from embark_jax.ops import native, reference

ISAS = [
    i
    for i in native.CPU_ISAS
    if native.CPU_ISAS.index(i) <= native.CPU_ISAS.index(native.cpu_isa()["best"])
]


@pytest.fixture
def isa(request):
    previous = native.set_cpu_isa(request.param)
    assert native.cpu_isa()["active"] == request.param
    yield request.param
    native.set_cpu_isa(previous)


def _bags(rng, n_bags, max_len, vocab, sorted_segments=True):
    lengths = rng.integers(0, max_len + 1, size=n_bags)
    lengths[0] = 0  # an empty bag
    seg = np.repeat(np.arange(n_bags), lengths).astype(np.int32)
    ids = rng.integers(-2, vocab + 2, size=seg.size).astype(np.int32)  # padding both sides
    w = rng.uniform(0.25, 2.0, size=seg.size).astype(np.float32)
    if not sorted_segments:
        p = rng.permutation(seg.size)
        seg, ids, w = seg[p], ids[p], w[p]
    return ids, seg, w


def _check(table, ids, seg, w, n_bags, combiner, out_dtype=None, sorted_hint=True):
    got = ops.lookup_pool(
        table, ids, seg, n_bags, w, combiner, out_dtype=out_dtype, indices_are_sorted=sorted_hint
    )
    want = reference.lookup_pool(table.astype(jnp.float32), ids, seg, n_bags, w, combiner)
    tol = 1e-5 if (table.dtype == jnp.float32 and got.dtype == jnp.float32) else 1e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=tol, atol=tol)


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("dim", [1, 7, 16, 24, 64, 128, 136, 264])
@pytest.mark.parametrize("weighted", [True, False])
def test_every_isa_matches_the_reference_on_every_width(isa, dim, weighted, rng):
    """1 and 7: the scalar tail only; 16/24/64/128: one (partial) block (a whole number of
    vectors takes the flat loop, PoolSortedFlat); 136/264: several blocks
    (AVX-512 blocks are 128 floats, AVX2's 64, scalar's 16) plus a tail. Unweighted calls
    pass no weights to the kernel (its `[0]` form), a separate compiled loop."""
    table = jnp.asarray(rng.normal(size=(50, dim)).astype(np.float32))
    ids, seg, w = _bags(rng, 40, 9, 50)
    w = w if weighted else None
    for combiner in ("sum", "mean", "sqrtn"):
        _check(table, ids, seg, w, 40, combiner)
    got = ops.lookup_pool(table, ids, None, 0, w, "none")
    want = reference.lookup_pool(table, ids, None, 0, w, "none")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("isa", ISAS, indirect=True)
def test_bag_ends_guessed_from_the_last_bag_are_checked(isa, rng):
    """The sorted path first tries each bag's end at the previous bag's length: runs of equal
    lengths (guess right), a change of length, empty bags and a last bag cut by the chunk
    end (guess wrong), over enough bags that every worker gets several chunks."""
    lengths = np.array(([3] * 40 + [5] * 7 + [0, 0] + [1] * 30 + [2, 9, 9, 0]) * 5 + [3])
    seg = np.repeat(np.arange(lengths.size), lengths).astype(np.int32)
    ids = rng.integers(-1, 60, size=seg.size).astype(np.int32)
    w = rng.uniform(0.25, 2.0, size=seg.size).astype(np.float32)
    table = jnp.asarray(rng.normal(size=(60, 64)).astype(np.float32))
    for weights in (w, None):
        for combiner in ("sum", "mean"):
            _check(table, ids, seg, weights, lengths.size + 3, combiner)


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("table_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
# 64: whole vectors in one block, the flat loop; 48 and 64: paired bf16 loads; 160: two blocks
@pytest.mark.parametrize("dim", [40, 48, 64, 160])
def test_every_isa_handles_bf16_tables_and_outputs(isa, table_dtype, out_dtype, dim, rng):
    table = jnp.asarray(rng.normal(size=(64, dim)), table_dtype)
    ids, seg, w = _bags(rng, 30, 6, 64)
    _check(table, ids, seg, w, 30, "mean", out_dtype=out_dtype)


@pytest.mark.parametrize("isa", ISAS, indirect=True)
def test_every_isa_handles_int64_ids_and_segments(isa, rng):
    table = jnp.asarray(rng.normal(size=(30, 32)).astype(np.float32))
    ids, seg, w = _bags(rng, 20, 5, 30)
    with jax.enable_x64(True) if hasattr(jax, "enable_x64") else jax.experimental.enable_x64():
        _check(table, jnp.asarray(ids, jnp.int64), jnp.asarray(seg, jnp.int64), w, 20, "sum")


@pytest.mark.parametrize("sorted_hint", [True, False])
def test_unsorted_segments_are_pooled_right_with_or_without_the_hint(sorted_hint, rng):
    """With the hint the order is checked inside the parallel pass; an unsorted pair anywhere
    (here: only the last two ids swapped) must still send the call down the unsorted path."""
    table = jnp.asarray(rng.normal(size=(40, 16)).astype(np.float32))
    ids, seg, w = _bags(rng, 600, 4, 40)
    seg = seg.copy()
    seg[-2], seg[-1] = seg[-1], seg[-2] - 1  # one descending pair at the very end
    _check(table, ids, seg, w, 600, "sum", sorted_hint=sorted_hint)
    ids, seg, w = _bags(rng, 600, 4, 40, sorted_segments=False)
    _check(table, ids, seg, w, 600, "mean", sorted_hint=sorted_hint)


def _chunk_starts(n_bags, threads):
    """The first bag of each chunk but the first, as ParallelFor splits a lookup's bags
    (embark_ffi.h: min(4 x threads, ceil(bags / 32)) chunks of ceil(bags / chunks) bags)."""
    chunks = min(4 * threads, -(-n_bags // 32))
    size = -(-n_bags // chunks)
    return [c * size for c in range(1, chunks) if c * size < n_bags]


def descents_missed(threads):
    """Positions q where one descending pair (q - 1, q), next to a chunk's first position,
    gives a wrong result with the sorted hint. Each chunk checks the pairs that end in its
    own positions, so the pair that ends at a chunk's first position is only that chunk's."""
    n, n_bags = 1000, 300
    sorted_seg = (np.arange(n) * n_bags // n).astype(np.int32)
    rng = np.random.default_rng(3)
    table = jnp.asarray(rng.normal(size=(50, 16)).astype(np.float32))
    ids = jnp.asarray(rng.integers(0, 50, n).astype(np.int32))
    missed = []
    for s0 in _chunk_starts(n_bags, threads):
        p = s0 * n // n_bags  # the chunk's first position (RunPooled's split of the check)
        for q in (p - 1, p, p + 1):
            seg = sorted_seg.copy()
            seg[q] = seg[q - 1] - 1  # the one descent
            got = ops.lookup_pool(table, ids, jnp.asarray(seg), n_bags, indices_are_sorted=True)
            want = reference.lookup_pool(table, ids, jnp.asarray(seg), n_bags)
            if not np.allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5):
                missed.append(q)
    return missed


def test_a_descent_at_a_chunk_boundary_is_found_with_the_hint():
    """Found by a stranger test: a check that skipped each chunk's first pair passed every
    other test. This one runs with this process's threads and, in a fresh process, with 4."""
    assert native.cpu_threads() == 1 or _chunk_starts(300, native.cpu_threads())
    assert descents_missed(native.cpu_threads()) == []
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = "from tests.xla_ffi.test_cpu_isa import descents_missed; print(descents_missed(4))"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBARK_CPU")}
    r = subprocess.run(
        [sys.executable, "-c", code],
        env=env | {"EMBARK_CPU_THREADS": "4"},
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[-1] == "[]"


def test_set_cpu_isa_refuses_unknown_names():
    with pytest.raises(ValueError, match="cpu isa must be"):
        native.set_cpu_isa("sse9")
    assert native.cpu_isa()["active"] == native.cpu_isa()["best"]


def test_concurrent_callers_get_their_own_results(rng):
    """Only one call at a time uses the worker pool; the others run on their own thread."""
    table = jnp.asarray(rng.normal(size=(500, 64)).astype(np.float32))
    batches = [_bags(np.random.default_rng(s), 2000, 8, 500) for s in range(6)]
    f = jax.jit(lambda t, i, s, w: ops.lookup_pool(t, i, s, 2000, w, indices_are_sorted=True))
    wants = [np.asarray(reference.lookup_pool(table, *b[:2], 2000, b[2])) for b in batches]
    errors = []

    def work(k):
        for _ in range(20):
            got = np.asarray(f(table, *batches[k]))
            if not np.allclose(got, wants[k], rtol=1e-5, atol=1e-5):
                errors.append(k)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(batches))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


_CHILD = """
import numpy as np, jax.numpy as jnp
from embark_jax import ops
from embark_jax.ops import native, reference
print(native.cpu_threads(), native.cpu_isa()["active"])
rng = np.random.default_rng(1)
t = jnp.asarray(rng.normal(size=(100, 48)).astype(np.float32))
ids = jnp.asarray(rng.integers(0, 100, 4000).astype(np.int32))
seg = jnp.repeat(jnp.arange(1000, dtype=jnp.int32), 4)
got = ops.lookup_pool(t, ids, seg, 1000, indices_are_sorted=True)
np.testing.assert_allclose(got, reference.lookup_pool(t, ids, seg, 1000), rtol=1e-5, atol=1e-5)
"""


def _child(env_extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBARK_CPU")}
    env.update(env_extra)
    return subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=120
    )


def test_environment_switches_take_effect_in_a_fresh_process():
    r = _child({"EMBARK_CPU_THREADS": "1", "EMBARK_CPU_ISA": "scalar"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["1", "scalar"]


@pytest.mark.parametrize(
    "env, message",
    [
        ({"EMBARK_CPU_ISA": "sse9"}, "EMBARK_CPU_ISA='sse9': expected auto"),
        ({"EMBARK_CPU_THREADS": "0"}, "EMBARK_CPU_THREADS='0': expected a positive integer"),
        ({"EMBARK_CPU_THREADS": "two"}, "EMBARK_CPU_THREADS='two'"),
    ],
)
def test_bad_environment_switches_are_one_line_errors(env, message):
    r = _child(env)
    assert r.returncode != 0
    assert message in r.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("dim", [40, 48])  # 48: whole vectors in one block, the flat loop
def test_every_isa_rounds_bf16_outputs_to_nearest_even_bit_for_bit(isa, dim):
    """A bfloat16 output row is stored a vector at a time (tail in scalar code); every path must
    round as ml_dtypes does: exact ties both ways, the largest floats (to inf), inf, NaN."""
    rng = np.random.default_rng(7)
    x = rng.normal(size=(8, dim)).astype(np.float32) * np.float32(1e3)
    bits = x.view(np.uint32)
    bits[0, :20] = (bits[0, :20] & 0xFFFF0000) | 0x8000  # exact ties, odd and even
    x[1, :6] = [
        np.inf,
        -np.inf,
        np.nan,
        3.4028235e38,
        -3.4028235e38,
        1e-30,
    ]  # XLA flushes denormals
    table = jnp.asarray(x)
    ids = jnp.arange(8, dtype=jnp.int32)
    got = ops.lookup_pool(table, ids, ids, 8, out_dtype=jnp.bfloat16, indices_are_sorted=True)
    got = np.asarray(got.astype(jnp.float32))
    want = np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan], want[~nan])


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
# 64: paired loads (two vectors a load) with AVX2 and AVX-512; 48: with AVX2 only; 160: two
# column blocks; 40: two vectors (paired with AVX-512) and a scalar tail
@pytest.mark.parametrize("dim", [40, 48, 64, 160])
def test_every_isa_sums_bf16_rows_in_order_bit_for_bit(isa, out_dtype, dim):
    """A bfloat16 row is widened two vectors per load into even and odd columns; the store
    must put every column back in place and round it once. Bags of two rows, so each float
    sum is one add that numpy makes too; ties to even, inf, NaN and huge values included."""
    rng = np.random.default_rng(9)
    x = (rng.normal(size=(16, dim)) * 1e3).astype(np.float32)
    x[0], x[1] = 1.0, 2.0**-8  # 1 + 2**-8: an exact tie, rounds down to even
    x[2], x[3] = 1.0 + 2.0**-7, 2.0**-8  # a tie that rounds up to even
    x[4, :4], x[5, :4] = [np.inf, np.nan, 3.3e38, -np.inf], [1.0, 1.0, 3.3e38, np.inf]
    table = jnp.asarray(x, jnp.bfloat16)
    v32 = np.asarray(table.astype(jnp.float32))
    ids = jnp.arange(16, dtype=jnp.int32)
    seg = jnp.repeat(jnp.arange(8, dtype=jnp.int32), 2)
    got = ops.lookup_pool(table, ids, seg, 8, out_dtype=out_dtype, indices_are_sorted=True)
    got = np.asarray(got.astype(jnp.float32))
    with np.errstate(over="ignore", invalid="ignore"):
        want = np.asarray(jnp.asarray(v32[0::2] + v32[1::2]).astype(out_dtype).astype(jnp.float32))
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan], want[~nan])


@pytest.mark.parametrize("isa", ISAS, indirect=True)
def test_subnormals_read_as_zero_in_every_chunk_as_in_xla(isa):
    """Kernels compute in their caller's floating-point mode, which under XLA flushes
    subnormals to zero; the pool's workers take that mode for each job. Enough bags that
    every worker pools some: each bag sums a subnormal row with a tiny normal one, so a path
    that kept subnormals (the row's 1e-39) would differ from XLA's result in every bag."""
    tiny = np.float32(np.finfo(np.float32).tiny)  # the smallest normal float
    table = jnp.asarray(np.array([[1e-39] * 16, [tiny] * 16], np.float32))
    bags = 4096
    ids = jnp.asarray(np.tile([0, 1], bags).astype(np.int32))
    seg = jnp.asarray(np.repeat(np.arange(bags), 2).astype(np.int32))
    got = np.asarray(ops.lookup_pool(table, ids, seg, bags, indices_are_sorted=True))
    want = np.asarray(jax.jit(lambda t: t[ids].reshape(bags, 2, 16).sum(1))(table))
    assert want[0, 0] == tiny  # XLA's own code flushed the subnormal row
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("isa", ISAS, indirect=True)
def test_every_isa_rounds_bf16_segment_sums_once_bit_for_bit(isa):
    """segment_sum of bfloat16 adds in float32 and rounds each output element once, a vector
    at a time: two rows per segment, so the float32 sum is the same single add as numpy's."""
    rng = np.random.default_rng(8)
    v = jnp.asarray(rng.normal(size=(64, 40)) * 100.0, jnp.bfloat16)
    seg = jnp.repeat(jnp.arange(32, dtype=jnp.int32), 2)
    got = np.asarray(ops.segment_sum(v, seg, 32).astype(jnp.float32))
    v32 = np.asarray(v.astype(jnp.float32))
    want = np.asarray(jnp.asarray(v32[0::2] + v32[1::2]).astype(jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_array_equal(got, want)


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as fh:
            line = next(ln for ln in fh if ln.startswith("flags"))
    except (OSError, StopIteration):
        pytest.skip("no x86 flags in /proc/cpuinfo")
    return set(line.split(":", 1)[1].split())


def test_the_best_isa_is_the_one_the_cpu_reports():
    """Checked against the kernel's own account of the CPU (/proc/cpuinfo lists a feature only
    where the OS also saves its registers), not against our detection code."""
    flags = _cpu_flags()
    if {"avx512f", "avx512bw", "avx512_bf16"} <= flags:
        want = "avx512bf16"
    elif "avx512f" in flags:
        want = "avx512"
    elif {"avx2", "fma"} <= flags:
        want = "avx2"
    else:
        want = "scalar"
    assert native.cpu_isa()["best"] == want


@pytest.mark.parametrize("table_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("combiner", ["sum", "mean"])
def test_every_isa_stores_the_same_bf16_bits(table_dtype, combiner):
    """A bfloat16 output is rounded by a different instruction sequence on each path (the
    BF16 extension's conversion on avx512bf16); unweighted sums in the same order must give
    the same bits everywhere. Random bags of 0-12 ids over widths with and without paired
    loads, several column blocks and scalar tails."""
    rng = np.random.default_rng(11)
    for dim in (16, 32, 40, 64, 96, 128, 136, 264):
        table = jnp.asarray(rng.normal(size=(300, dim)) * 50.0, table_dtype)
        ids, seg, _ = _bags(rng, 200, 12, 300)
        outs = {}
        for name in ISAS:
            previous = native.set_cpu_isa(name)
            try:
                out = ops.lookup_pool(
                    table,
                    jnp.asarray(ids),
                    jnp.asarray(seg),
                    200,
                    combiner=combiner,
                    out_dtype=jnp.bfloat16,
                    indices_are_sorted=True,
                )
                outs[name] = np.asarray(out).view(np.uint16)
            finally:
                native.set_cpu_isa(previous)
        for name, bits in outs.items():
            np.testing.assert_array_equal(bits, outs["scalar"], err_msg=f"{name}, dim {dim}")


@pytest.mark.parametrize("dim", [1, 7, 16, 24, 136])
@pytest.mark.parametrize("table_dtype", [jnp.float32, jnp.bfloat16])
def test_every_isa_stages_the_bits_of_the_in_place_update(table_dtype, dim):
    """The staged update's row loop has a copy per instruction set; each stages, for every
    optimizer, exactly the bits the portable in-place fused update writes (stochastic
    rounding of bfloat16 tables included): no contraction into FMAs, no reordered sums."""
    from embark_jax.ops import optimizers as O

    rng = np.random.default_rng(dim)
    vocab, n, bags = 50, 300, 40
    table = jnp.asarray(rng.normal(size=(vocab, dim)), table_dtype)
    ids = jnp.asarray(rng.integers(-1, vocab, n), jnp.int32)
    seg = jnp.asarray(np.sort(rng.integers(0, bags, n)), jnp.int32)
    grads = jnp.asarray(rng.normal(size=(bags, dim)), jnp.float32)
    opts = [
        O.SGD(learning_rate=0.1),
        O.Adagrad(learning_rate=0.1),
        O.RowWiseAdagrad(learning_rate=0.1),
        O.Adam(learning_rate=0.01),
    ]
    for opt in opts:
        state = opt.init(table)
        kw = dict(optimizer=opt, combiner="mean", seed=jnp.uint32(7))
        previous = native.set_cpu_isa("scalar")
        try:
            want, want_s, _ = ops.lookup_pool_backward_update(table, state, grads, ids, seg, **kw)
        finally:
            native.set_cpu_isa(previous)
        for isa in ISAS:
            previous = native.set_cpu_isa(isa)
            try:
                staged = ops.stage_backward_update(table, state, grads, ids, seg, **kw)
                got, got_s = ops.commit_update(staged, True, optimizer=opt)
            finally:
                native.set_cpu_isa(previous)
            where = f"{type(opt).__name__} {isa}"
            np.testing.assert_array_equal(
                np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8), err_msg=where
            )
            for a, b in zip(opt.slot_arrays(got_s), opt.slot_arrays(want_s), strict=True):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=where)
