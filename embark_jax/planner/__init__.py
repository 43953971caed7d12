"""The sharding planner (DESIGN.md §5): hardware topologies, the cost model, the search and
its baselines, and reports. `plan(model, batch, hardware)` returns an `Evaluation` whose
`.plan` is an `embark_jax.core.plan.Plan`."""

from embark_jax.planner.hardware import PRESETS, HardwareTopology, calibrate_local, get_hardware
from embark_jax.planner.model import ModelSpec, PlannerTable, load_preset, preset_names
from embark_jax.planner.search import (
    BASELINES,
    Evaluation,
    PlannerError,
    baseline,
    evaluate,
    plan,
)

__all__ = [
    "BASELINES",
    "PRESETS",
    "Evaluation",
    "HardwareTopology",
    "ModelSpec",
    "PlannerError",
    "PlannerTable",
    "baseline",
    "calibrate_local",
    "evaluate",
    "get_hardware",
    "load_preset",
    "plan",
    "preset_names",
]
