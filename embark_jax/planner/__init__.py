"""The sharding planner (docs/design.md, section "Planner"): hardware topologies, the cost
model, the staged search (`search.plan`: propose, place and refine, compare with the
baselines, explain) and reports. `plan(model, batch, hardware)` returns an `Evaluation`
whose `.plan` is an `embark_jax.core.plan.Plan`. Planning is arithmetic: this package
imports only `embark_jax.core`, never JAX or the kernels.
"""

from embark_jax.planner.baselines import BASELINES, baseline, evaluate
from embark_jax.planner.hardware import PRESETS, HardwareTopology, calibrate_local, get_hardware
from embark_jax.planner.model import ModelSpec, PlannerTable, load_preset, preset_names
from embark_jax.planner.search import plan
from embark_jax.planner.types import Evaluation, PlannerError

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
