"""The sharding planner (docs/design.md, section "Planner"): hardware topologies, the cost
model, the staged search (`search.plan`: bound, propose, place and refine, compare with
the baselines, explain) and reports. `plan(model, batch, hardware)` returns an `Evaluation`
whose `.plan` is an `embark_jax.core.plan.Plan`; every `Evaluation` carries a lower bound
on the step of any plan (`step_bound`) and where its own step exceeds it. Planning is
arithmetic: this package imports only `embark_jax.core`, never JAX or the kernels.
"""

from embark_jax.planner.baselines import BASELINES, baseline, evaluate
from embark_jax.planner.bound import step_bound
from embark_jax.planner.hardware import PRESETS, HardwareTopology, calibrate_local, get_hardware
from embark_jax.planner.model import (
    ModelSpec,
    PlannerTable,
    canonical_preset,
    load_preset,
    preset_aliases,
    preset_names,
)
from embark_jax.planner.search import plan
from embark_jax.planner.types import Bound, Evaluation, Gap, PlannerError

__all__ = [
    "BASELINES",
    "PRESETS",
    "Bound",
    "Evaluation",
    "Gap",
    "HardwareTopology",
    "ModelSpec",
    "PlannerError",
    "PlannerTable",
    "baseline",
    "calibrate_local",
    "canonical_preset",
    "evaluate",
    "get_hardware",
    "load_preset",
    "plan",
    "preset_aliases",
    "preset_names",
    "step_bound",
]
