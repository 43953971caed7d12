"""The checkpoint directory: names, metadata files, atomic commits, pruning, leftovers.

Rules (docs/design.md §8, "Checkpoints"):

* **Atomic saves.** A save is written to `step_N.tmp-<tag>` and renamed to `step_N` once
  complete (meta.json last). Re-saving an existing step first renames the old `step_N` to
  `step_N.old-<tag>`, then renames the new one into place, then deletes the old one; a crash
  between the two renames leaves the old one complete under its `.old-` name, which
  `latest_step` / `resolve` still find (and the next save renames back or deletes). At
  every instant a complete checkpoint of the newest step exists.
* **Latest = last committed.** Each commit records a `sequence` number in meta.json, one
  more than any checkpoint already in the directory. `latest_step` is the checkpoint with
  the highest sequence (save order, not step number), and pruning keeps the `max_to_keep`
  most recently committed ones: a fresh run saving step 1 into a directory holding an older
  run's steps 100-102 keeps its step 1 (and `--resume` continues the new run). Checkpoints
  written before sequences existed count as older than any that has one.
* **Pruning is atomic too**: a pruned checkpoint is renamed to `step_N.del-<tag>` before it
  is deleted, so a half-deleted one is never taken for complete. It comes after the commit
  and is best effort: one that cannot be moved is warned about, and the save still returns.
* **Leftovers** of interrupted saves (`.tmp-*`, `.del-*`, `.old-*`) are cleaned by the next
  commit, as is anything else found under such a name (a file; a link, never what it points
  to). An entry named `step_N` that is not a complete checkpoint (no `meta.json`: not one we
  wrote) is ignored, and replaced only when step N is saved (or its moved-aside copy is put
  back). One save at a time per directory. A `step_N` holding a checkpoint's folders whose
  meta.json is missing or unreadable (deleted or damaged after its commit) is skipped by
  `latest_step` with a warning naming the step, not silently (an unreadable one with no
  other checkpoint to take stays the latest: its restore fails naming the file).
* **Table names** become one path component each (`table_dirname`): characters other than
  letters, digits, `_` and `-` are %-escaped, so no name can leave the checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
import warnings
from typing import Any

import numpy as np

from embark_jax.core.specs import table_dirname

__all__ = [
    "FORMAT",
    "check_writable",
    "commit",
    "field",
    "is_count",
    "latest_step",
    "not_a_directory",
    "read_json",
    "read_meta",
    "resolve",
    "step_dir",
    "table_dirname",
]

FORMAT = "embark-ckpt/2"  # /2: the dense part holds the RNG key too
_PREFIX = "step_"


def step_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f"{_PREFIX}{step:08d}")


def not_a_directory(path: str) -> bool:
    """Whether something other than a directory (a file, a dangling link) is at `path`."""
    return os.path.lexists(path) and not os.path.isdir(path)


def check_writable(directory: str) -> None:
    """Creates `directory` if needed and writes and removes a probe file in it; raises
    `PermissionError` (one line, naming the directory) when checkpoints cannot be saved
    there. Call it before training starts (`CheckpointEvery` does at construction)."""
    if not_a_directory(directory):
        raise PermissionError(
            f"checkpoint directory {directory!r} is not writable: it exists and is not a directory"
        )
    probe = os.path.join(directory, f".write-probe-{uuid.uuid4().hex}")
    try:
        os.makedirs(directory, exist_ok=True)
        with open(probe, "w") as fh:
            fh.write("ok")
        os.remove(probe)
    except OSError as e:
        raise PermissionError(
            f"checkpoint directory {directory!r} is not writable: {e.strerror or e}"
        ) from None


def read_json(path: str) -> dict[str, Any]:
    """A JSON object from `path`; `ValueError` naming the file when it is truncated or not
    an object, `FileNotFoundError` naming it when it is missing."""
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        first = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise ValueError(
            f"checkpoint file {path} is not valid JSON (truncated?): {first}"
        ) from None
    if not isinstance(data, dict):
        raise ValueError(f"checkpoint file {path} does not hold a JSON object")
    return data


def field(obj: dict[str, Any], key: str, where: str) -> Any:
    """`obj[key]`, or a `ValueError` naming the file/entry and the missing field."""
    if not isinstance(obj, dict) or key not in obj:
        raise ValueError(f"checkpoint metadata {where} has no field {key!r}")
    return obj[key]


MAX_STEP = 2**31 - 1  # the state's step is int32; save and restore both hold to these
MAX_POSITION = 2**63 - 1


def is_count(value, limit: int) -> bool:
    """Whether `value` is an integer (a numpy one too; not a bool) in [0, limit]: the rule
    for a step or data position, whether save is given it or meta.json holds it."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        return False
    return 0 <= int(value) <= limit


