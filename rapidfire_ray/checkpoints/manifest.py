"""Checkpoints that a crash cannot corrupt silently.

At save, each rank writes `manifest-rank<r>.json` into its checkpoint folder before reporting it
to Ray Train: every file it wrote, with its size and sha256. Ray Train merges the ranks' folders
into one checkpoint on the run's storage. At resume, every manifest in the checkpoint is
verified; a checkpoint with a missing, truncated or altered file (or no manifest at all) is
skipped with one line, and the newest older checkpoint of the run that verifies is used instead.
On `--resume` the driver does this first (`ledger.prepare_resume`: the damaged folder is renamed
aside and Ray Train's record updated); the workers' check here covers restarts within a run.
"""
from __future__ import annotations

import hashlib
import json
import os
import re

from ..atomic import atomic_write_json

MANIFEST_PREFIX = "manifest-rank"
SHARD_PLAN_FILE = "shard_plan.json"  # rank 0 saves the run's shard plan with every checkpoint
_CKPT_NAME = re.compile(r"checkpoint-(\d+)$")


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_manifest(folder: str, rank: int) -> str:
    """List every file under `folder` (this rank's part of a checkpoint) with size and sha256."""
    files = {}
    for root, _dirs, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, folder)
            if rel.startswith(MANIFEST_PREFIX) or ".tmp-" in name:
                continue
            files[rel] = {"size": os.path.getsize(path), "sha256": _sha256(path)}
    return atomic_write_json(os.path.join(folder, f"{MANIFEST_PREFIX}{rank}.json"),
                             {"rank": rank, "files": dict(sorted(files.items()))})


def verify(folder: str) -> str | None:
    """None if every manifest in `folder` matches the files there, else what is wrong (one phrase)."""
    manifests = sorted(n for n in os.listdir(folder) if n.startswith(MANIFEST_PREFIX) and n.endswith(".json"))
    if not manifests:
        return "no manifest (the save did not finish)"
    for name in manifests:
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                files = json.load(f)["files"]
        except (OSError, ValueError, KeyError) as e:
            return f"{name} unreadable ({type(e).__name__})"
        for rel, want in files.items():
            path = os.path.join(folder, rel)
            if not os.path.isfile(path):
                return f"{rel} missing"
            size = os.path.getsize(path)
            if size != want["size"]:
                return f"{rel} is {size} bytes, {want['size']} expected"
            if _sha256(path) != want["sha256"]:
                return f"{rel} sha256 differs from its manifest"
    return None


def step_of(name: str) -> int | None:
    m = _CKPT_NAME.search(name.rstrip("/"))
    return int(m.group(1)) if m else None


def complete(folder: str, world_size: int) -> bool:
    """Every rank of the worker group that saved `folder` left its manifest there (all ranks'
    parts were stored). That group's size is the one in its shard plan (an elastic run's earlier
    group may have had another size), else `world_size`."""
    try:
        names = set(os.listdir(folder))
    except OSError:
        return False
    try:
        with open(os.path.join(folder, SHARD_PLAN_FILE), encoding="utf-8") as f:
            world_size = len(json.load(f)["ranges"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return all(f"{MANIFEST_PREFIX}{r}.json" in names for r in range(world_size))


def usable_checkpoint(checkpoint, say=print, *, run_dir: str | None = None, world_size: int | None = None,
                      note=None):
    """The checkpoint to resume from: `checkpoint` (Ray Train's latest registered one, or None)
    or, when it fails verification, the newest older one of the run that verifies; None if none.

    With `world_size` (and `run_dir` when `checkpoint` is None), a newer checkpoint folder than the
    registered one is preferred when every rank's manifest is in it and it verifies: Ray Train's
    controller registers a reported checkpoint only at its next poll of the workers (every 2 s),
    so when a worker dies the newest fully saved checkpoint may not be registered yet, and
    resuming from the registered one would train the steps in between twice.

    Checkpoints on local or mounted storage are checked in place; others (object stores) are
    downloaded by `as_directory` to be checked. `say` gets the fallback line, `note` (default
    `say`) the line about a newer checkpoint."""
    import pyarrow.fs
    import ray.train

    if checkpoint is not None:
        fs, path = checkpoint.filesystem, checkpoint.path.rstrip("/")
        parent, newest = os.path.dirname(path), step_of(os.path.basename(path))
    elif run_dir is not None and world_size is not None and os.path.isdir(run_dir):
        fs, path, parent, newest = pyarrow.fs.LocalFileSystem(), None, os.path.abspath(run_dir), -1
    else:
        return None
    found = []
    if newest is not None:
        infos = fs.get_file_info(pyarrow.fs.FileSelector(parent))
        found = sorted(((step_of(i.base_name), i.path) for i in infos
                        if i.type == pyarrow.fs.FileType.Directory and step_of(i.base_name) is not None),
                       reverse=True)
    newer = [p for step, p in found if step > newest] if world_size else []
    older = [p for step, p in found if step < newest]
    candidates = newer + ([path] if path is not None else []) + older
    skipped = []
    for candidate in candidates:
        ckpt = checkpoint if candidate == path else ray.train.Checkpoint(candidate, filesystem=fs)
        with ckpt.as_directory() as folder:
            if candidate in newer and not complete(folder, world_size):
                continue  # not every rank's part is there: never reported as a whole
            problem = verify(folder)
        if problem is None:
            if skipped:
                say(f"checkpoint {skipped[0][0]} failed verification ({skipped[0][1]}); resuming from "
                    f"{os.path.basename(candidate)} instead"
                    + (f" ({len(skipped) - 1} more skipped)" if len(skipped) > 1 else ""))
            elif candidate in newer:
                (note or say)(f"resuming from {os.path.basename(candidate)}, saved by every rank but not yet "
                              f"registered by Ray Train (its latest: {os.path.basename(path) if path else 'none'})")
            return ckpt
        if candidate not in newer:
            skipped.append((os.path.basename(candidate), problem))
    if skipped:
        say(f"checkpoint {skipped[0][0]} failed verification ({skipped[0][1]}) and no older checkpoint of the run "
            "verifies; starting from the beginning")
    return None


def refresh_manifest_entries(folder: str, rel_paths: list[str]) -> None:
    """After a deliberate rewrite of files in a finished checkpoint (the parameter server's final
    state), record their new size and sha256 in the manifests that list them, so the checkpoint
    still verifies; a file no manifest lists goes into rank 0's."""
    manifests = sorted(n for n in os.listdir(folder) if n.startswith(MANIFEST_PREFIX) and n.endswith(".json"))
    if not manifests:
        return  # a checkpoint saved without manifests is not verified either
    docs = {}
    for name in manifests:
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            docs[name] = json.load(f)
    for rel in rel_paths:
        entry = {"size": os.path.getsize(os.path.join(folder, rel)), "sha256": _sha256(os.path.join(folder, rel))}
        owner = next((n for n, d in docs.items() if rel in d["files"]), f"{MANIFEST_PREFIX}0.json")
        docs.setdefault(owner, {"rank": 0, "files": {}})["files"][rel] = entry
    for name, doc in docs.items():
        doc["files"] = dict(sorted(doc["files"].items()))
        atomic_write_json(os.path.join(folder, name), doc)
