"""`rapidfire train --communication parameter_server`: 2 real Ray Train workers, real shard actors,
TRL's SFTTrainer, tiny-random. Training, exactly-once updates, bounded staleness, the summary,
final model = server state, resume (shard versions, rapidfire_adamw state); a shard killed mid-run;
a worker killed mid-run; bad input."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from rapidfire_ray.cli import main
from paths import SAMPLE, TINY_PROFILE

pytestmark = pytest.mark.timeout(300)

PS = ["--communication", "parameter_server"]


def train(out, name, *overrides, resume=False, expect=0):
    argv = ["train", "--profile", TINY_PROFILE, *PS, *(["--resume"] if resume else []), f"data.path={SAMPLE}",
            f"run.output_dir={out}", f"run.name={name}", "scaling.cpus_per_worker=1", *overrides]
    assert main(argv) == expect
    return json.loads((out / name / "run_summary.json").read_text()) if expect == 0 else None


def steps_of(out, name):
    return [json.loads(line) for line in (out / name / "steps.jsonl").read_text().splitlines()]


def assert_model_is_server_state(run_dir, checkpoint, num_shards):
    """The exported model's weights are exactly the shards' final parameters."""
    weights = load_file(str(run_dir / "model" / "model.safetensors"))
    server = {}
    for i in range(num_shards):
        server.update(torch.load(os.path.join(checkpoint, f"ps_shard_{i}.pt"), weights_only=True)["params"])
    assert set(server) <= set(weights)
    assert all(torch.equal(weights[n], t) for n, t in server.items())


def test_two_workers_two_shards_1bit_train_with_bounded_staleness(ray_cluster, tmp_path, monkeypatch):
    # Rank 1 is a straggler (its compute takes 3x as long): the bound must still hold.
    monkeypatch.setenv("RAPIDFIRE_INJECT_SLOW_RANKS", "1:3")
    s = train(tmp_path, "ps", "communication.ps.num_shards=2", "communication.ps.max_staleness=1",
              "optimizer.params.compression.grad=1bit", "communication.ps.snapshot_every=4")
    assert s["final_loss"] < s["first_loss"], s["loss_history"]
    ps = s["parameter_server"]
    updates = 2 * 8 * 2  # workers x steps x shards: every push applied exactly once
    assert ps["num_shards"] == 2 and ps["pushes"] == ps["applied"] == updates, ps
    assert ps["duplicates"] == 0 and ps["lost_updates"] == 0 and ps["restarts"] == 0
    assert sum(ps["staleness_hist"].values()) == updates
    assert ps["staleness_max"] <= 1 and ps["bound_violations"] == 0
    assert ps["torch_process_group"] is False  # no process group: no allreduce, no collective at all
    assert ps["push_latency_p99_s"] >= ps["push_latency_p50_s"] > 0 and ps["pull_latency_p50_s"] > 0
    assert all(u > 0 for u in ps["updates_per_s_per_shard"]) and ps["snapshots"] >= 2
    assert [w["steps"] for w in ps["workers"]] == [8, 8]
    comm = s["communication"]
    assert comm["mode"] == "parameter_server" and comm["compression_ratio"] > 10, comm
    # 1-bit both ways: pushes and delta pulls far below the model's 4 bytes per parameter.
    fp32 = 4 * sum(t.numel() for t in load_file(str(tmp_path / "ps" / "model" / "model.safetensors")).values())
    assert 0 < ps["bytes_pushed_per_step"] < fp32 / 10 and 0 < ps["bytes_pulled_per_step"] < fp32 / 10
    records = [r for r in steps_of(tmp_path, "ps") if r["ps_push_s"] is not None]
    compute = {rank: sorted(r["phases"]["forward"] + r["phases"]["backward"] for r in records if r["rank"] == rank)
               for rank in (0, 1)}
    assert compute[1][4] > 1.8 * compute[0][4], compute  # the injected straggler really was slower
    assert len(records) == 16 and all(r["ps_staleness"] <= 1 and r["ps_bytes_pushed"] > 0 for r in records)
    ckpt = s["checkpoint"]
    assert sorted(f for f in os.listdir(ckpt) if f.startswith(("comm_state", "ps_shard"))) == [
        "comm_state_rank0.pt", "comm_state_rank1.pt", "ps_shard_0.pt", "ps_shard_1.pt"]
    assert_model_is_server_state(tmp_path / "ps", ckpt, 2)


def test_rapidfire_adamw_on_the_shards_warms_up_then_pushes_updates_and_resumes(ray_cluster, tmp_path):
    rfa = ["communication.ps.num_shards=2", "communication.ps.max_staleness=1", "optimizer.type=rapidfire_adamw",
           "optimizer.params.compression.grad=1bit", "optimizer.params.freeze_step=3"]
    s = train(tmp_path, "ps-rfa", *rfa)
    assert s["final_loss"] < s["first_loss"], s["loss_history"]
    ps = s["parameter_server"]
    # 2 workers x 2 shards: 3 warm-up steps of AdamW on exact gradients, then 5 of updates
    assert ps["applied_by_kind"] == {"grad": 2 * 3 * 2, "update": 2 * 5 * 2}, ps
    records = sorted(steps_of(tmp_path, "ps-rfa"), key=lambda r: (r["rank"], r["step"]))
    kinds = [r["ps_push_kind"] for r in records if r["rank"] == 0]
    assert kinds == ["grad"] * 3 + ["update"] * 5, kinds
    warm = [r["ps_bytes_pushed"] for r in records if r["ps_push_kind"] == "grad"]
    compressed = [r["ps_bytes_pushed"] for r in records if r["ps_push_kind"] == "update"]
    assert max(compressed) < min(warm) / 20  # float32 gradients, then 1 bit per element (+ scales)
    state = torch.load(os.path.join(s["checkpoint"], "comm_state_rank0.pt"), weights_only=True)["ps_client"]
    assert state["steps"] == 8 and state["rapidfire_adamw"]["compressed_steps"] == 5
    assert_model_is_server_state(tmp_path / "ps-rfa", s["checkpoint"], 2)

    # Resumed: each worker's momentum and frozen denominator come back; no second warm-up.
    resumed = train(tmp_path, "ps-rfa", *rfa, "train.max_steps=10", resume=True)
    assert resumed["start_step"] == 8 and resumed["steps"] == 10
    rps = resumed["parameter_server"]
    assert rps["applied_by_kind"] == {"update": 2 * 2 * 2}
    # The shards continued from the checkpoint's state: versions go on from there (16 pushes each).
    assert [sh["restored_from_version"] for sh in rps["shards"]] == [16, 16]
    assert [sh["version"] for sh in rps["shards"]] == [16 + 4, 16 + 4]
    assert_model_is_server_state(tmp_path / "ps-rfa", resumed["checkpoint"], 2)


def _kill_when(predicate, action, stop):
    def run():
        while not stop.is_set():
            try:
                if predicate():
                    action()
                    return
            except ValueError:  # the named shard does not exist yet
                pass
            time.sleep(0.05)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_killed_shard_restarts_from_snapshot_and_the_run_completes(ray_cluster, tmp_path):
    ray = ray_cluster
    name = "ps-shard-kill"
    killed = threading.Event()
    stop = threading.Event()

    def version():
        return ray.get(ray.get_actor(f"rapidfire-ps-{name}-0").ping.remote())

    def kill():
        ray.kill(ray.get_actor(f"rapidfire-ps-{name}-0"), no_restart=False)
        killed.set()

    t = _kill_when(lambda: version() >= 10, kill, stop)
    try:
        s = train(tmp_path, name, "communication.ps.num_shards=2", "communication.ps.snapshot_every=4",
                  "train.max_steps=12", "checkpoint.every_steps=0")
    finally:
        stop.set()
        t.join()
    assert killed.is_set()
    ps = s["parameter_server"]
    dead, alive = ps["shards"]
    assert dead["restarts"] == 1 and dead["restored_from_version"] is not None and alive["restarts"] == 0
    # Every acknowledged push is in the final state or counted as lost, never both.
    assert dead["version"] + dead["lost_updates"] == 2 * 12 and alive["version"] == 2 * 12
    assert dead["lost_updates"] <= 4 + 2  # at most the updates since the last snapshot (and in flight)
    assert ps["lost_updates"] == dead["lost_updates"] and ps["restarts"] == 1
    assert s["steps"] == 12
    assert_model_is_server_state(tmp_path / name, s["checkpoint"], 2)


def _train_worker_pids(ray):
    """PIDs of this cluster's live Ray Train worker actors."""
    from ray.util.state import list_actors

    return [a.pid for a in list_actors(address=ray.get_runtime_context().gcs_address,
                                       filters=[("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")])]


