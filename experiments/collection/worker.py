"""One contender's worker: `python -m experiments.collection.worker --contender NAME
--manifest DIR/manifest.json`.

Each contender runs in its own process (the libraries' thread pools slow each other in one
process, and each process's memory is its own). The driver (`bench.py`) sends one JSON
command per line on stdin; the worker answers one JSON line on its protocol stream (the
original stdout; anything else printed goes to stderr). The first line is a hello:
`{"available": true}`, or `{"available": false, "reason": "ImportError: ..."}`
when the library cannot be imported (then the worker exits 0); `EMBARK_BENCH_UNAVAILABLE=tbe`
(a comma list of contenders or libraries, `embark` or `tbe`) makes it so on a machine that
has the library (how the tests take the "fbgemm not installed" branch).

  {"cmd": "build"}              -> {"build_s", "memory", "info"}  the state, inputs copied in
  {"cmd": "check", "dir": D}    -> {..., "first_step_s", "check_s"}   step 1 on batch 0
                                   (first_step_s: the step alone); D/out_I.npy, D/rows_I.npy
  {"cmd": "settle"}             -> {"seconds", "huge_pages"}   waits for the library's
                                   background work (embark: tables onto huge pages)
  {"cmd": "run", "steps": n}    -> {"seconds": s}   n steps back to back, waits for the last
  {"cmd": "reset_peak"}         -> {"ok": bool}     peak RSS from now on (/proc clear_refs)
  {"cmd": "memory"}             -> {"memory": {...}}
  {"cmd": "quit"}

The embark workers run JAX on one CPU device; the tbe worker sets torch's threads to the
CPUs this process may use (XLA's CPU client uses them all too).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import time
import traceback

from experiments.kernels.worker import UNAVAILABLE_ENV, _protocol_stream

GIB = 2**30


def memory() -> dict:
    """This process's resident memory now and at its peak (GiB), from /proc/self/status."""
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024 / GIB
    return {"rss_gib": out.get("VmRSS"), "peak_rss_gib": out.get("VmHWM")}


def volunteer_for_oom_killer() -> None:
    """oom_score_adj 1000: should memory run out, the kernel ends this worker before any
    other job on a shared machine (raising one's own score needs no privilege)."""
    try:
        with open("/proc/self/oom_score_adj", "w") as fh:
            fh.write("1000")
    except OSError:
        pass


def reset_peak() -> bool:
    """Resets VmHWM to the current RSS (Linux >= 4.0); False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


class Worker:
    def __init__(self, contender: str, manifest: str, index_dtype: str):
        library = "tbe" if contender == "tbe" else "embark"
        unavailable = os.environ.get(UNAVAILABLE_ENV, "").split(",")
        if contender in unavailable or library in unavailable:
            raise ImportError(f"{contender} made unavailable by {UNAVAILABLE_ENV}")
        self.contender, self.library = contender, library
        self.manifest, self.index_dtype = manifest, index_dtype
        if library == "tbe":
            import torch

            from experiments.collection import side_tbe

            side_tbe.available()
            torch.set_num_threads(len(os.sched_getaffinity(0)))
        else:
            import jax

            jax.config.update("jax_num_cpu_devices", 1)
            jax.config.update("jax_platforms", "cpu")
        self.c = None

    def build(self, msg) -> dict:
        from experiments.collection.data import Inputs

        inp = Inputs.load(self.manifest)
        t0 = time.perf_counter()
        if self.library == "tbe":
            from experiments.collection.side_tbe import TBEContender

            self.c = TBEContender(inp, self.index_dtype)
        else:
            from experiments.collection.side_embark import EmbarkContender

            self.c = EmbarkContender(self.contender, inp)
        return {"build_s": time.perf_counter() - t0, "memory": memory(), "info": self.c.info()}

    def check(self, msg) -> dict:
        t0 = time.perf_counter()
        out = self.c.check(msg["dir"])
        return out | {"check_s": time.perf_counter() - t0}

    def settle(self, msg) -> dict:
        t0 = time.perf_counter()
        pages = self.c.settle()
        return {"seconds": time.perf_counter() - t0, "huge_pages": pages}

    def run(self, msg) -> dict:
        t0 = time.perf_counter()
        for _ in range(msg["steps"]):
            self.c.one()
        self.c.sync()
        return {"seconds": time.perf_counter() - t0}

    def reset_peak(self, msg) -> dict:
        return {"ok": reset_peak()}

    def memory(self, msg) -> dict:
        return {"memory": memory()}


def serve(worker: Worker, inp, out) -> None:
    for line in inp:
        msg = json.loads(line)
        cmd = msg["cmd"]
        if cmd == "quit":
            return
        try:
            reply = getattr(worker, cmd)(msg)
        except Exception as e:
            reply = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        out.write(json.dumps(reply) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contender", required=True)
    ap.add_argument("--manifest", required=True)
    ap.add_argument("--index-dtype", choices=("int32", "int64"), default="int32")
    args = ap.parse_args(argv)
    proto = _protocol_stream()
    faulthandler.enable()
    volunteer_for_oom_killer()
    try:
        worker = Worker(args.contender, args.manifest, args.index_dtype)
    except ImportError as e:
        proto.write(json.dumps({"available": False, "reason": f"ImportError: {e}"}) + "\n")
        return 0
    proto.write(json.dumps({"available": True}) + "\n")
    serve(worker, sys.stdin, proto)
    return 0


if __name__ == "__main__":
    sys.exit(main())
