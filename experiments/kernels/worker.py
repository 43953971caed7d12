"""One library's benchmark worker: `python -m experiments.kernels.worker --lib {embark,xla,torch}`.

Each library runs in its own process (their thread pools slow each other in one process); the
driver (`bench.py`) keeps one worker per library alive for the whole run and sends it one JSON
command per line on stdin; the worker answers one JSON line on its protocol stream (the
original stdout; anything else printed goes to stderr). Commands:

  {"cmd": "point", "point": {...}, "seed": 0}  -> {"unique_rows": U}   build the point's data
  {"cmd": "setup", "op": OP, "warmup": 2,      -> {"impls": [...], "errors": {impl: msg}}
   "extra_ops": [OP2]}                            (OP2's cases named IMPL@OP2)
  {"cmd": "run", "impl": IMPL, "reps": k, "warm": w} -> {"times": [k seconds]} (w untimed first)
  {"cmd": "sample", "impl": IMPL}              -> {"sample": [...]}  rows compared across libs
  {"cmd": "teardown"}                          -> {}                 frees the op's cases
  {"cmd": "copy", "nbytes": n}                 -> {"GBps": x}        copy bandwidth (embark)
  {"cmd": "info"}                              -> {"info": {...}}    versions, thread counts
  {"cmd": "quit"}

The first line is a hello: {"available": true, "info": {...}}, or {"available": false,
"reason": "ImportError: ..."} when the library cannot be imported (then the worker exits 0).
EMBARK_BENCH_UNAVAILABLE=torch (a comma list of libraries) makes those report ImportError:
how the tests take the "torch not installed" branch on a machine that has it.

Threads (--threads N, default: the CPUs this process may run on): when N is below that, the
worker first restricts its CPU affinity to N CPUs. XLA's CPU client sizes its intra-op pool
(the `tf_XLAEigen` threads, whose `num_threads()` our FFI `ParallelFor` splits work over, the
calling thread taking chunks too) from the affinity mask, and torch gets
`torch.set_num_threads(N)`; `info` reports the threads each process really has.
"""

from __future__ import annotations

import argparse
import collections
import faulthandler
import gc
import json
import os
import sys
import time
import traceback

UNAVAILABLE_ENV = "EMBARK_BENCH_UNAVAILABLE"
LIBS = ("embark", "xla", "torch")