def test_killed_worker_is_restarted_and_the_run_completes(ray_cluster, tmp_path):
    ray = ray_cluster
    name = "ps-worker-kill"
    killed = threading.Event()
    stop = threading.Event()
    before = set(_train_worker_pids(ray))

    def kill():
        pids = sorted(set(_train_worker_pids(ray)) - before)
        os.kill(pids[-1], signal.SIGKILL)
        killed.set()

    t = _kill_when(lambda: ray.get(ray.get_actor(f"rapidfire-ps-{name}-0").ping.remote()) >= 12, kill, stop)
    try:
        s = train(tmp_path, name, "communication.ps.num_shards=1", "scaling.max_failures=1",
                  "train.max_steps=12", "checkpoint.every_steps=4")
    finally:
        stop.set()
        t.join()
    assert killed.is_set()
    assert s["steps"] == 12
    ps = s["parameter_server"]
    assert ps["pushes"] == ps["applied"] and ps["bound_violations"] == 0
    assert_model_is_server_state(tmp_path / name, s["checkpoint"], 1)


@pytest.mark.parametrize("overrides, expected", [
    (["communication.ps.max_staleness=-1"], "communication.ps.max_staleness: -1 is out of range; allowed: >= 0"),
    (["communication.ps.num_shards=0"], "communication.ps.num_shards: 0 is out of range; allowed: >= 1"),
    (["optimizer.type=rapidfire_adamw"], "leaves rapidfire_adamw nothing to compress in the pushes"),
    (["optimizer.params.compression.grad=auto"], "use none, fp16, 1bit or 2bit"),
    (["memory.optim_level=level3"], "keeps them on its shard actors instead; choose one"),
    (["scaling.hybrid_parallel=true"], "scaling.hybrid_parallel: ZeRO-3 shards parameters"),
    (["communication.ps.lr_staleness_scaling=sqrt"], "is not one of: none, inverse"),
])
def test_bad_parameter_server_config_is_one_line(capsys, overrides, expected):
    assert main(["train", "--profile", TINY_PROFILE, *PS, "--dry-run", *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert expected in err and len(err.splitlines()) == 1, err


def test_more_shards_than_parameters_is_refused(ray_cluster, tmp_path, capsys):
    train(tmp_path, "ps-too-many", "communication.ps.num_shards=1000", expect=2)
    err = capsys.readouterr().err
    assert "communication.ps.num_shards: 1000 is more than the" in err and "choose at most" in err
