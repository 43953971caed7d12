"""Hardware topologies the planner prices plans on: presets for the paper's DGX H100 and an
H200 machine, and the local CPU machine measured by a small calibration."""

from __future__ import annotations

import dataclasses
import json
import os
import time

import numpy as np

from embark_jax.core.plan import Topology

__all__ = ["PRESETS", "HardwareTopology", "calibrate_local", "get_hardware"]

GB = 1e9


@dataclasses.dataclass(frozen=True, kw_only=True)
class HardwareTopology:
    """Nodes x devices, per-device memory (bytes) and bandwidths (bytes/s, per direction)."""

    name: str
    num_nodes: int
    devices_per_node: int
    memory_bytes: float
    memory_bw: float
    intra_bw: float
    inter_bw: float
    dense_flops: float = 4e14  # effective dense-net FLOP/s per device (bf16 tensor cores)

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.devices_per_node

    @property
    def topology(self) -> Topology:
        return Topology(num_nodes=self.num_nodes, devices_per_node=self.devices_per_node)

    def with_shape(self, num_nodes: int, devices_per_node: int) -> HardwareTopology:
        return dataclasses.replace(self, num_nodes=num_nodes, devices_per_node=devices_per_node)


# DGX H100: 80 GB HBM3 ~3.35 TB/s, NVLink4 ~450 GB/s per direction, 400 Gb/s IB per GPU
_DGX_H100 = HardwareTopology(
    name="dgx-h100",
    num_nodes=1,
    devices_per_node=8,
    memory_bytes=80 * GB,
    memory_bw=3350 * GB,
    intra_bw=450 * GB,
    inter_bw=50 * GB,
    dense_flops=4e14,
)
PRESETS = {
    "dgx-h100": _DGX_H100,
    # H200: the same node design with 141 GB of HBM3e at ~4.8 TB/s
    "h200": dataclasses.replace(_DGX_H100, name="h200", memory_bytes=141 * GB, memory_bw=4800 * GB),
}

_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "embark_jax", "calibration.json")


def calibrate_local(refresh: bool = False) -> HardwareTopology:
    """The local CPU machine: memory bandwidth from a numpy copy, measured once and cached
    (~/.cache/embark_jax/calibration.json). Fake CPU devices share memory, so the "links"
    run at memcpy speed too; memory is what the OS reports available."""
    if not refresh and os.path.exists(_CACHE):
        with open(_CACHE) as fh:
            return HardwareTopology(**json.load(fh))
    src = np.ones(1 << 25, np.float32)  # 128 MiB
    dst = np.empty_like(src)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    bw = 2 * src.nbytes / min(times)
    try:
        mem = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):  # pragma: no cover
        mem = 8 * GB
    hw = HardwareTopology(
        name="local-cpu",
        num_nodes=1,
        devices_per_node=8,
        memory_bytes=float(mem) / 8,
        memory_bw=bw,
        intra_bw=bw / 2,
        inter_bw=bw / 2,
        dense_flops=2e10,
    )
    os.makedirs(os.path.dirname(_CACHE), exist_ok=True)
    tmp = f"{_CACHE}.{os.getpid()}.tmp"
    with open(tmp, "w") as fh:
        json.dump(dataclasses.asdict(hw), fh)
    os.replace(tmp, _CACHE)  # atomic: concurrent processes never read half a file
    return hw


def get_hardware(name: str, num_nodes: int, devices_per_node: int) -> HardwareTopology:
    if name in ("local", "local-cpu", "cpu"):
        base = calibrate_local()
    elif name in PRESETS:
        base = PRESETS[name]
    else:
        raise ValueError(f"unknown topology {name!r}; choose from {sorted(PRESETS)} or 'local'")
    return base.with_shape(num_nodes, devices_per_node)
