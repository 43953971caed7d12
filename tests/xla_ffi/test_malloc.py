"""EMBARK_MALLOC: loading the kernels sets glibc's mmap and trim thresholds (docs/design.md §7).

Checked by what the thresholds are for: in a fresh process, a 24 MiB block that is freed and
allocated again lands on pages already faulted in (tuned), while with the switch off glibc
still serves it from fresh pages, faulted in again on first touch (its thresholds have not
risen that far in a process that has only imported JAX)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or not platform.libc_ver()[0].startswith("glibc"),
    reason="glibc only",
)

_CHILD = """
import ctypes, resource
from embark_jax.ops import native
mode = native.malloc_mode()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
n = 24 << 20

def touch_faults():
    p = libc.malloc(n)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    ctypes.memset(p, 1, n)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    libc.free(p)
    return faults

touch_faults()
print(mode, touch_faults(), n // 4096)
"""

_MALLOC_ENV = (
    "EMBARK_MALLOC",
    "EMBARK_CPU_TUNING",
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "GLIBC_TUNABLES",
)


def _child(**env_vars):
    return _child_code("", **env_vars)


def _child_code(prelude, **env_vars):
    env = {k: v for k, v in os.environ.items() if k not in _MALLOC_ENV}
    env.update(env_vars)
    run = subprocess.run(
        [sys.executable, "-c", prelude + _CHILD],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    mode, faults, pages = run.stdout.split()
    return mode, int(faults), int(pages)


def test_auto_reuses_freed_blocks_and_off_leaves_glibc_alone():
    mode, faults, pages = _child(EMBARK_MALLOC="auto")
    assert mode == "tuned"
    assert faults < pages // 20, f"{faults} faults touching a reused {pages}-page block"
    assert _child(EMBARK_CPU_TUNING="on")[0] == "tuned"
    for env in ({}, {"EMBARK_MALLOC": " OFF "}):  # off unless asked for
        mode, faults, pages = _child(**env)
        assert mode == "off"
        assert faults > pages // 2, f"only {faults} faults for {pages} fresh pages"


def test_a_process_that_sets_glibc_thresholds_keeps_them():
    mode, faults, pages = _child(
        EMBARK_MALLOC="auto", MALLOC_TRIM_THRESHOLD_="131072", MALLOC_MMAP_THRESHOLD_="131072"
    )
    assert mode == "user"
    assert faults > pages // 2  # the user's 128 KiB thresholds, not ours: fresh pages
    tunables = "glibc.malloc.trim_threshold=1048576"
    assert _child(EMBARK_MALLOC="auto", GLIBC_TUNABLES=tunables)[0] == "user"


def test_only_the_environment_the_process_started_with_counts():
    """glibc read its settings at startup: a variable set later is not the user's choice (we
    still tune), and one removed later still was (we leave glibc alone)."""
    prelude = "import os; os.environ['MALLOC_TRIM_THRESHOLD_'] = '131072'\n"
    mode, faults, pages = _child_code(prelude, EMBARK_MALLOC="auto")
    assert (mode, faults < pages // 20) == ("tuned", True)
    prelude = "import os; del os.environ['MALLOC_TRIM_THRESHOLD_']\n"
    mode, faults, pages = _child_code(
        prelude, EMBARK_MALLOC="auto", MALLOC_TRIM_THRESHOLD_="131072"
    )
    assert mode == "user"


def test_bad_switch_is_one_error_line():
    env = {k: v for k, v in os.environ.items() if k not in _MALLOC_ENV}
    env["EMBARK_MALLOC"] = "jemalloc"
    run = subprocess.run(
        [sys.executable, "-c", "from embark_jax.ops import native; native.malloc_mode()"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert "EMBARK_MALLOC='jemalloc': expected auto, on, 1, off or 0" in last