def read_meta(path: str) -> dict[str, Any]:
    """The meta.json of the checkpoint at `path`, checked for the fields a restore needs and
    their types (a hand-edited file gets a one-line error naming the field, not a crash)."""
    file = os.path.join(path, "meta.json")
    meta = read_json(file)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: unsupported checkpoint format {meta.get('format')!r}")
    for key in ("step", "plan", "tables"):
        field(meta, key, file)
    for key, limit in (("step", MAX_STEP), ("data_position", MAX_POSITION)):
        value = meta.get(key, 0)  # data_position may be absent (restore uses step)
        if not is_count(value, limit):
            raise ValueError(
                f"checkpoint metadata {file}: {key} must be an integer in [0, {limit}], "
                f"got {value!r}"
            )
    for key in ("plan", "tables", "dense"):  # dense may be absent (checkpoints before it)
        value = meta.get(key, {})
        if not isinstance(value, dict):
            raise ValueError(f"checkpoint metadata {file}: {key} must be an object, got {value!r}")
    return meta


def _sequence(path: str) -> int:
    """The commit sequence of a complete checkpoint (-1 for one without; unreadable
    metadata counts as oldest here, and fails loudly when restored)."""
    try:
        seq = read_json(os.path.join(path, "meta.json")).get("sequence", -1)
    except (OSError, ValueError):
        return -1
    return seq if type(seq) is int and seq >= 0 else -1  # not True, not 2.0


def _complete(directory: str) -> dict[int, str]:
    """step -> path of every complete checkpoint (`step_N`, or `step_N.old-*` when a
    re-save was interrupted between its renames and `step_N` is missing)."""
    if not os.path.isdir(directory):
        return {}
    found: dict[int, str] = {}
    for n in sorted(os.listdir(directory)):
        if not n.startswith(_PREFIX):
            continue
        num, _, suffix = n[len(_PREFIX) :].partition(".")
        path = os.path.join(directory, n)
        if not num.isdigit() or (suffix and not suffix.startswith("old-")):
            continue
        if suffix and os.path.islink(path):  # we make no links: not a moved-aside save
            continue
        if not os.path.exists(os.path.join(path, "meta.json")):
            continue
        if not suffix or int(num) not in found:
            found[int(num)] = path
    return found


def _by_commit_order(directory: str) -> list[tuple[int, str]]:
    """(step, path) of every complete checkpoint, oldest commit first."""
    found = _complete(directory)
    return sorted(found.items(), key=lambda kv: (_sequence(kv[1]), kv[0]))


def _damaged(directory: str) -> dict[int, tuple[str, str]]:
    """step -> (path, what is wrong) of every `step_N` directory holding a checkpoint's
    `dense/` or `tables/` folder whose meta.json is missing, or of any whose meta.json
    cannot be read: a checkpoint of ours, damaged after its commit."""
    if not os.path.isdir(directory):
        return {}
    out: dict[int, tuple[str, str]] = {}
    for n in sorted(os.listdir(directory)):
        num = n[len(_PREFIX) :]
        path = os.path.join(directory, n)
        if not n.startswith(_PREFIX) or not num.isdigit() or os.path.islink(path):
            continue
        meta = os.path.join(path, "meta.json")
        if os.path.lexists(meta):
            try:
                read_json(meta)
            except (OSError, ValueError):
                out[int(num)] = (path, "its meta.json cannot be read (truncated?)")
        elif any(os.path.isdir(os.path.join(path, d)) for d in ("dense", "tables")):
            out[int(num)] = (path, "its meta.json is missing")
    return out


