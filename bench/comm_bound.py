"""Communication-bound training on the netns harness: step time and time to the same loss for
`allreduce` vs `allreduce_compressed` vs `rapidfire_adamw`, and the runs the scaling model is
checked against.

What runs (all on this one host; root needed):
  - `cluster/local/netns.py` brings up N "nodes" (network namespaces joined by a bridge, every
    veth shaped by `tbf` in both directions) and starts one Ray node per namespace with
    `--num-cpus 2` (--node-cpus): the CPU a training worker asks for plus one. With exactly 1
    per node the run hangs before its first step: Ray Train's DatasetManager realises the shard
    plan (`rapidfire_ray/data/sharding.py: realise` -> `Dataset.split_at_indices`) with Ray
    tasks that need 1 CPU each, after the workers' placement group holds every CPU (`ray
    status`: "2.0/2.0 CPU (2.0 used of 2.0 reserved in placement groups)", pending demand
    {'CPU': 1.0}); nothing times out. All namespaces share this machine's CPU cores: N workers
    compete for them, so the compute part of a step grows with N here.
  - Every training run is the real CLI, executed inside namespace 0 against that cluster:
        python -m rapidfire_ray train --profile jobs/configs/tiny.yaml --address <head> \\
            scaling.num_workers=N scaling.placement=SPREAD scaling.cpus_per_worker=1 ...
    tiny-random model (its fp32 gradient is the whole exchange), fixed steps, no intermediate
    checkpoints. Gradients cross the shaped links (one worker per namespace; checked by looking
    for the Ray Train worker processes in each namespace while the run trains).
  - Per node count: a raw gloo probe of the shaped link (latency of a 1-element allreduce,
    achieved bandwidth of an fp32-gradient-sized allreduce), a calibration run with the links
    unshaped (the compute time per step: step minus the exchange), then on the shaped links:
    allreduce + adamw; allreduce_compressed with 1bit under the default per-layer policy and
    pure 1bit (keep_fp16=[] min_numel=0); rapidfire_adamw with 1bit and freeze_step = 20% of
    the steps; `parameter_server` (only when named in --modes, with --node-cpus 3: with 2 the
    worker and its node's shard leave no CPU for Ray Data's split tasks and the run hangs; issue 5): one shard per node,
    rapidfire_adamw with 1bit pushes and pulls after the same warm-up, max_staleness 1 (the
    scaling model has no parameter-server mode: these runs are left out of its check).
  - The rate: chosen from the 2-node calibration so that the fp32 exchange (2(n-1)/n * 4P bytes
    per rank per step) takes --comm-share of the step, then kept for 3 nodes.
  - The burst: netns.py sizes the tbf bucket at max(64 KiB, 1 ms of the rate). At a rate of
    about 1 Mbit/s that bucket refills during the compute part of every step, so any exchange
    under 64 KiB (a whole 1-bit exchange of this model is ~13 KB) would cross at line rate and
    compression would look free. --burst small (default) re-applies the same tbf (same rate,
    same `latency 50ms` queue) with a 3028-byte bucket (two full frames; GSO packets are
    segmented by tbf), so every byte pays the rate; --burst harness keeps netns.py's shaping.
    (A deep queue is no better: with a 256 KiB queue a 2-rank fp32 gloo allreduce took 2.7-2.9 s
    instead of 1.75 s, because each direction's ACKs wait behind the other direction's data.)

Measured per run (steps.jsonl, run_summary.json): mean step time over the steps after the
first --warmup, the exchange time (the communication phase of the rank that waited least, so
that one rank waiting for a slower one is counted as compute, not as network), bytes sent per
step (counted by the product where it sends), compression ratio, loss history, data wait, and
the bytes that really crossed each node's link (veth counters: gradients + Ray + data).

Reported: step-time speedup of each compressed mode over allreduce; the Amdahl limit
1 / (compute_share + comm_share / ratio) from the allreduce run's measured compute and exchange
times and the measured byte ratio, and the share of it achieved; time to the same loss (the
first step whose 3-step trailing mean loss is <= the allreduce run's final 3-step trailing
mean, times the run's mean step time; if some run never gets there, the lowest level every run
reaches, and the result says so); pure 1-bit bytes vs fp32 bytes per step. `compressed_auto`
(`grad: auto`) against the others (`auto_targets`): with `--unshaped-modes allreduce
compressed_auto` both also run on the unshaped links after the calibration (auto within 3% of
plain allreduce there), and on the shaped links auto within 10% of the best fixed codec run.

Writes bench/results/comm_bound.json: {"runs": [...]} in the `bench/scaling_model.py check`
format (one row per shaped run) plus the full result, then runs
`python bench/scaling_model.py check bench/results/comm_bound.json --out
bench/results/comm_bound_scaling_check.json` (rows and verdicts; rerun it alone to re-check a
stored result). The harness is always taken down (processes by
PID, namespaces, links); Ray is stopped by PID only.

    python bench/comm_bound.py [--steps 30] [--steps-3 20] [--nodes 2 3] [--comm-share 0.97]
                               [--rate 1mbit] [--burst small|harness] [--modes-3 ...]
                               [--unshaped-modes allreduce compressed_auto]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NETNS_PY = os.path.join(REPO, "cluster", "local", "netns.py")
PROFILE = os.path.join(REPO, "jobs", "configs", "tiny.yaml")
SCALING_MODEL = os.path.join(REPO, "bench", "scaling_model.py")
RESULTS = os.path.join(REPO, "bench", "results")

SMALL_BURST = 2 * 1514          # bytes: two full Ethernet frames
SMOOTH = 3                      # trailing window of the time-to-loss comparison

# name -> (mode for the scaling model, codec, config overrides)
VARIANTS = {
    "allreduce": ("allreduce", "1bit", {}),
    "compressed_1bit": ("allreduce_compressed", "1bit",
                        {"communication.mode": "allreduce_compressed", "optimizer.params.compression.grad": "1bit"}),
    # the same without overlapping the exchange with backward (communication.overlap: false)
    "compressed_1bit_sync": ("allreduce_compressed", "1bit",
                             {"communication.mode": "allreduce_compressed", "optimizer.params.compression.grad": "1bit",
                              "communication.overlap": "false"}),
    "compressed_1bit_pure": ("allreduce_compressed", "1bit",
                             {"communication.mode": "allreduce_compressed", "optimizer.params.compression.grad": "1bit",
                              "optimizer.params.compression.keep_fp16": "[]",
                              "optimizer.params.compression.min_numel": 0}),
    "rapidfire_adamw": ("rapidfire_adamw", "1bit",
                        {"optimizer.type": "rapidfire_adamw", "optimizer.params.compression.grad": "1bit"}),
    # compression only where it pays: the measured link and codecs pick per bucket (fp16/none when fast)
    "compressed_auto": ("allreduce_compressed", "auto",
                        {"communication.mode": "allreduce_compressed", "optimizer.params.compression.grad": "auto"}),
    "compressed_fp16": ("allreduce_compressed", "fp16",
                        {"communication.mode": "allreduce_compressed", "optimizer.params.compression.grad": "fp16"}),
    # one shard per node (the default); pushes and pulls are Ray object transfers across the links
    "parameter_server": ("parameter_server", "1bit",
                         {"communication.mode": "parameter_server", "optimizer.type": "rapidfire_adamw",
                          "optimizer.params.compression.grad": "1bit", "communication.ps.max_staleness": 1}),
}
FROZEN = ("rapidfire_adamw", "parameter_server")  # variants with a full-precision warm-up (freeze_step)

T0 = time.monotonic()


def say(msg: str) -> None:
    print(f"[bench +{time.monotonic() - T0:5.0f}s] {msg}", flush=True)


def load_netns():
    spec = importlib.util.spec_from_file_location("rapidfire_netns_harness", NETNS_PY)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look the module up by name
    spec.loader.exec_module(mod)
    return mod


netns = load_netns()


# ----------------------------------------------------------------------------- the link

def shape(h, bits: int, burst: str) -> dict:
    """Shape every link of the harness at `bits`/s. `harness`: netns.py's tbf; `small`: the same
    tbf (rate, queue of `latency` 50 ms) with a SMALL_BURST bucket. Returns the tbf settings."""
    h.set_bandwidth(f"{bits}bit")  # the harness's shaping and bookkeeping (state file)
    if burst == "harness":
        return {"bucket": "harness", **netns.tbf_params(bits)}
    args = ["tbf", "rate", f"{bits}bit", "burst", str(SMALL_BURST), "latency", netns.TBF_LATENCY]
    for i, ns in enumerate(h.ns_names):
        for tc in (["tc", "qdisc", "replace", "dev", h.host_links[i]],
                   ["tc", "-n", ns, "qdisc", "replace", "dev", h.ifname]):
            subprocess.run(tc + ["root", "handle", "1:", *args], check=True, capture_output=True, text=True)
    qd = h.qdiscs()
    if len(qd) != 2 * len(h.ns_names) or not all("tbf" in v for v in qd.values()):
        raise RuntimeError(f"shaping did not take: {qd}")
    return {"bucket": "small", "rate": f"{bits}bit", "burst": str(SMALL_BURST), "latency": netns.TBF_LATENCY}


def link_bytes(h) -> list[dict]:
    """Per node: bytes out of and into it so far (the host end's counters: rx = out of the node)."""
    out = []
    for link in h.host_links:
        base = f"/sys/class/net/{link}/statistics"
        with open(f"{base}/rx_bytes") as f_rx, open(f"{base}/tx_bytes") as f_tx:
            out.append({"out": int(f_rx.read()), "in": int(f_tx.read())})
    return out


PROBE = r"""
import datetime, json, sys, time
import torch, torch.distributed as dist
rank, world, addr, numel = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://{addr}:29511", rank=rank, world_size=world,
                        timeout=datetime.timedelta(seconds=120))
def timed(n, reps):
    t = torch.ones(n); dist.all_reduce(torch.ones(1)); dist.barrier()
    out = []
    for _ in range(reps):
        dist.barrier(); t0 = time.perf_counter(); dist.all_reduce(t); out.append(time.perf_counter() - t0)
    return out
small = timed(1, 20)
big = timed(numel, 2)
if rank == 0:
    print(json.dumps({"small_s": small, "fp32_s": big}), flush=True)
dist.destroy_process_group()
"""


def probe_link(h, params: int) -> dict:
    """Raw gloo between the namespaces: latency of a 1-element allreduce and the time of an
    allreduce of the model's fp32 gradient (the bandwidth TCP actually gets through the tbf)."""
    n = len(h.ns_names)
    env = {**os.environ, **h.gloo_env, "OMP_NUM_THREADS": "1"}
    procs = [h.run(i, [sys.executable, "-c", PROBE, str(i), str(n), h.ips[0], str(params)], env=env,
                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(n)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise RuntimeError("link probe timed out")
    if any(p.returncode for p in procs):
        raise RuntimeError("link probe failed: " + " | ".join(e[-500:] for _, e in outs))
    r = json.loads(outs[0][0].strip().splitlines()[-1])
    wire = 2 * (n - 1) / n * 4 * params
    fp32 = statistics.median(r["fp32_s"])
    return {"latency_p50_s": round(statistics.median(r["small_s"]), 6), "latency_s": r["small_s"],
            "fp32_allreduce_s": [round(x, 4) for x in r["fp32_s"]], "fp32_wire_bytes": round(wire),
            "achieved_bytes_s": round(wire / fp32)}


# ----------------------------------------------------------------------------- a training run

def _cpu_ticks(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        fields = stat[stat.rindex(")") + 2:].split()
        return int(fields[11]) + int(fields[12])  # utime + stime
    except (OSError, ValueError, IndexError):
        return None


class Watch(threading.Thread):
    """While a run goes: Ray Train worker processes per namespace (max seen), the link byte
    counters over time, and the CPU time taken by processes that are not ours (other work on
    this machine competes with the workers for the same cores)."""

    def __init__(self, h):
        super().__init__(daemon=True)
        self.h = h
        self.stop = threading.Event()
        self.max_per_ns = [0] * len(h.ns_names)
        self.link = []  # (unix time, [per node {"out", "in"}])
        self.foreign: dict[int, float] = defaultdict(float)  # pid -> CPU seconds during the run
        self.names: dict[int, str] = {}
        self._prev: dict[int, int] = {}
        self._hz = os.sysconf("SC_CLK_TCK")

    def sample(self):
        self.link.append((time.time(), link_bytes(self.h)))
        ours = set(netns.pids_in_namespaces(self.h.ns_names)) | {os.getpid()}
        for i, ns in enumerate(self.h.ns_names):
            n = sum("RayTrainWorker" in netns._proc_cmdline(p) for p in netns.pids_in_namespaces([ns]))
            self.max_per_ns[i] = max(self.max_per_ns[i], n)
        now = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) not in ours:
                t = _cpu_ticks(int(entry))
                if t is not None:
                    now[int(entry)] = t
        for pid, t in now.items():
            if pid in self._prev and t > self._prev[pid]:
                self.foreign[pid] += (t - self._prev[pid]) / self._hz
                if pid not in self.names:
                    self.names[pid] = netns._proc_cmdline(pid)[:100]
        self._prev = now

    def run(self):
        self.sample()
        while not self.stop.wait(0.5):
            self.sample()
        self.sample()

    def foreign_summary(self, wall: float) -> dict:
        top = sorted(self.foreign.items(), key=lambda kv: -kv[1])[:3]
        total = sum(self.foreign.values())
        return {"cpu_s": round(total, 1), "cores_busy": round(total / wall, 2) if wall else None,
                "top": [{"cpu_s": round(c, 1), "cmd": self.names.get(p, "")} for p, c in top if c >= 0.5]}

    def link_at(self, t: float) -> list[dict]:
        """Link counters interpolated at unix time t."""
        pts = self.link
        for (t0, a), (t1, b) in zip(pts, pts[1:]):
            if t0 <= t <= t1:
                w = (t - t0) / (t1 - t0) if t1 > t0 else 0.0
                return [{k: a[i][k] + w * (b[i][k] - a[i][k]) for k in ("out", "in")} for i in range(len(a))]
        return pts[-1][1] if t > pts[-1][0] else pts[0][1]


def foreign_load(h, seconds: float = 3.0) -> float:
    """Cores' worth of CPU used by processes that are not ours over `seconds`."""
    w = Watch(h)
    w.sample()
    time.sleep(seconds)
    w.sample()
    return sum(w.foreign.values()) / seconds


def wait_quiet(h, limit: float, max_wait: float) -> dict:
    """Wait (up to max_wait s) until other work on this machine uses at most `limit` cores: the
    workers share its cores with everything else, so a busy machine inflates compute times."""
    t0 = time.monotonic()
    load = foreign_load(h)
    said = False
    while load > limit and time.monotonic() - t0 < max_wait:
        if not said:
            say(f"  waiting for a quiet machine: other processes use {load:.2f} cores (limit {limit})")
            said = True
        time.sleep(15)
        load = foreign_load(h)
    return {"waited_s": round(time.monotonic() - t0, 1), "foreign_cores_before": round(load, 2)}


def train(h, address: str, out_root: str, name: str, nodes: int, steps: int, overrides: dict,
          timeout: float, quiet: tuple[float, float] | None = None) -> dict:
    """One `rapidfire train` inside namespace 0 (after waiting for a quiet machine, and once more
    when other work used more than the limit during the run); returns its summary, records, facts."""
    if quiet is None:
        return _train(h, address, out_root, name, nodes, steps, overrides, timeout)
    limit, max_wait = quiet
    gate = wait_quiet(h, limit, max_wait)
    run = _train(h, address, out_root, name, nodes, steps, overrides, timeout)
    run["quiet_gate"] = gate
    busy = run["foreign_cpu"]["cores_busy"] or 0.0
    if run["returncode"] == 0 and busy > limit:
        say(f"  other processes used {busy} cores during {name}; running it again")
        gate = wait_quiet(h, limit, max_wait)
        again = _train(h, address, out_root, name + "-again", nodes, steps, overrides, timeout)
        again["quiet_gate"] = gate
        if again["returncode"] == 0 and (again["foreign_cpu"]["cores_busy"] or 0.0) < busy:
            again["disturbed_first_try"] = {"foreign_cpu": run["foreign_cpu"]}
            run = again
    return run


def _train(h, address: str, out_root: str, name: str, nodes: int, steps: int, overrides: dict,
           timeout: float) -> dict:
    """One `rapidfire train` inside namespace 0; returns its summary, step records and facts."""
    sets = {"run.name": name, "run.output_dir": out_root, "train.max_steps": steps, "scaling.num_workers": nodes,
            "scaling.placement": "SPREAD", "scaling.cpus_per_worker": 1, "checkpoint.every_steps": 0,
            "train.log_every_steps": 1, **overrides}
    argv = [sys.executable, "-m", "rapidfire_ray", "train", "--profile", PROFILE, "--address", address,
            *(f"{k}={v}" for k, v in sets.items())]
    command = ("ip netns exec " + h.ns_names[0] + " env RAY_AUTH_MODE=token GLOO_SOCKET_IFNAME=eth0 "
               + " ".join(["python", *argv[1:]]).replace(REPO + "/", ""))
    log_path = os.path.join(out_root, f"{name}.log")
    env = netns.ray_env({**h.gloo_env, "RAY_TRAIN_ENABLE_PRINT_PATCH": "0", "TOKENIZERS_PARALLELISM": "false"})
    before = link_bytes(h)
    watch = Watch(h)
    watch.start()
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = h.run(0, argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
            rc = f"timeout after {timeout:.0f} s"
    wall = time.monotonic() - t0
    watch.stop.set()
    watch.join()
    after = link_bytes(h)
    with open(log_path, encoding="utf-8", errors="replace") as f:
        log_text = f.read()
    run_dir = os.path.join(out_root, name)
    out = {"name": name, "command": command, "returncode": rc, "wall_s": round(wall, 1),
           "train_workers_per_namespace": watch.max_per_ns, "foreign_cpu": watch.foreign_summary(wall),
           "loadavg_after": open("/proc/loadavg").read().split()[:3],
           "link_bytes": [{"out": a["out"] - b["out"], "in": a["in"] - b["in"]} for a, b in zip(after, before)],
           "log_warnings": [line for line in log_text.splitlines()
                            if any(w in line for w in ("Warning", "WARNING", "Error", "ERROR", "error:"))][:20]}
    if rc != 0:
        out["log_tail"] = log_text[-4000:]
        return out
    with open(os.path.join(run_dir, "run_summary.json"), encoding="utf-8") as f:
        out["summary"] = json.load(f)
    with open(os.path.join(run_dir, "steps.jsonl"), encoding="utf-8") as f:
        out["records"] = [json.loads(line) for line in f]
    out["watch"] = watch
    return out


def measure(run: dict, warmup: int, freeze: int | None = None) -> dict:
    """Step-time statistics of a finished run (steps after `warmup`)."""
    by_step = defaultdict(list)
    for r in run["records"]:
        by_step[r["step"]].append(r)
    per_step = []
    for s in sorted(by_step):
        rs = by_step[s]
        ph = [r["phases"] for r in rs]
        per_step.append({
            "step": s,
            "step_s": statistics.mean(p["step"] for p in ph),
            # Exchange time as the product measures it (gradient hook / optimizer exchange, wall
            # time including encode/decode), averaged over ranks. The ranks' step boundaries are
            # not aligned (a rank that leaves the exchange first waits for the others in the next
            # small collective, which lands in "other"), so a per-step minimum over ranks would
            # undercount; the mean over ranks and steps does not.
            "comm_s": statistics.mean(p["communication"] for p in ph),
            "comm_min_rank_s": min(p["communication"] for p in ph),
            "other_s": statistics.mean(p["other"] for p in ph),
            "data_wait_s": statistics.mean(p["data_wait"] for p in ph),
            "bytes_sent": statistics.mean(r.get("bytes_sent", 0) for r in rs),
            "fp32_bytes": statistics.mean(r.get("bytes_sent", 0) * r.get("compression_ratio", 1.0) for r in rs),
            "comm_calls": statistics.mean(r.get("comm_calls", 0) for r in rs),
            # in flight, hidden part included (comm_s is the exposed part)
            "in_flight_s": statistics.mean(r.get("comm_in_flight_s", p["communication"]) for r, p in zip(rs, ph)),
        })

    def stats(rows: list[dict]) -> dict | None:
        if not rows:
            return None
        step = statistics.mean(r["step_s"] for r in rows)
        comm = statistics.mean(r["comm_s"] for r in rows)
        in_flight = statistics.mean(r["in_flight_s"] for r in rows)
        sent = statistics.mean(r["bytes_sent"] for r in rows)
        fp32 = statistics.mean(r["fp32_bytes"] for r in rows)
        return {"steps": len(rows), "step_s": round(step, 4), "step_median_s": round(statistics.median(r["step_s"] for r in rows), 4),
                "step_stdev_s": round(statistics.stdev(r["step_s"] for r in rows), 4) if len(rows) > 1 else 0.0,
                "comm_s": round(comm, 4), "comm_min_rank_s": round(statistics.mean(r["comm_min_rank_s"] for r in rows), 4),
                "other_s": round(statistics.mean(r["other_s"] for r in rows), 4),
                "non_comm_s": round(step - comm, 4), "comm_share": round(comm / step, 4),
                "data_wait_share": round(statistics.mean(r["data_wait_s"] for r in rows) / step, 4),
                "bytes_sent_per_step": round(sent), "compression_ratio": round(fp32 / sent, 3) if sent else None,
                "comm_calls_per_step": round(statistics.mean(r["comm_calls"] for r in rows), 2),
                "in_flight_s": round(in_flight, 4),
                "hidden_share": round(max(0.0, 1 - comm / in_flight), 4) if in_flight else None}

    measured = [r for r in per_step if r["step"] > warmup]
    out = {"measured": stats(measured)}
    if freeze is not None:
        out["warmup_stage"] = stats([r for r in measured if r["step"] <= freeze])
        out["compressed_stage"] = stats([r for r in measured if r["step"] > freeze])
    s = run["summary"]
    steps = s["steps"]
    ends = defaultdict(list)
    for r in run["records"]:
        ends[r["step"]].append(r["time"])
    if warmup in ends and steps in ends and steps > warmup:
        a, b = run["watch"].link_at(max(ends[warmup])), run["watch"].link_at(max(ends[steps]))
        out["link_bytes_per_measured_step"] = [{k: round((y[k] - x[k]) / (steps - warmup)) for k in ("out", "in")}
                                               for x, y in zip(a, b)]
    out.update({
        "per_step": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for r in per_step],
        "losses": [h["loss"] for h in s["loss_history"]],
        "final_loss": s["final_loss"], "communication": s["communication"], "time_breakdown": s["time_breakdown"],
        "train_time_s": s["train_time_s"], "wall_time_s": s["wall_time_s"], "steps_run": steps,
        "link_bytes_whole_run": run["link_bytes"],
        "foreign_cpu": run["foreign_cpu"],
    })
    return out


# ----------------------------------------------------------------------------- comparisons

def trailing(losses: list[float], w: int = SMOOTH) -> list[float]:
    return [statistics.mean(losses[max(0, i - w + 1):i + 1]) for i in range(len(losses))]


def time_to_loss(results: dict) -> dict:
    """First step (1-based) whose trailing-mean loss is <= a target, for every run, times its
    mean step time (and the measured cumulative time of those steps, warm-up included)."""
    smooth = {k: trailing(v["losses"]) for k, v in results.items()}
    target, rule = smooth["allreduce"][-1], f"allreduce run's final {SMOOTH}-step trailing mean loss"
    if any(min(s) > target for s in smooth.values()):
        target = max(min(s) for s in smooth.values())
        rule = f"lowest {SMOOTH}-step trailing mean loss every run reaches (not all reach the allreduce final loss)"
    out = {"target_loss": round(target, 4), "rule": rule, "runs": {}}
    base = None
    for k, s in smooth.items():
        step = next(i + 1 for i, v in enumerate(s) if v <= target + 1e-12)
        mean_step = results[k]["measured"]["step_s"]
        cumulative = sum(r["step_s"] for r in results[k]["per_step"] if r["step"] <= step)
        out["runs"][k] = {"step": step, "time_s": round(step * mean_step, 3), "cumulative_s": round(cumulative, 3)}
        if k == "allreduce":
            base = out["runs"][k]
    for k, r in out["runs"].items():
        r["speedup_vs_allreduce"] = round(base["time_s"] / r["time_s"], 2)
        r["cumulative_speedup_vs_allreduce"] = round(base["cumulative_s"] / r["cumulative_s"], 2)
    return out


def amdahl(results: dict, compute_s: float) -> dict:
    """Speed-up of each compressed mode over allreduce against the Amdahl limit. Compute: the
    step on unshaped links (`compute_s`, the calibration run); communication: the rest of the
    allreduce step (everything the link adds). The hook-measured exchange share is reported too:
    it leaves out the waits the slow link causes outside the hook (see `measure`)."""
    ar = results["allreduce"]["measured"]
    compute_share = compute_s / ar["step_s"]
    comm_share = 1 - compute_share
    out = {"allreduce_step_s": ar["step_s"], "compute_s": compute_s, "comm_s": round(ar["step_s"] - compute_s, 4),
           "compute_share": round(compute_share, 4), "comm_share": round(comm_share, 4),
           "hook_measured_comm_s": ar["comm_s"], "hook_measured_comm_share": ar["comm_share"], "modes": {}}
    for k, v in results.items():
        if k == "allreduce":
            continue
        stages = [("measured", v["measured"])]
        if v.get("compressed_stage"):
            stages.append(("compressed_stage", v["compressed_stage"]))
        for stage, m in stages:
            ratio = ar["bytes_sent_per_step"] / m["bytes_sent_per_step"]
            limit = 1 / (compute_share + comm_share / ratio)
            speedup = ar["step_s"] / m["step_s"]
            out["modes"][k if stage == "measured" else f"{k} (compressed stage only)"] = {
                "step_s": m["step_s"], "speedup": round(speedup, 2), "byte_ratio": round(ratio, 2),
                "amdahl_limit": round(limit, 2), "fraction_of_limit": round(speedup / limit, 3),
                "meets_10x": speedup >= 10, "meets_80pct_of_limit": speedup / limit >= 0.8}
    return out


# ----------------------------------------------------------------------------- main

def rate_for(compute_s: float, params: int, share: float, nodes: int) -> int:
    """tbf rate (bits/s) at which the fp32 exchange takes `share` of the step."""
    comm_s = compute_s * share / (1 - share)
    wire = 2 * (nodes - 1) / nodes * 4 * params
    return int(round(8 * wire / comm_s / 1000)) * 1000


def run_node_count(args, nodes: int, steps: int, variants: list[str], params: int, bits: int | None,
                   prefix: str, subnet: str, work: str) -> dict:
    out = {"nodes": nodes, "steps": steps, "runs": {}, "raw": {}}
    temp_root = tempfile.mkdtemp(prefix="rfb", dir="/tmp")  # short: Ray's socket paths live under it
    h = None
    try:
        say(f"{nodes} nodes: harness up (prefix {prefix}, subnet {subnet}), Ray with {args.node_cpus} CPU(s) per node")
        h = netns.up(nodes, None, prefix=prefix, subnet=subnet)
        address = netns.start_ray(h, temp_root, num_cpus=args.node_cpus)
        out["ray_address"] = address
        timeout = args.run_timeout

        say(f"{nodes} nodes: calibration run, links unshaped ({args.calib_steps} steps, allreduce)")
        quiet = (args.quiet_limit, args.quiet_wait)
        calib = train(h, address, work, f"calib-n{nodes}", nodes, args.calib_steps, {}, timeout, quiet)
        out["raw"]["calibration"] = {k: v for k, v in calib.items() if k not in ("records", "summary", "watch")}
        if calib["returncode"] != 0:
            raise RuntimeError(f"calibration run failed ({calib['returncode']}):\n{calib['log_tail']}")
        cal = measure(calib, args.warmup)
        out["calibration"] = cal
        compute_s = cal["measured"]["non_comm_s"]
        say(f"  unshaped: step {cal['measured']['step_s']:.3f} s, exchange {cal['measured']['comm_s']:.4f} s -> "
            f"compute {compute_s:.3f} s; workers per namespace {calib['train_workers_per_namespace']}")
        out["compute_s"] = round(compute_s, 4)
        quiet_runs = quiet
        for v in args.unshaped_modes:
            say(f"{nodes} nodes: {v} on the unshaped links ({steps} steps)")
            run = train(h, address, work, f"{v}-unshaped-n{nodes}", nodes, steps, dict(VARIANTS[v][2]), timeout,
                        quiet_runs)
            if run["returncode"] != 0:
                say(f"  FAILED ({run['returncode']}); log tail:\n{run['log_tail'][-1500:]}")
                continue
            m = measure(run, args.warmup)
            m["command"] = run["command"]
            out.setdefault("unshaped_runs", {})[v] = m
            say(f"  step {m['measured']['step_s']:.4f} s (median {m['measured']['step_median_s']:.4f}, exchange "
                f"{m['measured']['comm_s']:.4f} s), {m['measured']['bytes_sent_per_step']} B/step, "
                f"auto: {auto_codecs(run)}")
        if bits is None:
            bits = rate_for(compute_s, params, args.comm_share, nodes)
            say(f"  rate for a {args.comm_share:.0%} fp32 exchange share: {bits / 1e6:.3f} Mbit/s")
        out["rate_bits_s"] = bits
        out["shaping"] = shape(h, bits, args.burst)
        out["qdiscs"] = h.qdiscs()
        mtu = json.loads(subprocess.run(["ip", "-n", h.ns_names[0], "-j", "link", "show", h.ifname], check=True,
                                        capture_output=True, text=True).stdout)[0]["mtu"]
        out["mtu"] = mtu
        wait_quiet(h, args.quiet_limit, args.quiet_wait)
        out["link_probe"] = probe_link(h, params)
        say(f"  shaped link probe: 1-element allreduce p50 {out['link_probe']['latency_p50_s'] * 1e3:.2f} ms, fp32 "
            f"gradient allreduce {out['link_probe']['fp32_allreduce_s']} s -> "
            f"{out['link_probe']['achieved_bytes_s'] * 8 / 1e6:.3f} Mbit/s achieved")

        freeze = max(1, steps // 5)
        for v in variants:
            overrides = dict(VARIANTS[v][2])
            if v in FROZEN:
                overrides["optimizer.params.freeze_step"] = freeze
            say(f"{nodes} nodes: {v} ({steps} steps, {bits / 1e6:.3f} Mbit/s)")
            run = train(h, address, work, f"{v}-n{nodes}", nodes, steps, overrides, timeout, quiet)
            out["raw"][v] = {k: val for k, val in run.items() if k not in ("records", "summary", "watch")}
            if run["returncode"] != 0:
                say(f"  FAILED ({run['returncode']}); log tail:\n{run['log_tail'][-1500:]}")
                continue
            m = measure(run, args.warmup, freeze if v in FROZEN else None)
            m["command"] = run["command"]
            m["train_workers_per_namespace"] = run["train_workers_per_namespace"]
            if v in FROZEN:
                m["freeze_step"] = freeze
            out["runs"][v] = m
            mm = m["measured"]
            if v == "compressed_auto":
                m["auto_codecs"] = auto_codecs(run)
            hidden = f", {mm['hidden_share']:.0%} of {mm['in_flight_s']:.3f} s in flight hidden" if mm["hidden_share"] else ""
            say(f"  step {mm['step_s']:.3f} s (exchange {mm['comm_s']:.3f} s, {mm['comm_share']:.1%}{hidden}), "
                f"{mm['bytes_sent_per_step']} B/step sent (ratio {mm['compression_ratio']}), final loss "
                f"{m['final_loss']}, workers per namespace {run['train_workers_per_namespace']}, wall {run['wall_s']} s, "
                f"other CPU load {run['foreign_cpu']['cores_busy']} cores")
        if args.harness_burst_check and nodes == args.nodes[0] and args.burst == "small":
            # The same pure 1-bit run on netns.py's own tbf (64 KiB bucket): how much of the
            # exchange the bucket hides at this rate.
            out["harness_burst_check"] = {"shaping": shape(h, bits, "harness")}
            say(f"{nodes} nodes: compressed_1bit_pure again on the harness's own tbf (64 KiB burst)")
            run = train(h, address, work, f"compressed_1bit_pure-harness-burst-n{nodes}", nodes, steps,
                        dict(VARIANTS["compressed_1bit_pure"][2]), timeout, quiet)
            if run["returncode"] == 0:
                m = measure(run, args.warmup)
                out["harness_burst_check"].update({"command": run["command"], "measured": m["measured"],
                                                   "foreign_cpu": m["foreign_cpu"]})
                say(f"  step {m['measured']['step_s']:.3f} s (exchange {m['measured']['comm_s']:.4f} s); "
                    f"other CPU load {m['foreign_cpu']['cores_busy']} cores")
            else:
                out["harness_burst_check"]["error"] = run.get("log_tail", "")[-1500:]
        if "allreduce" in out["runs"]:
            out["amdahl"] = amdahl(out["runs"], out["compute_s"])
            out["time_to_loss"] = time_to_loss(out["runs"])
    finally:
        if h is not None:
            with_ray = netns.stop_ray(h)
            say(f"{nodes} nodes: stopped {len(with_ray)} Ray processes by PID")
        removed = netns.down(prefix)
        say(f"{nodes} nodes: harness down ({len(removed['pids'])} stray processes stopped, "
            f"namespaces {removed['namespaces']})")
        shutil.rmtree(temp_root, ignore_errors=True)
    return out


def auto_codecs(run: dict) -> dict | None:
    """What `auto` chose in a run: the summary's decisions (codec per bucket) and rank 0's last
    tensors-per-codec count."""
    auto = (run.get("summary") or {}).get("communication", {}).get("auto")
    if not auto:
        return None
    last = [r for r in run.get("records", []) if r["rank"] == 0 and "auto_codecs" in r]
    return {"buckets": {str(d["bucket"]): d["codec"] for d in auto["decisions"]},
            "tensors_per_codec": last[-1]["auto_codecs"] if last else None,
            "measured_link": [m.get("link") for m in auto["measurements"]]}


def auto_targets(node_results: list[dict]) -> dict:
    """Issue 19's auto targets: on the unshaped link within 3% of plain allreduce, on the shaped
    one within 10% of the best fixed codec (mean step time after the warm-up, same run order)."""
    out = {}
    for nr in node_results:
        t = {}
        fast = nr.get("unshaped_runs", {})
        if "allreduce" in fast and "compressed_auto" in fast:
            ratio = fast["compressed_auto"]["measured"]["step_s"] / fast["allreduce"]["measured"]["step_s"]
            median = fast["compressed_auto"]["measured"]["step_median_s"] / fast["allreduce"]["measured"]["step_median_s"]
            t["unshaped"] = {"auto_over_allreduce": round(ratio, 4), "median_auto_over_allreduce": round(median, 4),
                             "target": "<= 1.03", "met": ratio <= 1.03}
        slow = nr["runs"]
        fixed = {v: m["measured"]["step_s"] for v, m in slow.items() if v not in ("compressed_auto",) + FROZEN}
        if "compressed_auto" in slow and fixed:
            best = min(fixed, key=fixed.get)
            ratio = slow["compressed_auto"]["measured"]["step_s"] / fixed[best]
            t["shaped"] = {"best_fixed": best, "best_fixed_step_s": fixed[best],
                           "auto_step_s": slow["compressed_auto"]["measured"]["step_s"],
                           "auto_over_best_fixed": round(ratio, 4), "target": "<= 1.10", "met": ratio <= 1.10,
                           "fp32_exchange_share": (nr.get("amdahl") or {}).get("comm_share")}
        if t:
            out[f"{nr['nodes']}_nodes"] = t
    return out


def codec_params(keep_default: bool) -> dict[str, int]:
    """Gradient elements per wire codec of tiny-random under the 1bit policy: the default
    per-layer rules (keep_fp16 patterns, min_numel 4096), or none (pure 1bit)."""
    import torch

    from rapidfire_ray.exchange.policy import CompressionPolicy
    from rapidfire_ray.models import load_model

    policy = CompressionPolicy("1bit") if keep_default else CompressionPolicy("1bit", keep_fp16=[], min_numel=0)
    out: dict[str, int] = defaultdict(int)
    for name, p in load_model("tiny-random", dtype=torch.float32).named_parameters():
        out[policy.rule(name, p.numel())] += p.numel()
    return dict(out)


def targets(node_results: list[dict]) -> dict:
    """The issue's targets, per node count, as measured."""
    out = {}
    for nr in node_results:
        a, runs = nr.get("amdahl"), nr["runs"]
        if not a:
            continue
        t = {"fp32_exchange_share_of_step": {"link_attributable": a["comm_share"], "hook_measured": a["hook_measured_comm_share"],
                                             "target": ">= 0.90"}}
        for k, v in a["modes"].items():
            t[k] = {"speedup": v["speedup"], "target_speedup": ">= 10x", "fraction_of_amdahl_limit": v["fraction_of_limit"],
                    "target_fraction": ">= 0.80"}
        if "compressed_1bit_pure" in runs:
            ratio = runs["allreduce"]["measured"]["bytes_sent_per_step"] / runs["compressed_1bit_pure"]["measured"]["bytes_sent_per_step"]
            t["pure_1bit_bytes_ratio"] = {"value": round(ratio, 2), "target": ">= 30x"}
        out[f"{nr['nodes']}_nodes"] = t
    return out


def tcp_overhead(mtu: int) -> float:
    spec = importlib.util.spec_from_file_location("scaling_model", SCALING_MODEL)
    sm = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = sm  # dataclasses look the module up by name
    spec.loader.exec_module(sm)
    return sm.tcp_wire_overhead(mtu)


def model_rows(node_results: list[dict], params: int, codec_gbps: float) -> list[dict]:
    """The shaped runs in `bench/scaling_model.py check` format."""
    split = {"compressed_1bit": codec_params(True), "compressed_1bit_sync": codec_params(True)}
    rows = []
    for nr in node_results:
        for v, m in nr["runs"].items():
            mode, codec, _ = VARIANTS[v]
            if mode not in ("allreduce", "allreduce_compressed", "rapidfire_adamw") or codec in ("auto", "fp16"):
                continue  # the scaling model has no parameter-server mode; auto and all-fp16: not in its check
            warmup = 0.0
            if v == "rapidfire_adamw":
                # the measured mean covers steps warmup+1..steps; freeze_step of them are fp32
                measured_steps = m["measured"]["steps"]
                warmup = round(m["warmup_stage"]["steps"] / measured_steps, 4) if m["warmup_stage"] else 0.0
            rows.append({"mode": mode, "variant": v, "nodes": nr["nodes"], "params": params,
                         "compute_s": nr["compute_s"], "bandwidth_bytes_s": nr["rate_bits_s"] / 8,
                         "latency_s": nr["link_probe"]["latency_p50_s"], "wire_overhead": round(tcp_overhead(nr["mtu"]), 4),
                         "step_s": m["measured"]["step_s"],
                         "codec": codec, "warmup_share": warmup, "codec_gbps": codec_gbps})
            if v in split:  # the per-layer policy: some tensors go as fp16 (scaling_model.py: codec_params)
                rows[-1]["codec_params"] = split[v]
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30, help="steps per run at the first node count")
    p.add_argument("--steps-3", type=int, default=20, help="steps per run at later node counts")
    p.add_argument("--calib-steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of step-time means")
    p.add_argument("--nodes", type=int, nargs="+", default=[2, 3])
    p.add_argument("--comm-share", type=float, default=0.97, help="fp32 exchange share of the step to aim for")
    p.add_argument("--rate", default=None, help="tbf rate (tc units, e.g. 1mbit) instead of choosing it")
    p.add_argument("--burst", choices=("small", "harness"), default="small")
    p.add_argument("--modes", nargs="+", default=["allreduce", "compressed_1bit", "compressed_1bit_pure",
                                                  "rapidfire_adamw", "compressed_auto"],
                   choices=list(VARIANTS))
    p.add_argument("--modes-3", nargs="+", default=["allreduce", "compressed_1bit_pure", "rapidfire_adamw"],
                   choices=list(VARIANTS))
    p.add_argument("--no-harness-burst-check", dest="harness_burst_check", action="store_false",
                   help="skip the pure 1-bit rerun on netns.py's own 64 KiB-burst tbf")
    p.add_argument("--unshaped-modes", nargs="*", default=[],
                   help="variants also run on the unshaped links after the calibration (e.g. allreduce compressed_auto)")
    p.add_argument("--codec-gbps", type=float, default=0.25, help="1-bit encode+decode GB/s (bench/codecs.py)")
    p.add_argument("--node-cpus", type=int, default=2,
                   help="CPUs each Ray node offers; 1 (the worker's own) deadlocks the data sharding (see the docstring)")
    p.add_argument("--quiet-limit", type=float, default=0.3,
                   help="cores other processes may use: wait for that before each run, rerun a run once if exceeded")
    p.add_argument("--quiet-wait", type=float, default=600, help="longest wait for a quiet machine, seconds")
    p.add_argument("--prefix", default="rfb")
    p.add_argument("--subnet", default="10.78.31.0/24")
    p.add_argument("--run-timeout", type=float, default=420)
    p.add_argument("--out", default=os.path.join(RESULTS, "comm_bound.json"))
    p.add_argument("--check-out", default=os.path.join(RESULTS, "comm_bound_scaling_check.json"))
    args = p.parse_args()
    if "parameter_server" in args.modes + args.modes_3 and args.node_cpus < 3:
        # the worker (1 CPU) and its node's shard (0.25) leave Ray Data's 1-CPU split tasks no room: the run hangs
        sys.exit("comm_bound: --modes parameter_server needs --node-cpus 3 (a node runs a worker and a shard "
                 "besides Ray Data's 1-CPU tasks)")
    reason = netns.preflight()
    if reason:
        sys.exit(f"comm_bound: {reason}")

    sys.path.insert(0, REPO)
    from rapidfire_ray.models import model_num_parameters

    params = model_num_parameters("tiny-random")
    say(f"tiny-random: {params} parameters, fp32 gradient {4 * params} bytes")
    bits = netns.parse_rate(args.rate) if args.rate else None
    work = tempfile.mkdtemp(prefix="rfb-out-", dir="/tmp")
    node_results = []
    try:
        for k, nodes in enumerate(args.nodes):
            steps = args.steps if k == 0 else args.steps_3
            variants = args.modes if k == 0 else args.modes_3
            nr = run_node_count(args, nodes, steps, variants, params, bits, args.prefix, args.subnet, work)
            bits = nr["rate_bits_s"]  # the same link for every node count
            node_results.append(nr)
    finally:
        left = {"netns": subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.strip(),
                "links": [l for l in subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout.split("\n")
                          if l.startswith(args.prefix + "-")],
                "processes": [int(q) for q in os.listdir("/proc") if q.isdigit() and netns._proc_starttime(int(q))
                              and ("/tmp/rfb" in netns._proc_cmdline(int(q)) or "rfb-out-" in netns._proc_cmdline(int(q)))
                              and int(q) != os.getpid()]}
        shutil.rmtree(work, ignore_errors=True)
        say(f"left behind: namespaces {left['netns'] or 'none'}, links {left['links'] or 'none'}")

    rows = model_rows(node_results, params, args.codec_gbps)
    result = {
        "benchmark": "comm_bound", "date": time.strftime("%Y-%m-%d"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0],
                    "note": f"all namespaces (Ray nodes) share these {os.cpu_count()} cores; each Ray node offers "
                            f"{args.node_cpus} CPU(s) to Ray, each training worker takes 1"},
        "settings": vars(args) | {"params": params, "fp32_gradient_bytes": 4 * params},
        "runs": rows,
        "targets": targets(node_results),
        "auto_targets": auto_targets(node_results),
        "node_counts": node_results,
        "left_behind": left,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".tmp", "w") as f:
        json.dump(result, f, indent=2)
    os.replace(args.out + ".tmp", args.out)
    say(f"wrote {args.out}")
    for nr in node_results:
        a = nr.get("amdahl")
        if a:
            say(f"{nr['nodes']} nodes: allreduce step {a['allreduce_step_s']} s; compute (unshaped) {a['compute_s']} s; "
                f"link share {a['comm_share']:.1%} (hook-measured exchange {a['hook_measured_comm_share']:.1%})")
            for k, v in a["modes"].items():
                say(f"  {k}: {v['step_s']} s/step, speedup {v['speedup']}x, bytes {v['byte_ratio']}x, Amdahl limit "
                    f"{v['amdahl_limit']}x, {v['fraction_of_limit']:.0%} of it")
        t = nr.get("time_to_loss")
        if t:
            say(f"  time to loss {t['target_loss']} ({t['rule']}): " + ", ".join(
                f"{k} step {v['step']} {v['time_s']} s ({v['speedup_vs_allreduce']}x)" for k, v in t["runs"].items()))

    for key, t in result["auto_targets"].items():
        if "unshaped" in t:
            u = t["unshaped"]
            say(f"{key}, unshaped: auto / allreduce step {u['auto_over_allreduce']} (median "
                f"{u['median_auto_over_allreduce']}), target {u['target']}: {'met' if u['met'] else 'NOT met'}")
        if "shaped" in t:
            u = t["shaped"]
            say(f"{key}, shaped: auto {u['auto_step_s']} s / best fixed ({u['best_fixed']}) {u['best_fixed_step_s']} s "
                f"= {u['auto_over_best_fixed']}, target {u['target']}: {'met' if u['met'] else 'NOT met'}")

    cmd = [sys.executable, SCALING_MODEL, "check", args.out, "--out", args.check_out]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    print(proc.stdout, proc.stderr, sep="", flush=True)
    if proc.returncode != 0:
        raise SystemExit(f"bench/scaling_model.py check failed (exit {proc.returncode}); {args.out} is kept")
    with open(args.check_out, encoding="utf-8") as f:
        check = json.load(f)
    say(f"wrote {args.check_out} (all within 20%: formula {check['within_tolerance']}, "
        f"roofline {check['within_tolerance_roofline']})")


if __name__ == "__main__":
    main()