def _protocol_stream():
    """The original stdout for replies; fd 1 then points at stderr, so that stray prints
    (ours or a C library's) cannot corrupt the protocol."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    sys.stdout.flush()
    os.dup2(2, 1)
    return proto


def _set_threads(n: int | None) -> int:
    cpus = sorted(os.sched_getaffinity(0))
    if n and n < len(cpus):
        os.sched_setaffinity(0, cpus[:n])
        return n
    return len(cpus)


def os_threads() -> dict[str, int]:
    """This process's threads by name (`tf_XLAEigen`: XLA's intra-op pool)."""
    names = collections.Counter()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as fh:
                names[fh.read().strip()] += 1
        except OSError:
            pass
    return dict(names)


class Lib:
    """One library in this process: its cases per op, on the current point's data."""

    def __init__(self, lib: str, threads: int, device: str):
        if lib in os.environ.get(UNAVAILABLE_ENV, "").split(","):
            raise ImportError(f"{lib} made unavailable by {UNAVAILABLE_ENV}")
        self.lib, self.threads = lib, threads
        if lib == "torch":
            import torch

            from experiments.kernels import cases_torch

            torch.set_num_threads(threads)
            if device == "cuda" and not torch.cuda.is_available():
                raise ImportError("torch has no CUDA here")
            cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
            self.device = "cuda" if cuda else "cpu"
            self._mod = cases_torch
        else:
            import jax

            from experiments.kernels import cases_jax

            self.device = jax.default_backend()
            self._mod = cases_jax
        self.data = self.builder = None
        self.cases = {}

    def info(self) -> dict:
        info = {"lib": self.lib, "threads_requested": self.threads, "os_threads": os_threads()}
        info["cpu_affinity"] = len(os.sched_getaffinity(0))
        if self.lib == "torch":
            return info | self._mod.info(self.device)
        import jax
        import jaxlib

        from embark_jax.ops import native

        info |= {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "backend": self.device}
        info["device"] = str(jax.devices()[0])
        info["xla_intra_op_threads"] = os_threads().get("tf_XLAEigen", 0)
        if self.lib == "embark":
            info["embark_build"] = {k: str(v) for k, v in native.build_info().items()}
            info["huge_page_stats"] = native.huge_page_stats()
        return info

    def point(self, msg) -> dict:
        from experiments.kernels.cases import Data
        from experiments.kernels.points import Point

        self.cases, self.builder, self.data = {}, None, None
        gc.collect()
        self.data = Data(Point.from_json(msg["point"]), msg.get("seed", 0))
        if self.lib == "torch":
            self.builder = self._mod.TorchCases(self.data, self.device)
        else:
            self.builder = self._mod.JaxCases(self.lib, self.data)
        return {"unique_rows": self.data.unique_rows, "capacity": self.data.capacity}

    def setup(self, msg) -> dict:
        """Builds and warms up the cases of `op` and of `extra_ops` (timed in the same
        session; their impls are named `IMPL@OP`)."""
        self.cases, errors = {}, {}
        gc.collect()
        for op in [msg["op"], *msg.get("extra_ops", [])]:
            at = "" if op == msg["op"] else f"@{op}"
            try:
                made = self.builder.cases(op)
            except Exception as e:  # e.g. a dtype this library lacks: recorded, not fatal
                made, errors[self.lib + at] = {}, f"{type(e).__name__}: {e}"
            for impl, case in made.items():
                try:
                    for _ in range(msg.get("warmup", 2)):
                        _rep(case)
                    self.cases[impl + at] = case
                except Exception as e:
                    errors[impl + at] = f"{type(e).__name__}: {e}"
        if self.lib == "embark":  # steady state: the tables the warm-up saw are on huge pages
            from embark_jax.ops import native

            if not native.wait_huge_pages(300):
                print("warning: huge-page advice still running; timing anyway", file=sys.stderr)
        return {"impls": list(self.cases), "errors": errors}

    def run(self, msg) -> dict:
        case = self.cases[msg["impl"]]
        for _ in range(msg.get("warm", 0)):  # untimed: the turn's first calls wake the threads
            _rep(case)
        return {"times": [_rep(case) for _ in range(msg["reps"])]}

    def sample(self, msg) -> dict:
        return {"sample": self.cases[msg["impl"]].sample().reshape(-1).tolist()}

    def teardown(self, msg) -> dict:
        self.cases = {}
        gc.collect()
        return {}

    def copy(self, msg) -> dict:
        return {"GBps": self._mod.copy_bandwidth(msg["nbytes"]) / 1e9}


def _rep(case) -> float:
    if case.prepare is not None:
        case.prepare()
    t0 = time.perf_counter()
    case.run()
    return time.perf_counter() - t0


def serve(lib: Lib, inp, out) -> None:
    for line in inp:
        msg = json.loads(line)
        cmd = msg["cmd"]
        if cmd == "quit":
            return
        try:
            reply = lib.info() if cmd == "info" else getattr(lib, cmd)(msg)
            reply = {"info": reply} if cmd == "info" else reply
        except Exception as e:
            reply = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        out.write(json.dumps(reply) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lib", choices=LIBS, required=True)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help="torch's device"
    )
    args = ap.parse_args(argv)
    proto = _protocol_stream()
    faulthandler.enable()  # a crashing kernel leaves its stack on stderr
    threads = _set_threads(args.threads)
    try:
        lib = Lib(args.lib, threads, args.device)
    except ImportError as e:
        proto.write(json.dumps({"available": False, "reason": f"ImportError: {e}"}) + "\n")
        return 0
    proto.write(json.dumps({"available": True, "info": lib.info()}) + "\n")
    serve(lib, sys.stdin, proto)
    return 0


if __name__ == "__main__":
    sys.exit(main())