def latest_step(directory: str) -> int | None:
    """The step of the most recently committed complete checkpoint (None if there is none).
    A checkpoint whose meta.json was deleted or damaged after its commit cannot be ordered
    or restored: it is skipped with a warning naming its step and the one taken instead
    (falling back silently would resume an older step unnoticed). With no other checkpoint
    to take, a damaged meta.json is still the latest, so that its restore fails naming the
    file."""
    found = _complete(directory)
    damaged = {s: v for s, v in _damaged(directory).items() if found.get(s, v[0]) == v[0]}
    everything = _by_commit_order(directory)
    order = [(s, p) for s, p in everything if s not in damaged]
    if not order and everything:  # nothing to fall back to: the damaged one, whose
        order = everything[-1:]  # restore then fails naming its file
        damaged.pop(order[0][0])
    latest = order[-1][0] if order else None
    for step, (path, why) in sorted(damaged.items()):
        instead = (
            f"the latest checkpoint is step {latest}"
            if latest is not None
            else "no other complete checkpoint is there"
        )
        warnings.warn(
            f"checkpoint step {step} skipped: {why} ({path}); {instead}", UserWarning, stacklevel=2
        )
    return latest


def resolve(directory: str, step: int) -> str | None:
    """Path of the complete checkpoint of `step` (None if there is none)."""
    return _complete(directory).get(step)


def _delete(path: str) -> None:
    """Removes a directory tree, or a file (or link) found where one was expected; errors
    are ignored (the next commit tries again)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
        return
    try:
        os.remove(path)
    except OSError:
        pass


def _remove(path: str, tag: str) -> None:
    """Deletes a directory atomically as far as readers go: renamed first, then removed."""
    gone = f"{path}.del-{tag}"
    os.replace(path, gone)
    _delete(gone)


def _clean_leftovers(directory: str, keep: str) -> None:
    """Removes what interrupted saves left (except `keep`, the save being committed)."""
    for n in sorted(os.listdir(directory)):
        path = os.path.join(directory, n)
        if not n.startswith(_PREFIX) or path == keep:
            continue
        base, _, suffix = n.partition(".")
        if suffix.startswith(("tmp-", "del-", "old-")) and os.path.islink(path):
            _delete(path)  # we make no links: the link goes, never what it points to
        elif suffix.startswith(("tmp-", "del-")):
            _delete(path)
        elif suffix.startswith("old-"):
            final = os.path.join(directory, base)
            if os.path.exists(os.path.join(final, "meta.json")):
                _delete(path)
            elif os.path.exists(os.path.join(path, "meta.json")):
                if os.path.lexists(final):  # an incomplete step_N: the old one wins
                    _delete(final)
                try:
                    os.replace(path, final)
                except OSError:  # step_N would not go: the old one is still found as is
                    pass
            else:  # not a checkpoint (a file, or an incomplete directory) and nothing newer
                _delete(path)


def commit(directory: str, tmp: str, final: str, meta: dict, max_to_keep: int | None) -> None:
    """Writes meta.json into the finished save `tmp`, moves it to `final` (see the module
    docstring for the order of renames) and prunes the oldest commits."""
    _clean_leftovers(directory, keep=tmp)
    order = _by_commit_order(directory)
    meta = {**meta, "sequence": 1 + max((_sequence(p) for _, p in order), default=0)}
    with open(os.path.join(tmp, "meta.json"), "w") as fh:
        json.dump(meta, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    tag = uuid.uuid4().hex[:12]
    aside = f"{final}.old-{tag}"
    if os.path.lexists(final):
        os.replace(final, aside)  # still complete, and still found, under its .old- name
    os.replace(tmp, final)  # the new checkpoint exists only once complete
    if os.path.lexists(aside):
        _delete(aside)
    if max_to_keep:
        order = [p for p in _by_commit_order(directory) if p[1] != final] + [(0, final)]
        for _, path in order[:-max_to_keep]:
            try:
                _remove(path, tag)
            except OSError as e:  # the save is committed; the next one prunes again
                warnings.warn(
                    f"checkpoint saved, but {path} could not be pruned: {e}", stacklevel=3
                )
