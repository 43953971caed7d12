"""`embark_jax.data.prefetch.Prefetcher`: read-ahead that never changes what a step sees."""

import threading

import pytest

from embark_jax.data.prefetch import Prefetcher


def test_get_returns_fn_of_step_in_any_order_and_reads_ahead():
    threads = {}

    def fn(step):
        threads[step] = threading.current_thread().name
        return step * 10

    p = Prefetcher(fn, depth=2)
    try:
        assert [p.get(s) for s in (0, 1, 5, 2)] == [0, 10, 50, 20]
    finally:
        p.close()
    assert threads[0] == threading.current_thread().name  # asked first: on the spot
    assert threads[1].startswith("embark-prefetch")  # read ahead while 0 was used
    assert threads[5] == threading.current_thread().name  # out of order: on the spot


def test_depth_zero_computes_on_the_spot_only():
    calls = []
    p = Prefetcher(lambda s: calls.append(s) or s, depth=0)
    assert p.get(3) == 3 and calls == [3]
    p.close()


def test_an_error_in_the_background_is_raised_by_its_get():
    def fn(step):
        if step == 1:
            raise RuntimeError("bad batch 1")
        return step

    p = Prefetcher(fn, depth=1)
    try:
        assert p.get(0) == 0
        with pytest.raises(RuntimeError, match="bad batch 1"):
            p.get(1)
    finally:
        p.close()


def test_negative_depth_is_refused():
    with pytest.raises(ValueError, match="depth must be >= 0, got -1"):
        Prefetcher(lambda s: s, depth=-1)
