"""The text report of a plan (`planner.report`)."""

from embark_jax.planner import load_preset, plan, report
from tests.planner.helpers import H100


def test_report_summary_truncates():
    ev = plan(load_preset("dcnv2-mini"), 4096, H100.with_shape(2, 4))
    text = report.summary(ev, max_tables=3, max_devices=2)
    assert text.startswith(f"plan '{ev.name}': 26 tables on 2 node(s) x 4 devices")
    assert "6 less loaded devices not shown" in text and "23 more tables" in text
