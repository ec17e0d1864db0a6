"""Run metrics on Ray's metrics endpoint (`ray.util.metrics`), for the Ray dashboard,
Prometheus and Grafana.

Every Ray Train worker records its own numbers at log steps (`train.log_every_steps`) from the
same step records the progress board and `run_summary.json` use (`WorkerMetrics`); parameter-
server shard actors record theirs as they apply updates (`ShardMetrics`); the run's control
actor counts its knob changes (`count_adjustment`); an experiment's controller actor records each
config's latest numbers whenever the driver publishes the leaderboard (`record_experiment`). Ray exports a metric named `rapidfire_x`
as `ray_rapidfire_x` (counters: `ray_rapidfire_x_total`), with our labels plus Ray's own
(`SessionName`, `NodeAddress`, `Component`, `Version`, ...), on every node's metrics export port
(`ray.nodes()[i]["MetricsExportPort"]`), about `metrics_report_interval_ms` (default 10 s)
after they are recorded. A gauge keeps its last value on the endpoint while its process lives
(set again every report interval); a process that ended loses its series two intervals later.

`METRICS` is the catalogue: the README's table, the Grafana dashboard and the tests come from it.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

from .rules import knob_gauge

WORKER_LABELS = ("run", "rank", "node")
SHARD_LABELS = ("run", "shard", "node")
EXPERIMENT_LABELS = ("experiment", "config")
STEP_SECONDS_BOUNDARIES = [0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
STALENESS_BOUNDARIES = [0.5, 1.5, 2.5, 3.5, 4.5, 8.5, 16.5]  # histogram buckets at integers 0, 1, 2, ...


@dataclass(frozen=True)
class Metric:
    name: str  # as recorded; Prometheus sees "ray_" + name (+ "_total" for counters)
    kind: str  # gauge | counter | histogram
    labels: tuple[str, ...]
    doc: str
    boundaries: tuple[float, ...] = ()

    @property
    def exported(self) -> str:
        """The name on the metrics endpoint (histograms add _bucket, _count and _sum to it)."""
        return f"ray_{self.name}" + ("_total" if self.kind == "counter" else "")


METRICS = (
    Metric("rapidfire_loss", "gauge", WORKER_LABELS, "training loss at the last log step"),
    Metric("rapidfire_learning_rate", "gauge", WORKER_LABELS, "learning rate at the last log step"),
    Metric("rapidfire_rl_reward", "gauge", WORKER_LABELS,
           "RL runs: mean reward of the last step's completions (over all ranks)"),
    Metric("rapidfire_rl_kl", "gauge", WORKER_LABELS, "RL runs: mean KL to the reference policy at the last step"),
    Metric("rapidfire_tokens_per_second", "gauge", WORKER_LABELS,
           "real (non-padding) tokens per second of this worker over the steps since the last log step"),
    Metric("rapidfire_step_phase_seconds", "gauge", WORKER_LABELS + ("phase",),
           "seconds per step in each phase (data_wait, forward, backward, optimizer, communication, other; "
           "step = wall time), mean over the steps since the last log step"),
    Metric("rapidfire_step_seconds", "histogram", WORKER_LABELS, "wall seconds per optimizer step",
           tuple(STEP_SECONDS_BOUNDARIES)),
    Metric("rapidfire_steps", "counter", WORKER_LABELS, "optimizer steps taken"),
    Metric("rapidfire_tokens", "counter", WORKER_LABELS, "real tokens trained on"),
    Metric("rapidfire_comm_latency_p50_seconds", "gauge", WORKER_LABELS,
           "median latency of one gradient exchange call (compressed allreduce, DDP bucket, PS push/pull) "
           "in the last logged step"),
    Metric("rapidfire_comm_latency_p99_seconds", "gauge", WORKER_LABELS,
           "99th-percentile latency of one gradient exchange call in the last logged step"),
    Metric("rapidfire_comm_bytes_sent", "counter", WORKER_LABELS, "gradient bytes this worker sent"),
    Metric("rapidfire_comm_bytes_received", "counter", WORKER_LABELS, "gradient bytes this worker received"),
    Metric("rapidfire_compression_ratio", "gauge", WORKER_LABELS,
           "fp32 ring-allreduce bytes / bytes actually sent, last logged step (1: uncompressed)"),
    Metric("rapidfire_ps_staleness", "gauge", WORKER_LABELS,
           "parameter_server: staleness (versions) of this worker's last applied push"),
    Metric("rapidfire_batch_rows", "gauge", WORKER_LABELS, "rows in this worker's last step (dynamic batch size)"),
    Metric("rapidfire_padding_fraction", "gauge", WORKER_LABELS,
           "padding tokens / all tokens computed on, steps since the last log step"),
    Metric("rapidfire_memory_bytes", "gauge", WORKER_LABELS,
           "accelerator memory allocated now (GPU); resident set size of the worker process (CPU)"),
    Metric("rapidfire_memory_peak_bytes", "gauge", WORKER_LABELS,
           "peak accelerator memory (GPU); peak resident set size of the worker process (CPU)"),
    Metric("rapidfire_utilization", "gauge", WORKER_LABELS + ("device",),
           "busy share 0..1: GPU utilisation from NVML where available (device=cuda); on CPU the process's CPU "
           "time / (wall time x its torch threads) since the last log step (device=cpu)"),
    Metric("rapidfire_knob", "gauge", WORKER_LABELS + ("knob",),
           "the value this worker runs with for each adjustable knob (rapidfire monitor, monitor.allowed); "
           "null = -1, the gradient codec as 0-3 (none, fp16, 2bit, 1bit)"),
    Metric("rapidfire_adjustments", "counter", ("run", "knob"),
           "knob changes published by the run's control actor (rules or rapidfire monitor --set)"),
    Metric("rapidfire_ps_shard_version", "gauge", SHARD_LABELS, "parameter_server: updates the shard has applied"),
    Metric("rapidfire_ps_shard_updates", "counter", SHARD_LABELS, "parameter_server: updates applied by the shard"),
    Metric("rapidfire_ps_shard_staleness", "histogram", SHARD_LABELS,
           "parameter_server: staleness (versions) of each update the shard applied", tuple(STALENESS_BOUNDARIES)),
    Metric("rapidfire_experiment_score", "gauge", EXPERIMENT_LABELS,
           "experiments: the config's held-out metric (experiment.metric) after its last trained chunk"),
    Metric("rapidfire_experiment_train_loss", "gauge", EXPERIMENT_LABELS,
           "experiments: the config's training loss over its last trained chunk"),
    Metric("rapidfire_experiment_chunks_done", "gauge", EXPERIMENT_LABELS,
           "experiments: chunks the config has trained"),
)
BY_NAME = {m.name: m for m in METRICS}


def exported_names() -> set[str]:
    """Every series name the endpoint can show for our metrics."""
    out = set()
    for m in METRICS:
        if m.kind == "histogram":
            out |= {f"{m.exported}_bucket", f"{m.exported}_count", f"{m.exported}_sum"}
        else:
            out.add(m.exported)
    return out


def reference_markdown() -> str:
    """The metrics table of the README and docs/metrics.md."""
    lines = ["| metric on the endpoint | type | labels | meaning |", "|---|---|---|---|"]
    for m in METRICS:
        lines.append(f"| `{m.exported}` | {m.kind} | {', '.join(m.labels)} | {m.doc} |")
    return "\n".join(lines) + "\n"


class _Instruments:
    """Ray metric objects, made once per process on first use."""

    _made: dict | None = None

    @classmethod
    def get(cls, name: str):
        if cls._made is None:
            from ray.util.metrics import Counter, Gauge, Histogram

            made = {}
            for m in METRICS:
                if m.kind == "gauge":
                    made[m.name] = Gauge(m.name, description=m.doc, tag_keys=m.labels)
                elif m.kind == "counter":
                    made[m.name] = Counter(m.name, description=m.doc, tag_keys=m.labels)
                else:
                    made[m.name] = Histogram(m.name, description=m.doc, boundaries=list(m.boundaries),
                                             tag_keys=m.labels)
            cls._made = made
        return cls._made[name]

    # Ray 2.60 drops a gauge series from the endpoint two report intervals after its last `set`,
    # even while its process lives (measured: a gauge set once by a live actor is gone 3 s later at
    # a 1 s interval). A shard's version, a knob or a config's score changes rarely: Prometheus
    # would scrape nothing between changes. So every gauge series this process set is set again
    # each report interval, until the process ends (then Ray ages it out as before).
    _last: dict = {}
    _lock = threading.Lock()
    _keeper = None

    @classmethod
    def set_gauge(cls, name: str, value: float, tags: dict) -> None:
        with cls._lock:
            cls._last[(name, tuple(sorted(tags.items())))] = value
            cls.get(name).set(value, tags=tags)
            if cls._keeper is None:
                cls._keeper = threading.Thread(target=cls._keep, name="rapidfire-gauges", daemon=True)
                cls._keeper.start()

    @classmethod
    def forget_gauges(cls, tags: dict, keep: set) -> None:
        """Stop setting again the series whose tags include `tags`, except the (name, tags) in
        `keep`: Ray then ages them out (an experiment's deleted config)."""
        with cls._lock:
            for key in [k for k in cls._last if set(tags.items()) <= set(k[1]) and k not in keep]:
                del cls._last[key]

    @classmethod
    def _keep(cls) -> None:
        interval = report_interval_s()
        while True:
            time.sleep(interval)
            with cls._lock:
                for (name, tags), value in cls._last.items():
                    cls.get(name).set(value, tags=dict(tags))


def report_interval_s() -> float:
    """How often Ray exports this process's metrics: metrics_report_interval_ms, at least 1 s."""
    try:
        import ray

        return max(ray._config.metrics_report_interval_ms(), 1000) / 1000
    except Exception:  # noqa: BLE001 -- Ray's private config moved: its documented default
        return 10.0


def node_label() -> str:
    """The node's IP address (what Ray's own NodeAddress label shows)."""
    import ray

    try:
        return ray.util.get_node_ip_address()
    except Exception:
        return "unknown"


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _current_memory_bytes() -> int:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.memory_allocated())
    return _rss_bytes()


