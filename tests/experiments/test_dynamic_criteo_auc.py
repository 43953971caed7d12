"""Smoke test of the raw-ids-against-a-vocabulary experiment (experiments/dynamic/
criteo_auc.py): a written Criteo TSV file read with no bad rows, then `train` on it twice,
vocabulary-mapped and with dynamic tables, each learning the hidden teacher."""

import json

import pytest

from embark_jax.data.criteo import CriteoTSV
from embark_jax.planner import load_preset
from experiments.dynamic.criteo_auc import main, write_tsv


def test_written_file_is_criteo_tsv(tmp_path):
    spec = load_preset("dcnv2-mini")
    vocabs = [t.vocab_size for t in spec.tables]
    path = tmp_path / "t.tsv"
    write_tsv(path, 300, vocabs)
    ds = CriteoTSV(path, spec.embedding_config(), batch_size=100, prefetch=0)
    assert ds.num_samples == 300 and sum(ds.bad_rows.values()) == 0
    b = ds.batch(0)
    assert 0.1 < float(b.labels.mean()) < 0.9  # the teacher is not one-sided
    assert len(set(b.sparse.ids["f_t0"][:, 0].tolist())) > 20  # a Zipf tail, not one id


@pytest.mark.slow
def test_criteo_auc_quick(tmp_path):
    out = tmp_path / "auc.json"
    result = main(["--quick", "--seeds", "0", "--workdir", str(tmp_path), "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    runs = {r["run"]: r for r in result["runs"]}
    assert sorted(runs) == ["dynamic", "vocabulary"]
    for r in runs.values():
        assert r["eval_auc"] > 0.6, r  # both learn (chance is 0.5)
    counts = runs["dynamic"]["dynamic"]
    assert len(counts) == 13 and all(
        c["inserted"] > 0 and c["dropped"] == 0 for c in counts.values()
    )
    assert abs(result["auc_difference"][0]) < 0.05
