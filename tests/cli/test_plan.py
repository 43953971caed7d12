"""The one-line notes under a plan summary: how to get the full plan JSON, devices with
almost no table memory, a higher communication share than TRW together with a faster step."""

import types

import numpy as np

from embark_jax.cli.plan import plan_notes


def _ev(step_s, comm_share, memory, tables=3):
    return types.SimpleNamespace(
        step_s=step_s,
        comm_share=comm_share,
        device_memory=np.asarray(memory, float),
        plan=types.SimpleNamespace(tables=[object()] * tables),
    )


def test_notes_explain_what_looks_wrong():
    ours = _ev(1.0e-3, 0.30, [10e9, 9e9, 0.1e9, 0.0])
    trw = _ev(2.0e-3, 0.20, [5e9] * 4)
    notes = plan_notes(ours, trw, out_flag="--out plan.json", max_tables=2)
    assert len(notes) == 3
    assert "all 3 tables" in notes[0] and "--out plan.json" in notes[0]
    assert "device(s) 2, 3 hold under 5%" in notes[1]
    assert "30.0% of this plan's step vs 20.0% for TRW" in notes[2]
    assert "2.00x faster" in notes[2] and "less communication" in notes[2]


def test_no_notes_for_an_unsurprising_plan():
    ours = _ev(1.0e-3, 0.10, [5e9] * 4)
    trw = _ev(2.0e-3, 0.20, [5e9] * 4)
    assert plan_notes(ours, trw, out_flag=None, max_tables=2) == []
