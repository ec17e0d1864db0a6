"""Manifests after a deliberate rewrite of a finished checkpoint (the parameter server's final
state): the rewritten checkpoint still verifies; an unrecorded change still does not. Ray Train's
record of the run's checkpoints (`checkpoints/ledger.py`) kept in agreement with the folders: a
damaged checkpoint set aside and dropped from it, never-registered ones added, keep applied."""
from __future__ import annotations

import os

from rapidfire_ray.checkpoints import refresh_manifest_entries, verify, write_manifest


def test_refreshed_manifest_verifies_after_a_rewrite(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"a" * 10)
    (tmp_path / "ps_shard_0.pt").write_bytes(b"b" * 5)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "comm_state_rank1.pt").write_bytes(b"c")
    write_manifest(str(tmp_path), 0)
    assert verify(str(tmp_path)) is None
    (tmp_path / "model.safetensors").write_bytes(b"z" * 12)  # the final state replaces the weights
    (tmp_path / "ps_shard_1.pt").write_bytes(b"new")          # and adds a file
    assert "model.safetensors" in verify(str(tmp_path))
    refresh_manifest_entries(str(tmp_path), ["model.safetensors", "ps_shard_1.pt"])
    assert verify(str(tmp_path)) is None
    (tmp_path / "ps_shard_0.pt").write_bytes(b"b" * 4)        # anything else changed is still caught
    assert "ps_shard_0.pt" in verify(str(tmp_path))


