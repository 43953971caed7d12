"""`embark_jax.core.names.name_mismatch`."""

from embark_jax.core.names import name_mismatch


def test_unknown_and_missing_are_sorted_and_disjoint():
    assert name_mismatch(["c", "a", "x", "x"], ["b", "a", "c", "d"]) == (["x"], ["b", "d"])


def test_equal_sets_match_whatever_the_order():
    assert name_mismatch(("b", "a"), {"a", "b"}) == ([], [])
