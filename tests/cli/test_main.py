"""Every user mistake on the command line is one `error:` line and exit code 2: no
traceback, and nothing written."""

import os
import re
import shlex
import subprocess
import sys

import pytest

from embark_jax.cli.main import main

SMALL = ["--max-vocab", "500", "--max-hotness", "4", "--eval-batches", "1"]


def _files(root) -> set[str]:
    return {os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs}


def _check(code: int, out: str, err: str, needle: str) -> None:
    text = out + err
    assert code == 2, text
    assert "Traceback" not in text, text
    lines = [ln for ln in text.splitlines() if "error:" in ln]
    assert len(lines) == 1, text
    assert needle in lines[0], text


def run_in_process(argv, capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse
        code = e.code
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def run_subprocess(argv, cwd) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    return subprocess.run(
        [sys.executable, "-m", "embark_jax", *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture
def plans(tmp_path):
    """Plan files: malformed, for 64 devices, for another model; a regular file."""
    d = tmp_path / "inputs"
    d.mkdir()
    (d / "bad.json").write_text('{"format": "embark-plan/1", ')
    (d / "file.txt").write_text("x")
    step = d / "used" / "step_00000004"  # another run's checkpoint (only what is listed)
    step.mkdir(parents=True)
    (step / "meta.json").write_text('{"format": "embark-ckpt/2", "sequence": 1}')
    assert (
        main(["plan", "--model", "dcnv2-mini", "--nodes", "8", "--out", str(d / "p64.json")]) == 0
    )
    return d


# flags that argparse or the checks before JAX refuse: in process
IN_PROCESS = [
    (["train", "--batch-size", "0"], "--batch-size: must be >= 1, got 0"),
    (["train", "--batch-size", "8796093022208"], "--batch-size: must be <= 2147483647"),
    (["train", "--steps", "-1"], "--steps: must be >= 1, got -1"),
    (["train", "--steps", "0"], "--steps: must be >= 1, got 0"),
    (["train", "--eval-batches", "0"], "--eval-batches: must be >= 1, got 0"),
    (["train", "--devices", "0"], "--devices: must be >= 1, got 0"),
    (["train", "--nodes", "0"], "--nodes: must be >= 1, got 0"),
    (["train", "--model", "nope"], "unknown model 'nope'"),
    (["train", "--topology", "tpu"], "unknown topology 'tpu'"),
    (["train", "--lr", "nan"], "--lr: must be a finite number > 0"),
    (["train", "--resume"], "--resume needs --checkpoint-dir"),
    (["train", "--plan", "{inputs}/missing.json"], "cannot read plan file"),
    (["train", "--plan", "{inputs}/bad.json"], "plan is not valid JSON"),
    (["train", "--checkpoint-dir", "{inputs}/file.txt/ckpt"], "--checkpoint-dir"),
    (["train", "--save-every", "2"], "--save-every 2 needs --checkpoint-dir"),
    (
        ["train", "--checkpoint-dir", "{inputs}/used"],
        "already holds checkpoints (latest step 4); add --resume",
    ),
    (["train", "--log-dir", "{inputs}/file.txt"], "--log-dir"),
    (["train", "--out", "{inputs}/file.txt/m.json"], "--out"),
    (["plan", "--nodes", "0"], "--nodes: must be >= 1, got 0"),
    (["plan", "--batch-size", "8796093022208"], "--batch-size: must be <= 2147483647"),
    (["plan", "--devices-per-node", "0"], "--devices-per-node: must be >= 1"),
    (["plan", "--model", "nope"], "unknown model 'nope'"),
    (["plan", "--topology", "tpu"], "unknown topology 'tpu'"),
    (["plan", "--batch-size", "100"], "--batch-size 100 is not a multiple of the 8 devices"),
    (["plan", "--out", "{inputs}/file.txt/p.json"], "--out"),
    (["plan", "--model", "t7", "--nodes", "1"], "does not fit"),
    (["simulate", "--nodes", "0"], "--nodes: must be >= 1, got 0"),
    (["simulate", "--models", "nope"], "unknown model 'nope'"),
    (["launch", "--nproc", "0", "--", "train"], "--nproc: must be >= 1, got 0"),
    (["launch", "--", "bogus"], "invalid choice: 'bogus'"),  # once, not once per process
    (["launch", "--", "train", "--steps", "0"], "--steps: must be >= 1, got 0"),
    (["launch", "--", "train", "--resume"], "--resume needs --checkpoint-dir"),
]


@pytest.mark.parametrize(("argv", "needle"), IN_PROCESS, ids=[" ".join(a) for a, _ in IN_PROCESS])
def test_user_mistake_is_one_error_line(argv, needle, plans, tmp_path, capsys, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    before = _files(tmp_path)
    argv = [a.replace("{inputs}", str(plans)) for a in argv]
    _check(*run_in_process(argv, capsys), needle)
    assert _files(tmp_path) == before


# mistakes found once the devices are known, and a few of the above: as a user runs them
SUBPROCESS = [
    (["train", "--plan", "{inputs}/p64.json", *SMALL], "is for 8x8 = 64 devices but this run"),
    (["train", "--batch-size", "60", *SMALL], "--batch-size 60 is not a multiple of the 8"),
    (["train", "--nodes", "3", *SMALL], "8 devices do not split into --nodes 3"),
    (["train", "--model", "t7", *SMALL[2:]], "does not fit"),
    (
        [
            "train",
            "--model",
            "t180-mini",
            "--plan",
            "{inputs}/p64.json",
            "--devices",
            "64",
            "--nodes",
            "8",
        ],
        "does not fit --model",
    ),
    (["train", "--steps", "0"], "--steps: must be >= 1"),
    (["train", "--plan", "{inputs}/bad.json"], "plan is not valid JSON"),
    (["plan", "--out", "/proc/no/such/dir/p.json"], "--out"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("argv", "needle"), SUBPROCESS, ids=[" ".join(a) for a, _ in SUBPROCESS])
def test_user_mistake_in_a_subprocess(argv, needle, plans, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    before = _files(tmp_path)
    argv = [a.replace("{inputs}", str(plans)) for a in argv]
    r = run_subprocess(argv, work)
    _check(r.returncode, r.stdout, r.stderr, needle)
    assert _files(tmp_path) == before


def test_info_into_a_closed_pipe_has_no_traceback(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    r = subprocess.run(
        f"{sys.executable} -m embark_jax info | head -c 1",
        shell=True,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.stdout == "{" and "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr


def test_help_lists_defaults_models_and_version(capsys):
    for command in ("train", "plan", "simulate", "launch"):
        code, out, _ = run_in_process([command, "--help"], capsys)
        assert code == 0
        text = " ".join(out.split())
        assert "(default:" in text
        if command != "launch":
            assert "dcnv2-mini" in text and "dlrm_dcnv2" in text, text
    code, out, _ = run_in_process(["--version"], capsys)
    assert code == 0 and out.startswith("embark_jax ")


def test_plan_notes_say_how_to_get_the_json(capsys):
    assert main(["plan", "--model", "t180-mini", "--batch-size", "4096"]) == 0
    out = capsys.readouterr().out
    assert "more tables" in out and "add --out plan.json" in out


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"EMBARK_CPU_ISA": "sse9"}, "EMBARK_CPU_ISA='sse9': expected auto"),
        ({"EMBARK_CPU_THREADS": "0"}, "EMBARK_CPU_THREADS='0': expected a positive integer"),
        ({"EMBARK_CPU_THREADS": "-3"}, "EMBARK_CPU_THREADS='-3'"),
        (
            {"EMBARK_HUGEPAGES": "always"},
            "EMBARK_HUGEPAGES='always': expected auto, on, 1, off or 0",
        ),
        ({"EMBARK_MALLOC": "jemalloc"}, "EMBARK_MALLOC='jemalloc': expected auto, on, 1, off"),
    ],
)
def test_bad_kernel_environment_is_one_error_line_before_anything_runs(
    env, needle, tmp_path, capsys, monkeypatch
):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    code, out, err = run_in_process(
        ["plan", "--model", "dcnv2-mini", "--out", str(tmp_path / "p.json")], capsys
    )
    _check(code, out, err, needle)
    assert _files(tmp_path) == set()


def test_output_files_may_go_to_new_folders(tmp_path, capsys):
    """`--out` / `--plot` into a folder that does not exist yet: it is created (as `train
    --out` always did), not a traceback after the work."""
    out, plot = tmp_path / "a" / "b" / "plan.json", tmp_path / "c" / "plan.png"
    assert main(["plan", "--model", "dcnv2-mini", "--out", str(out), "--plot", str(plot)]) == 0
    assert out.is_file() and plot.is_file()
    sim = tmp_path / "d" / "sim.json"
    assert main(["simulate", "--models", "dcnv2", "--nodes", "1", "--out", str(sim)]) == 0
    assert sim.is_file()


FAST = [*SMALL, "--model", "dcnv2-mini", "--batch-size", "16", "--devices", "1"]
FAST += ["--baseline", "dp", "--topology", "h200", "--dense-net", "mini", "--log-every", "1"]


@pytest.mark.slow
def test_ctrl_c_during_train_says_where_it_stopped_and_how_to_resume(tmp_path):
    """Ctrl-C is not a KeyboardInterrupt traceback: the step under way and its save finish,
    then one line: the step reached, the last checkpoint and the command that
    resumes; exit code 130."""
    import signal
    import time

    ckpt = tmp_path / "ckpt"
    argv = ["train", *FAST, "--steps", "100000", "--checkpoint-dir", str(ckpt)]
    argv += ["--save-every", "1"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    proc = subprocess.Popen(
        [sys.executable, "-m", "embark_jax", *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not (ckpt / "step_00000002" / "meta.json").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out + err
    assert "Traceback" not in out + err, out + err
    lines = err.strip().splitlines()
    assert lines[0] == "stopping after the step under way (Ctrl-C again to stop at once)", err
    assert len(lines) == 2, err
    m = re.fullmatch(
        r"interrupted at step (\d+); last checkpoint step (\d+) in (\S+); resume with: "
        r"\S*python\S* -m embark_jax (train .*--resume)",
        lines[1],
    )
    assert m and int(m[1]) == int(m[2]) >= 2 and m[3] == str(ckpt), lines[1]  # saved each step
    resumed = run_subprocess(
        [*shlex.split(m[4]), "--steps", "1"], tmp_path
    )  # the last --steps wins: a short resume
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"(step {m[2]}, saved with 1 devices)" in resumed.stdout, resumed.stdout
