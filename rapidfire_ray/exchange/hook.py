"""DDP communication hook for `communication.mode: allreduce_compressed`.

    state = HookState(ddp_model.module.named_parameters(), CompressionPolicy("1bit"), timer=step_timer)
    ddp_model.register_comm_hook(state, compressed_allreduce_hook)
    ...each optimizer step, after backward:
    if state.nonfinite:  # parameter names whose gradient was NaN/inf on some rank
        ...skip the step (the bucket gradients are already zero on every rank); state.nonfinite.clear()
    metrics.update(state.stats.take())

With `overlap` (the default, `communication.overlap`), the hook hands each bucket to one
exchange thread of its own and returns at once, so the backward pass goes on computing the next
buckets while this one is encoded and sent: buckets are processed one at a time in the order DDP
hands them over (the same on every rank), over a process group of their own (no interleaving
with collectives of the training thread), on CUDA on a side stream that first waits for the
backward pass's writes to the bucket. DDP waits for every bucket's future at the end of backward,
so `nonfinite` and the stats are complete when the optimizer step reads them. The results are the
same as without overlap, bit for bit.

Per bucket: one small agreement allreduce (NaN/inf anywhere), then the parameters grouped by codec (`policy`): none and fp16 as plain
allreduces, 1bit/2bit through `compressed_allreduce` with one error-feedback slot per group
composition. Under `auto`, the first bucket of the first step and of every `auto_interval`-th
step after it first measures the link and the codecs (auto.py; all ranks reach it at the same
bucket), then each bucket is decided again and the ranks check they chose alike. The steps, how
slots follow DDP's bucket rebuilds, and how bytes are counted: docs/exchange.md.
"""
import logging
import queue
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..compression import CODECS
from .allreduce import AllreduceState, _world, compressed_allreduce, layout
from .auto import fp16_prepare, measure
from .policy import CompressionPolicy
from .stats import CommStats, fp32_allreduce_bytes

log = logging.getLogger(__name__)

STATE_FORMAT = "rapidfire_ray.comm.hook/1"  # the saved format's name (checkpoints): kept
CODEC_ORDER = tuple(CODECS)  # none, fp16, 1bit, 2bit: the same group order on every rank


@dataclass
class _Slot:
    codec: str
    names: tuple[str, ...]
    numels: tuple[int, ...]
    state: AllreduceState = field(default_factory=AllreduceState)
    owned: int = 0  # parameters whose worker error lives here

    def offsets(self) -> list[int]:
        out, at = [], 0
        for n in self.numels:
            out.append(at)
            at += n
        return out

    def fits(self, padded: int, m: int) -> bool:
        w, s = self.state.worker_error, self.state.server_error
        return (w is None or w.numel() == padded) and (s is None or s.numel() == m)


