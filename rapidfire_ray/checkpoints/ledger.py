"""Ray Train's record of a run's checkpoints (`checkpoint_manager_snapshot.json` in the run's
storage folder) kept in agreement with the checkpoint folders on disk.

Ray Train v2's checkpoint manager restores its list of checkpoints from that snapshot when a run
starts, hands the latest one to the workers (`ray.train.get_checkpoint`), and at every newly
registered checkpoint deletes the folders of the oldest entries beyond `checkpoint.keep`. It
refuses to start (`CheckpointManagerInitializationError`) when an entry's folder is gone. Its
entries are matched by object, not by folder name, so a resumed run that saves under a name the
snapshot still holds (it fell back from a damaged checkpoint 60 to 50, then saved 60 again) ends
up with two entries for one folder: pruning the old one deletes the new checkpoint, and the next
start fails.

So the driver, before Ray Train starts a resumed run (`prepare_resume`):
- verifies the checkpoints newest first (registered or not) until one verifies; a damaged one,
  and a newer partial save, is renamed `<name>.damaged-<time>` (kept, with `damaged.json` saying
  why) and dropped from the snapshot, so the resumed run's new checkpoints never reuse a name
  Ray holds;
- registers the checkpoint chosen (and older ones Ray never registered, saved by a worker that
  died before Ray's next poll) in the snapshot, so it is the one Ray hands out and they are all
  pruned by `checkpoint.keep`;
- drops entries whose folder is gone.
After a run (`settle_after_fit`), checkpoints a restarted worker group resumed from without Ray
having registered them are registered and `checkpoint.keep` applied to them.

The snapshot is rewritten atomically, the previous one kept as `<snapshot>.bak-<time>`. The
pure parts (`drop_entries`, `add_entries`, `prune`) work on the snapshot as a dict.
"""
from __future__ import annotations

import json
import os
import shutil
import time

from ..atomic import atomic_write_json
from .manifest import complete, step_of, verify

SNAPSHOT_FILE = "checkpoint_manager_snapshot.json"
DAMAGED_TAG = ".damaged-"
DAMAGED_NOTE = "damaged.json"


# ---------------------------------------------------------------------------------------------
# the snapshot as a dict (Ray's _CheckpointManagerState): pure functions


def empty_snapshot() -> dict:
    import ray

    return {"ray_version": ray.__version__, "checkpoint_results": [], "checkpoint_report_indices": [],
            "latest_checkpoint_result": None, "pending_training_results": [], "pending_validation_specs": [],
            "current_report_index": 0, "validated_checkpoint_dir_names": [],
            "timed_out_validation_checkpoint_dir_names": [], "failed_validation_checkpoint_dir_names": []}


def entry_names(state: dict) -> list[str]:
    """The checkpoint folder names Ray holds, in its order (oldest first)."""
    return [r["checkpoint_dir_name"] for r in state.get("checkpoint_results", [])]


def latest_name(state: dict | None) -> str | None:
    latest = (state or {}).get("latest_checkpoint_result")
    return latest["checkpoint_dir_name"] if latest else None


def _step(name: str) -> int:
    step = step_of(name)
    return -1 if step is None else step


def _newest(results: list[dict]) -> dict | None:
    return max(results, key=lambda r: _step(r["checkpoint_dir_name"]), default=None)


def drop_entries(state: dict, names) -> dict:
    """`state` without the checkpoints `names` (everywhere Ray lists them); the latest becomes the
    newest remaining one when it was dropped."""
    names = set(names)
    out = json.loads(json.dumps(state))
    kept = [(r, i) for r, i in zip(out["checkpoint_results"], out["checkpoint_report_indices"])
            if r["checkpoint_dir_name"] not in names]
    out["checkpoint_results"] = [r for r, _ in kept]
    out["checkpoint_report_indices"] = [i for _, i in kept]
    pending = [(r, v) for r, v in zip(out["pending_training_results"], out["pending_validation_specs"])
               if r["checkpoint_dir_name"] not in names]
    out["pending_training_results"] = [r for r, _ in pending]
    out["pending_validation_specs"] = [v for _, v in pending]
    for key in ("validated_checkpoint_dir_names", "timed_out_validation_checkpoint_dir_names",
                "failed_validation_checkpoint_dir_names"):
        out[key] = [n for n in out.get(key, []) if n not in names]
    if latest_name(out) in names or latest_name(out) not in entry_names(out):
        newest = _newest(out["checkpoint_results"])
        out["latest_checkpoint_result"] = json.loads(json.dumps(newest)) if newest else None
    return out


