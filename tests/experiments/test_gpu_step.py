"""experiments/training/gpu_step.py at a tiny size on one CPU device: the main job's model
and plan, every phase's numbers in the JSON and the whole-table ops of the compiled step.
tests/experiments/test_gpu_check_script.py runs its command line with a spent budget (the skipped
phase)."""

import json
import re

import jax
import pytest

from experiments.training import gpu_step

TINY = {"max_vocab": 300, "max_hotness": 2, "num_devices": 1, "topology": "dgx-h100"}


def test_the_model_is_the_main_jobs():
    args = gpu_step.train_defaults(batch_size=64)
    assert (args.model, args.optimizer, args.batch_size) == ("dcnv2-mini", "adagrad", 64)
    opt = gpu_step.sparse_optimizer(args.optimizer, args.lr)
    spec = gpu_step.model_spec(gpu_step.train_defaults(max_vocab=300, max_hotness=2), opt)
    assert len(spec.tables) == 26 and max(t.vocab_size for t in spec.tables) == 300
    assert max(t.hotness for t in spec.tables) == 2
    assert spec.slot_footprint == opt.slot_footprint


def test_step_measurement_end_to_end(tmp_path):
    out = tmp_path / "step.json"
    said = []
    result = gpu_step.measure(64, steps=2, warmup=1, out=str(out), say=said.append, **TINY)
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(result))
    assert data["schema"] == gpu_step.SCHEMA and data["backend"] == jax.default_backend()
    assert data["phases"] == ["plan", "compile", "step", "memory", "embedding_only"]
    assert data["devices"] == 1 and data["model"] == "dcnv2-mini" and data["batch"] == 64
    assert sum(data["plan"]["clusters"].values()) == 26 and data["plan"]["dense_params"] > 0
    pred = data["predicted"]
    assert pred["step_ms"] > 0 and 0 < pred["embedding_share"] < 1
    assert pred["device_memory_bytes"] > 0
    step = data["step"]
    assert len(step["times_s"]) == 2 and step["min_s"] <= step["median_s"]
    assert step["samples_per_s"] == pytest.approx(64 / step["median_s"])
    assert step["first_s"] > 0 and data["compile"]["compile_s"] > 0
    ma = data["memory_analysis"]
    assert ma["peak_estimate"] == ma["argument"] + ma["output"] - ma["alias"] + ma["temp"]
    # the state is donated: its tables and slots alias the outputs
    assert ma["alias"] > 0
    mem = data["memory"]
    assert mem["device"] is None and mem["peak_vs_predicted"] is None  # no counters on CPU
    assert mem["estimate_vs_predicted"] == pytest.approx(
        ma["peak_estimate"] / pred["device_memory_bytes"]
    )
    # the planner's memory model plus the dense net's state and temporaries: the compiled step
    assert abs(mem["estimate_vs_predicted"] - 1) <= 0.10
    parts = pred["step_memory"]
    assert parts["total"] == pytest.approx(
        parts["state"]
        + parts["batch"]
        + max(parts["staged"] + parts["exchange"], parts["backward"])
    )
    hlo = data["hlo"]
    assert hlo["buffers"] >= 2 and hlo["count"] >= hlo["copies"] == sum(
        f["copy"] for f in hlo["ops"]
    )
    for f in hlo["ops"]:  # named after the state's buffers; never a no-op instruction
        assert all(re.fullmatch(r"tables/\w+|slots/\w+/\d+", b) for b in f["buffers"])
        assert f["opcode"] not in ("parameter", "bitcast", "tuple", "get-tuple-element")
    emb = data["embedding_only"]
    assert emb["dense"] == json.loads(json.dumps(gpu_step.MINIMAL_DENSE))
    assert len(emb["times_s"]) == 2
    assert emb["share"] == pytest.approx(emb["median_s"] / step["median_s"])
    assert any("samples/s" in line for line in said)