def _gpu_utilization() -> float | None:
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    try:
        return float(torch.cuda.utilization()) / 100.0  # needs NVML (pynvml / nvidia-ml-py)
    except Exception:
        return None


class WorkerMetrics:
    """One Ray Train worker's metrics. `step(record)` every step (the progress board's record);
    `log(logs)` at the trainer's log events; gauges and counters go to Ray at log steps."""

    def __init__(self, run: str, rank: int, every_steps: int = 1, threads: int = 1):
        self.tags = {"run": run, "rank": str(rank), "node": node_label()}
        self.every_steps = max(1, every_steps)
        self.threads = max(1, threads)
        self._pending: list[dict] = []
        self._cpu = (time.process_time(), time.perf_counter())

    def _gauge(self, name: str, value, **extra) -> None:
        if value is not None:
            _Instruments.set_gauge(name, float(value), {**self.tags, **extra})

    def _count(self, name: str, value) -> None:
        if value:
            _Instruments.get(name).inc(float(value), tags=self.tags)

    def step(self, record: dict) -> None:
        """A finished step's record (telemetry.records.StepRecord); recorded at log steps."""
        self._pending.append(record)
        _Instruments.get("rapidfire_step_seconds").observe(record["phases"]["step"], tags=self.tags)
        if record["step"] % self.every_steps == 0:
            self.flush()

    def flush(self) -> None:
        records, self._pending = self._pending, []
        if not records:
            return
        last = records[-1]
        n = len(records)
        wall = sum(r["phases"]["step"] for r in records)
        tokens = sum(r["tokens"] for r in records)
        padded = sum(r["padded_tokens"] for r in records)
        self._count("rapidfire_steps", n)
        self._count("rapidfire_tokens", tokens)
        self._count("rapidfire_comm_bytes_sent", sum(r.get("bytes_sent", 0) or 0 for r in records))
        self._count("rapidfire_comm_bytes_received", sum(r.get("bytes_received", 0) or 0 for r in records))
        self._gauge("rapidfire_tokens_per_second", tokens / wall if wall > 0 else 0.0)
        for phase in last["phases"]:
            self._gauge("rapidfire_step_phase_seconds", sum(r["phases"][phase] for r in records) / n, phase=phase)
        self._gauge("rapidfire_comm_latency_p50_seconds", last.get("comm_latency_p50_s"))
        self._gauge("rapidfire_comm_latency_p99_seconds", last.get("comm_latency_p99_s"))
        self._gauge("rapidfire_compression_ratio", last.get("compression_ratio"))
        self._gauge("rapidfire_ps_staleness", last.get("ps_staleness"))
        self._gauge("rapidfire_batch_rows", last["samples"])
        self._gauge("rapidfire_padding_fraction", (padded - tokens) / padded if padded else 0.0)
        self._gauge("rapidfire_memory_bytes", _current_memory_bytes())
        self._gauge("rapidfire_memory_peak_bytes", last.get("peak_memory_bytes"))
        self.knobs(last.get("knobs") or {})  # again at every log step: a series recorded once can age out
        gpu = _gpu_utilization()
        if gpu is not None:
            self._gauge("rapidfire_utilization", gpu, device="cuda")
        cpu_now = (time.process_time(), time.perf_counter())
        busy, elapsed = cpu_now[0] - self._cpu[0], cpu_now[1] - self._cpu[1]
        self._cpu = cpu_now
        if elapsed > 0:
            self._gauge("rapidfire_utilization", min(1.0, busy / (elapsed * self.threads)), device="cpu")

    def log(self, logs: dict) -> None:
        self._gauge("rapidfire_loss", logs.get("loss"))
        self._gauge("rapidfire_learning_rate", logs.get("learning_rate"))
        self._gauge("rapidfire_rl_reward", logs.get("reward"))
        self._gauge("rapidfire_rl_kl", logs.get("kl"))

    def knobs(self, values: dict) -> None:
        for knob, value in values.items():
            self._gauge("rapidfire_knob", knob_gauge(knob, value), knob=knob)


