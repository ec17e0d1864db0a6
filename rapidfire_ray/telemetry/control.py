"""The run's control actor: live knob values, the adjustment rules, and how workers apply a
change at the same step.

`RunControl` is a named actor (`rapidfire-control-<run.name>` in namespace `rapidfire`) started
by the driver for every run; `rapidfire monitor` finds a running run through it. It holds the
progress board's handle, the current value of each knob (`rules.KNOBS`), the list of changes,
and, in mode `auto`, evaluates the rules (`rules.evaluate`) on the workers' step records every
`interval_s`. Mode `off` only watches; `rapidfire monitor --adjust_parameters auto|off` switches
it, and `rapidfire monitor --set knob=value` changes a knob by hand (or back).

Same step on every worker. Workers ask for changes (`poll`) at their log steps
(`train.log_every_steps` = L) and apply a change at the end of its `apply_step`. A change is
published with apply_step = (the newest step any worker has polled at) + L: every worker polls
again at or before that step, so every worker learns it in time and applies it after the same
step (DDP ranks then run the next step with the same value; the first step that sees it is
apply_step + 1).
"""
from __future__ import annotations

import threading
import time

import ray

from ..config import worker_range
from ..log import say, warn

from .rules import CODEC_KNOB, KNOBS, RuleState, Settings, check_knob_value, codec_is_live, evaluate
from .progress import Poller

NAMESPACE = "rapidfire"
PREFIX = "rapidfire-control-"


def control_name(run: str) -> str:
    return f"{PREFIX}{run}"


