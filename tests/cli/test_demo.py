import json
import re

from embark_jax.cli.main import main


def test_demo_cli_learns_and_writes_metrics(tmp_path, capsys):
    out = tmp_path / "m.json"
    assert main(["demo", "--steps", "60", "--batch-size", "256", "--out", str(out)]) == 0
    m = json.loads(out.read_text())
    # the teacher is learnable: the held-out AUC is far above chance (0.5) even this early
    assert m["auc"] > 0.6, m
    assert re.search(r"step +60/60", capsys.readouterr().out)