class HookState:
    """State of `compressed_allreduce_hook`: names, policy, group, error-feedback slots, stats.

    `nonfinite`: parameter names whose gradient was NaN/inf on some rank, appended by the hook
    (the same list on every rank); the trainer reads it after backward, skips the optimizer
    step if it is not empty, and clears it. `skipped_buckets` counts zeroed buckets.
    `timer`: optional object with `comm_interval(start, end)` and `comm_call(start, end)`
    (telemetry's StepTimer), told each bucket's in-flight interval and, with `overlap`, the
    interval the hook held the backward thread. `overlap`: process buckets on the exchange
    thread (module docstring); `group` should then be a process group of the exchange's own."""

    def __init__(self, named_parameters: Iterable[tuple[str, torch.Tensor]], policy: CompressionPolicy,
                 group=None, stats: CommStats | None = None, timer=None, overlap: bool = False):
        self.policy = policy
        self.group = group
        self.overlap = overlap
        self._worker: _ExchangeThread | None = None
        self._streams: dict = {}  # CUDA device -> the exchange's side stream
        self.stats = stats if stats is not None else CommStats()
        self.timer = timer
        self.nonfinite: list[str] = []
        self.skipped_buckets = 0
        self._names_by_id: dict[int, str] = {}
        self._names_by_ptr: dict[tuple[int, int], str] = {}
        named = list(named_parameters)
        for name, p in named:
            self._names_by_id.setdefault(id(p), name)
            self._names_by_ptr.setdefault((p.data_ptr(), p.numel()), name)
        self._slots: dict[tuple, _Slot] = {}
        self._owner: dict[str, tuple] = {}
        self._warned_unnamed = False
        self.step = 0  # synchronised backward passes seen (auto: when to measure again)
        # trainable elements: how large the auto probes get (codec buffer, link payload cap)
        self._numel = sum(p.numel() for p in {id(p): p for _, p in named if p.requires_grad}.values())

    # --- naming and layout -------------------------------------------------------------------

    def _name(self, p: torch.Tensor, bucket_index: int, i: int) -> str:
        name = self._names_by_id.get(id(p)) or self._names_by_ptr.get((p.data_ptr(), p.numel()))
        if name is None:
            name = f"<bucket{bucket_index}.param{i}>"
            if not self._warned_unnamed:
                log.warning("compressed allreduce hook: a bucket parameter is not in named_parameters; "
                            "calling it %s (pass the DDP module's named_parameters())", name)
                self._warned_unnamed = True
        return name

    def _entries(self, bucket, buffer: torch.Tensor) -> list[tuple[str, int, int]]:
        """(name, offset into buffer, numel) per bucket parameter, in bucket order."""
        base, size, es = buffer.data_ptr(), buffer.numel(), buffer.element_size()
        out, at = [], 0
        for i, (p, g) in enumerate(zip(bucket.parameters(), bucket.gradients())):
            n = g.numel()
            ptr = g.data_ptr()
            if n and g.dtype == buffer.dtype and base <= ptr and (ptr - base) // es + n <= size:
                at = (ptr - base) // es
            out.append((self._name(p, bucket.index(), i), at, n))
            at += n
        return out

    # --- error-feedback slots ----------------------------------------------------------------

    def _slot(self, codec: str, names: tuple[str, ...], numels: tuple[int, ...], ws: int,
              device: torch.device) -> _Slot:
        key = (codec, names)
        m, padded = layout(sum(numels), ws)
        slot = self._slots.get(key)
        if slot is not None and slot.numels == numels and slot.fits(padded, m):
            return slot
        new = _Slot(codec, names, numels)
        worker_error = None
        for name, offset, n in zip(names, new.offsets(), numels):
            old_key = self._owner.get(name)
            old = self._slots.get(old_key) if old_key is not None else None
            if old is not None and old.state.worker_error is not None and name in old.names:
                j = old.names.index(name)
                if old.numels[j] == n:
                    at = old.offsets()[j]
                    if worker_error is None:
                        worker_error = torch.zeros(padded, dtype=torch.float32, device=device)
                    worker_error[offset:offset + n].copy_(old.state.worker_error.reshape(-1)[at:at + n])
        new.state.worker_error = worker_error
        self._slots.pop(key, None)
        for name in names:
            old_key = self._owner.get(name)
            if old_key is not None and old_key != key and old_key in self._slots:
                old = self._slots[old_key]
                old.owned -= 1
                if old.owned <= 0:
                    del self._slots[old_key]
            self._owner[name] = key
        new.owned = len(names)
        self._slots[key] = new
        return new

    def reset_errors(self) -> None:
        """Drop every error-feedback buffer (e.g. to restart compression from scratch)."""
        self._slots.clear()
        self._owner.clear()

    # --- checkpoints -------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Error buffers (CPU copies) of every slot and the policy's auto choices."""
        return {"format": STATE_FORMAT, "policy": self.policy.state_dict(),
                "slots": [{"codec": s.codec, "names": list(s.names), "numels": list(s.numels),
                           "state": s.state.state_dict()} for s in self._slots.values()]}

    def load_state_dict(self, state: dict) -> None:
        """Restore slots and policy state. Buffers stay on CPU until their first use, then live
        on the gradients' device; a different world size re-lays worker errors by name and
        starts server errors fresh."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError(f"compressed allreduce hook: not a hook state dict (expected format {STATE_FORMAT!r})")
        self.policy.load_state_dict(state["policy"])
        self._slots.clear()
        self._owner.clear()
        for entry in state["slots"]:
            slot = _Slot(entry["codec"], tuple(entry["names"]), tuple(int(n) for n in entry["numels"]))
            slot.state.load_state_dict(entry["state"])
            key = (slot.codec, slot.names)
            self._slots[key] = slot
            for name in slot.names:
                self._owner[name] = key
            slot.owned = len(slot.names)

    # --- the bucket ----------------------------------------------------------------------------

    def _allreduce(self, t: torch.Tensor, ws: int, fp32_numel: int = 0) -> None:
        if ws > 1:
            dist.all_reduce(t, group=self.group)
            nbytes = 2 * (ws - 1) * t.numel() * t.element_size() // ws
            self.stats.add_bytes(nbytes, nbytes, fp32_allreduce_bytes(fp32_numel, ws))

    def _job(self, bucket) -> "_Job":
        """What the exchange needs of a DDP bucket, read while the hook runs (the GradBucket is
        DDP's for the duration of the call only)."""
        buffer = bucket.buffer()
        return _Job(bucket.index(), bucket.is_last(), self._entries(bucket, buffer), buffer)

    def _process(self, job: "_Job") -> None:
        try:
            self._process_bucket(job.index, job.entries, job.buffer)
        finally:
            if self.policy.grad == "auto" and job.is_last:
                self.step += 1  # DDP calls the hook for every bucket of every synchronised backward

    def _side_stream(self, device: torch.device):
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream

    def submit(self, bucket) -> torch.futures.Future:
        """Hand the bucket to the exchange thread; a future completed (or failed) there."""
        start = time.perf_counter()
        job = self._job(bucket)
        buffer = job.buffer
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future(
            devices=[buffer.device] if buffer.is_cuda else None)
        ready = None
        if buffer.is_cuda:
            ready = torch.cuda.Event()
            ready.record()  # on the backward pass's stream: the bucket's gradients are written
        if self._worker is None:
            self._worker = _ExchangeThread()

        def done() -> None:  # told before the future completes: the step may be taken right after
            if self.timer is not None:
                self.timer.comm_interval(start, time.perf_counter())

        def work():
            try:
                if ready is None:
                    with self.stats.timed(buffer.device):
                        self._process(job)
                    done()
                    fut.set_result(buffer)
                else:
                    stream = self._side_stream(buffer.device)
                    with torch.cuda.stream(stream):
                        stream.wait_event(ready)
                        with self.stats.timed(buffer.device):
                            self._process(job)
                        done()
                        fut.set_result(buffer)  # records the side stream: DDP's wait syncs with it
            except BaseException as e:  # noqa: BLE001 - raised by DDP's wait on the training thread
                done()
                fut.set_exception(e)

        self._worker.submit(work)
        if self.timer is not None:
            self.timer.comm_call(start, time.perf_counter())
        return fut

    def close(self) -> None:
        """Stop the exchange thread (after the last backward pass)."""
        if self._worker is not None:
            self._worker.stop()
            self._worker = None

    def _measure(self, device: torch.device, ws: int, rank: int) -> None:
        """auto: time the link over this hook's group and the codecs on this device (agreed by all
        ranks, which reach this at the same bucket of the same step)."""
        policy = self.policy
        policy.announce = rank == 0
        codecs = {c: policy.codec(c) for c in CODEC_ORDER}
        measurement = measure(codecs, device, self.group, elements=self._numel,
                              max_link_bytes=4 * self._numel)
        policy.set_measurement(measurement, self.step)

    def _check_agreed(self, codec: str, bucket_index: int, ws: int, device: torch.device) -> None:
        """Every rank must have chosen the same codec; stop with a clear error rather than hang."""
        if ws <= 1:
            return
        i = float(CODEC_ORDER.index(codec))
        t = torch.tensor([i, -i], dtype=torch.float32, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        high, low = t[0].item(), -t[1].item()
        if high != low:
            raise RuntimeError(f"compression auto: the workers chose different codecs for bucket {bucket_index} "
                               f"({CODEC_ORDER[int(low)]} .. {CODEC_ORDER[int(high)]}); this is a bug, please report "
                               "it; set optimizer.params.compression.grad to a fixed codec meanwhile")

    def _process_bucket(self, index: int, entries: list[tuple[str, int, int]], buffer: torch.Tensor) -> None:
        ws, rank = _world(self.group)
        policy = self.policy
        rules = [policy.rule(name, n) for name, _, n in entries]
        auto = [entries[i] for i, r in enumerate(rules) if r == "auto"]
        if auto and policy.measurement_due(self.step):
            self._measure(buffer.device, ws, rank)
        decide = bool(auto) and policy.decision_due(name for name, _, _ in auto)

        # One allreduce: is the bucket non-finite on any rank.
        agreed = (~torch.isfinite(buffer).all()).to(torch.float32).reshape(1)
        self._allreduce(agreed, ws)
        agreed = agreed.tolist()

        if agreed[0] > 0:
            flags = torch.stack([~torch.isfinite(buffer[off:off + n]).all() for _, off, n in entries]).to(torch.float32)
            self._allreduce(flags, ws)
            bad = [name for (name, _, _), f in zip(entries, flags.tolist()) if f > 0]
            self.nonfinite.extend(name for name in bad if name not in self.nonfinite)
            self.skipped_buckets += 1
            buffer.zero_()
            log.warning("non-finite gradient in bucket %d (%s); bucket zeroed on every rank",
                        index, ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else ""))
            return

        if decide:
            codec = policy.decide_bucket(index, [name for name, _, _ in auto], sum(n for _, _, n in auto),
                                         self.step)
            self._check_agreed(codec, index, ws, buffer.device)
        codecs = [policy.choices.get(name, "none") if r == "auto" else r for (name, _, _), r in zip(entries, rules)]

        for codec in CODEC_ORDER:
            members = [e for e, c in zip(entries, codecs) if c == codec]
            if not members:
                continue
            spans = [(off, n) for _, off, n in members]
            numel = sum(n for _, n in spans)
            flat, is_view = _gather(buffer, spans)
            if codec == "none":
                flat.div_(ws)
                self._allreduce(flat, ws, numel)
                result = flat
            elif codec == "fp16":
                half = fp16_prepare(flat, ws)
                self._allreduce(half, ws, numel)
                flat.copy_(half)
                result = flat
            else:
                names = tuple(name for name, _, _ in members)
                slot = self._slot(codec, names, tuple(n for _, n in spans), ws, buffer.device)
                # float32 buckets get the result in place (flat: a view of the bucket where the
                # members are adjacent); bf16/fp16 ones are copied back.
                out = flat if flat.dtype == torch.float32 else None
                result = compressed_allreduce(flat, policy.codec(codec), slot.state, self.group, self.stats, out=out)
                if is_view and out is None:
                    flat.copy_(result)
            if not is_view:
                _scatter(buffer, spans, result)


def _gather(buffer: torch.Tensor, spans: list[tuple[int, int]]) -> tuple[torch.Tensor, bool]:
    """The spans' elements as one flat tensor: a view of the buffer when they are adjacent."""
    adjacent = all(spans[k + 1][0] == spans[k][0] + spans[k][1] for k in range(len(spans) - 1))
    if adjacent:
        start = spans[0][0]
        return buffer[start:start + sum(n for _, n in spans)], True
    return torch.cat([buffer[o:o + n] for o, n in spans]), False


def _scatter(buffer: torch.Tensor, spans: list[tuple[int, int]], flat: torch.Tensor) -> None:
    at = 0
    for o, n in spans:
        buffer[o:o + n].copy_(flat[at:at + n])
        at += n


def compressed_allreduce_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: `ddp_model.register_comm_hook(state, compressed_allreduce_hook)`.
    Averages the bucket per the policy (see the module docstring); returns a completed future
    of the bucket buffer, or with `state.overlap` a future the exchange thread completes. (This
    module has no `from __future__ import annotations`: DDP checks these annotations at runtime
    and rejects strings.)"""
    if state.overlap:
        return state.submit(bucket)
    job = state._job(bucket)
    buffer = job.buffer
    start = time.perf_counter()
    with state.stats.timed(buffer.device):
        state._process(job)
    if state.timer is not None:
        state.timer.comm_interval(start, time.perf_counter())
    # A future holding CUDA tensors must name their devices (torch.futures.Future's contract),
    # so that DDP's wait synchronises with the stream the result was written on.
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future(
        devices=[buffer.device] if buffer.is_cuda else None)
    fut.set_result(buffer)
    return fut


class _Job:
    __slots__ = ("index", "is_last", "entries", "buffer")

    def __init__(self, index: int, is_last: bool, entries: list[tuple[str, int, int]], buffer: torch.Tensor):
        self.index, self.is_last, self.entries, self.buffer = index, is_last, entries, buffer


class _ExchangeThread:
    """One daemon thread running the submitted buckets in order (a stuck collective never holds
    up the interpreter's exit, unlike a ThreadPoolExecutor's worker)."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="rapidfire-exchange", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (work := self._queue.get()) is not None:
            work()

    def submit(self, work) -> None:
        self._queue.put(work)

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)
