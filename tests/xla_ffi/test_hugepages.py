"""Transparent huge pages for the tables the CPU kernels read at random (docs/design.md §7).

Checked from outside, in the kernel's own accounting: /proc/self/smaps shows how much of the
table's mapping sits on huge pages (AnonHugePages) before and after the advice, the data is
unchanged, the auto mode does it in the background after a table's second call (and not with
the mode off), and a stale pointer does not crash. Where the OS has THP switched off the
placement checks are skipped, the rest still runs.
"""

import mmap
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from embark_jax import ops
from embark_jax.ops import native, reference

MIB = 1 << 20
THP_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"


def _thp_available() -> bool:
    try:
        with open(THP_FILE) as fh:
            return "[never]" not in fh.read()
    except OSError:
        return False


needs_thp = pytest.mark.skipif(not _thp_available(), reason="transparent huge pages are off")


@pytest.fixture(autouse=True)
def auto_mode():
    """The tests here run in the auto mode, a process's default (`test_environment_switch`),
    whatever the environment the tests were started with says."""
    previous = native.set_huge_page_mode("auto")
    yield
    native.set_huge_page_mode(previous)


def _huge_bytes(array) -> int:
    """Bytes of `array`'s buffer that lie on huge pages, from /proc/self/smaps (each mapping
    overlapping the buffer counts its AnonHugePages, prorated by the overlap)."""
    lo = array.unsafe_buffer_pointer()
    hi = lo + array.nbytes
    total, overlap = 0, 0
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split(" ", 1)[0]
            if "-" in head and ":" not in head:
                a, b = (int(x, 16) for x in head.split("-"))
                overlap = max(0, min(b, hi) - max(a, lo))
                size = b - a
            elif line.startswith("AnonHugePages:") and overlap:
                total += int(line.split()[1]) * 1024 * overlap // size
    return total


def _table(rows, dim=128, seed=0):
    t = jax.random.normal(jax.random.key(seed), (rows, dim), jnp.float32)
    return t.block_until_ready()


@needs_thp
def test_huge_pages_moves_the_table_and_keeps_its_data():
    """In a fresh process: in this one, malloc may hand the table memory an earlier test's
    table left on huge pages (freed blocks under the trim threshold stay in the heap)."""
    _in_a_fresh_process("moves_the_table_and_keeps_its_data")