def add_entries(state: dict, entries: dict[str, dict]) -> dict:
    """`state` with the checkpoints `entries` (folder name -> metrics) registered: the list stays
    in step order (the order Ray prunes in: oldest first), each new entry takes the report index
    of the entry before it, and the latest is the newest by step."""
    out = json.loads(json.dumps(state))
    pairs = list(zip(out["checkpoint_results"], out["checkpoint_report_indices"]))
    have = {r["checkpoint_dir_name"] for r, _ in pairs}
    for name, metrics in entries.items():
        if name not in have:
            pairs.append(({"version": 0, "checkpoint_dir_name": name, "metrics": dict(metrics)}, None))
    pairs.sort(key=lambda p: _step(p[0]["checkpoint_dir_name"]))
    index = 0
    for k, (r, i) in enumerate(pairs):
        index = i if i is not None else index
        pairs[k] = (r, index)
    out["checkpoint_results"] = [r for r, _ in pairs]
    out["checkpoint_report_indices"] = [i for _, i in pairs]
    newest = _newest(out["checkpoint_results"])
    if newest is not None and (latest_name(out) is None
                               or _step(newest["checkpoint_dir_name"]) > _step(latest_name(out))):
        out["latest_checkpoint_result"] = json.loads(json.dumps(newest))
    return out


def prune(state: dict, keep: int | None) -> tuple[dict, list[str]]:
    """Ray's own rule: beyond the newest `keep` entries, drop the oldest, never the latest nor
    one pending validation. Returns (state, the names dropped)."""
    if not keep:
        return state, []
    names = sorted(entry_names(state), key=_step)
    protected = {latest_name(state)} | {r["checkpoint_dir_name"] for r in state.get("pending_training_results", [])}
    dropped = [n for n in names[:-keep] if n not in protected]
    return (drop_entries(state, dropped) if dropped else state), dropped


# ---------------------------------------------------------------------------------------------
# the run folder


def snapshot_path(run_dir: str) -> str:
    return os.path.join(run_dir, SNAPSHOT_FILE)


