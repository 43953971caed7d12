"""`embark_jax.training.checkpoint_dir`: names, meta.json checks, commit order and pruning,
on fake checkpoints (a folder and its meta.json; whole saves: tests/training/test_checkpoint.py)."""

import json
import os

import pytest

from embark_jax.training import checkpoint_dir as D


def _save(directory, step, max_to_keep=None):
    tmp = os.path.join(directory, f"step_{step:08d}.tmp-t")
    os.makedirs(tmp)
    D.commit(str(directory), tmp, D.step_dir(str(directory), step), {"step": step}, max_to_keep)


def test_resolve_finds_a_moved_aside_copy_and_ignores_foreign_entries(tmp_path):
    assert D.latest_step(str(tmp_path / "none")) is None
    _save(tmp_path, 1)
    os.rename(tmp_path / "step_00000001", tmp_path / "step_00000001.old-x")
    (tmp_path / "step_00000002").mkdir()  # no meta.json: not a checkpoint of ours
    assert D.resolve(str(tmp_path), 1) == str(tmp_path / "step_00000001.old-x")
    assert D.resolve(str(tmp_path), 2) is None and D.latest_step(str(tmp_path)) == 1
    assert D.step_dir("ck", 12) == os.path.join("ck", "step_00000012")


def test_max_to_keep_prunes_the_oldest_commits_and_leftovers_go(tmp_path):
    (tmp_path / "step_00000009.tmp-old").mkdir()  # an interrupted save
    for step in (3, 1, 2):
        _save(tmp_path, step, max_to_keep=2)
    assert sorted(os.listdir(tmp_path)) == ["step_00000001", "step_00000002"]
    meta = json.loads((tmp_path / "step_00000002" / "meta.json").read_text())
    assert meta == {"step": 2, "sequence": 3}


def _meta(tmp_path, **fields):
    meta = {"format": D.FORMAT, "step": 1, "plan": {}, "tables": {}, **fields}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    return str(tmp_path)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(format="embark-ckpt/1"), "unsupported checkpoint format 'embark-ckpt/1'"),
        (dict(step=True), r"step must be an integer in \[0, 2147483647\], got True"),
        (dict(data_position=-1), "data_position must be an integer"),
        (dict(tables=[]), "tables must be an object, got"),
    ],
)
def test_read_meta_names_the_bad_field(tmp_path, fields, message):
    assert D.read_meta(_meta(tmp_path))["step"] == 1
    with pytest.raises(ValueError, match=message):
        D.read_meta(_meta(tmp_path, **fields))


def test_read_json_refuses_truncated_files_and_non_objects(tmp_path):
    f = tmp_path / "meta.json"
    f.write_text('{"step": ')
    with pytest.raises(ValueError, match=r"is not valid JSON \(truncated\?\)"):
        D.read_json(str(f))
    f.write_text("[1]")
    with pytest.raises(ValueError, match="does not hold a JSON object"):
        D.read_json(str(f))