def _in_a_fresh_process(function: str) -> None:
    """Runs this module's `function` in a new Python process (a heap no test has used)."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = f"from tests.xla_ffi import test_hugepages as t; t.{function}()"
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]


def moves_the_table_and_keeps_its_data():
    t = _table(64 * 1024)  # 32 MiB
    before = np.asarray(t).copy()
    assert _huge_bytes(t) < t.nbytes // 2  # a fresh malloc: 4 KiB pages (THP "madvise")
    moved = native.huge_pages(t)
    assert moved % (2 * MIB) == 0 and 28 * MIB <= moved <= t.nbytes
    assert _huge_bytes(t) >= moved
    np.testing.assert_array_equal(np.asarray(t), before)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 64 * 1024, 256), jnp.int32)
    seg = jnp.repeat(jnp.arange(32, dtype=jnp.int32), 8)
    got = ops.lookup_pool(t, ids, seg, 32, indices_are_sorted=True)
    want = reference.lookup_pool(t, ids, seg, 32)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_small_arrays_are_left_alone_and_bad_input_is_refused():
    assert native.huge_pages(jnp.zeros((1024, 16))) == 0  # under 8 MiB
    with pytest.raises(TypeError, match=r"huge_pages: array must be a jax\.Array; got ndarray"):
        native.huge_pages(np.zeros((4096, 1024), np.float32))
    with pytest.raises(ValueError, match="huge page mode must be auto, on, 1, off or 0; got 'x'"):
        native.set_huge_page_mode("x")


def test_a_stale_pointer_does_not_crash():
    t = _table(32 * 1024)
    addr, nbytes = t.unsafe_buffer_pointer(), t.nbytes
    del t
    got = native._cpu_module().advise_huge_pages(addr, nbytes)  # freed: unmapped or reused
    assert got == 0 or got % (2 * MIB) == 0 or -got in (12, 22)  # bytes, ENOMEM or EINVAL


def _lookup_twice(t):
    ids = jnp.arange(512, dtype=jnp.int32) * 61
    seg = jnp.repeat(jnp.arange(64, dtype=jnp.int32), 8)
    f = jax.jit(lambda t: ops.lookup_pool(t, ids, seg, 64, indices_are_sorted=True))
    for _ in range(3):
        f(t).block_until_ready()


@needs_thp
def test_auto_mode_moves_a_table_in_the_background_after_its_second_call():
    t = _table(48 * 1024, seed=1)  # 24 MiB
    before = native.huge_page_stats()
    _lookup_twice(t)
    assert native.wait_huge_pages(120)
    after = native.huge_page_stats()
    assert after["queued"] > before["queued"] and after["advised"] > before["advised"]
    assert _huge_bytes(t) >= 20 * MIB


@needs_thp
def test_a_new_table_at_an_old_tables_address_is_advised_after_a_pause():
    """A table freed and its successor put at the same address (the allocator reuses it):
    the old entry's backoff (its second advice moved pages, so its interval doubled) must not
    leave the new table on 4 KiB pages once the range was idle for a second."""
    rows, addrs = 80 * 1024, []  # 40 MiB: above the 32 MiB mmap threshold, so munmap'd
    for k in range(3):
        t = _table(rows, seed=10 + k)
        addrs.append(t.unsafe_buffer_pointer())
        _lookup_twice(t)
        assert native.wait_huge_pages(120)
        if k == 2:
            assert _huge_bytes(t) >= 32 * MIB
        del t
        time.sleep(1.2)  # longer than the idle time after which a range counts as new
    if len(set(addrs)) == 3:
        pytest.skip("the allocator gave each table its own address: nothing reused to test")


def test_off_mode_queues_nothing():
    previous = native.set_huge_page_mode(" 0 ")  # the environment switch's spellings too
    try:
        assert native.huge_page_mode() == "off"
        t = _table(48 * 1024, seed=2)
        before = native.huge_page_stats()
        _lookup_twice(t)
        assert native.huge_page_stats()["queued"] == before["queued"]
    finally:
        native.set_huge_page_mode(previous)


_CHILD = """
from embark_jax.ops import native
print(native.huge_page_mode())
"""


def _child(value=None, **more):
    env = {
        k: v for k, v in os.environ.items() if k not in ("EMBARK_HUGEPAGES", "EMBARK_CPU_TUNING")
    }
    if value is not None:
        env["EMBARK_HUGEPAGES"] = value
    env.update(more)
    return subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=120
    )


def test_environment_switch():
    """On unless turned off: by EMBARK_HUGEPAGES, or by EMBARK_CPU_TUNING=off (which the switch
    of its own overrides)."""
    off, on = _child("off"), _child(" AUTO ")
    assert (off.returncode, off.stdout.split()) == (0, ["off"]), off.stderr
    assert (on.returncode, on.stdout.split()) == (0, ["auto"]), on.stderr
    assert _child().stdout.split() == ["auto"]
    assert _child(EMBARK_CPU_TUNING="on").stdout.split() == ["auto"]
    assert _child(EMBARK_CPU_TUNING="off").stdout.split() == ["off"]
    assert _child("on", EMBARK_CPU_TUNING="off").stdout.split() == ["auto"]
    assert _child("off", EMBARK_CPU_TUNING="on").stdout.split() == ["off"]
    bad = _child("always")
    assert bad.returncode != 0
    assert "EMBARK_HUGEPAGES='always': expected auto, on" in bad.stderr.strip().splitlines()[-1]


@needs_thp
def test_auto_mode_keeps_up_with_many_tables():
    """More tables than a small registry would hold (a model's shards cycling through the
    lookups): each one is still advised after its second call. In a fresh process: 8 MiB
    tables come from the heap, and in a long-lived one the heap mapping is large and mostly
    on 4 KiB pages, which `_huge_bytes` (prorated per mapping) cannot see past."""
    _in_a_fresh_process("keeps_up_with_many_tables")


def keeps_up_with_many_tables():
    native.set_huge_page_mode("auto")  # the fixture set it in the pytest process only
    tables = [_table(16 * 1024, dim=128, seed=100 + k) for k in range(70)]  # 8 MiB each
    before = native.huge_page_stats()
    for _ in range(3):
        for t in tables:
            _lookup_once(t)
    assert native.wait_huge_pages(300)
    after = native.huge_page_stats()
    assert after["advised"] - before["advised"] >= len(tables)
    assert all(_huge_bytes(t) >= 4 * MIB for t in tables)


def _lookup_once(t):
    ids = jnp.arange(64, dtype=jnp.int32) * 97
    seg = jnp.repeat(jnp.arange(8, dtype=jnp.int32), 8)
    _jit_lookup(t, ids, seg).block_until_ready()


@jax.jit
def _jit_lookup(t, ids, seg):
    return ops.lookup_pool(t, ids, seg, 8, indices_are_sorted=True)


@needs_thp
def test_regions_never_written_do_not_fail_the_rest():
    """MADV_COLLAPSE refuses a 2 MiB region that was never written (EINVAL); the written
    regions of the same 32 MiB slice are still moved, and the call is not an error."""
    # a fresh private anonymous mapping (np.empty may hand back heap memory an earlier test
    # wrote; a shared one is shmem, where THP has its own switch)
    region = mmap.mmap(-1, 64 * MIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf = np.frombuffer(region, np.float32)
    buf[: 4 * MIB // 4] = 1.0  # only the first 4 MiB exist
    got = native._cpu_module().advise_huge_pages(buf.ctypes.data, buf.nbytes)
    assert 2 * MIB <= got < 32 * MIB
    assert (buf[: 4 * MIB // 4] == 1.0).all()


def _thp_always() -> bool:
    with open(THP_FILE) as fh:
        return "[always]" in fh.read()


@needs_thp
def test_a_large_output_is_written_on_huge_pages():
    """A kernel advises a large output before it writes it: lookup_pool_backward's 40 MiB
    [C, D] gradient (over the 32 MiB mmap threshold: a fresh mapping each call) comes back on
    huge pages, and on 4 KiB pages with the mode off; the values are the same either way.
    In a fresh process: in this one, glibc may serve the 40 MiB from a heap block an earlier
    test's buffer left on huge pages (seen in CI: 30 of 40 MiB huge with the mode off)."""
    _in_a_fresh_process("large_output_on_huge_pages")


def large_output_on_huge_pages():
    rng = np.random.default_rng(3)
    cap, d = 80 * 1024, 128
    ids = jnp.asarray(rng.integers(0, 10 * cap, cap), jnp.int32)
    seg = jnp.arange(cap, dtype=jnp.int32)
    grads = jnp.asarray(rng.standard_normal((cap, d)), jnp.float32)

    def backward():
        _, row_grads, n = ops.lookup_pool_backward(grads, ids, seg, capacity=cap)
        return row_grads.block_until_ready(), int(n)

    native.set_huge_page_mode("auto")  # a fresh process: opt in
    on, n_on = backward()
    assert _huge_bytes(on) >= 32 * MIB
    # Background advice queued by earlier tests acts on whatever is mapped at its range, a
    # freed table's address included: let it finish before the mode goes off.
    assert native.wait_huge_pages(60)
    native.set_huge_page_mode("off")
    try:
        off, n_off = backward()
    finally:
        native.set_huge_page_mode("auto")
    if not _thp_always():
        assert _huge_bytes(off) < 4 * MIB
    assert n_on == n_off
    np.testing.assert_array_equal(np.asarray(on), np.asarray(off))