def test_refresh_without_manifests_leaves_the_folder_alone(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"a")
    refresh_manifest_entries(str(tmp_path), ["model.safetensors"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


# ---------------------------------------------------------------------------------------------
# Ray Train's record of the run (checkpoint_manager_snapshot.json) kept in agreement with the disk


def _snapshot(names, latest=None):
    from rapidfire_ray.checkpoints.ledger import empty_snapshot

    s = empty_snapshot()
    s["checkpoint_results"] = [{"version": 0, "checkpoint_dir_name": n, "metrics": {"step": int(n[-8:])}}
                               for n in names]
    s["checkpoint_report_indices"] = [int(n[-8:]) for n in names]
    latest = latest or (names[-1] if names else None)
    s["latest_checkpoint_result"] = next((r for r in s["checkpoint_results"] if r["checkpoint_dir_name"] == latest),
                                         None)
    s["current_report_index"] = 99
    return s


def _ray_parses(state):
    """Ray's own model of the snapshot accepts it (what its checkpoint manager loads)."""
    from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import _CheckpointManagerState

    (getattr(_CheckpointManagerState, "model_validate", None) or _CheckpointManagerState.parse_obj)(state)
    return True


def _c(step):
    return f"checkpoint-{step:08d}"


def test_snapshot_entries_dropped_added_and_pruned_as_ray_would():
    from rapidfire_ray.checkpoints.ledger import add_entries, drop_entries, entry_names, latest_name, prune

    state = _snapshot([_c(4), _c(6)])
    state["validated_checkpoint_dir_names"] = [_c(6)]
    assert _ray_parses(state)
    dropped = drop_entries(state, [_c(6)])  # the damaged newest: the latest becomes the one before
    assert entry_names(dropped) == [_c(4)] and latest_name(dropped) == _c(4)
    assert dropped["checkpoint_report_indices"] == [4] and dropped["validated_checkpoint_dir_names"] == []
    assert dropped["current_report_index"] == 99 and _ray_parses(dropped)
    assert entry_names(state) == [_c(4), _c(6)]  # the input is not changed
    assert latest_name(drop_entries(state, [_c(4), _c(6)])) is None
    # Never-registered checkpoints go in step order (Ray prunes oldest first), the newest is the latest.
    added = add_entries(dropped, {_c(2): {"step": 2}, _c(5): {"step": 5, "loss": 1.5}})
    assert entry_names(added) == [_c(2), _c(4), _c(5)] and latest_name(added) == _c(5)
    assert added["checkpoint_report_indices"] == [0, 4, 4] and _ray_parses(added)
    assert latest_name(add_entries(state, {_c(2): {}})) == _c(6)  # an older one leaves the latest alone
    # checkpoint.keep: the oldest beyond it go, never the latest.
    pruned, gone = prune(added, 2)
    assert gone == [_c(2)] and entry_names(pruned) == [_c(4), _c(5)] and _ray_parses(pruned)
    assert prune(added, 3) == (added, [])
    odd = add_entries(_snapshot([_c(8)]), {_c(2): {}, _c(4): {}})
    odd["latest_checkpoint_result"] = odd["checkpoint_results"][0]  # latest registered, oldest by step
    assert prune(odd, 1)[1] == [_c(4)]  # the latest (2) stays, whatever its step


def _save(run_dir, step, ranks=(0, 1)):
    from rapidfire_ray.checkpoints import write_manifest

    d = run_dir / _c(step)
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(os.urandom(1024))
    for r in ranks:
        write_manifest(str(d), r)
    return d


def test_prepare_resume_sets_a_damaged_checkpoint_aside_and_makes_rays_record_agree(tmp_path):
    import json

    from rapidfire_ray.checkpoints.ledger import (DAMAGED_NOTE, SNAPSHOT_FILE, entry_names, latest_name,
                                                  prepare_resume, read_snapshot, resume_folder)

    run_dir = tmp_path / "run"
    for step in (2, 4, 6):
        _save(run_dir, step)
    _save(run_dir, 1)  # saved, never registered (a worker died before Ray's poll), older
    _save(run_dir, 8, ranks=(0,))  # a newer partial save: rank 1's part never arrived
    (run_dir / SNAPSHOT_FILE).write_text(json.dumps(_snapshot([_c(4), _c(6)])))
    with open(run_dir / _c(6) / "model.safetensors", "r+b") as f:
        f.truncate(100)
    lines = []
    out = prepare_resume(str(run_dir), 2, say=lines.append)
    assert out["resume_from"] == _c(4)
    assert [(d["checkpoint"], d["reason"]) for d in out["damaged"]] == [
        (_c(8), "not every rank's part was saved"), (_c(6), "model.safetensors is 100 bytes, 1024 expected")]
    for d in out["damaged"]:  # kept aside, renamed, with the reason beside it; nothing deleted
        assert d["kept_as"].startswith(d["checkpoint"] + ".damaged-")
        assert json.loads((run_dir / d["kept_as"] / DAMAGED_NOTE).read_text())["reason"] == d["reason"]
        assert (run_dir / d["kept_as"] / "model.safetensors").exists()
    kept = [d["kept_as"] for d in out["damaged"]]
    assert lines[0] == out["message"] == (
        f"checkpoint {_c(8)} failed verification (not every rank's part was saved), checkpoint {_c(6)} failed "
        f"verification (model.safetensors is 100 bytes, 1024 expected); resuming from {_c(4)} instead; the damaged "
        f"folders are kept as {kept[0]}, {kept[1]}")
    state = read_snapshot(str(run_dir))
    # Ray's record: no damaged entry (a new checkpoint-00000006 cannot collide), the chosen one is the
    # latest Ray hands out, and the never-registered older one is in it (pruned by keep like the rest).
    assert entry_names(state) == [_c(1), _c(2), _c(4)] and latest_name(state) == _c(4) and _ray_parses(state)
    assert out["registered"] == [_c(1), _c(2)]
    assert sorted(p.name for p in run_dir.glob(SNAPSHOT_FILE + ".bak-*"))  # the previous snapshot kept
    assert resume_folder(str(run_dir)) == str(run_dir / _c(4))
    assert sorted(p.name for p in run_dir.iterdir() if p.name.startswith("checkpoint-0") and "." not in p.name) \
        == [_c(1), _c(2), _c(4)]
    # Again: nothing to do, nothing said, the snapshot left as it is.
    lines.clear()
    again = prepare_resume(str(run_dir), 2, say=lines.append)
    assert again["resume_from"] == _c(4) and again["damaged"] == [] and lines == []
    assert read_snapshot(str(run_dir)) == state
    # A registered checkpoint whose folder is gone is dropped from Ray's record (Ray would refuse to start).
    (run_dir / _c(1)).rename(tmp_path / "elsewhere")
    gone = prepare_resume(str(run_dir), 2, say=lines.append)
    assert gone["missing"] == [_c(1)] and entry_names(read_snapshot(str(run_dir))) == [_c(2), _c(4)]


def test_prepare_resume_without_a_snapshot_registers_the_newest_good_checkpoint(tmp_path):
    from rapidfire_ray.checkpoints.ledger import entry_names, latest_name, prepare_resume, read_snapshot

    run_dir = tmp_path / "run"
    _save(run_dir, 2)
    out = prepare_resume(str(run_dir), 2, say=lambda m: None)
    state = read_snapshot(str(run_dir))
    assert out["resume_from"] == _c(2) and entry_names(state) == [_c(2)] and latest_name(state) == _c(2)
    assert _ray_parses(state)
    # All damaged: everything set aside, resumed from the beginning, said so.
    empty = tmp_path / "empty"
    _save(empty, 2, ranks=(0,))
    lines = []
    out = prepare_resume(str(empty), 2, say=lines.append)
    assert out["resume_from"] is None and "starting from the beginning" in lines[0]
    assert read_snapshot(str(empty)) is None


def test_settle_after_fit_registers_unregistered_checkpoints_and_applies_keep(tmp_path):
    import json

    from rapidfire_ray.checkpoints.ledger import SNAPSHOT_FILE, entry_names, read_snapshot, settle_after_fit

    run_dir = tmp_path / "run"
    for step in (2, 4, 6, 8):
        _save(run_dir, step)
    # A restarted worker group resumed from 4 before Ray registered it; Ray then registered 6 and 8.
    (run_dir / SNAPSHOT_FILE).write_text(json.dumps(_snapshot([_c(2), _c(6), _c(8)])))
    lines = []
    assert settle_after_fit(str(run_dir), 2, say=lines.append) == [_c(2), _c(4)]
    assert entry_names(read_snapshot(str(run_dir))) == [_c(6), _c(8)]
    assert sorted(p.name for p in run_dir.glob("checkpoint-0*")) == [_c(6), _c(8)]
    assert "checkpoint.keep=2" in lines[0]
    assert settle_after_fit(str(run_dir), 2, say=lines.append) == [] and len(lines) == 1
