"""`PSClient`: a worker's side of the parameter server.

    shards, partition, pinned = launch_shards(model.named_parameters(), 2, codec="1bit", max_staleness=2, ...)
    client = PSClient(model.named_parameters(), shards, codec="1bit", max_staleness=2)
    client.sync()                       # full pull; admits this worker to its first step
    for batch in data:
        loss = model(batch).backward()
        client.push_and_pull({n: p.grad for n, p in model.named_parameters()})

`push_and_pull(grads)` pushes this worker's compressed gradients to every shard, then pulls
each shard's compressed delta into the local parameters; the pull also admits the worker to its
next step under `max_staleness`. How it works (admission, rapidfire_adamw on the shards, shard
order, float32 shadows, `state_dict()`): docs/parameter_server.md.
"""
from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Mapping

import torch

from ..exchange.stats import CommStats, _percentile
from ..compression import ErrorFeedback, NonFiniteGradient, get_codec

STATE_FORMAT = "rapidfire_ray.ps.client/1"


class PSClient:
    def __init__(self, named_parameters, shards, *, codec: str = "none", codec_opts: Mapping | None = None,
                 max_staleness: int | None = None, worker_id: str | None = None,
                 poll_s: tuple[float, float] = (0.0005, 0.02), stats: CommStats | None = None,
                 freeze_step: int | None = None, max_update: float | None = 1.0):
        import ray

        self._ray = ray
        self.params: dict[str, torch.Tensor] = dict(named_parameters)
        self.shards = list(shards)
        self.worker_id = worker_id or uuid.uuid4().hex[:12]
        self.codec = get_codec(codec, **dict(codec_opts or {}))
        self.max_staleness = max_staleness
        self.poll_s = poll_s
        self.stats = stats if stats is not None else CommStats()
        self.feedback = ErrorFeedback()
        if freeze_step is not None and (isinstance(freeze_step, bool) or not isinstance(freeze_step, int)
                                        or freeze_step < 1):
            raise ValueError(f"PSClient: freeze_step must be an int >= 1 or None, got {freeze_step!r}")
        if max_update is not None and not max_update > 0:
            raise ValueError(f"PSClient: max_update must be > 0 or None, got {max_update!r}")
        self.freeze_step = freeze_step   # None: plain pushes of gradients (the shards' AdamW)
        self.max_update = max_update
        self.full_codec = get_codec("none")
        # rapidfire_adamw's compressed stage (see `_updates`): per parameter name
        self.momentum: dict[str, torch.Tensor] = {}
        self.denom: dict[str, torch.Tensor] = {}
        self.zero_variance: dict[str, torch.Tensor] = {}
        self.base_step: list[int] = []       # per shard: its AdamW step count when the variance froze
        self.beta1 = 0.9
        self.compressed_steps = 0

        described = ray.get([s.describe.remote() for s in self.shards])
        self.partition = [d["names"] for d in described]
        self.shard_of = {name: i for i, names in enumerate(self.partition) for name in names}
        owned = [n for names in self.partition for n in names]
        missing = sorted(set(self.params) - set(owned))
        extra = sorted(set(owned) - set(self.params))
        if len(owned) != len(set(owned)) or missing or extra:
            raise ValueError(f"parameter server: the shards' partition does not match the model "
                             f"(not on any shard: {missing[:3]}, not in the model: {extra[:3]}, "
                             f"on two shards: {len(owned) - len(set(owned))})")
        for d in described:
            if d["max_staleness"] != max_staleness:
                raise ValueError(f"parameter server: shard {d['index']} bounds staleness at "
                                 f"{d['max_staleness']}, this client at {max_staleness}")
        self.shadow = {n: p.detach().to(torch.float32, copy=True)
                       for n, p in self.params.items() if p.dtype != torch.float32}
        n = len(self.shards)
        self.versions: list[int | None] = [None] * n   # version of the local copy, per shard
        self.seq = [0] * n                              # pushes acknowledged, per shard
        self.synced = False
        self.steps = 0
        self.applied = 0
        self.duplicates = 0
        self.lost = 0
        self.staleness_hist: Counter[int] = Counter()
        self.bound_exceeded = 0
        self.wait_s = 0.0
        self.refusals = 0
        self.full_pulls = 0
        self.push_latencies: list[float] = []
        self.pull_latencies: list[float] = []

    # --- the calls a trainer makes -------------------------------------------------------

    def sync(self) -> dict:
        """Full pull of every shard (start, after a worker restart, or to check the final
        parameters); admits this worker to its next step."""
        report = self._pull_all(full=True)
        self.synced = True
        return report

    def push_and_pull(self, grads: Mapping[str, torch.Tensor | None], lr: float | None = None) -> dict:
        """Push this step's gradients (name -> tensor; None or absent: no gradient) to every
        shard, then pull the new parameters into the local model. Returns staleness (the
        largest over shards of this push), wait_s (admission wait), bytes_sent,
        bytes_received, versions. NaN/inf in any gradient raises NonFiniteGradient before
        anything is sent or any error-feedback state changes (skip the step and call again)."""
        if not self.synced:
            raise RuntimeError("PSClient: call sync() before the first push_and_pull()")
        for name, g in grads.items():
            if g is not None and not bool(torch.isfinite(g).all()):
                raise NonFiniteGradient(name, self.codec.name)
        ray = self._ray
        start = time.perf_counter()
        received = 0
        if self.in_compressed_stage:
            kind = "update"
            if not self.denom:
                received = self._fetch_preconditioner()
            tensors = self._updates(grads)
        else:
            kind = "grad"
            tensors = grads
        # Warm-up of rapidfire_adamw: exact gradients (the shards run AdamW on them, building the
        # variance the compressed stage freezes). Otherwise the codec, with error feedback.
        codec = self.full_codec if self.freeze_step is not None and kind == "grad" else self.codec
        refs = []
        sent = 0
        fp32 = 0
        for i, names in enumerate(self.partition):
            encoded = {}
            for name in names:
                g = tensors.get(name)
                if g is None:
                    continue
                enc = self.feedback.compress(name, g, codec)
                encoded[name] = enc
                sent += enc.nbytes
                fp32 += 4 * enc.numel
            refs.append(self.shards[i].push.remote(self.worker_id, self.seq[i] + 1, self.versions[i], encoded, lr,
                                                   kind))
        replies = ray.get(refs)
        if kind == "update":
            self.compressed_steps += 1
        push_s = time.perf_counter() - start
        self.push_latencies.append(push_s)
        self.stats.add_bytes(sent, received, fp32)
        staleness = 0
        for i, reply in enumerate(replies):
            self.seq[i] += 1
            self.lost += reply["lost"]
            if reply["status"] == "duplicate":
                self.duplicates += 1
                continue
            self.applied += 1
            s = reply["staleness"]
            self.staleness_hist[s] += 1
            staleness = max(staleness, s)
            if self.max_staleness is not None and s > self.max_staleness:
                self.bound_exceeded += 1
        pulled = self._pull_all(full=False)
        self.stats.add_call(time.perf_counter() - start)
        self.steps += 1
        return {"staleness": staleness, "wait_s": pulled["wait_s"], "bytes_sent": sent,
                "bytes_received": pulled["nbytes"] + received, "versions": list(self.versions), "push_s": push_s,
                "kind": kind}

    # --- rapidfire_adamw: 1-bit Adam on the parameter server ------------------------------

    @property
    def in_compressed_stage(self) -> bool:
        """rapidfire_adamw's compressed stage: this worker has pushed `freeze_step` warm-up
        gradients (False for the plain AdamW mode)."""
        return self.freeze_step is not None and self.steps >= self.freeze_step

    def _fetch_preconditioner(self) -> int:
        """Take every shard's frozen preconditioner and momentum (once, at the freeze; again after
        a restart without saved state). Returns the bytes received."""
        replies = self._ray.get([s.preconditioner.remote() for s in self.shards])
        nbytes = 0
        self.base_step = []
        for reply in replies:
            self.beta1 = float(reply["betas"][0])
            self.base_step.append(int(reply["step"]))
            for name, m in reply["exp_avg"].items():
                self.momentum[name] = m.to(torch.float32)
                self.denom[name] = reply["denom"][name].to(torch.float32)
                self.zero_variance[name] = reply["zero_variance"][name]
                nbytes += 9 * m.numel()  # momentum and denom in float32, the mask in bytes
        return nbytes

    @torch.no_grad()
    def _updates(self, grads: Mapping[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
        """This worker's AdamW update for each parameter with a gradient: its momentum (started
        from the shards' at the freeze) m = lerp(m, g, 1 - beta1), then m_hat / denom with the
        frozen denom = sqrt(v_hat) + eps, zero where v == 0 (nothing in the warm-up: 1-bit codes
        cannot send a zero), clamped to +-max_update (as RapidfireAdamW's compressed stage).
        Compressing the preconditioned update rather than m puts the codec's error where the
        update is: elements of m with a tiny variance would otherwise turn the chunk-wide scale
        into huge steps."""
        out = {}
        for name, g in grads.items():
            if g is None:
                continue
            m = self.momentum[name]
            m.lerp_(g.detach().to(m.device, torch.float32).reshape(m.shape), 1 - self.beta1)
            m.masked_fill_(self.zero_variance[name], 0.0)
            t = self.base_step[self.shard_of[name]] + self.compressed_steps + 1
            u = (m / (1 - self.beta1**t)).div_(self.denom[name])
            if self.max_update is not None:
                u.clamp_(-self.max_update, self.max_update)
            out[name] = u
        return out

    def pull(self) -> dict:
        """Pull what changed since the local copy (deltas) and be admitted to the next step: after
        `finish()`, to take part again (e.g. after waiting at a checkpoint barrier)."""
        return self._pull_all(full=False)

    def pull_states(self) -> list[dict]:
        """Every shard's whole state (parameters, optimizer state, version, push counts: what a
        snapshot holds), with its parameters installed in the local model, so the model equals
        exactly the state returned (for a checkpoint that holds both). The shards' mirrors of this
        worker are older than the versions now held, so the next pull is a full one."""
        states = self._ray.get([s.state_dict.remote() for s in self.shards])
        for i, st in enumerate(states):
            self._apply(i, {"kind": "full", "tensors": st["params"], "version": st["version"],
                            "last_seq": st["last_seq"].get(self.worker_id, 0),
                            "nbytes": sum(4 * t.numel() for t in st["params"].values())})
        return states

    def finish(self) -> None:
        """End of training for this worker: give back the admission its last pull took, so the
        other workers are not held back waiting for a push that will never come."""
        self._ray.get([s.withdraw.remote(self.worker_id) for s in self.shards])

    def release(self) -> None:
        """Tell every shard this worker is gone (its admission and mirror are dropped)."""
        self._ray.get([s.release.remote(self.worker_id) for s in self.shards])
        self.synced = False

    # --- pulling -------------------------------------------------------------------------

    def _pull_all(self, full: bool) -> dict:
        ray = self._ray
        start = time.perf_counter()
        wid = self.worker_id
        # All shards at once first: the usual case is that every one admits us.
        replies = ray.get([s.pull.remote(wid, self.versions[i], True, full) for i, s in enumerate(self.shards)])
        nbytes = 0
        refused = [i for i, r in enumerate(replies) if not r["admitted"]]
        for i, r in enumerate(replies):
            if r["admitted"]:
                nbytes += self._apply(i, r)
        wait = 0.0
        if refused:
            # Keep shards in index order: give back admissions and queue places above the first
            # refusal, then take them one by one (a worker holding a later shard while waiting
            # on an earlier one could deadlock with one doing the opposite).
            first = refused[0]
            later = list(range(first + 1, len(self.shards)))
            if later:
                ray.get([self.shards[i].withdraw.remote(wid) for i in later])
            wait_start = time.perf_counter()
            for i in range(first, len(self.shards)):
                delay = self.poll_s[0]
                while True:
                    r = ray.get(self.shards[i].pull.remote(wid, self.versions[i], True, full))
                    if r["admitted"]:
                        nbytes += self._apply(i, r)
                        break
                    self.refusals += 1
                    time.sleep(delay)
                    delay = min(2 * delay, self.poll_s[1])
            wait = time.perf_counter() - wait_start
            self.wait_s += wait
        self.stats.add_bytes(0, nbytes)
        self.pull_latencies.append(time.perf_counter() - start)
        return {"wait_s": wait, "nbytes": nbytes}

    @torch.no_grad()
    def _apply(self, i: int, reply: dict) -> int:
        if reply["kind"] == "full":
            self.full_pulls += 1
            # The shard's count of our pushes wins over ours after a worker restart.
            self.seq[i] = max(self.seq[i], reply.get("last_seq", 0))
        for name, value in reply["tensors"].items():
            p = self.params[name]
            target = self.shadow.get(name, p)
            if reply["kind"] == "full":
                target.copy_(value.to(target.device))
            else:
                decoder = self.codec if value.codec == self.codec.name else get_codec(value.codec)
                decoded = decoder.decode(value).to(target.device)
                if reply["kind"] == "values":
                    target.copy_(decoded)
                else:
                    target.add_(decoded)
            if target is not p:
                p.copy_(target)
        self.versions[i] = reply["version"]
        return reply["nbytes"]

    # --- reporting and checkpoints -------------------------------------------------------

    def report(self) -> dict:
        push = sorted(self.push_latencies)
        pull = sorted(self.pull_latencies)
        hist = dict(sorted(self.staleness_hist.items()))
        return {"worker_id": self.worker_id, "steps": self.steps, "applied": self.applied,
                "duplicates": self.duplicates, "lost_updates": self.lost,
                "staleness_hist": hist, "staleness_max": max(hist) if hist else 0,
                "bound_exceeded": self.bound_exceeded, "wait_s": self.wait_s, "refusals": self.refusals,
                "full_pulls": self.full_pulls,
                "push_latency_p50_s": _percentile(push, 0.5), "push_latency_p99_s": _percentile(push, 0.99),
                "pull_latency_p50_s": _percentile(pull, 0.5), "pull_latency_p99_s": _percentile(pull, 0.99),
                "bytes_sent": self.stats.total_bytes_sent, "bytes_received": self.stats.total_bytes_received,
                "versions": list(self.versions)}

    def state_dict(self) -> dict:
        state = {"format": STATE_FORMAT, "worker_id": self.worker_id, "seq": list(self.seq),
                 "feedback": self.feedback.state_dict(), "steps": self.steps}
        if self.denom:
            state["rapidfire_adamw"] = {"momentum": dict(self.momentum), "denom": dict(self.denom),
                                        "zero_variance": dict(self.zero_variance), "base_step": list(self.base_step),
                                        "beta1": self.beta1, "compressed_steps": self.compressed_steps}
        return state

    def load_state_dict(self, state: Mapping) -> None:
        if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
            raise ValueError("PSClient: not a PSClient state dict")
        if len(state["seq"]) != len(self.shards):
            raise ValueError(f"PSClient: state has {len(state['seq'])} shards, this client {len(self.shards)}")
        self.seq = [max(a, int(b)) for a, b in zip(self.seq, state["seq"])]
        self.feedback.load_state_dict(state["feedback"])
        self.steps = int(state.get("steps", self.steps))
        rfa = state.get("rapidfire_adamw")
        if rfa is not None:
            if len(rfa["base_step"]) != len(self.shards):
                raise ValueError(f"PSClient: state has a preconditioner from {len(rfa['base_step'])} shards, "
                                 f"this client has {len(self.shards)}")
            self.momentum = {n: t.to(torch.float32) for n, t in rfa["momentum"].items()}
            self.denom = {n: t.to(torch.float32) for n, t in rfa["denom"].items()}
            self.zero_variance = dict(rfa["zero_variance"])
            self.base_step = [int(b) for b in rfa["base_step"]]
            self.beta1 = float(rfa["beta1"])
            self.compressed_steps = int(rfa["compressed_steps"])
