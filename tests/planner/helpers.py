"""Tiny planner inputs shared by the planner's test files: optimizer slot footprints, the
DGX H100 preset, one-line tables and models, and a `Problem` on a small device grid."""

import dataclasses
import math

from embark_jax.core.plan import Cluster
from embark_jax.core.specs import Combiner
from embark_jax.planner import PRESETS, ModelSpec, PlannerTable
from embark_jax.planner.types import Option, Problem

SGD, ADAGRAD = (0, 0), (1, 0)  # optimizer slot footprints (per element, per row)
H100 = HW1 = PRESETS["dgx-h100"]
HW2 = HW1.with_shape(2, 4)
DP, RB, UB = Option(Cluster.DP), Option(Cluster.RB), Option(Cluster.UB)


def table(name, vocab=1000, dim=16, hotness=1.0, combiner=Combiner.SUM):
    return PlannerTable(name=name, vocab_size=vocab, dim=dim, hotness=hotness, combiner=combiner)


def model(*tables, slots=SGD):
    return ModelSpec(name="tiny", tables=tables, slot_footprint=slots)


def problem(m, batch=64, nodes=1, per_node=4, cap=math.inf, **hw):
    return Problem(m, batch, dataclasses.replace(H100.with_shape(nodes, per_node), **hw), cap)


def small_model():
    tables = (
        PlannerTable(name="big", vocab_size=1_000_000, dim=64, hotness=20),
        PlannerTable(name="onehot", vocab_size=50_000, dim=32, hotness=1),
        PlannerTable(name="tiny", vocab_size=10, dim=16, hotness=1),
        PlannerTable(name="seq", vocab_size=5_000, dim=32, hotness=4, combiner=Combiner.NONE),
        PlannerTable(name="mid", vocab_size=200_000, dim=128, hotness=8),
    )
    return ModelSpec(name="small", tables=tables, slot_footprint=SGD)
