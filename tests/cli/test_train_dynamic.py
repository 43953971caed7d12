"""`train --dynamic-tables` (`embark_jax.cli.train_dynamic`): which tables become dynamic,
their configs, one-line errors; end to end, a real 2-process x 2-device run with a dynamic
table, checkpointed and resumed, against a 1-process 4-device run of the same steps."""

import argparse
import json

import pytest

from embark_jax.cli import train_dynamic as td
from embark_jax.cli.errors import CLIError
from embark_jax.cli.train_args import add_train_args
from embark_jax.planner import get_hardware, load_preset
from tests.cli.test_train import SMALL, run

SPEC = load_preset("dcnv2-mini")
HW = get_hardware("h200", 1, 8)
BATCH = ("--batch-size", "4096")


def _args(*argv):
    p = argparse.ArgumentParser()
    add_train_args(p)
    return p.parse_args(list(argv))


def test_count_picks_the_largest_tables_in_preset_order_on_ties():
    # t0, t1, t4, t9, ... have 20000 rows; t2 17295 comes after every 20000-row table
    assert td.chosen(_args("--dynamic-tables", "3"), SPEC) == ["t0", "t1", "t4"]
    eleventh = td.chosen(_args("--dynamic-tables", "11"), SPEC)[-1]
    assert eleventh == "t2"
    assert td.chosen(_args("--dynamic-tables", "t5,t3,t5"), SPEC) == ["t5", "t3"]
    assert td.chosen(_args(), SPEC) == []


@pytest.mark.parametrize(
    "value, message",
    [
        ("t3,t99", "--dynamic-tables: t99 not in --model dcnv2-mini (tables t0..t25)"),
        ("26", "--dynamic-tables 26: all 26 tables would be dynamic; keep at least one fixed"),
    ],
)
def test_bad_choices_are_one_line_errors(value, message):
    with pytest.raises(CLIError) as e:
        td.chosen(_args("--dynamic-tables", value), SPEC)
    assert str(e.value) == message


@pytest.mark.parametrize(
    "argv",
    [
        ["--dynamic-tables", "0"],
        ["--dynamic-tables", "t1,,t2"],
        ["--dynamic-tables", "t1;rm"],
        ["--dynamic-capacity", "100"],
        ["--dynamic-capacity", "-32"],
        ["--admission", "0"],
        ["--dynamic-replicate-below", "-1"],
        ["--eviction", "fifo"],
    ],
)
def test_bad_flag_values_are_refused_by_the_parser(argv, capsys):
    with pytest.raises(SystemExit) as e:
        _args(*argv)
    assert e.value.code == 2
    assert "error: argument" in capsys.readouterr().err


def test_split_keeps_the_rest_fixed_and_sizes_capacity_from_the_vocabulary():
    args = _args("--dynamic-tables", "t20,t5", "--admission", "3", "--eviction", "lfu", *BATCH)
    fixed, dyn, columns, choices = td.split(args, SPEC, HW)
    assert columns == [f"f_t{i}" for i in range(26)]  # Criteo's column order: the preset's
    assert [t.name for t in fixed.tables] == [f"t{i}" for i in range(26) if i not in (5, 20)]
    by = {t.name: t for t in dyn.tables}
    assert sorted(by) == ["t20", "t5"]
    # twice the rows over 8 devices, whole buckets of 32: 20000 -> 5000 -> 5024; t5's 3 rows
    # the planner replicates (predicted faster, a tiny copy): held whole, 6 -> 32
    assert by["t20"].capacity == 5024 and by["t5"].capacity == 32
    assert dyn.replicated == ("t5",)
    assert [c.name for c in choices] == ["t5", "t20"] and choices[0].replicated
    assert choices[0].replicated_s < choices[0].sharded_s and "replicated:" in choices[0].reason
    args = _args("--dynamic-tables", "t20,t7", "--dynamic-replicate-below", "0", *BATCH)
    assert td.split(args, SPEC, HW)[1].replicated == ()
    args = _args("--dynamic-tables", "t13", "--dynamic-replicate-below", "3000", *BATCH)
    assert td.split(args, SPEC, HW)[1].tables[0].capacity == 4448  # 2 x 2209 rows, whole
    assert by["t20"].dim == 128 and by["t20"].admission_threshold == 3
    assert by["t20"].eviction.value == "lfu"
    feats = {f.table: f for f in dyn.features}
    assert feats["t20"].name == "f_t20" and feats["t20"].max_hotness == 100
    args = _args("--dynamic-tables", "t20", "--dynamic-capacity", "64", *BATCH)
    assert td.split(args, SPEC, HW)[1].tables[0].capacity == 64
    none = td.split(_args(), SPEC, HW)
    assert none[0] is SPEC and none[1] is None


@pytest.mark.slow
def test_two_processes_with_a_dynamic_table_resume_and_match_one_process(tmp_path):
    # t0 (500 rows under --max-vocab 500) sharded, t8 (63 rows) replicated on every device
    common = [*SMALL, "--optimizer", "sgd", "--dynamic-tables", "t0,t8"]
    common += ["--dynamic-replicate-below", "100"]
    ckpt = tmp_path / "ckpt"
    launch = ["launch", "--nproc", "2", "--devices-per-proc", "2", "--", "train", *common]
    parts = []
    for i, extra in enumerate((["--steps", "2"], ["--steps", "1", "--resume"])):
        out = tmp_path / f"multi{i}.json"
        r = run([*launch, *extra, "--checkpoint-dir", str(ckpt), "--out", str(out)])
        assert r.returncode == 0, r.stdout + r.stderr
        parts.append(json.loads(out.read_text()))
    assert "resumed from" in r.stdout and "dynamic table t0: found" in r.stdout
    r = run(["train", *common, "--steps", "3", "--devices", "4", "--out", str(tmp_path / "s.json")])
    assert r.returncode == 0, r.stdout + r.stderr
    single = json.loads((tmp_path / "s.json").read_text())
    assert parts[0]["processes"] == 2 and single["processes"] == 1
    assert parts[0]["losses"] + parts[1]["losses"] == pytest.approx(single["losses"], rel=1e-5)
    assert "  t0: sharded, 256 rows/device -- sharded: --dynamic-replicate-below 100" in r.stdout
    assert "  t8: replicated, 128 rows/device -- replicated: --dynamic" in r.stdout
    for name in ("t0", "t8"):  # every count reported, and summed over the two runs the same
        counts = single["dynamic"][name]
        assert counts["inserted"] > 0 and counts["found"] > 0
        assert counts["dropped"] == counts["overflow"] == 0
        both = {k: parts[0]["dynamic"][name][k] + parts[1]["dynamic"][name][k] for k in counts}
        assert both == counts
    assert single["eval_auc"] == pytest.approx(parts[1]["eval_auc"], abs=1e-6)
