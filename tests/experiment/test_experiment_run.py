"""`rapidfire experiment` end to end on the session's Ray cluster with the tiny random model."""
from __future__ import annotations

import json
import shutil
import threading
import time

import pytest
import ray

import rapidfire_ray
from rapidfire_ray.cli import main
from rapidfire_ray.errors import RapidfireError

from tests.paths import REPO

PROFILE = f"{REPO}/jobs/configs/experiment_tiny.yaml"


def _summary(folder) -> dict:
    return json.loads((folder / "experiment_summary.json").read_text())


def test_three_configs_two_chunks_side_by_side_and_a_bad_one_failed(ray_cluster, tmp_path, capsys):
    summary = rapidfire_ray.experiment(PROFILE, overrides={
        "run.output_dir": str(tmp_path), "experiment.search.optimizer.params.lr": [1e-3, 5.0, 1e-2, 3e-3]})
    folder = tmp_path / "experiment-tiny"
    assert summary == _summary(folder) and summary["status"] == "completed"
    configs = {c["id"]: c for c in summary["configs"]}
    assert configs["c1"]["state"] == "failed" and "optimizer.params.lr" in configs["c1"]["error"]
    assert summary["chunk_rows"] == [16, 16] and summary["eval_rows"] == 16
    for cid in ("c0", "c2", "c3"):
        c = configs[cid]
        assert c["state"] == "done" and [h["chunk"] for h in c["history"]] == [1, 2]
        assert [h["steps"] for h in c["history"]] == [2, 2] and c["history"][-1]["step"] == 4
        assert all(h["swap_in_s"] >= 0 and h["swap_out_s"] >= 0 for h in c["history"])
        assert (folder / "configs" / cid / "state-chunk2.pt").is_file() and (folder / "configs" / cid / "state-chunk1.pt").is_file()
    # a higher learning rate learns more of the same 32 rows in 4 steps (lr 1e-3 < 3e-3 < 1e-2)
    assert configs["c2"]["score"] < configs["c3"]["score"] < configs["c0"]["score"]
    assert summary["best"]["id"] == "c2" and summary["swap"]["chunks"] == 6
    out = capsys.readouterr().out
    assert "chunk 2/2 | c2 (lr=0.01) | eval_loss" in out and "failed validation" in out

    assert main(["experiment", "status", str(folder)]) == 0
    board = capsys.readouterr().out.splitlines()
    assert board[0].startswith("experiment experiment-tiny (completed, policy none): 3 done, 1 failed")
    assert board[2].split()[:5] == ["1", "c2", "lr=0.01", "2/2", f"{configs['c2']['score']:.4f}"]

    # every config is an MLflow run in the folder's SQLite store, read back with MLflow's own client
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{folder}/mlflow.db")
    experiment_id = client.get_experiment_by_name("experiment-tiny").experiment_id
    runs = {r.info.run_name: r for r in client.search_runs([experiment_id])}
    assert set(runs) == {"c0", "c1", "c2", "c3"}
    assert runs["c1"].info.status == "FAILED" and "optimizer.params.lr" in runs["c1"].data.tags["rapidfire.reason"]
    for cid in ("c0", "c2", "c3"):
        run = runs[cid]
        assert run.info.status == "FINISHED" and run.data.tags["rapidfire.config"] == cid
        assert float(run.data.params["optimizer.params.lr"]) == configs[cid]["values"]["optimizer.params.lr"]
        logged = client.get_metric_history(run.info.run_id, "eval_loss")
        assert [(m.step, m.value) for m in logged] == [(h["step"], h["eval_loss"]) for h in configs[cid]["history"]]

    # rapidfire report draws the experiment folder: every config's curves in one PNG, and the leaderboard
    capsys.readouterr()
    assert main(["report", str(folder)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == board[0] and (folder / "report.png").stat().st_size > 10_000

    with pytest.raises(RapidfireError, match="already has experiment_summary.json; pass --resume"):
        rapidfire_ray.experiment(PROFILE, overrides={"run.output_dir": str(tmp_path)})

    # --resume after a crash that came right after c0's chunk 1 was counted: c0 trains chunk 2 again
    # from the chunk-1 state on storage and reaches the very same held-out loss; the others are done
    crashed = json.loads(json.dumps(summary))
    c0 = crashed["configs"][0]
    c0.update(state="running", chunks_done=1, history=c0["history"][:1], score=c0["history"][0]["score"])
    crashed["status"] = "interrupted"
    (folder / "experiment_summary.json").write_text(json.dumps(crashed))
    (folder / "configs" / "c0" / "state-chunk2.pt").unlink()
    again = rapidfire_ray.experiment(PROFILE, resume=True, overrides={
        "run.output_dir": str(tmp_path), "experiment.search.optimizer.params.lr": [1e-3, 5.0, 1e-2, 3e-3]})
    before, after = summary["configs"][0], again["configs"][0]
    assert after["state"] == "done" and [h["chunk"] for h in after["history"]] == [1, 2]
    assert after["history"][1]["eval_loss"] == before["history"][1]["eval_loss"]
    assert after["history"][1]["train_loss"] == before["history"][1]["train_loss"]
    for i in (2, 3):  # done before the crash: not trained again
        assert again["configs"][i]["history"] == summary["configs"][i]["history"]
    assert again["configs"][1]["state"] == "failed" and again["config_chunks"] == 6
    assert again["status"] == "completed"
    # the same MLflow runs go on: c0's chunk 2 (logged before the crash) is not logged twice
    runs = {r.info.run_name: r for r in client.search_runs([experiment_id])}
    assert set(runs) == {"c0", "c1", "c2", "c3"} and runs["c0"].info.status == "FINISHED"
    assert len(client.get_metric_history(runs["c0"].info.run_id, "eval_loss")) == 2


def test_successive_halving_and_live_ctl_ops(ray_cluster, tmp_path):
    """Ops queued through the controller while the experiment runs are applied at a chunk boundary."""
    overrides = {"run.output_dir": str(tmp_path), "run.name": "exp-ctl", "experiment.num_chunks": 3,
                 "experiment.rows": 36, "experiment.policy": "successive_halving", "experiment.eta": 2,
                 "experiment.min_chunks": 2, "experiment.num_slots": 2,
                 "experiment.search.optimizer.params.lr": [1e-3, 1e-2, 3e-3]}
    queued = []

    def steer():
        from rapidfire_ray.experiments.control import controller_name, NAMESPACE

        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                ray.get_actor(controller_name("exp-ctl"), namespace=NAMESPACE)
                break
            except ValueError:
                time.sleep(0.05)
        queued.append(rapidfire_ray.experiment_ctl("stop", "c0", experiment="exp-ctl"))
        queued.append(rapidfire_ray.experiment_ctl("clone", "c1", {"optimizer.params.lr": 2e-2}, warm=False,
                                                   experiment="exp-ctl"))

    thread = threading.Thread(target=steer)
    thread.start()
    summary = rapidfire_ray.experiment(PROFILE, overrides=overrides)
    thread.join()
    assert [q["op"] for q in queued] == ["stop", "clone"]
    configs = {c["id"]: c for c in summary["configs"]}
    log = {e["op"]: e for e in summary["ctl_log"]}
    # stopped at a boundary: it trained exactly the chunks it had done when the op was applied
    assert log["stop"]["result"].startswith("stopped after chunk")
    assert configs["c0"]["state"] == "stopped" and configs["c0"]["chunks_done"] == log["stop"]["after_chunk"]
    assert configs["c3"]["values"] == {"optimizer.params.lr": 2e-2} and configs["c3"]["parent"] == "c1"
    assert "@" in log["clone"]["who"]
    # the cut after chunk 2 keeps max(1, n // 2) of the configs that reached it, best first
    cut = summary["cuts"][0]
    assert cut["after_chunk"] == 2 and len(cut["kept"]) == max(1, (len(cut["kept"]) + len(cut["stopped"])) // 2)
    reached = [configs[c] for c in cut["kept"] + cut["stopped"]]
    scores = {c["id"]: c["history"][1]["score"] for c in reached}
    assert max(scores[c] for c in cut["kept"]) <= min(scores[c] for c in cut["stopped"])
    for c in cut["kept"]:
        assert configs[c]["state"] == "done" and configs[c]["chunks_done"] == 3
    for c in cut["stopped"]:
        assert configs[c]["state"] == "stopped" and configs[c]["chunks_done"] == 2
    lines = (tmp_path / "exp-ctl" / "ctl_log.jsonl").read_text().splitlines()
    # (in the order applied: a stop waits while its config is mid-chunk, a clone does not)
    assert sorted(json.loads(line)["op"] for line in lines) == ["clone", "stop"]



def test_co_batched_and_two_worker_slots_train_to_the_same_numbers_as_one_config_on_one_worker(
        ray_cluster, tmp_path, capsys, monkeypatch):
    """experiment.co_batch 3 on one slot: the three configs train every chunk in one pass (rows routed
    to their adapters); a slot of 2 workers (each half of every step's 8 rows, gradients summed),
    alone and co-batched: every chunk's train and held-out loss is the one-at-a-time run's. A group
    that runs out of memory (injected: a slot whose forward pass holds 8 rows, the group's is 24):
    each of its configs trains the chunk again alone, to the same numbers."""
    runs = {}
    for name, over in (("co1", {"experiment.co_batch": 1}), ("co3", {"experiment.co_batch": 3}),
                       ("w2", {"experiment.resources.workers": 2, "train.per_device_batch_size": 4}),
                       ("w2co3", {"experiment.resources.workers": 2, "train.per_device_batch_size": 4,
                                  "experiment.co_batch": 3}),
                       ("oom", {"experiment.co_batch": 3})):
        if name == "oom":
            monkeypatch.setenv("RAPIDFIRE_INJECT_OOM_ROWS", "8")
        runs[name] = rapidfire_ray.experiment(PROFILE, overrides={
            "run.output_dir": str(tmp_path), "run.name": name, "experiment.tracking": "none",
            "experiment.num_slots": 1, "experiment.resources.cpus": 0.5, **over})
        monkeypatch.delenv("RAPIDFIRE_INJECT_OOM_ROWS", raising=False)
        if name == "co3":
            out = capsys.readouterr().out
            assert "up to 3 configs co-batched per slot" in out and "chunk 2/2 | c2 (lr=0.01) | eval_loss" in out
            assert out.count("| co-batched x3") == 6
        if name == "w2co3":
            assert "1 slot(s) of 2 workers x 0.5 CPU 0 GPU" in capsys.readouterr().out
    printed = "".join(capsys.readouterr())
    assert printed.count("failed in chunk 1 (OutOfMemoryError: injected: a forward pass over 24 rows") == 1
    assert "co-batched configs c0, c1, c2 failed in chunk 1" in printed and "each trains it again alone" in printed
    assert "| co-batched x3" not in printed  # from then on alone, every chunk
    assert all("co_batch" not in h for c in runs["oom"]["configs"] for h in c["history"])
    for name in ("w2", "w2co3", "oom"):
        ref, got = ({c["id"]: c for c in runs[n]["configs"]} for n in ("co1", name))
        for cid, c in got.items():
            assert c["state"] == "done", (name, cid, c["reason"])
            for h, r in zip(c["history"], ref[cid]["history"], strict=True):
                assert (h["chunk"], h["steps"], h["step"]) == (r["chunk"], r["steps"], r["step"]), (name, cid)
                assert h["eval_loss"] == pytest.approx(r["eval_loss"], rel=1e-5), (name, cid)
                assert h["train_loss"] == pytest.approx(r["train_loss"], rel=1e-5), (name, cid)
    runs[1], runs[3] = runs["co1"], runs["co3"]
    alone, together = ({c["id"]: c for c in runs[k]["configs"]} for k in (1, 3))
    assert set(alone) == set(together) == {"c0", "c1", "c2"}
    for cid, c in together.items():
        assert c["state"] == "done" and [h["co_batch"] for h in c["history"]] == [3, 3]
        # one node: chunk 2 swapped in from this node's object store (chunk 1 was a fresh adapter)
        assert [h["state_on_node"] for h in c["history"]] == [None, True] and c["history"][0]["node"]
        assert "co_batch" not in alone[cid]["history"][0]
        for h, ref in zip(c["history"], alone[cid]["history"], strict=True):
            assert (h["chunk"], h["steps"], h["step"]) == (ref["chunk"], ref["steps"], ref["step"])
            assert h["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-5), cid
            assert h["train_loss"] == pytest.approx(ref["train_loss"], rel=1e-5), cid
        assert (tmp_path / "co3" / "configs" / cid / "state-chunk2.pt").is_file()
        assert (tmp_path / "w2" / "configs" / cid / "state-chunk2.pt").stat().st_size > 0
    assert runs[3]["best"]["id"] == runs[1]["best"]["id"] == "c2" and runs[3]["swap"]["chunks"] == 6


def test_pbt_replaces_the_worse_config_by_a_warm_perturbed_clone_and_resumes_it_exactly(ray_cluster, tmp_path):
    summary = rapidfire_ray.experiment(PROFILE, overrides={
        "run.output_dir": str(tmp_path), "run.name": "exp-pbt", "experiment.policy": "pbt",
        "experiment.quantile": 0.5, "experiment.tracking": "none", "experiment.num_slots": 1,
        "experiment.search.optimizer.params.lr": [1e-3, 1e-2]})
    configs = {c["id"]: c for c in summary["configs"]}
    (cut,) = summary["cuts"]
    # lr 1e-2 learns more in chunk 1 (as in the grid test): c0 is replaced by a warm clone of c1
    assert cut == {"after_chunk": 1, "kept": ["c1"], "stopped": ["c0"], "cloned": ["c1"]}
    assert configs["c0"]["state"] == "stopped" and configs["c0"]["chunks_done"] == 1
    clone = configs["c2"]
    assert clone["parent"] == "c1" and clone["warm_from"] == "c1" and clone["state"] == "done"
    # a list value moves to a neighbouring entry: the only neighbour of 1e-2 is 1e-3
    assert clone["values"] == {"optimizer.params.lr": 1e-3}
    # it trained chunk 2 only, from the parent's step 2 on
    assert [(h["chunk"], h["step"]) for h in clone["history"]] == [(2, 4)]
    (logged,) = summary["ctl_log"]
    assert logged["who"] == "policy pbt (replaces c0)" and logged["result"].startswith("cloned as c2")
    assert not (tmp_path / "exp-pbt" / "mlflow.db").exists()  # experiment.tracking: none
    folder = tmp_path / "exp-pbt"
    assert (folder / "configs" / "c2" / "state-chunk1.pt").is_file()  # the clone's own copy of c1's boundary

    # --resume after a crash right after both configs' chunk 1 was counted, before the cut: the
    # summary on storage has no cut and no clone (cut and clone happen in one loop turn, before the
    # next write). The cut is made again, the same warm clone (same id, same perturbed values) starts
    # from c1's chunk-1 state read back from storage, and every number comes out as before.
    crashed = json.loads(json.dumps(summary))
    crashed.update(status="interrupted", cuts=[], ctl_log=[], best=None)
    crashed["configs"] = [c for c in crashed["configs"] if c["id"] != "c2"]
    for c in crashed["configs"]:
        c.update(state="running", chunks_done=1, history=c["history"][:1], score=c["history"][0]["score"],
                 reason=None)
    (folder / "experiment_summary.json").write_text(json.dumps(crashed))
    (folder / "configs" / "c1" / "state-chunk2.pt").unlink()
    shutil.rmtree(folder / "configs" / "c2")
    (folder / "ctl_log.jsonl").unlink()
    again = rapidfire_ray.experiment(PROFILE, resume=True, overrides={
        "run.output_dir": str(tmp_path), "run.name": "exp-pbt", "experiment.policy": "pbt",
        "experiment.quantile": 0.5, "experiment.tracking": "none", "experiment.num_slots": 1,
        "experiment.search.optimizer.params.lr": [1e-3, 1e-2]})
    assert again["status"] == "completed" and again["cuts"] == summary["cuts"]
    after = {c["id"]: c for c in again["configs"]}
    assert set(after) == {"c0", "c1", "c2"} and after["c0"]["state"] == "stopped"
    assert after["c2"]["values"] == clone["values"] and after["c2"]["warm_from"] == "c1"
    for cid in ("c1", "c2"):
        assert [(h["chunk"], h["step"], h["eval_loss"], h["train_loss"]) for h in after[cid]["history"]] == [
            (h["chunk"], h["step"], h["eval_loss"], h["train_loss"]) for h in configs[cid]["history"]], cid
    (logged,) = again["ctl_log"]
    assert logged["who"] == "policy pbt (replaces c0)" and logged["result"] == summary["ctl_log"][0]["result"]
    assert len((folder / "ctl_log.jsonl").read_text().splitlines()) == 1


def test_a_slot_killed_mid_chunk_retrains_from_the_last_boundary_and_twice_fails_the_config(
        ray_cluster, tmp_path, monkeypatch, capsys):
    # c0 and c1 are the same config; c0's slot dies in chunk 2, c2's twice in chunk 1
    monkeypatch.setenv("RAPIDFIRE_INJECT_KILL_SLOT", "c0:2,c2:1:2")
    summary = rapidfire_ray.experiment(PROFILE, overrides={
        "run.output_dir": str(tmp_path), "run.name": "exp-kill", "experiment.tracking": "none",
        "experiment.num_slots": 1, "experiment.search.optimizer.params.lr": [3e-3, 3e-3, 1e-2]})
    configs = {c["id"]: c for c in summary["configs"]}
    c0, c1, c2 = configs["c0"], configs["c1"], configs["c2"]
    assert c0["state"] == c1["state"] == "done" and [h["chunk"] for h in c0["history"]] == [1, 2]
    # retrained from the chunk-1 state on storage: the same numbers as the twin never interrupted
    for a, b in zip(c0["history"], c1["history"]):
        assert (a["eval_loss"], a["train_loss"], a["step"]) == (b["eval_loss"], b["train_loss"], b["step"])
    assert c2["state"] == "failed" and "its slot was lost 2 time(s)" in c2["reason"] and c2["chunks_done"] == 0
    printed = "".join(capsys.readouterr())
    assert "config c0: its slot was lost 1 time(s)" in printed and "chunk 2 runs again from its last boundary" in printed
    assert summary["status"] == "completed"
