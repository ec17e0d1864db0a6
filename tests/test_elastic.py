"""Elastic training end to end: `scaling.num_workers: [1, 2]` on a head of the test's own, with
"nodes" (raylets) that join and leave while the run trains."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from rapidfire_ray.config import load_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "jobs", "configs", "tiny.yaml")


@pytest.mark.parametrize("overrides, message", [
    ({"scaling.num_workers": [2, 1]}, "1 <= min <= max"),
    ({"scaling.num_workers": [1, 2, 3]}, "1 <= min <= max"),
    ({"scaling.num_workers": [1, 2], "communication.mode": "parameter_server"}, "parameter_server"),
    ({"scaling.num_workers": [1, 2], "memory.optim_level": "level3"}, "ZeRO-3"),
    ({"scaling.num_workers": [1, 2], "optimizer.type": "rapidfire_adamw", "communication.mode": "allreduce",
      "optimizer.params.compression.grad": "1bit"}, "rapidfire_adamw"),
    ({"scaling.num_workers": [1, 2], "train.stage": "rl", "data.format": "prompt"}, "train.stage rl"),
    ({"scaling.num_workers": [1, 2], "train.max_steps": -1, "train.epochs": 1.5}, "whole epochs"),
    ({"scaling.num_workers": [1, 2], "scaling.elastic.batch": "double"}, "scaling.elastic.batch"),
])
def test_elastic_config_errors_name_the_key_and_the_fix(overrides, message):
    with pytest.raises(Exception, match=message) as e:
        load_config(TINY, overrides)
    assert len(str(e.value).splitlines()) == 1


def test_an_equal_min_and_max_is_a_fixed_worker_count():
    assert load_config(TINY, {"scaling.num_workers": [2, 2]}).scaling.num_workers == 2


def _node_id(head, resource: str) -> str:
    return head.python(f"print([n['NodeID'] for n in ray.nodes() if n['Alive'] and "
                       f"n['Resources'].get({resource!r})][0])").strip().splitlines()[-1]


def test_an_elastic_run_grows_when_a_node_joins_shrinks_when_one_is_lost_and_trains_every_row_once(tmp_path):
    """Workers need {trainer: 1}; each added "node" has one. The run starts on one node with one
    worker (accumulating two micro-batches per step: the global batch of two workers), grows to
    two workers when a second node joins, shrinks back to one when that node is killed, and
    finishes its two epochs. Each resize resumes from the latest checkpoint: the summary's
    accounting must show every row trained exactly once per epoch (steps redone after a
    checkpoint counted apart)."""
    from private_head import PrivateHead, cluster_pids

    data = tmp_path / "rows.jsonl"
    with open(os.path.join(REPO, "jobs", "data", "sft_sample.jsonl"), encoding="utf-8") as f:
        data.write_text("".join(f.readlines()[:240]))
    with PrivateHead(num_cpus=1) as head:
        head.add_node(num_cpus=2, resources={"trainer": 1, "first": 1})
        log_path = tmp_path / "run.log"
        env = {**head.env, "RAPIDFIRE_DATA_DELAY_S": "1.0", "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "30"}
        with open(log_path, "w") as log:
            run = subprocess.Popen([sys.executable, "-m", "rapidfire_ray", "train", "--profile", TINY, "--address",
                                    head.address, f"run.output_dir={tmp_path}", f"data.path={data}",
                                    "train.max_steps=-1", "train.epochs=2", "checkpoint.every_steps=2",
                                    "scaling.num_workers=[1, 2]", "scaling.resources_per_worker={trainer: 1}",
                                    "scaling.elastic.resize_interval_s=2", "scaling.max_failures=3"],
                                   env=env, stdout=log, stderr=subprocess.STDOUT, text=True, cwd=REPO)
        try:
            def wait_for(pattern: str, timeout: float = 600) -> re.Match:
                deadline = time.time() + timeout
                while time.time() < deadline:
                    found = re.search(pattern, log_path.read_text())
                    if found:
                        return found
                    assert run.poll() is None, log_path.read_text()[-3000:]
                    time.sleep(0.5)
                raise AssertionError(f"{pattern!r} not seen: {log_path.read_text()[-3000:]}")

            wait_for(r"\[rapidfire\] step \d+/")  # training on one worker (under load the first line can be step 2)
            head.add_node(num_cpus=2, resources={"trainer": 1, "second": 1})
            joined_at = time.time()
            second = _node_id(head, "second")
            # two workers train once rank 1 has saved its part of a checkpoint
            deadline = time.time() + 600
            while time.time() < deadline and run.poll() is None:
                if _ranks_seen(tmp_path) >= 2:
                    break
                time.sleep(0.5)
            assert _ranks_seen(tmp_path) >= 2, log_path.read_text()[-3000:]
            time.sleep(3)  # a step or two on two workers, past a checkpoint
            killed_at = time.time()
            for pid in cluster_pids([f"--node_id={second}", f"--node-id={second}"]):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            assert run.wait(timeout=900) == 0, log_path.read_text()[-3000:]
        finally:
            if run.poll() is None:
                run.kill()
    summary = json.loads((tmp_path / "tiny" / "run_summary.json").read_text())
    el = summary["elastic"]
    counts = [g["world_size"] for g in el["worker_groups"] if g["steps"]]
    assert counts[0] == 1 and 2 in counts and counts[-1] == 1, el
    assert el["resizes"] >= 2, el
    assert el["untrainable_rows"] == 0 and el["samples_trained_once"] == el["expected_samples"] == 2 * summary["data"]["rows"], el
    first = el["worker_groups"][0]
    assert first["gradient_accumulation_steps"] == 2 and first["global_batch_rows"] == 16, first
    grown = next(g for g in el["worker_groups"] if g["world_size"] == 2)
    assert grown["gradient_accumulation_steps"] == 1 and grown["global_batch_rows"] == 16, grown
    steps = [json.loads(line) for line in (tmp_path / "tiny" / "steps.jsonl").read_text().splitlines()]
    grown_at = min(r["time"] for r in steps if r["world"] == 2)
    last_attempt = max(r["attempt"] for r in steps)
    shrunk_at = min(r["time"] for r in steps if r["attempt"] == last_attempt)
    assert grown_at > joined_at and shrunk_at > killed_at
    print(f"\nelastic: node joined -> first step on 2 workers {grown_at - joined_at:.1f} s; node killed -> first "
          f"step on 1 worker {shrunk_at - killed_at:.1f} s; {summary['recovery']}; {el}")


def _ranks_seen(tmp_path) -> int:
    """Ranks in the run's live progress (the board writes nothing to disk until the end, so the
    log's step lines cannot tell ranks apart): read from the Ray Train checkpoints' manifests."""
    ranks = set()
    for manifest in (tmp_path / "tiny").glob("checkpoint-*/manifest-rank*.json"):
        ranks.add(manifest.name)
    return len(ranks)
