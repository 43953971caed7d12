"""`embark_jax.cli.errors`: argparse types, output-path probes and one-line user errors."""

import argparse

import pytest

from embark_jax.cli import errors as E


@pytest.mark.parametrize(
    "parse, text, message",
    [
        (E.positive_int, "0", "must be >= 1, got 0"),
        (E.positive_int, "2.5", "must be an integer, got '2.5'"),
        (E.nonneg_int, "-1", "must be >= 0, got -1"),
        (E.positive_float, "nan", "must be a finite number > 0, got 'nan'"),
        (E.positive_float, "x", "must be a number, got 'x'"),
        (E.topology_name, "tpu9", "unknown topology 'tpu9'; choose from"),
    ],
)
def test_argparse_types_refuse_bad_values(parse, text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        parse(text)


def test_argparse_types_accept_their_boundaries():
    assert (E.positive_int("1"), E.nonneg_int("0"), E.positive_float("1e-9")) == (1, 0, 1e-9)
    assert E.topology_name("local") == "local"
    with pytest.raises(argparse.ArgumentTypeError, match=f"must be <= {E.MAX_BATCH_SIZE}"):
        E.batch_size(str(E.MAX_BATCH_SIZE + 1))


def test_one_line_parser_exits_2_with_one_line(capsys):
    p = E.OneLineParser(prog="embark")
    p.add_argument("--n", type=E.positive_int)
    with pytest.raises(SystemExit) as e:
        p.parse_args(["--n", "0"])
    err = capsys.readouterr().err
    assert e.value.code == E.USAGE_ERROR and err.count("\n") == 1
    assert err.startswith("embark: error: argument --n: must be >= 1, got 0")


def test_guarded_turns_a_cli_error_into_exit_2(capsys):
    def run():
        E.require(False, "--resume needs --checkpoint-dir")

    assert E.guarded(run) == E.USAGE_ERROR
    assert "error: --resume needs --checkpoint-dir" in capsys.readouterr().err


def test_writable_checks_create_nothing_and_refuse_files_as_dirs(tmp_path):
    E.check_writable_dir(str(tmp_path / "new" / "deeper"), "--log-dir")
    E.check_writable_file(str(tmp_path / "new" / "out.json"), "--out")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "f").write_text("")
    with pytest.raises(E.CLIError, match="exists and is not a directory"):
        E.check_writable_dir(str(tmp_path / "f"), "--log-dir")
    with pytest.raises(E.CLIError, match="is a directory, not a file"):
        E.check_writable_file(str(tmp_path), "--out")
    with pytest.raises(E.CLIError, match="is not a directory"):
        E.check_writable_file(str(tmp_path / "f" / "out.json"), "--out")
