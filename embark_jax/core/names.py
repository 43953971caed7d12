"""`name_mismatch`: the one comparison of a set of given names against the expected ones,
used wherever user input names tables, features, fields or slots."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["name_mismatch"]


def name_mismatch(given: Iterable, expected: Iterable) -> tuple[list, list]:
    """`(unknown, missing)`: the sorted names in `given` that are not `expected`, and the
    sorted `expected` names that are not given."""
    given, expected = set(given), set(expected)
    return sorted(given - expected), sorted(expected - given)
