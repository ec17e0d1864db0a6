"""Observability (issue 9, items 1-3): metrics on Ray's endpoint, `rapidfire monitor`, live
knobs changed by rules at a step boundary.

One real tiny-random run (2 workers) with an injected slow data source (RAPIDFIRE_DATA_DELAY_S:
the loader really sleeps per batch) and `data.prefetch_depth 0`, `monitor.adjust auto`. While it
trains, the test runs `rapidfire monitor --once --json` in another process and scrapes the
metrics export port over HTTP; afterwards it checks the change the prefetch rule made.
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from paths import REPO, TINY_PROFILE
from rapidfire_ray.config import load_config
from rapidfire_ray.errors import RapidfireError
from rapidfire_ray.telemetry.metrics import METRICS, exported_names, reference_markdown
from rapidfire_ray.telemetry.rules import RuleState, Settings, evaluate, window

RUN = "observe-live"


def record(rank, step, *, step_s=1.0, wait_s=0.0, oom=0, padded=400, tokens=300, peak=100, p99=0.0):
    return {"rank": rank, "step": step, "phases": {"step": step_s, "data_wait": wait_s}, "oom_splits": oom,
            "padded_tokens": padded, "tokens": tokens, "peak_memory_bytes": peak, "comm_latency_p99_s": p99}


def records(steps, **kw):
    return [record(rank, s, **kw) for s in steps for rank in (0, 1)]


KNOBS = {"data.prefetch_depth": 2, "memory.max_forward_tokens": None}
CODEC = "optimizer.params.compression.grad"


# --- rules (pure functions over step records) -----------------------------------------------

def test_window_is_the_last_steps_every_rank_reported():
    recs = records(range(1, 6)) + [record(0, 6)]
    assert sorted({r["step"] for r in window(recs, 2)}) == [4, 5]


def test_data_wait_above_threshold_doubles_prefetch_and_below_does_nothing():
    s = Settings(adjust="auto", window_steps=2)
    out = evaluate(records([1, 2], wait_s=0.2), KNOBS, s, RuleState())
    assert [(p.knob, p.new) for p in out] == [("data.prefetch_depth", 4)]
    assert "data wait 20.0% of step time > 5%" in out[0].reason
    assert evaluate(records([1, 2], wait_s=0.04), KNOBS, s, RuleState()) == []
    # capped, and at least 1 from 0
    assert evaluate(records([1], wait_s=0.5), {**KNOBS, "data.prefetch_depth": 0}, s, RuleState())[0].new == 1
    assert evaluate(records([1], wait_s=0.5), {**KNOBS, "data.prefetch_depth": 16}, s, RuleState()) == []


def test_rules_never_touch_knobs_that_are_not_allowed():
    s = Settings(adjust="auto", allowed=("memory.max_forward_tokens",), window_steps=2)
    assert evaluate(records([1, 2], wait_s=0.5), KNOBS, s, RuleState()) == []


def test_a_changed_knob_waits_a_full_window_with_its_new_value():
    s = Settings(adjust="auto", window_steps=2)
    state = RuleState(quiet_until={"data.prefetch_depth": 3})
    assert evaluate(records([2, 3, 4], wait_s=0.5), KNOBS, s, state) == []  # window 3-4 starts at the change
    assert evaluate(records([3, 4, 5], wait_s=0.5), KNOBS, s, state)[0].knob == "data.prefetch_depth"


def test_oom_splits_lower_max_forward_tokens_and_headroom_raises_it_back():
    s = Settings(adjust="auto", window_steps=2, oom_splits=2)
    out = evaluate(records([1, 2], oom=1, padded=1000), KNOBS, s, RuleState())
    assert [(p.knob, p.new) for p in out] == [("memory.max_forward_tokens", 500)]
    knobs = {**KNOBS, "memory.max_forward_tokens": 300}
    limits = {0: 1000, 1: 1000}
    up = evaluate(records([5, 6], peak=400, padded=1000), knobs, s, RuleState(), limits)
    assert [(p.knob, p.new) for p in up] == [("memory.max_forward_tokens", 600)]
    back = evaluate(records([5, 6], peak=400, padded=1000), {**KNOBS, "memory.max_forward_tokens": 600}, s,
                    RuleState(), limits)
    assert [(p.knob, p.new) for p in back] == [("memory.max_forward_tokens", None)]  # whole batches again
    assert evaluate(records([5, 6], peak=600, padded=1000), knobs, s, RuleState(), limits) == []  # no headroom


def test_comm_latency_gives_advice_once_naming_the_stronger_codec():
    s = Settings(adjust="auto", window_steps=2, comm_latency_p99_s=0.5)
    state = RuleState()
    out = evaluate(records([1, 2], p99=0.9), KNOBS, s, state, codec="fp16", mode="allreduce_compressed")
    assert len(out) == 1 and out[0].advice and "compression.grad 2bit" in out[0].reason
    assert evaluate(records([3, 4], p99=0.9), KNOBS, s, state, codec="fp16") == []
    ps = evaluate(records([1, 2], p99=0.9), KNOBS, s, RuleState(), mode="parameter_server")
    assert ps[0].knob == "communication.ps.max_staleness"


def test_comm_latency_switches_to_the_next_stronger_codec_where_it_is_a_live_allowed_knob():
    knob = "optimizer.params.compression.grad"
    s = Settings(adjust="auto", window_steps=2, comm_latency_p99_s=0.5, allowed=(knob,))
    knobs = {**KNOBS, knob: "fp16"}
    state = RuleState()
    out = evaluate(records([1, 2], p99=0.9), knobs, s, state, codec="fp16", mode="allreduce_compressed")
    assert [(p.knob, p.new, p.advice) for p in out] == [(knob, "2bit", False)]
    assert "comm latency p99 0.900 s > 0.5 s (steps 1-2)" in out[0].reason
    state.quiet_until[knob] = 3  # the change takes effect after step 3: no new proposal before a full window
    assert evaluate(records([3, 4], p99=0.9), {**knobs, knob: "2bit"}, s, state, mode="allreduce_compressed") == []
    up = evaluate(records([4, 5], p99=0.9), {**knobs, knob: "2bit"}, s, state, mode="allreduce_compressed")
    assert [(p.knob, p.new) for p in up] == [(knob, "1bit")]
    # 1bit is the strongest: advice (once), naming the parameter server
    last = evaluate(records([6, 7], p99=0.9), {**knobs, knob: "1bit"}, s, state, mode="allreduce_compressed")
    assert len(last) == 1 and last[0].advice and "parameter_server" in last[0].reason
    # a live codec knob the user did not allow: advice only, saying how to allow it
    advice = evaluate(records([1, 2], p99=0.9), knobs, Settings(adjust="auto", window_steps=2), RuleState(),
                      mode="allreduce_compressed")
    assert advice[0].advice and "2bit" in advice[0].reason and "monitor.allowed" in advice[0].reason


def test_knob_values_are_checked_before_a_change_is_published():
    from rapidfire_ray.telemetry.rules import check_knob_value, knob_gauge

    check_knob_value("optimizer.params.compression.grad", "2bit")
    check_knob_value("memory.max_forward_tokens", None)
    for knob, bad in (("optimizer.params.compression.grad", "3bit"), ("data.prefetch_depth", -1),
                      ("data.prefetch_depth", "deep"), ("memory.max_forward_tokens", 0)):
        with pytest.raises(ValueError, match=knob.replace(".", r"\.")):
            check_knob_value(knob, bad)
    assert knob_gauge("optimizer.params.compression.grad", "1bit") == 3.0
    assert knob_gauge("memory.max_forward_tokens", None) == -1.0


def test_monitor_config_is_validated():
    cfg = load_config(TINY_PROFILE, ["monitor.adjust=off", "monitor.allowed=[data.prefetch_depth]"])
    assert cfg.monitor.adjust == "off" and list(cfg.monitor.allowed) == ["data.prefetch_depth"]
    cfg = load_config(TINY_PROFILE, ["monitor.allowed=[optimizer.params.compression.grad]"])
    assert list(cfg.monitor.allowed) == ["optimizer.params.compression.grad"]
    with pytest.raises(RapidfireError, match="monitor.allowed: 'communication.ps.max_staleness' is not a knob"):
        load_config(TINY_PROFILE, ["monitor.allowed=[communication.ps.max_staleness]"])
    with pytest.raises(RapidfireError, match="monitor.adjust"):
        load_config(TINY_PROFILE, ["monitor.adjust=sometimes"])


# --- the control actor: same step on every worker ---------------------------------------------

def test_a_change_is_applied_by_every_worker_after_the_same_step(ray_cluster):
    """Two workers polling every 2 steps, one a step behind the other: a change published while
    they are at different steps is applied by both after the same step; set back by hand too."""
    import ray

    from rapidfire_ray.telemetry.control import KnobClient, start_control, stop_control
    from rapidfire_ray.telemetry.board import RunBoard

    board = RunBoard.remote()
    control = start_control("observe-unit", board, Settings(adjust="off"), dict(KNOBS), world_size=2,
                            every_steps=2, interval_s=60)
    try:
        applied = {0: [], 1: []}
        clients = [KnobClient(control, r, 2, {"data.prefetch_depth": lambda v, r=r: applied[r].append(v)},
                              initial=dict(KNOBS)) for r in (0, 1)]
        for c in clients:
            c.begin(0)
        steps = {0: 0, 1: 0}

        def advance(rank, to):
            while steps[rank] < to:
                steps[rank] += 1
                for c in clients[rank].step_end(steps[rank]):
                    applied_at[rank].append((steps[rank], c["new"]))

        applied_at = {0: [], 1: []}
        advance(0, 5)
        advance(1, 4)
        change = ray.get(control.set_knob.remote("data.prefetch_depth", 7, "test"))
        assert change["step"] >= 6 and change["old"] == 2  # rank 0's next poll is at step 6
        advance(0, 12)
        advance(1, 12)
        assert applied_at[0] == applied_at[1] == [(change["step"], 7)]
        assert clients[0].values["data.prefetch_depth"] == clients[1].values["data.prefetch_depth"] == 7
        back = ray.get(control.set_knob.remote("data.prefetch_depth", 2, "set back"))
        advance(0, 20)
        advance(1, 20)
        assert applied_at[0][-1] == applied_at[1][-1] == (back["step"], 2)
        deadline = time.time() + 10  # the workers report their application asynchronously
        while time.time() < deadline:
            info = ray.get(control.info.remote())
            if all(len(c["applied"]) == 2 for c in info["changes"]):
                break
            time.sleep(0.1)
        assert [c["applied"] for c in info["changes"]] == [{"0": change["step"], "1": change["step"]},
                                                           {"0": back["step"], "1": back["step"]}]
        with pytest.raises(ray.exceptions.RayTaskError, match="unknown knob"):
            ray.get(control.set_knob.remote("optimizer.params.lr", 1.0))
    finally:
        stop_control(control, "observe-unit")
        ray.kill(board)


# --- documentation and dashboard match what is exported -------------------------------------

def test_readme_metrics_table_is_the_catalogue():
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    assert reference_markdown() in readme


def test_docs_metrics_reference_is_the_catalogue():
    with open(os.path.join(REPO, "docs", "metrics.md"), encoding="utf-8") as f:
        assert reference_markdown() in f.read()


def test_grafana_dashboard_uses_only_exported_metrics():
    with open(os.path.join(REPO, "cluster", "grafana_rapidfire.json"), encoding="utf-8") as f:
        dash = json.load(f)
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 10
    used = {name for e in exprs for name in re.findall(r"\bray_rapidfire_[a-z0-9_]+", e)}
    assert used and used <= exported_names(), used - exported_names()
    # every worker metric of the catalogue has a panel
    assert {m.exported for m in METRICS if m.kind != "histogram"} - used <= {"ray_rapidfire_adjustments_total"}


# --- a live run ------------------------------------------------------------------------------

def _scrape() -> str:
    import ray

    text = []
    for node in ray.nodes():
        if node["Alive"] and node.get("MetricsExportPort"):
            url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
            text.append(urllib.request.urlopen(url, timeout=10).read().decode())
    return "\n".join(text)


EXPECTED = {"ray_rapidfire_loss", "ray_rapidfire_learning_rate", "ray_rapidfire_tokens_per_second",
            "ray_rapidfire_step_phase_seconds", "ray_rapidfire_steps_total", "ray_rapidfire_tokens_total",
            "ray_rapidfire_comm_latency_p50_seconds", "ray_rapidfire_comm_latency_p99_seconds",
            "ray_rapidfire_comm_bytes_sent_total", "ray_rapidfire_comm_bytes_received_total",
            "ray_rapidfire_compression_ratio", "ray_rapidfire_batch_rows", "ray_rapidfire_padding_fraction",
            "ray_rapidfire_memory_bytes", "ray_rapidfire_memory_peak_bytes", "ray_rapidfire_utilization",
            "ray_rapidfire_knob", "ray_rapidfire_step_seconds_bucket"}


def _samples(text: str) -> dict:
    """metric name -> [(labels, value)] of our run's series."""
    samples: dict = {}
    for line in text.splitlines():
        m = re.match(r"(ray_rapidfire_[a-z0-9_]+)\{(.*)\} (\S+)$", line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            if labels.get("run") == RUN:
                samples.setdefault(m.group(1), []).append((labels, float(m.group(3))))
    return samples


def _monitors(*calls: tuple[str, ...], timeout: float = 120) -> list[subprocess.CompletedProcess]:
    """`rapidfire monitor` with each argument list, all started at once (each spends seconds starting
    Python and joining the cluster: one after the other, the later ones could miss a short run)."""
    procs = [subprocess.Popen([sys.executable, "-m", "rapidfire_ray", "monitor", *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=REPO) for args in calls]
    out = []
    for args, proc in zip(calls, procs):
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        out.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    return out


@pytest.fixture(scope="module")
def live(ray_cluster, tmp_path_factory):
    """Run a 2-worker job in a thread; while it trains, take a monitor snapshot from another
    process and scrape the metrics endpoint until our metrics show up."""
    import ray

    from rapidfire_ray import train
    from rapidfire_ray.telemetry.control import NAMESPACE, control_name

    out = tmp_path_factory.mktemp("observe")
    result: dict = {}

    def go():
        try:
            result["summary"] = train(TINY_PROFILE, overrides={
                "run.name": RUN, "run.output_dir": str(out), "train.max_steps": 40, "data.prefetch_depth": 0,
                "checkpoint.every_steps": 0, "monitor.adjust": "auto", "monitor.window_steps": 2,
                "monitor.interval_s": 0.5,
                # the codec is a live knob too: any latency is "high", so fp16 -> 2bit -> 1bit
                "communication.mode": "allreduce_compressed", "optimizer.params.compression.grad": "fp16",
                "monitor.allowed": ["data.prefetch_depth", CODEC], "monitor.comm_latency_p99_s": 0.0})
        except BaseException as e:  # handed to the tests
            result["error"] = e

    os.environ["RAPIDFIRE_DATA_DELAY_S"] = "0.5"  # a run long enough for several scrapes
    thread = threading.Thread(target=go, daemon=True)
    try:
        thread.start()
        deadline = time.time() + 400
        board = None
        while thread.is_alive() and time.time() < deadline:  # until a step is on the board
            try:
                control = ray.get_actor(control_name(RUN), namespace=NAMESPACE)
                board = board or ray.get(control.info.remote())["board"]
                if ray.get(board.latest.remote())["workers"]:
                    break
            except (ValueError, ray.exceptions.RayActorError):
                pass
            time.sleep(0.5)
        # Every series seen while the run trains, scraped from now on beside the monitor calls (a gauge
        # leaves the endpoint with its worker process: scrapes taken after the run miss it).
        # Series are merged across scrapes by their labels: one scrape can hold one worker's counter
        # and not yet the other's (each worker process exports on its own report interval).
        series: dict = {}

        def complete() -> bool:
            names = {name for name, _ in series}
            ranks = {dict(labels).get("rank") for name, labels in series if name == "ray_rapidfire_steps_total"}
            return EXPECTED <= names and {"0", "1"} <= ranks

        def scrape():
            while time.time() < deadline and not complete():
                try:
                    for name, found in _samples(_scrape()).items():
                        for labels, value in found:
                            series[name, tuple(sorted(labels.items()))] = value
                except OSError:
                    pass
                if not thread.is_alive():
                    break
                time.sleep(1)

        scraper = threading.Thread(target=scrape, daemon=True)
        scraper.start()
        address = ray.get_runtime_context().gcs_address
        result["monitor"], result["monitor_all"] = _monitors(
            ("--address", address, "--run", RUN, "--once", "--json"),
            ("--address", address, "--once", "--metrics", "throughput,comm_latency"))
        scraper.join(timeout=max(1.0, deadline - time.time()))
        samples: dict = {}
        for (name, labels), value in list(series.items()):
            samples.setdefault(name, []).append((dict(labels), value))
        result["samples"] = samples
        thread.join(timeout=600)
    finally:
        os.environ.pop("RAPIDFIRE_DATA_DELAY_S", None)
    if "error" in result:
        raise result["error"]
    result["run_dir"] = os.path.join(str(out), RUN)
    return result


def test_monitor_once_json_returns_live_values(live):
    proc = live["monitor"]
    assert proc.returncode == 0, proc.stderr
    snap = json.loads(proc.stdout.strip().splitlines()[-1])
    assert snap["run"] == RUN and snap["total_steps"] == 40
    assert 1 <= snap["step"] < 40  # taken while the run trained
    assert [w["rank"] for w in snap["workers"]] == [0, 1]
    for w in snap["workers"]:
        assert w["tokens_per_s"] > 0 and w["step_s"] > 0 and w["batch_rows"] >= 1
        assert w["data_wait_s"] >= 0 and w["knobs"]["data.prefetch_depth"] >= 0
    assert snap["adjust"] == "auto" and "data.prefetch_depth" in snap["knobs"]
    table = live["monitor_all"]
    assert table.returncode == 0, table.stderr
    assert f"run {RUN}" in table.stdout and "tokens_per_s" in table.stdout and "comm_latency_p99_s" in table.stdout


def test_monitor_without_a_running_run_fails_in_one_line(live):
    from rapidfire_ray.monitor import main

    import io
    from contextlib import redirect_stderr

    err = io.StringIO()
    with redirect_stderr(err):
        code = main(["--run", RUN, "--once", "--json"])
    assert code == 1
    assert err.getvalue().count("\n") == 1 and f"run '{RUN}' is not running" in err.getvalue()


def test_metrics_appear_on_the_endpoint_with_documented_names_and_labels(live):
    samples = live["samples"]
    present = set(samples)
    assert EXPECTED <= present, sorted(EXPECTED - present)
    assert present <= exported_names(), present - exported_names()
    for name in EXPECTED:
        for labels, _ in samples[name]:
            assert labels["rank"] in ("0", "1") and labels["node"], (name, labels)
    phases = {lab["phase"] for lab, _ in samples["ray_rapidfire_step_phase_seconds"]}
    assert {"data_wait", "forward", "backward", "optimizer", "communication"} <= phases
    assert any(v > 0 for _, v in samples["ray_rapidfire_comm_bytes_sent_total"])
    assert {lab["rank"] for lab, _ in samples["ray_rapidfire_steps_total"]} == {"0", "1"}


def test_prefetch_rule_fires_on_slow_data_and_every_worker_applies_it_at_the_same_step(live):
    summary = live["summary"]
    adj = summary["adjustments"]
    assert adj["adjust"] == "auto"
    changes = [c for c in adj["changes"] if c["knob"] == "data.prefetch_depth"]
    assert changes, adj
    first = changes[0]
    assert first["old"] == 0 and first["new"] == 1 and first["source"] == "rule"
    assert "data wait" in first["reason"] and "> 5%" in first["reason"]
    assert first["applied"] == {"0": first["step"], "1": first["step"]} and first["applied_step"] == first["step"]
    with open(os.path.join(live["run_dir"], "steps.jsonl"), encoding="utf-8") as f:
        steps = [json.loads(line) for line in f]
    for rank in (0, 1):
        depth = {r["step"]: r["knobs"]["data.prefetch_depth"] for r in steps if r["rank"] == rank}
        assert depth[first["step"]] == 0 and depth[first["step"] + 1] == 1  # from the next step on
    # the depth the run ended with is the last change's
    assert adj["knobs"]["data.prefetch_depth"] == changes[-1]["new"]


def test_comm_latency_rule_switches_the_codec_live_on_every_worker_at_the_same_step(live):
    adj = live["summary"]["adjustments"]
    changes = [c for c in adj["changes"] if c["knob"] == CODEC]
    assert changes and changes[0]["old"] == "fp16" and changes[0]["new"] == "2bit", adj
    assert "comm latency p99" in changes[0]["reason"] and changes[0]["source"] == "rule"
    with open(os.path.join(live["run_dir"], "steps.jsonl"), encoding="utf-8") as f:
        steps = [json.loads(line) for line in f]
    for c in changes:
        assert c["applied"] == {"0": c["step"], "1": c["step"]}
    first = changes[0]["step"]
    for rank in (0, 1):
        mine = {r["step"]: r for r in steps if r["rank"] == rank}
        assert mine[first]["knobs"][CODEC] == "fp16" and mine[first + 1]["knobs"][CODEC] == "2bit"
        # what went over the wire: fp16 gradients before, 2-bit (with error feedback) after
        before = [mine[s]["bytes_sent"] for s in range(2, first + 1)]
        after = [mine[s]["bytes_sent"] for s in range(first + 1, (changes[1]["step"] if len(changes) > 1 else 40) + 1)]
        assert max(after) < 0.5 * min(before), (before, after)
    assert math.isfinite(live["summary"]["final_loss"])


def test_parameter_server_shards_export_their_updates_and_staleness(ray_cluster):
    """Shard actors of a run (named rapidfire-ps-<run>-<i>, as ps.driver starts them) record their
    applied updates; a client pushes a few real gradients. Seconds after the last push (more than
    the two report intervals Ray keeps a gauge that is not set again) one scrape still shows each
    shard's final version: an idle shard's gauges stay on the endpoint while it lives."""
    import ray
    import torch

    from rapidfire_ray.ps import PSClient, launch_shards
    from rapidfire_ray.telemetry.metrics import report_interval_s

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1))
    shards, _, pinned = launch_shards(model.named_parameters(), 2, name_prefix="rapidfire-ps-observe-ps",
                                      max_staleness=2)
    try:
        client = PSClient(model.named_parameters(), shards, max_staleness=2, worker_id="w0")
        client.sync()
        x = torch.randn(32, 8)
        for _ in range(5):
            model.zero_grad()
            model(x).pow(2).mean().backward()
            client.push_and_pull({n: p.grad for n, p in model.named_parameters()})
        client.finish()
        time.sleep(3 * report_interval_s())
        pattern = re.compile(r'^ray_rapidfire_ps_shard_(updates_total|version|staleness_count)\{(.*)\} (\S+)$')
        wanted = {(name, shard, value) for shard in ("0", "1")
                  for name, value in (("updates_total", "5.0"), ("version", "5.0"), ("staleness_count", "5.0"))}
        deadline, seen = time.time() + 60, set()
        while not wanted <= seen and time.time() < deadline:
            try:
                text = _scrape()
            except OSError:
                text = ""
            seen = set()  # one scrape must hold them all
            for line in text.splitlines():
                m = pattern.match(line)
                if m and 'run="observe-ps"' in m.group(2):
                    seen.add((m.group(1), re.search(r'shard="(\d+)"', m.group(2)).group(1), m.group(3)))
            time.sleep(0.5)
        assert wanted <= seen, sorted(seen)
    finally:
        for s in shards:
            ray.kill(s)
        del pinned


