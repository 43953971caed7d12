"""`embark_jax.cli.flags`: flags shared by several commands."""

import argparse

import pytest

from embark_jax.cli.flags import add_batch_size, add_choice, add_counts
from embark_jax.core.options import OverflowPolicy


def _parser():
    p = argparse.ArgumentParser(exit_on_error=False)
    add_counts(p, {"--steps": (3, "training steps")})
    add_batch_size(p, "the plan's")
    add_choice(p, "--overflow", OverflowPolicy.COUNT, "what an overflow does")
    return p


def test_defaults_and_parsed_values():
    args = _parser().parse_args([])
    assert (args.steps, args.batch_size, args.overflow) == (3, None, "count")
    args = _parser().parse_args(["--steps", "1", "--batch-size", "8", "--overflow", "grow"])
    assert (args.steps, args.batch_size, OverflowPolicy.parse(args.overflow)) == (
        1,
        8,
        OverflowPolicy.GROW,
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "0"], "must be >= 1, got 0"),
        (["--batch-size", "-4"], "must be >= 1, got -4"),
        (["--overflow", "drop"], "invalid choice: 'drop'"),
    ],
)
def test_bad_values_are_refused(argv, message):
    with pytest.raises(argparse.ArgumentError, match=message):
        _parser().parse_args(argv)
