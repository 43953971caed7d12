"""The main job end to end, and a real 2-process x 2-device run (jax.distributed, gloo on
localhost) against a 1-process 4-device run."""

import json
import os
import re
import subprocess
import sys

import pytest

SMALL = [
    "--model",
    "dcnv2-mini",
    "--max-vocab",
    "500",
    "--max-hotness",
    "4",
    "--batch-size",
    "64",
    "--eval-batches",
    "1",
    "--log-every",
    "1",
    "--dense-net",
    "mini",
]


def run(args, timeout=300, **env):
    e = dict(os.environ)
    e.pop("JAX_PLATFORMS", None)
    e.update(env)
    return subprocess.run(
        [sys.executable, "-m", "embark_jax", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=e,
    )


@pytest.mark.slow
def test_main_job_short(tmp_path):
    out, logs = tmp_path / "m.json", tmp_path / "logs"
    r = run(["train", "--steps", "8", *SMALL, "--out", str(out), "--log-dir", str(logs)])
    assert r.returncode == 0, r.stdout + r.stderr
    m = json.loads(out.read_text())
    for key in ("eval_auc", "eval_logloss", "samples_per_s", "overflow", "comm_bytes_per_step"):
        assert key in m
    assert m["devices"] == 8 and sum(m["overflow"].values()) == 0
    assert m["comm_bytes_per_step"]["total"] > 0
    assert "predicted step" in r.stdout and "samples/s" in r.stdout and "eval AUC" in r.stdout
    assert "steps/s" in r.stdout and "left" in r.stdout and "train AUC (cumulative" in r.stdout
    rows = [json.loads(line) for line in (logs / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows[:8]] == list(range(1, 9)) and "eval_auc" in rows[-1]
    assert len(list(logs.glob("events.out.tfevents.*"))) == 1


@pytest.mark.slow
def test_two_processes_match_one_process(tmp_path):
    a, b = tmp_path / "multi.json", tmp_path / "single.json"
    common = ["--steps", "3", *SMALL, "--optimizer", "sgd"]
    r1 = run(
        [
            "launch",
            "--nproc",
            "2",
            "--devices-per-proc",
            "2",
            "--",
            "train",
            *common,
            "--out",
            str(a),
        ]
    )
    assert r1.returncode == 0, r1.stdout + r1.stderr
    # launch keeps the processes' output readable: no gloo notices, no empty prefixed lines
    assert "[Gloo]" not in r1.stdout and "peer ranks" not in r1.stdout, r1.stdout
    assert not re.search(r"^\[\d+\] *$", r1.stdout, re.M), r1.stdout
    r2 = run(["train", *common, "--devices", "4", "--out", str(b)])
    assert r2.returncode == 0, r2.stdout + r2.stderr
    multi, single = json.loads(a.read_text()), json.loads(b.read_text())
    assert multi["processes"] == 2 and single["processes"] == 1
    assert multi["devices"] == single["devices"] == 4
    assert multi["losses"] == pytest.approx(single["losses"], rel=1e-5)