def read_snapshot(run_dir: str) -> dict | None:
    try:
        with open(snapshot_path(run_dir), encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def write_snapshot(run_dir: str, state: dict) -> str | None:
    """Replace the snapshot atomically; the previous one is kept as `<snapshot>.bak-<time>`
    (returned)."""
    path, backup = snapshot_path(run_dir), None
    if os.path.exists(path):
        backup = f"{path}.bak-{time.strftime('%Y%m%dT%H%M%S')}"
        n = 1
        while os.path.exists(backup):
            n += 1
            backup = f"{path}.bak-{time.strftime('%Y%m%dT%H%M%S')}-{n}"
        shutil.copy2(path, backup)
    atomic_write_json(path, state)
    return backup


def checkpoint_folders(run_dir: str) -> dict[str, int]:
    """The run's checkpoint folders (name -> step); folders kept aside are not among them."""
    try:
        names = os.listdir(run_dir)
    except OSError:
        return {}
    return {n: step_of(n) for n in names
            if step_of(n) is not None and os.path.isdir(os.path.join(run_dir, n))}


def resume_folder(run_dir: str) -> str | None:
    """The checkpoint folder a resumed run continues from: Ray's latest (after `prepare_resume`,
    the one chosen), else the newest checkpoint folder; None if there is none."""
    folders = checkpoint_folders(run_dir)
    latest = latest_name(read_snapshot(run_dir))
    if latest in folders:
        return os.path.join(run_dir, latest)
    if folders:
        return os.path.join(run_dir, max(folders, key=folders.get))
    return None


def set_aside(run_dir: str, name: str, reason: str) -> str:
    """Rename a damaged checkpoint folder to `<name>.damaged-<time>` (never deleted), with a
    `damaged.json` saying why; returns the new name."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    aside, n = f"{name}{DAMAGED_TAG}{stamp}", 1
    while os.path.lexists(os.path.join(run_dir, aside)):
        n += 1
        aside = f"{name}{DAMAGED_TAG}{stamp}-{n}"
    os.rename(os.path.join(run_dir, name), os.path.join(run_dir, aside))
    try:
        atomic_write_json(os.path.join(run_dir, aside, DAMAGED_NOTE),
                          {"checkpoint": name, "reason": reason, "set_aside_at": stamp})
    except OSError:
        pass  # the name says it; the note is a courtesy
    return aside


def _metrics(folder: str, step: int) -> dict:
    """What Ray's entry for a checkpoint it never registered carries (the saver reports step and loss)."""
    try:
        with open(os.path.join(folder, "trainer_state.json"), encoding="utf-8") as f:
            history = json.load(f).get("log_history") or []
        loss = next((h["loss"] for h in reversed(history) if "loss" in h), None)
    except (OSError, ValueError, AttributeError):
        loss = None
    return {"step": step, "loss": loss}


def prepare_resume(run_dir: str, world_size: int, say=print) -> dict:
    """Before Ray Train starts a resumed run: choose the checkpoint to resume from and make Ray's
    snapshot agree with the folders (see the module docstring). Returns {"resume_from": name or
    None, "damaged": [{"checkpoint", "reason", "kept_as"}], "message": the fallback line or None,
    "registered": [names added to Ray's record], "missing": [entries dropped, folder gone]}."""
    state = read_snapshot(run_dir)
    folders = checkpoint_folders(run_dir)
    names = entry_names(state) if state else []
    registered = set(names)
    latest = latest_name(state)
    missing = [n for n in names if n not in folders]
    if latest is not None and latest not in folders:
        missing.append(latest)
    damaged, chosen = [], None
    for name in sorted(folders, key=folders.get, reverse=True):
        folder = os.path.join(run_dir, name)
        if name not in registered and name != latest and not complete(folder, world_size):
            problem = "not every rank's part was saved"
        else:
            problem = verify(folder)
        if problem is None:
            chosen = name
            break
        damaged.append({"checkpoint": name, "reason": problem, "kept_as": set_aside(run_dir, name, problem)})
    gone = {d["checkpoint"] for d in damaged} | set(missing)
    new = dict(state) if state else empty_snapshot()
    if gone and state:
        new = drop_entries(new, gone)
    orphans = {n: _metrics(os.path.join(run_dir, n), s) for n, s in checkpoint_folders(run_dir).items()
               if n not in registered and chosen is not None and s <= folders[chosen]}
    if orphans:
        new = add_entries(new, orphans)
    if new != (state or empty_snapshot()) and (state is not None or orphans):
        write_snapshot(run_dir, new)
    message = None
    if damaged:
        failed = ", ".join(f"checkpoint {d['checkpoint']} failed verification ({d['reason']})" for d in damaged)
        kept = ", ".join(d["kept_as"] for d in damaged)
        kept = f"; the damaged folder{'s are' if len(damaged) > 1 else ' is'} kept as {kept}"
        if chosen is not None:
            message = f"{failed}; resuming from {chosen} instead{kept}"
        else:
            message = f"{failed} and no older checkpoint of the run verifies; starting from the beginning{kept}"
        say(message)
    if missing:
        listed = ", ".join(sorted(set(missing)))
        say(f"Ray Train's record of the run listed checkpoint(s) no longer on disk ({listed}); they were dropped from it")
    return {"resume_from": chosen, "damaged": damaged, "message": message,
            "registered": sorted(orphans, key=_step), "missing": sorted(set(missing))}


def settle_after_fit(run_dir: str, keep: int | None, say=print) -> list[str]:
    """After Ray Train's run: checkpoints older than Ray's latest that it never registered (a
    restarted worker group resumed from one saved just before a worker died) are registered and
    `checkpoint.keep` is applied to the whole record, as Ray applies it; entries whose folder is
    gone are dropped. Returns the names of the folders removed by `keep`."""
    state = read_snapshot(run_dir)
    latest = latest_name(state)
    if state is None or latest is None:
        return []
    folders = checkpoint_folders(run_dir)
    new = state
    missing = [n for n in entry_names(state) if n not in folders]
    if missing:
        new = drop_entries(new, missing)
    orphans = {n: _metrics(os.path.join(run_dir, n), s) for n, s in folders.items()
               if n not in entry_names(state) and s < _step(latest)}
    if orphans:
        new = add_entries(new, orphans)
    new, dropped = prune(new, keep)
    if new == state:
        return []
    write_snapshot(run_dir, new)
    for name in dropped:
        shutil.rmtree(os.path.join(run_dir, name), ignore_errors=True)
    if dropped:
        say(f"checkpoint.keep={keep}: removed {', '.join(dropped)} (saved while a worker group restarted, not "
            "registered by Ray Train then)")
    return dropped
