"""Control ops, applied by the experiment loop's own code at the target's next chunk boundary (no Ray)."""
from __future__ import annotations

import json
from types import SimpleNamespace

from rapidfire_ray.experiments import ops
from rapidfire_ray.experiments.control import make_op
from rapidfire_ray.experiments.driver import _Experiment
from rapidfire_ray.experiments.scheduler import DELETED, FAILED, RUNNING, STOPPED, ChunkScheduler
from rapidfire_ray.experiments.spec import load_experiment

from .helpers import sample_rows
from .test_spec import _profile


def _experiment(tmp_path):
    exp = load_experiment(_profile(num_chunks=3), {"run.output_dir": str(tmp_path)})
    rows = sample_rows(12)
    data = SimpleNamespace(chunks=[rows[:4], rows[4:8], rows[8:]], eval_rows=rows[:2])
    run = _Experiment(exp, data, ChunkScheduler(3), exp.folder, None)
    for cand in exp.candidates:
        run.add(cand)
    return run


def test_an_op_on_a_config_in_flight_waits_for_its_chunk_boundary(tmp_path):
    run = _experiment(tmp_path)
    assert run.sched.next_pair() == ("c0", 0)  # c0 is training chunk 1
    run.pending_ops = [make_op("stop", "c0"), make_op("stop", "c1")]
    ops.apply_pending(run)
    assert run.sched.configs["c1"].state == STOPPED  # idle: at once (its boundary: before chunk 1)
    assert run.sched.configs["c0"].state == RUNNING and len(run.pending_ops) == 1
    run.sched.finished("c0", 1.0)
    ops.apply_pending(run)
    assert run.sched.configs["c0"].state == STOPPED and not run.pending_ops
    assert [(e["run"], e["after_chunk"]) for e in run.ctl_log] == [("c1", 0), ("c0", 1)]
    logged = [json.loads(line) for line in (tmp_path / "exp-t" / "ctl_log.jsonl").read_text().splitlines()]
    assert [e["op"] for e in logged] == ["stop", "stop"] and all("@" in e["who"] and e["asked_at"] for e in logged)
    assert run.sched.next_pair() is None  # nobody runnable


def test_resume_delete_and_unknown_configs(tmp_path):
    run = _experiment(tmp_path)
    run.pending_ops = [make_op("stop", "c1"), make_op("resume", "c1"), make_op("delete", "c0"), make_op("stop", "c9"),
                       make_op("resume", "c0")]
    ops.apply_pending(run)
    assert run.sched.configs["c1"].state == RUNNING and run.sched.configs["c0"].state == DELETED
    results = [e["result"] for e in run.ctl_log]
    assert results[2].startswith("deleted") and results[3] == "refused: no config 'c9'"
    assert results[4] == "nothing to do: it is deleted"
    assert run.sched.next_pair() == ("c1", 0)


def test_clone_cold_warm_and_refused(tmp_path):
    run = _experiment(tmp_path)
    run.sched.next_pair()
    run.sched.finished("c0", 2.0)
    run.states["c0"] = b"state of c0 after chunk 1"
    run.pending_ops = [make_op("clone", "c0", {"optimizer.params.lr": 5e-4}),
                       make_op("clone", "c0", {"optimizer.params.lr": 5e-4}, warm=True),
                       make_op("clone", "c0", {"model.lora.r": 16}, warm=True),
                       make_op("clone", "c1", {"optimizer.params.lr": 5e-4}, warm=True),
                       make_op("clone", "c0", {"data.max_length": 32}),
                       make_op("clone", "c0", {"optimizer.params.lr": 9.0})]
    ops.apply_pending(run)
    c = run.sched.configs
    assert c["c2"].state == RUNNING and c["c2"].chunks_done == 0 and run.states["c2"] is None
    assert run.cands["c2"].values == {"optimizer.params.lr": 5e-4} and run.info["c2"]["parent"] == "c0"
    assert c["c3"].chunks_done == 1 and run.states["c3"] == run.states["c0"] and run.info["c3"]["warm_from"] == "c0"
    assert c["c4"].state == FAILED and "adapter's shape" in c["c4"].reason
    assert c["c5"].state == FAILED and "no chunk yet" in c["c5"].reason
    assert c["c6"].state == FAILED and "data.max_length: cannot be changed" in c["c6"].reason
    assert c["c7"].state == FAILED and "optimizer.params.lr" in c["c7"].reason
    assert [e["result"].split(" ")[0] for e in run.ctl_log] == ["cloned", "cloned", "clone", "clone", "clone", "clone"]


def test_pbt_exploit_is_a_logged_warm_clone_with_perturbed_values(tmp_path):
    exp = load_experiment(_profile(num_chunks=3, policy="pbt", quantile=0.5,
                                   search={"optimizer.params.lr": {"low": 1e-4, "high": 1e-2}}, num_samples=2),
                          {"run.output_dir": str(tmp_path)})
    rows = sample_rows(12)
    data = SimpleNamespace(chunks=[rows[:4], rows[4:8], rows[8:]], eval_rows=rows[:2])
    run = _Experiment(exp, data, ChunkScheduler(3, "pbt", quantile=0.5), exp.folder, None, seed=3)
    for cand in exp.candidates:
        run.add(cand)
    for score in (1.0, 2.0):
        cid, _ = run.sched.next_pair()
        run.sched.finished(cid, score)
        run.states[cid] = f"state of {cid}".encode()
    assert run.sched.cut() == ["c1"]
    for ask in run.sched.take_exploits():
        ops.exploit(run, ask)
    c2 = run.cands["c2"]
    parent_lr = run.cands["c0"].values["optimizer.params.lr"]
    assert c2.parent == "c0" and run.info["c2"]["warm_from"] == "c0" and run.states["c2"] == b"state of c0"
    assert c2.values["optimizer.params.lr"] in (float(f"{parent_lr * 0.8:.6g}"), float(f"{parent_lr * 1.2:.6g}"))
    assert run.sched.configs["c2"].chunks_done == 1 and run.sched.configs["c2"].state == RUNNING
    (entry,) = run.ctl_log
    assert entry["who"] == "policy pbt (replaces c1)" and entry["warm"] and entry["result"].startswith("cloned as c2")
    assert sorted(run.sched.next_pair()[0] for _ in range(2)) == ["c0", "c2"]
