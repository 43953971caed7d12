"""`embark_jax.cli.train_checks`: `train`'s flag, plan-file and device checks."""

import argparse

import pytest

from embark_jax.cli.errors import CLIError
from embark_jax.cli.train_args import add_train_args
from embark_jax.cli.train_checks import check_args, check_devices


def _args(tmp_path, *argv):
    p = argparse.ArgumentParser()
    add_train_args(p)
    return p.parse_args(["--out", str(tmp_path / "m.json"), *argv])


def test_the_default_batch_fills_in_and_devices_must_divide_it(tmp_path):
    args = _args(tmp_path)
    assert check_args(args, default_batch=12) is None and args.batch_size == 12
    check_devices(args, 4, None)
    with pytest.raises(CLIError, match="--batch-size 12 is not a multiple of the 8 devices"):
        check_devices(args, 8, None)
    args.nodes = 5
    with pytest.raises(CLIError, match="4 devices do not split into --nodes 5"):
        check_devices(args, 4, None)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--resume"], "--resume needs --checkpoint-dir"),
        (["--save-every", "3"], "--save-every 3 needs --checkpoint-dir"),
        (["--plan", "p.json", "--baseline", "tw"], "--plan and --baseline exclude each other"),
    ],
)
def test_flag_combinations_are_refused(tmp_path, argv, message):
    with pytest.raises(CLIError, match=message):
        check_args(_args(tmp_path, *argv), default_batch=8)
