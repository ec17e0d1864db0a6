"""Fault tolerance: checkpoint manifests (a truncated checkpoint is detected, set aside and the
previous one used), a worker process killed mid-run (Ray Train restarts the group, which resumes from the last
checkpoint), and the sample accounting of what a failure cost."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "jobs", "configs", "tiny.yaml")


def _rec(rank, step, t, samples=8):
    return {"rank": rank, "step": step, "time": t, "samples": samples}


def test_recovery_summary_counts_restarts_retrained_and_skipped_steps():
    from rapidfire_ray.recovery import recovery_line, recovery_summary

    clean = [_rec(r, s, s) for s in range(1, 7) for r in (0, 1)]
    rec = recovery_summary(clean)
    assert rec["restarts"] == 0 and rec["steps_trained_twice"] == 0 and rec["steps_skipped"] == []
    assert rec["unique_samples"] == 6 * 2 * 8 and recovery_line(rec) is None
    # Checkpoint at step 4; failure after step 6; resumed: steps 5, 6 run again.
    failed = [_rec(r, s, s) for s in range(1, 7) for r in (0, 1)] + [_rec(r, s, 20 + s) for s in range(5, 9)
                                                                     for r in (0, 1)]
    rec = recovery_summary(failed, "checkpoint checkpoint-00000004 failed verification (x)")
    assert rec["restarts"] == 1 and rec["resumes"] == [{"resumed_from_step": 4, "failed_after_step": 6,
                                                        "lost_s": 19.0}]
    assert rec["steps_trained_twice"] == 2 and rec["samples_trained_twice"] == 2 * 2 * 8
    assert rec["unique_samples"] == 8 * 2 * 8 and rec["steps_skipped"] == []
    assert rec["checkpoint_fallback"].startswith("checkpoint checkpoint-00000004")
    assert "1 worker-group restart(s), resumed at step 4" in recovery_line(rec)
    # Resumed from a checkpoint at the very step it failed after: no step repeats, the new worker
    # processes still count as a restart.
    exact = [{**_rec(r, s, s), "pid": 100 + r} for s in range(1, 5) for r in (0, 1)] + \
        [{**_rec(r, s, 20 + s), "pid": 200 + r} for s in range(5, 7) for r in (0, 1)]
    rec = recovery_summary(exact)
    assert rec["restarts"] == 1 and rec["resumes"][0]["resumed_from_step"] == 4
    assert rec["resumes"][0]["failed_after_step"] == 4 and rec["steps_trained_twice"] == 0
    # A hole in a rank's steps is reported, not hidden.
    holed = [_rec(0, s, s) for s in (1, 2, 4)]
    assert recovery_summary(holed)["steps_skipped"] == [3]


def test_manifest_detects_truncated_missing_and_altered_files(tmp_path):
    from rapidfire_ray.checkpoints import verify, write_manifest

    ckpt = tmp_path / "checkpoint-00000002"
    (ckpt / "sub").mkdir(parents=True)
    (ckpt / "model.safetensors").write_bytes(os.urandom(4096))
    (ckpt / "sub" / "state.json").write_text("{}")
    assert verify(str(ckpt)) == "no manifest (the save did not finish)"
    write_manifest(str(ckpt), 0)
    assert verify(str(ckpt)) is None
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[:1000])
    assert verify(str(ckpt)) == "model.safetensors is 1000 bytes, 4096 expected"
    (ckpt / "model.safetensors").write_bytes(bytes([data[0] ^ 1]) + data[1:])
    assert verify(str(ckpt)) == "model.safetensors sha256 differs from its manifest"
    (ckpt / "model.safetensors").write_bytes(data)
    (ckpt / "sub" / "state.json").unlink()
    assert verify(str(ckpt)) == "sub/state.json missing"


def test_usable_checkpoint_falls_back_to_the_newest_one_that_verifies(tmp_path):
    import ray.train

    from rapidfire_ray.checkpoints import usable_checkpoint, write_manifest

    for step in (2, 4, 6):
        d = tmp_path / f"checkpoint-{step:08d}"
        d.mkdir()
        (d / "model.safetensors").write_bytes(os.urandom(2048))
        write_manifest(str(d), 0)
        write_manifest(str(d), 1)  # another rank's manifest, merged into the same folder
    lines = []
    latest = ray.train.Checkpoint(str(tmp_path / "checkpoint-00000006"))
    assert usable_checkpoint(latest, lines.append).path == latest.path and lines == []
    with open(tmp_path / "checkpoint-00000006" / "model.safetensors", "r+b") as f:
        f.truncate(100)
    os.remove(tmp_path / "checkpoint-00000004" / "manifest-rank1.json")
    with open(tmp_path / "checkpoint-00000004" / "manifest-rank0.json", "w") as f:
        f.write("{")
    chosen = usable_checkpoint(latest, lines.append)
    assert chosen.path.endswith("checkpoint-00000002")
    assert lines == ["checkpoint checkpoint-00000006 failed verification (model.safetensors is 100 bytes, 2048 "
                     "expected); resuming from checkpoint-00000002 instead (1 more skipped)"]
    assert usable_checkpoint(None) is None


def test_a_fully_saved_checkpoint_newer_than_the_registered_one_is_preferred(tmp_path):
    """Ray Train registers a reported checkpoint only at its next poll of the workers: a worker
    that dies right after two more saves leaves checkpoints on storage that Ray does not know yet.
    Resuming from the newest one every rank finished trains fewer steps twice."""
    import ray.train

    from rapidfire_ray.checkpoints import usable_checkpoint, write_manifest

    def save(step, ranks):
        d = tmp_path / f"checkpoint-{step:08d}"
        d.mkdir()
        (d / "model.safetensors").write_bytes(os.urandom(1024))
        for r in ranks:
            write_manifest(str(d), r)

    save(4, (0, 1))
    save(8, (0, 1))
    save(12, (0,))  # rank 1's part never arrived
    registered = ray.train.Checkpoint(str(tmp_path / "checkpoint-00000004"))
    notes, lines = [], []
    chosen = usable_checkpoint(registered, lines.append, world_size=2, note=notes.append)
    assert chosen.path.endswith("checkpoint-00000008") and lines == []
    assert notes == ["resuming from checkpoint-00000008, saved by every rank but not yet registered by Ray Train "
                     "(its latest: checkpoint-00000004)"]
    with open(tmp_path / "checkpoint-00000008" / "model.safetensors", "r+b") as f:
        f.truncate(10)  # a newer one that does not verify is passed over silently
    assert usable_checkpoint(registered, lines.append, world_size=2).path == registered.path and lines == []
    # none registered yet (the first failure came before Ray's first poll): the run folder is searched
    save(16, (0, 1))
    assert usable_checkpoint(None, lines.append, run_dir=str(tmp_path), world_size=2).path.endswith(
        "checkpoint-00000016")
    # without a world size (no process group to agree on a choice): Ray Train's registered one
    assert usable_checkpoint(registered, lines.append).path == registered.path


def _steps(run_dir):
    with open(os.path.join(run_dir, "steps.jsonl")) as f:
        return [json.loads(line) for line in f]


def _on_disk_and_in_rays_record(run_dir):
    from rapidfire_ray.checkpoints.ledger import entry_names, latest_name, read_snapshot

    state = read_snapshot(str(run_dir))
    disk = sorted(p.name for p in run_dir.iterdir() if p.is_dir() and p.name.startswith("checkpoint-")
                  and ".damaged-" not in p.name)
    return disk, sorted(entry_names(state)), latest_name(state)


@pytest.mark.slow
def test_resumes_after_a_damaged_checkpoint_keep_rays_record_and_the_disk_in_agreement(ray_cluster, tmp_path,
                                                                                      capsys):
    """The newest checkpoint damaged (optimizer.pt cut to 100 bytes), then three --resume runs
    with more steps: the first falls back to the checkpoint before it, sets the damaged folder
    aside (renamed, reported), and saves a new checkpoint of the same step; every run after it
    starts (Ray Train's record never names a folder that is gone), and after each one the
    checkpoints on disk are exactly those Ray lists, no more than checkpoint.keep."""
    from rapidfire_ray.config import load_config
    from rapidfire_ray.driver import run

    base = {"run.output_dir": str(tmp_path), "checkpoint.every_steps": 2, "checkpoint.keep": 3}
    run_dir = tmp_path / "tiny"
    run(load_config(TINY, {**base, "train.max_steps": 6}))
    assert _on_disk_and_in_rays_record(run_dir) == ([f"checkpoint-0000000{s}" for s in (2, 4, 6)],
                                                    [f"checkpoint-0000000{s}" for s in (2, 4, 6)],
                                                    "checkpoint-00000006")
    manifests = sorted(p.name for p in (run_dir / "checkpoint-00000006").glob("manifest-rank*.json"))
    assert manifests == ["manifest-rank0.json", "manifest-rank1.json"]
    size = (run_dir / "checkpoint-00000006" / "optimizer.pt").stat().st_size
    with open(run_dir / "checkpoint-00000006" / "optimizer.pt", "r+b") as f:  # what a crash mid-write leaves
        f.truncate(100)
    capsys.readouterr()
    second = run(load_config(TINY, {**base, "train.max_steps": 8}), resume=True)
    out = capsys.readouterr().out
    rec = second["recovery"]
    [damaged] = rec["damaged_checkpoints"]
    assert damaged["checkpoint"] == "checkpoint-00000006" and damaged["reason"] == f"optimizer.pt is 100 bytes, {size} expected"
    assert damaged["kept_as"].startswith("checkpoint-00000006.damaged-") and (run_dir / damaged["kept_as"]).is_dir()
    line = (f"checkpoint checkpoint-00000006 failed verification ({damaged['reason']}); resuming from "
            f"checkpoint-00000004 instead; the damaged folder is kept as {damaged['kept_as']}")
    assert rec["checkpoint_fallback"] == line and f"[rapidfire] {line}" in out
    assert f"[rapidfire] resumed past a damaged checkpoint: {line}" in out and "resumed at -" not in out
    assert sorted({r["step"] for r in _steps(run_dir)}) == [5, 6, 7, 8]  # resumed after step 4
    assert _on_disk_and_in_rays_record(run_dir) == ([f"checkpoint-0000000{s}" for s in (4, 6, 8)],
                                                    [f"checkpoint-0000000{s}" for s in (4, 6, 8)],
                                                    "checkpoint-00000008")
    for steps, kept in ((10, (6, 8, 10)), (12, (8, 10, 12))):
        summary = run(load_config(TINY, {**base, "train.max_steps": steps}), resume=True)
        assert summary["steps"] == steps and "checkpoint_fallback" not in summary["recovery"]
        assert sorted({r["step"] for r in _steps(run_dir)}) == [steps - 1, steps]
        names = [f"checkpoint-{s:08d}" for s in kept]
        assert _on_disk_and_in_rays_record(run_dir) == (names, names, names[-1])
    assert (run_dir / damaged["kept_as"] / "optimizer.pt").stat().st_size == 100  # still kept aside


def _train_worker_pids() -> list[int]:
    """Ray Train worker processes of this test session's cluster: children of its raylet (other
    Ray clusters on the machine are left alone)."""
    import ray

    raylet = ray._private.worker.global_worker.node.all_processes["raylet"][0].process.pid
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    cmd = f.read()
            except (OSError, IndexError, ValueError):
                continue
            if ppid == raylet and cmd.startswith(b"ray::RayTrainWorker"):
                pids.append(int(name))
    return sorted(pids)


@pytest.mark.slow
def test_a_killed_worker_process_is_replaced_and_the_run_finishes(ray_cluster, tmp_path, capsys, monkeypatch):
    """os.kill of one Ray Train worker once a checkpoint is saved: with max_failures 1 the
    group restarts, resumes from the newest checkpoint and finishes; the summary says what the
    failure cost (steps after that checkpoint trained twice, none skipped)."""
    from rapidfire_ray.checkpoints import MANIFEST_PREFIX
    from rapidfire_ray.config import load_config
    from rapidfire_ray.faults import DATA_DELAY as DATA_DELAY_ENV
    from rapidfire_ray.driver import run

    # Each batch waits 0.25 s at the source: the 24 steps after checkpoint 8 take >= 6 s, time
    # enough to kill a worker mid-run however fast the machine trains the tiny model.
    monkeypatch.setenv(DATA_DELAY_ENV, "0.25")
    run_dir = tmp_path / "tiny"
    killed = {}

    def kill_when_checkpointed():
        deadline = time.time() + 400
        # The step-8 checkpoint saved by both ranks (a restart resumes from the newest checkpoint
        # every rank saved, registered by Ray Train's controller or not), then a moment for it.
        while time.time() < deadline and not all((run_dir / "checkpoint-00000008" / f"{MANIFEST_PREFIX}{r}.json").is_file()
                                                 for r in (0, 1)):
            time.sleep(0.2)
        time.sleep(1.5)
        pids = _train_worker_pids()
        if pids:
            killed["pid"], killed["time"] = pids[-1], time.time()
            os.kill(pids[-1], signal.SIGKILL)

    killer = threading.Thread(target=kill_when_checkpointed, daemon=True)
    killer.start()
    summary = run(load_config(TINY, {"run.output_dir": str(tmp_path), "train.max_steps": 32,
                                     "checkpoint.every_steps": 4, "scaling.max_failures": 1}))
    killer.join(timeout=5)
    assert killed, "no Ray Train worker to kill"
    rec = summary["recovery"]
    assert summary["steps"] == 32 and rec["restarts"] == 1, rec
    resume = rec["resumes"][0]
    assert resume["resumed_from_step"] % 4 == 0 and resume["resumed_from_step"] >= 4
    # Only the steps after the checkpoint it resumed from ran twice; none was skipped.
    assert rec["steps_trained_twice"] == resume["failed_after_step"] - resume["resumed_from_step"]
    assert rec["steps_trained_twice"] < 4 + 4 and rec["steps_skipped"] == []
    records = _steps(run_dir)
    per_rank = {r: sorted({x["step"] for x in records if x["rank"] == r}) for r in (0, 1)}
    assert per_rank[0] == per_rank[1] == list(range(1, 33))
    assert rec["unique_samples"] == sum(x["samples"] for x in records) - rec["samples_trained_twice"]
    resumed_at = min(x["time"] for x in records if x["time"] > killed["time"]
                     and x["step"] == resume["resumed_from_step"] + 1)
    out = capsys.readouterr().out
    assert "[rapidfire] recovered from 1 worker-group restart(s)" in out
    print(f"\nworker killed -> first step after the restart: {resumed_at - killed['time']:.1f} s; "
          f"lost between steps {resume['lost_s']:.1f} s; {rec['steps_trained_twice']} steps / "
          f"{rec['samples_trained_twice']} samples trained twice")


@pytest.mark.slow
def test_a_preemption_notice_makes_a_checkpoint_and_the_run_resumes_from_it(tmp_path):
    """A head and a "spot" node (own raylet, resource `spot`) started here; the run's two workers
    need {spot: 1} each, so both sit on that node. Mid-run, what a cloud and Ray's autoscaler do on
    a spot interruption: `ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION` with a deadline,
    then the node goes (its processes killed) and a replacement joins. The run saves a checkpoint
    after the step it was in (off its schedule: every_steps 0), restarts on the new node from that
    checkpoint, and finishes; only the steps after the notice ran twice."""
    import re
    import subprocess
    import sys

    from private_head import PrivateHead, cluster_pids

    with PrivateHead(num_cpus=1) as head:
        head.add_node(num_cpus=2, resources={"spot": 2})
        node = head.python("print([n['NodeID'] for n in ray.nodes() if n['Alive'] and "
                           "n['Resources'].get('spot')][0])").strip().splitlines()[-1]
        log_path = tmp_path / "run.log"
        log = open(log_path, "w")
        run = subprocess.Popen([sys.executable, "-m", "rapidfire_ray", "train", "--profile", TINY, "--address",
                                head.address, f"run.output_dir={tmp_path}", "train.max_steps=300",
                                "checkpoint.every_steps=0", "scaling.resources_per_worker={spot: 1}",
                                "scaling.max_failures=1"],
                               env=head.env, stdout=log,
                               stderr=subprocess.STDOUT, text=True, cwd=REPO)
        notice = re.compile(r"\[rapidfire\] node\(s\) \w+ \(ranks \[0, 1\]\) are being preempted, (\d+) s left: "
                            r"saving a checkpoint after step (\d+)")
        try:
            deadline = time.time() + 900
            while time.time() < deadline and run.poll() is None:
                if re.search(r"\[rapidfire\] step ([3-9]|\d\d+)/300", log_path.read_text()):
                    break
                time.sleep(0.5)
            assert run.poll() is None, log_path.read_text()[-3000:]
            drained_at = time.time()
            drain = subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "drain-node", "--address",
                                    head.address, "--node-id", node, "--reason", "DRAIN_NODE_REASON_PREEMPTION",
                                    "--reason-message", "spot interruption notice (test)",
                                    "--deadline-remaining-seconds", "120"],
                                   env=head.env, capture_output=True, text=True, timeout=120)
            assert drain.returncode == 0, drain.stderr[-2000:]
            while time.time() < deadline and run.poll() is None and not notice.search(log_path.read_text()):
                time.sleep(0.5)
            noticed_at = time.time()
            step = int(notice.search(log_path.read_text()).group(2))
            while time.time() < deadline and not (tmp_path / "tiny" / f"checkpoint-{step:08d}").is_dir():
                time.sleep(0.2)
            time.sleep(8)  # the controller registers the checkpoint (it polls the workers every 2 s)
            # The instance goes away: its raylet and everything under it.
            gone = cluster_pids([f"--node_id={node}", f"--node-id={node}"])
            for pid in gone:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            head.add_node(num_cpus=2, resources={"spot": 2})  # the autoscaler's replacement
            assert run.wait(timeout=900) == 0, log_path.read_text()[-3000:]
        finally:
            if run.poll() is None:
                run.kill()
        out = log_path.read_text()
        summary = json.loads((tmp_path / "tiny" / "run_summary.json").read_text())
        rec = summary["recovery"]
        assert summary["steps"] == 300 and rec["restarts"] == 1, rec
        assert rec["resumes"][0]["resumed_from_step"] == step and rec["steps_skipped"] == [], rec
        print(f"\npreemption notice -> checkpoint line {noticed_at - drained_at:.1f} s (after step {step}; the run "
              f"said {notice.search(out).group(1)} s left of 120); node lost -> steps again "
              f"{rec['resumes'][0]['lost_s']:.1f} s between steps; {rec['steps_trained_twice']} steps trained twice")