@ray.remote(num_cpus=0, max_concurrency=8)
class RunControl:
    def __init__(self, run: str, board, settings: Settings, knobs: dict, *, world_size: int, every_steps: int,
                 mode: str | None = None, codec: str | None = None, interval_s: float = 1.0, job_id: str = ""):
        self.run = run
        self.job_id = job_id  # the driver's job: a leftover of a failed start in the same job may be replaced
        self.board = board
        self.settings = settings
        self.mode = settings.adjust
        self.knobs = dict(knobs)
        self.world_size = world_size
        self.every_steps = max(1, every_steps)
        self.comm_mode = mode
        self.codec = codec
        self.interval_s = interval_s
        self.changes: list[dict] = []
        self.advice: list[dict] = []
        self.polled: dict[int, int] = {}  # rank -> newest step it polled at
        self.seen: dict[int, int] = {}  # rank -> number of changes it has received
        self.memory_limits: dict[int, int] = {}
        self.records: list[dict] = []
        self._cursor = 0
        self._state = RuleState()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        threading.Thread(target=self._loop, name="rapidfire-rules", daemon=True).start()

    def __repr__(self) -> str:  # the dashboard's and the log prefix's name for this actor
        return f"RunControl({self.run})"

    # --- workers --------------------------------------------------------------------------

    def hello(self, rank: int, step: int, memory_limit_bytes: int | None = None) -> list[dict]:
        """A worker starts (or resumes) at `step`: it gets every change so far."""
        with self._lock:
            if memory_limit_bytes:
                self.memory_limits[rank] = int(memory_limit_bytes)
            self.seen[rank] = 0
        return self.poll(rank, step)

    def poll(self, rank: int, step: int) -> list[dict]:
        """The changes this worker has not received yet."""
        with self._lock:
            self.polled[rank] = max(self.polled.get(rank, step), step)
            start = self.seen.get(rank, 0)
            self.seen[rank] = len(self.changes)
            return [dict(c) for c in self.changes[start:]]

    def applied(self, rank: int, index: int, step: int) -> None:
        with self._lock:
            change = self.changes[index]
            change["applied"][str(rank)] = step
            if rank == 0:
                change["applied_step"] = step

    # --- changes ---------------------------------------------------------------------------

    def _publish(self, knob: str, new, reason: str, source: str) -> dict:
        """Caller holds the lock."""
        from .metrics import count_adjustment

        newest = max(self.polled.values()) if self.polled else 0
        newest = max([newest] + [r["step"] for r in self.records[-self.world_size:]])
        change = {"index": len(self.changes), "step": newest + self.every_steps, "knob": knob,
                  "old": self.knobs[knob], "new": new, "reason": reason, "source": source,
                  "published_at": time.time(), "applied_step": None, "applied": {}}
        self.knobs[knob] = new
        self.changes.append(change)
        # Rules wait a full window after the change takes effect before judging this knob again.
        self._state.quiet_until[knob] = change["step"]
        try:
            count_adjustment(self.run, knob)
        except Exception:  # metrics are best-effort
            pass
        return dict(change)

    def set_knob(self, knob: str, value, reason: str = "set by rapidfire monitor") -> dict:
        """A change by hand (also to set a knob back). ValueError for an unknown knob."""
        if knob not in KNOBS or knob not in self.knobs:
            raise ValueError(f"unknown knob '{knob}'; knobs of this run: {', '.join(sorted(self.knobs))}")
        check_knob_value(knob, value)
        with self._lock:
            return self._publish(knob, value, reason, "monitor")

    def set_mode(self, mode: str) -> str:
        if mode not in ("auto", "off"):
            raise ValueError(f"adjust mode must be auto or off, got {mode!r}")
        self.mode = mode
        return mode

    # --- rules -----------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.evaluate_once()
            except Exception as e:  # the rules must never stop the run
                warn(f"control: rule evaluation failed: {e}")

    def evaluate_once(self) -> list[dict]:
        new = ray.get(self.board.since.remote(self._cursor), timeout=30)
        with self._lock:
            self._cursor += len(new)
            self.records.extend(new)
            del self.records[:-max(64, 4 * self.settings.window_steps * self.world_size)]
            proposals = evaluate(self.records, self.knobs, self.settings, self._state, self.memory_limits,
                                 codec=self.codec, mode=self.comm_mode)
            out = []
            for p in proposals:
                if p.advice:
                    self.advice.append({"step": max(r["step"] for r in self.records), "knob": p.knob,
                                        "reason": p.reason, "published_at": time.time()})
                elif self.mode == "auto" and p.new != self.knobs.get(p.knob):
                    out.append(self._publish(p.knob, p.new, p.reason, "rule"))
            return out

    # --- readers ---------------------------------------------------------------------------

    def info(self) -> dict:
        with self._lock:
            return {"run": self.run, "adjust": self.mode, "allowed": list(self.settings.allowed),
                    "knobs": dict(self.knobs), "changes": [dict(c) for c in self.changes],
                    "advice": list(self.advice), "world_size": self.world_size, "board": self.board}

    def owner(self) -> str:
        return self.job_id

    def stop(self) -> None:
        self._stop.set()