class ShardMetrics:
    """A parameter-server shard actor's metrics, recorded per applied update."""

    def __init__(self, run: str, shard: int):
        self.tags = {"run": run, "shard": str(shard), "node": node_label()}

    def update(self, version: int, staleness: int) -> None:
        _Instruments.get("rapidfire_ps_shard_updates").inc(1.0, tags=self.tags)
        _Instruments.set_gauge("rapidfire_ps_shard_version", float(version), self.tags)
        _Instruments.get("rapidfire_ps_shard_staleness").observe(float(staleness), tags=self.tags)


def count_adjustment(run: str, knob: str) -> None:
    _Instruments.get("rapidfire_adjustments").inc(1.0, tags={"run": run, "knob": knob})


def experiment_gauges(board: dict) -> list[tuple[str, float, dict]]:
    """(metric, value, tags) per config of an experiment's leaderboard (summary_of's dict); a
    config that trained no chunk has only chunks_done, a deleted one nothing."""
    out = []
    for c in board.get("configs", []):
        if c["state"] == "deleted":
            continue
        tags = {"experiment": board["name"], "config": c["id"]}
        out.append(("rapidfire_experiment_chunks_done", float(c["chunks_done"]), tags))
        history = c.get("history") or []
        if history:
            out.append(("rapidfire_experiment_score", float(history[-1]["score"]), tags))
            out.append(("rapidfire_experiment_train_loss", float(history[-1]["train_loss"]), tags))
    return out


def record_experiment(board: dict) -> None:
    gauges = experiment_gauges(board)
    _Instruments.forget_gauges({"experiment": board["name"]},
                               keep={(name, tuple(sorted(tags.items()))) for name, _, tags in gauges})
    for name, value, tags in gauges:
        _Instruments.set_gauge(name, value, tags)
