"""`embark_jax.cli.train_args`: the flags of `train` and their parsers."""

import argparse

import pytest

from embark_jax.cli.train_args import DEFAULT_BATCH, add_train_args, data_source, lr_schedule


def test_defaults():
    p = argparse.ArgumentParser()
    add_train_args(p)
    args = p.parse_args([])
    assert (args.model, args.data, args.optimizer, args.batch_size) == (
        "dcnv2-mini",
        "synthetic",
        "adagrad",
        None,
    )
    assert DEFAULT_BATCH == 1024


def test_data_source_checks_the_kind_and_the_path(tmp_path):
    f = tmp_path / "day_0.tsv"
    f.write_text("")
    assert data_source(f"criteo-tsv:{f}") == f"criteo-tsv:{f}"
    assert data_source(f"criteo-multihot:{tmp_path}") == f"criteo-multihot:{tmp_path}"
    for text, message in [
        ("synthetic:x", "is not synthetic, criteo-tsv:PATH or criteo-multihot:DIR"),
        ("criteo-tsv:", "is not synthetic"),
        (f"criteo-tsv:{tmp_path}", "is not a file"),
        (f"criteo-multihot:{f}", "is not a directory"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            data_source(text)


def test_lr_schedule_errors_are_argparse_errors():
    assert lr_schedule("warmup=5").warmup == 5
    with pytest.raises(argparse.ArgumentTypeError, match="lr schedule: nothing given"):
        lr_schedule(" , ")