def start_control(run: str, board, settings: Settings, knobs: dict, **kw):
    """The run's control actor, named for `rapidfire monitor`. A live actor of that name means the
    run is running already: RapidfireError."""
    from ..errors import RapidfireError
    from ..driver.cluster import on_driver_node

    name = control_name(run)
    job = ray.get_runtime_context().get_job_id()
    deadline = time.time() + 15
    while True:
        try:
            return RunControl.options(name=name, namespace=NAMESPACE,
                                      scheduling_strategy=on_driver_node()).remote(run, board, settings, knobs,
                                                                            job_id=job, **kw)
        except ValueError:  # the name is taken: a running run, or a finished one's actor still going away
            try:
                old = ray.get_actor(name, namespace=NAMESPACE)
                if ray.get(old.owner.remote(), timeout=10) == job:
                    stop_control(old, run)  # left by a start of this driver that failed before training
                    continue
                raise RapidfireError(f"run.name: '{run}' is already running on this Ray cluster (actor {name}); "
                                     "wait for it to finish or choose another run.name") from None
            except (ValueError, ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                if time.time() > deadline:
                    raise
                time.sleep(0.2)


def run_control(cfg, board):
    """The control actor for the run `cfg` describes (its monitor section, its initial knobs)."""
    knobs = {"data.prefetch_depth": cfg.data.prefetch_depth, "memory.max_forward_tokens": cfg.memory.max_forward_tokens}
    codec = cfg.optimizer.params.compression.grad
    if codec_is_live(cfg.communication.mode, codec, cfg.optimizer.type):
        knobs[CODEC_KNOB] = codec
    return start_control(cfg.run.name, board, Settings.from_config(cfg), knobs,
                         world_size=worker_range(cfg)[1], every_steps=cfg.train.log_every_steps,
                         mode=cfg.communication.mode, codec=cfg.optimizer.params.compression.grad,
                         interval_s=cfg.monitor.interval_s)


def adjustments_summary(info: dict) -> dict:
    """The run summary's `adjustments` section: mode, the final knobs, every change (step: the
    step after which it applied on every worker; applied_step: rank 0's, None if the run ended
    first) and every piece of advice."""
    return {"adjust": info["adjust"], "allowed": info["allowed"], "knobs": info["knobs"],
            "changes": [{k: c[k] for k in ("step", "knob", "old", "new", "reason", "source", "applied_step",
                                           "applied")} for c in info["changes"]],
            "advice": [{k: a[k] for k in ("step", "knob", "reason")} for a in info["advice"]]}


def stop_control(control, run: str) -> None:
    """Kill the control actor and wait until its name is free (a next run may take it at once)."""
    ray.kill(control)
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            ray.get_actor(control_name(run), namespace=NAMESPACE)
        except ValueError:
            return
        time.sleep(0.1)


class KnobClient:
    """A worker's side: asks for changes at log steps, applies each at the end of its step.
    `appliers`: knob -> function(value) that makes the worker use it."""

    def __init__(self, control, rank: int, every_steps: int, appliers: dict, initial: dict | None = None,
                 on_apply=None):
        self.control = control
        self.rank = rank
        self.every_steps = max(1, every_steps)
        self.appliers = appliers
        self.on_apply = on_apply  # called with the knob values after a change (metrics)
        self.values: dict = dict(initial or {})  # what this worker runs with now
        self._pending: list[dict] = []

    def begin(self, step: int, memory_limit_bytes: int | None = None) -> None:
        """Training starts at `step`: apply every change so far (a resumed run gets the knobs it had)."""
        changes = ray.get(self.control.hello.remote(self.rank, step, memory_limit_bytes))
        for c in changes:
            if c["step"] > step:
                self._pending.append(c)
            else:
                self._apply(c, step, report=str(self.rank) not in c["applied"])

    def step_end(self, step: int) -> list[dict]:
        if step % self.every_steps == 0:
            self._pending += ray.get(self.control.poll.remote(self.rank, step))
        due = [c for c in self._pending if c["step"] <= step]
        self._pending = [c for c in self._pending if c["step"] > step]
        for c in due:
            if c["step"] < step:
                say(f"rank {self.rank}: {c['knob']} change for step {c['step']} applied late at step {step}")
            self._apply(c, step)
        return due

    def _apply(self, change: dict, step: int, report: bool = True) -> None:
        knob = change["knob"]
        if knob in self.appliers:
            self.appliers[knob](change["new"])
            self.values[knob] = change["new"]
            if self.on_apply is not None:
                self.on_apply(dict(self.values))
        if report:
            self.control.applied.remote(self.rank, change["index"], step)


def change_line(change: dict) -> str:
    return (f"adjust: {change['knob']} {change['old']} -> {change['new']} after step {change['step']} "
            f"({change['source']}: {change['reason']})")


class ControlWatcher(Poller):
    """Driver side: prints every change and piece of advice as it is published."""

    def __init__(self, control, interval_s: float = 1.0, stream=None):
        super().__init__(interval_s, stream, name="rapidfire-control-watch")
        self.control = control
        self._printed = (0, 0)

    def poll(self) -> None:
        try:
            info = ray.get(self.control.info.remote(), timeout=10)
        except Exception:
            return
        changes, advice = info["changes"], info["advice"]
        for c in changes[self._printed[0]:]:
            print(f"[rapidfire] {change_line(c)}", file=self.stream, flush=True)
        for a in advice[self._printed[1]:]:
            print(f"[rapidfire] advice at step {a['step']}: {a['reason']}", file=self.stream, flush=True)
        self._printed = (len(changes), len(advice))
