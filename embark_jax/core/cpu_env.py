"""The environment switches of the CPU kernels, checked without importing JAX (the command
line checks them before a command runs; `embark_jax.ops.native` before the kernels load).

- `EMBARK_CPU_ISA`: `auto` (default), `scalar`, `avx2`, `avx512` or `avx512bf16` (AVX-512 with
  the BF16 conversions): the SIMD path the kernels use (at most the best the CPU supports).
- `EMBARK_CPU_THREADS`: a positive integer, the threads each CPU kernel runs on (default: the
  CPUs the process may use).
Huge pages are on by default: they are advice about buffers the kernels read or write (the
tables, fresh outputs of 32 MiB or more), as numpy advises its large arrays, and a table read
at random is read faster on them (docs/benchmarks.md has the measurements). Process-wide tuning is opt-in: the other two switches
change the whole process (its allocator, threads that stay awake), so loading the kernels
does none of it unless asked. `EMBARK_CPU_TUNING=on` asks for all three, `off` turns all
three off (each switch set on its own wins):

- `EMBARK_HUGEPAGES`: `auto` (also `on`, `1`; the default unless `EMBARK_CPU_TUNING=off`) or
  `off` (`0`): whether the kernels move the tables they read at random onto transparent huge
  pages, from a background thread, and advise their large fresh outputs (docs/design.md §7).
- `EMBARK_MALLOC`: the same values: whether loading the kernels sets glibc's mmap and trim
  thresholds to the values its own rule converges to, so that large outputs reuse memory
  instead of faulting fresh pages in at each call (docs/design.md §7). A process started with
  glibc malloc thresholds of its own (`MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`, or
  those `GLIBC_TUNABLES`) keeps them.
- `EMBARK_CPU_SPIN`: the same values: whether the kernels' worker threads stay awake (spin,
  then yield the CPU) for a few milliseconds after each job, so kernels called in quick
  succession find them running; off, they sleep at once (a wake-up costs ~0.1 ms).
"""

from __future__ import annotations

import os

__all__ = [
    "CPU_ISAS",
    "check_cpu_env",
    "huge_page_mode_from_env",
    "malloc_mode_from_env",
    "parse_huge_page_mode",
    "spin_mode_from_env",
    "tuning_from_env",
    "user_sets_malloc",
]

CPU_ISAS = ("scalar", "avx2", "avx512", "avx512bf16")
_HUGE_PAGE_VALUES = {"auto": "auto", "on": "auto", "1": "auto", "off": "off", "0": "off"}


def parse_huge_page_mode(value: str) -> str | None:
    """`auto` or `off` for a huge-page switch value (auto, on, 1 / off, 0; any case, spaces
    ignored), None for anything else."""
    return _HUGE_PAGE_VALUES.get(str(value).strip().lower())


def _switch_from_env(name: str, default: str = "off") -> str:
    """`auto` or `off`, from an auto/off switch variable (unset or empty: `default`; the
    spellings of parse_huge_page_mode); ValueError naming the variable and value when
    malformed."""
    raw = os.environ.get(name, "")
    mode = parse_huge_page_mode(raw) if raw.strip() else default
    if mode is None:
        raise ValueError(f"{name}={raw!r}: expected auto, on, 1, off or 0")
    return mode


def tuning_from_env() -> str:
    """`auto` or `off`, from EMBARK_CPU_TUNING (unset: `off`): the default of the malloc and
    spin switches, and of the huge-page switch where it is set."""
    return _switch_from_env("EMBARK_CPU_TUNING")


def huge_page_mode_from_env() -> str:
    """`auto` or `off`, from EMBARK_HUGEPAGES (default: EMBARK_CPU_TUNING's where it is set,
    else `auto`)."""
    return _switch_from_env("EMBARK_HUGEPAGES", _switch_from_env("EMBARK_CPU_TUNING", "auto"))


def malloc_mode_from_env() -> str:
    """`auto` or `off`, from EMBARK_MALLOC (default: EMBARK_CPU_TUNING's)."""
    return _switch_from_env("EMBARK_MALLOC", tuning_from_env())


def spin_mode_from_env() -> str:
    """`auto` or `off`, from EMBARK_CPU_SPIN (default: EMBARK_CPU_TUNING's)."""
    return _switch_from_env("EMBARK_CPU_SPIN", tuning_from_env())


_USER_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
_USER_MALLOC_TUNABLES = ("glibc.malloc.mmap_threshold", "glibc.malloc.trim_threshold")


def _startup_environ() -> dict[str, str]:
    """The environment this process started with, which is what glibc read its malloc settings
    from (a variable set or removed later in `os.environ` changes nothing in glibc); Linux
    keeps it in /proc/self/environ. Elsewhere, `os.environ`."""
    try:
        with open("/proc/self/environ", "rb") as fh:
            entries = fh.read().split(b"\0")
    except OSError:
        return dict(os.environ)
    pairs = (e.decode(errors="replace").partition("=") for e in entries if b"=" in e)
    return {k: v for k, _, v in pairs}


def user_sets_malloc() -> bool:
    """Whether this process started with glibc malloc thresholds of its own (MALLOC_*_ or
    GLIBC_TUNABLES in the environment it was started with)."""
    env = _startup_environ()
    tunables = env.get("GLIBC_TUNABLES", "")
    return any(env.get(k, "").strip() for k in _USER_MALLOC_ENV) or any(
        t in tunables for t in _USER_MALLOC_TUNABLES
    )


def check_cpu_env() -> None:
    """Raises ValueError naming the variable and value when a switch is malformed."""
    isa = os.environ.get("EMBARK_CPU_ISA", "").strip().lower()
    if isa not in ("", "auto", *CPU_ISAS):
        raise ValueError(
            f"EMBARK_CPU_ISA={os.environ['EMBARK_CPU_ISA']!r}: expected auto, "
            + ", ".join(CPU_ISAS)
        )
    threads = os.environ.get("EMBARK_CPU_THREADS", "").strip()
    if threads and not (threads.isdigit() and int(threads) >= 1):
        raise ValueError(
            f"EMBARK_CPU_THREADS={os.environ['EMBARK_CPU_THREADS']!r}: expected a positive integer"
        )
    huge_page_mode_from_env()
    malloc_mode_from_env()
    spin_mode_from_env()