def test_experiment_gauges_per_config_from_the_leaderboard():
    from rapidfire_ray.telemetry.metrics import BY_NAME, experiment_gauges

    board = {"name": "exp", "configs": [
        {"id": "c0", "state": "running", "chunks_done": 2,
         "history": [{"score": 3.0, "train_loss": 3.5}, {"score": 2.5, "train_loss": 2.75}]},
        {"id": "c1", "state": "running", "chunks_done": 0, "history": []},
        {"id": "c2", "state": "deleted", "chunks_done": 1, "history": [{"score": 9.0, "train_loss": 9.0}]}]}
    got = experiment_gauges(board)
    tags0, tags1 = {"experiment": "exp", "config": "c0"}, {"experiment": "exp", "config": "c1"}
    assert got == [("rapidfire_experiment_chunks_done", 2.0, tags0), ("rapidfire_experiment_score", 2.5, tags0),
                   ("rapidfire_experiment_train_loss", 2.75, tags0), ("rapidfire_experiment_chunks_done", 0.0, tags1)]
    assert all(set(tags) == set(BY_NAME[name].labels) for name, _, tags in got)


def test_a_deleted_configs_gauges_are_no_longer_kept():
    from rapidfire_ray.telemetry.metrics import _Instruments, record_experiment

    def kept():
        return {(name, dict(tags)["config"]) for name, tags in _Instruments._last if dict(tags).get("experiment") == "exp-del"}

    row = {"state": "running", "chunks_done": 1, "history": [{"score": 2.0, "train_loss": 2.5}]}
    record_experiment({"name": "exp-del", "configs": [{"id": "a", **row}, {"id": "b", **row}]})
    assert {c for _, c in kept()} == {"a", "b"}
    record_experiment({"name": "exp-del", "configs": [{"id": "a", **row}, {"id": "b", **row, "state": "deleted"}]})
    assert {c for _, c in kept()} == {"a"} and len(kept()) == 3
