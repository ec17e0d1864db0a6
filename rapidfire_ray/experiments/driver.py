"""One experiment: many configs trained side by side on slots, chunk by chunk, steered live.

profile -> configs (spec.py) -> Ray -> the data read and tokenised once (Ray Data, the SFT stage's
`build_sft_dataset`), cut into `num_chunks` contiguous chunks held in the object store -> slots
(Ray actors, `slot.Slot`; `resources.workers` of them per slot, one torch.distributed group) ->
the loop: take ctl ops, make the policy's decisions (successive-halving cuts, pbt's warm clones),
hand (config, chunk) pairs, or up to `co_batch` configs at one chunk (cobatch.py), to free slots
(`scheduler.ChunkScheduler`, preferring configs whose state is on the slot's node), collect each
chunk's record and the config's state (an object ref; also written to
`configs/<id>/state-chunk<k>.pt` so --resume and a lost slot continue from the last boundary) -> experiment_summary.json rewritten at every boundary (and each
config's new records logged to MLflow, tracking.py).
"""
from __future__ import annotations

import math
import os
import time

import numpy as np
import ray
from omegaconf import OmegaConf

from ..atomic import atomic_write_json
from ..config import load_config
from ..errors import RapidfireError
from ..faults import KILL_SLOT, slot_env, slot_kills
from ..log import say, warn
from . import ops
from .cobatch import cobatch_key
from .control import start_controller
from .scheduler import FAILED, ChunkScheduler
from .slot import Slot, steps_for
from .spec import Candidate, load_experiment, short_values, validate_candidate
from .summary import SUMMARY, render_leaderboard, summary_of
from .tracking import start_tracker

SLOT_LOSSES = 2  # a config whose chunk loses its slot this many times is failed


def run_experiment(profile, overrides=(), *, address: str | None = None, resume: bool = False) -> dict:
    t_start = time.time()
    exp = load_experiment(profile, overrides)
    spec, folder = exp.spec, exp.folder
    summary_path = os.path.join(folder, SUMMARY)
    previous = _previous(summary_path, resume)
    candidates = _resumed(exp, previous) if previous else exp.candidates
    base_cfg = load_config(exp.base, {"scaling.num_workers": 1})
    from ..driver.cluster import connect, cpu_share

    connect(address, base_cfg)
    data = _Data(exp, base_cfg)
    say(data.line)
    if previous and previous.get("chunk_rows") != [len(c) for c in data.chunks]:
        raise RapidfireError(f"--resume: the chunks differ from the stopped experiment's ({previous.get('chunk_rows')} "
                             f"rows, now {[len(c) for c in data.chunks]}); keep data.*, experiment.rows, eval_* and "
                             "num_chunks as they were")
    sched = ChunkScheduler(spec.num_chunks, spec.policy, spec.eta, spec.min_chunks, spec.quantile)
    for cut in (previous or {}).get("cuts", []):
        sched.cuts_made.add(cut["after_chunk"])
        sched.cuts.append(cut)
    run = _Experiment(exp, data, sched, folder, previous, base_cfg.run.seed)
    run.t0 = t_start
    run.tracker = start_tracker(spec.tracking, exp.name, folder)
    for cand in candidates:
        run.add(cand, previous)
    valid = [c for c in candidates if c.error is None]
    slots = spec.num_slots or _fitting_slots(spec)
    slots = max(1, min(slots, math.ceil(len(valid) / spec.co_batch) or 1))
    res = spec.resources
    injected = slot_env()  # fault injection for tests (faults.py); none unless set
    slot_cls = ray.remote(Slot).options(num_cpus=cpu_share(res.cpus), num_gpus=res.gpus, max_concurrency=1,
                                        **({"runtime_env": {"env_vars": injected}} if injected else {}))
    run.slot_factory = lambda: _slot_workers(slot_cls, base_cfg.model.name, res)
    say(f"experiment {exp.name}: {len(candidates)} config(s) ({len(valid)} valid), {spec.num_chunks} chunk(s) of "
        f"~{len(data.chunks[0])} rows, held-out {len(data.eval_rows)} rows scored on {spec.metric}, policy "
        f"{spec.policy}, {slots} slot(s) of {_slot_text(res)}"
        f"{f', up to {spec.co_batch} configs co-batched per slot' if spec.co_batch > 1 else ''}; folder {folder}")
    controller = start_controller(exp.name)
    run.controller = controller
    status, error = "completed", None
    try:
        run.slots = [run.slot_factory() for _ in range(slots)]
        run.loop()
    except KeyboardInterrupt:
        status, error = "interrupted", "interrupted (Ctrl-C)"
    except Exception as e:  # noqa: BLE001 - recorded in the summary, then raised
        status, error = "failed", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        raise
    finally:
        for workers in run.slots:
            for worker in workers:
                ray.kill(worker)
        ray.kill(controller)
        summary = run.write(status, time.time() - t_start, error)
    say(render_leaderboard(summary))
    if status == "interrupted":
        from ..driver.failure import RunInterrupted

        raise RunInterrupted(f"experiment interrupted; to continue: rapidfire experiment --profile ... --resume "
                             f"(summary in {summary_path})")
    best = summary.get("best")
    say(f"done: {summary['counts']}; best {best['id']} ({best['values_text']}) {spec.metric} {best['score']:.4f}"
        if best else f"done: {summary['counts']}; no config finished a chunk")
    say(f"summary in {summary_path}")
    return summary


def _slot_workers(slot_cls, model_name: str, res) -> list:
    """One slot: its worker actors (started, loading the model; a slot of several joins them into
    one group before its first chunk, `_Experiment.join`)."""
    return [slot_cls.remote(model_name, max(1, int(res.cpus)), res.gpus > 0) for _ in range(res.workers)]


def _slot_text(res) -> str:
    each = f"{res.cpus:g} CPU {res.gpus:g} GPU"
    return each if res.workers == 1 else f"{res.workers} workers x {each}"


def _previous(path: str, resume: bool) -> dict | None:
    import json

    exists = os.path.isfile(path)
    if exists and not resume:
        raise RapidfireError(f"run.name: the experiment folder {os.path.dirname(path)} already has {SUMMARY}; pass "
                             "--resume to continue it, or choose another run.name")
    if resume and not exists:
        raise RapidfireError(f"--resume: no {SUMMARY} in {os.path.dirname(path)} to continue; run without --resume")
    if not exists:
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _resumed(exp, previous: dict) -> list[Candidate]:
    """The configs of a stopped experiment (clones too), from its summary, validated again."""
    out = []
    for c in previous["configs"]:
        cand = validate_candidate(exp.base, c["values"], c["id"], c.get("parent"))
        if c.get("error"):
            cand.error, cand.cfg = c["error"], None
        out.append(cand)
    return out


def _fitting_slots(spec) -> int:
    res = spec.resources
    avail = ray.cluster_resources()
    if res.gpus > 0:
        return max(1, int(avail.get("GPU", 0) // (res.gpus * res.workers)))
    from ..driver.cluster import cpu_share

    # one CPU stays for Ray Data and the driver's actors where the cluster has more than two
    cpus = avail.get("CPU", 1)
    cpus = cpus - 1 if cpus > 2 else cpus
    return max(1, int(cpus // max(cpu_share(res.cpus) * res.workers, 0.01)))


def _is_error(ref) -> bool:
    """Whether a ready object ref holds an error (a failed task, a lost actor)."""
    try:
        ray.get(ref, timeout=0)
        return False
    except Exception:  # noqa: BLE001 - any error is one
        return True


class _Data:
    """The experiment's rows: tokenised once, cut into contiguous chunks, shared through the object store."""

    def __init__(self, exp, cfg):
        from ..data.prepare import build_sft_dataset

        spec = exp.spec
        cpus = int(ray.available_resources().get("CPU", 1))
        ds, report = build_sft_dataset(cfg, max(1, cpus - 1 if cpus > 2 else cpus))
        rows = [{"input_ids": r["input_ids"], "loss_mask": r["loss_mask"]} for r in ds.take_all()]
        if spec.eval_path:
            eval_ds, _ = build_sft_dataset(cfg, 1, path=spec.eval_path, key="experiment.eval_path")
            self.eval_rows = [{"input_ids": r["input_ids"], "loss_mask": r["loss_mask"]} for r in eval_ds.take_all()]
        else:
            if len(rows) <= spec.eval_rows:
                raise RapidfireError(f"experiment.eval_rows: {spec.eval_rows} held-out rows leave none of the "
                                     f"{len(rows)} rows of data.path to train on; lower it or set experiment.eval_path")
            self.eval_rows, rows = rows[-spec.eval_rows:], rows[:-spec.eval_rows]
        rows = rows[:spec.rows] if spec.rows else rows
        if len(rows) < spec.num_chunks:
            raise RapidfireError(f"experiment.num_chunks: {spec.num_chunks} chunks of {len(rows)} training rows; "
                                 "lower num_chunks or use more rows")
        bounds = np.array_split(np.arange(len(rows)), spec.num_chunks)
        self.chunks = [rows[b[0]:b[-1] + 1] for b in bounds]
        self.chunk_refs = [ray.put(c) for c in self.chunks]
        self.eval_ref = ray.put(self.eval_rows)
        self.line = (f"{report.describe()}; experiment: {len(rows)} training rows in {spec.num_chunks} chunk(s), "
                     f"{len(self.eval_rows)} held out")


class _Experiment:
    """The loop's state: configs, their states (object refs), records, in-flight chunks, ctl ops."""

    def __init__(self, exp, data: _Data, sched: ChunkScheduler, folder: str, previous: dict | None, seed: int = 0):
        self.exp, self.data, self.sched, self.folder, self.seed = exp, data, sched, folder, seed
        self.cands: dict[str, Candidate] = {}
        self.states: dict[str, object] = {}  # config id -> ObjectRef of its state bytes (None: fresh)
        self.history: dict[str, list] = {}
        self.info: dict[str, dict] = {}  # parent, warm, total steps
        self.ctl_log: list = list((previous or {}).get("ctl_log", []))
        self.pending_ops: list = []
        self.inflight: dict = {}
        self.watch: dict = {}  # each in-flight worker's first record ref -> its chunk's inflight key
        self.slots: list = []
        self.slot_factory = None
        self.controller = None
        self.lost: dict[str, int] = {}
        self.joined: set[int] = set()  # multi-worker slots whose workers were asked to join
        self.slot_nodes: dict[int, str] = {}  # slot index -> its node, from its first record
        self.state_nodes: dict[str, str] = {}  # config id -> the node whose object store holds its state
        self.tracker = None  # tracking.MlflowTracker
        self.t0 = time.time()  # the experiment's start (records' at_s)
        self.kills = slot_kills()  # injected slot losses (faults.py), counted down

    def add(self, cand: Candidate, previous: dict | None = None, chunks_done: int = 0, state=None,
            warm_from: str | None = None) -> None:
        old = {c["id"]: c for c in (previous or {}).get("configs", [])}.get(cand.id, {})
        self.cands[cand.id] = cand
        self.history[cand.id] = list(old.get("history", []))
        self.info[cand.id] = {"parent": cand.parent, "warm_from": old.get("warm_from", warm_from)}
        if cand.error is not None:
            self.sched.add(cand.id, state=FAILED, reason=cand.error)
            warn(f"config {cand.id} ({short_values(cand.values)}) failed validation: {cand.error}")
            return
        cfg = OmegaConf.to_container(cand.cfg, resolve=True)
        self.info[cand.id]["plain"] = cfg
        self.info[cand.id]["total_steps"] = sum(steps_for(len(c), cfg, self.exp.spec.resources.workers)
                                                for c in self.data.chunks)
        self.info[cand.id]["cobatch_key"] = cobatch_key(cfg)
        if old:
            chunks_done = old.get("chunks_done", 0)
            path = self.state_path(cand.id, chunks_done)
            if chunks_done and os.path.isfile(path):
                with open(path, "rb") as f:
                    state = ray.put(f.read())
                self.state_nodes[cand.id] = ray.get_runtime_context().get_node_id()  # the driver's store
            elif chunks_done:
                chunks_done = 0  # no state on storage: it starts again
            st = old.get("state", "running")
            self.sched.add(cand.id, chunks_done, "running" if st == "running" else st,
                           scores=[h["score"] for h in self.history[cand.id]][:chunks_done] if chunks_done else [],
                           reason=old.get("reason"))
        else:
            self.sched.add(cand.id, chunks_done)
        self.states[cand.id] = state

    def state_path(self, cid: str, chunks_done: int) -> str:
        """A config's state after `chunks_done` chunks. Named by chunk: a crash after the slot wrote
        it but before the summary counted it leaves the summary's own boundary on storage."""
        return os.path.join(self.folder, "configs", cid, f"state-chunk{chunks_done}.pt")

    def prune_states(self, cid: str, chunks_done: int) -> None:
        """Keep the states of the last two boundaries the summary has counted."""
        for k in range(max(0, chunks_done - 1)):
            path = self.state_path(cid, k)
            if os.path.exists(path):
                os.remove(path)

    def loop(self) -> None:
        free = list(range(len(self.slots)))
        last_publish = 0.0
        while True:
            ops.apply_pending(self)
            for cid in self.sched.cut():
                say(f"config {cid} stopped: {self.sched.configs[cid].reason}")
            for ask in self.sched.take_exploits():
                ops.exploit(self, ask)
            while free and (got := self.sched.next_group(self.exp.spec.co_batch, self.group_key,
                                                         self.on_node_of(free[0]))) is not None:
                self.launch(free.pop(0), *got)
            if not self.inflight:
                if self.sched.idle() and not self.pending_ops:
                    ops.apply_pending(self)  # ops that arrived at the very end (e.g. a resume) still count
                    if self.sched.idle() and not self.pending_ops:
                        return
                time.sleep(0.2)
            else:
                ready, _ = ray.wait(list(self.watch), num_returns=1, timeout=0.5)
                for ref in ready:
                    key = self.watch.pop(ref)
                    rest = [r for r, k in self.watch.items() if k == key]
                    if rest and not _is_error(ref):
                        continue  # the slot's other workers are still on it
                    for r in rest:  # all done, or one failed: the others may wait on it in a collective
                        del self.watch[r]
                    free.append(self.collect(key))
            if time.time() - last_publish > 1.0:
                self.publish()
                last_publish = time.time()

    def join(self, slot_index: int) -> list:
        """A multi-worker slot's join, queued on its workers before its first chunk: worker 0's address
        and a free port there (waits for its start), then every worker joins (the refs: checked with
        the chunk's results). Nothing for a slot of one worker or one already joined."""
        workers = self.slots[slot_index]
        if len(workers) == 1 or slot_index in self.joined:
            return []
        self.joined.add(slot_index)
        address, port = ray.get(workers[0].rendezvous.remote())
        return [w.join.remote(address, port, rank, len(workers)) for rank, w in enumerate(workers)]

    def replace_slot(self, slot_index: int) -> None:
        """A fresh slot (its workers killed first: the others may wait on a lost one's collectives)."""
        for worker in self.slots[slot_index]:
            ray.kill(worker)
        self.slots[slot_index] = self.slot_factory()
        self.joined.discard(slot_index)
        self.slot_nodes.pop(slot_index, None)  # (it may start on another node)

    def group_key(self, cid: str) -> str:
        return self.info[cid]["cobatch_key"]

    def on_node_of(self, slot_index: int):
        """Whether a config's state is in the object store of this slot's node (the scheduler prefers
        those: its swap-in reads local memory, not the network). States read from storage at
        --resume are the driver's; a fresh config has none."""
        node = self.slot_nodes.get(slot_index)
        return lambda cid: node is not None and self.state_nodes.get(cid) == node

    def launch(self, slot_index: int, cids: list[str], chunk: int) -> None:
        """Train `cids` (one config, or a co-batched group) on chunk `chunk` on slot `slot_index`."""
        info = [self.info[cid] for cid in cids]
        workers = self.slots[slot_index]
        joins = self.join(slot_index)
        every = []  # each worker's record refs (a failure on any worker is the slot's)
        for worker in workers:  # the same call to every worker of the slot
            if len(cids) == 1:
                refs = worker.train_chunk.options(num_returns=2).remote(
                    info[0]["plain"], self.states[cids[0]], self.data.chunk_refs[chunk], self.data.eval_ref,
                    info[0]["total_steps"], self.state_path(cids[0], chunk + 1))
            else:
                refs = worker.train_group.options(num_returns=2 * len(cids)).remote(
                    [i["plain"] for i in info], self.data.chunk_refs[chunk], self.data.eval_ref,
                    [i["total_steps"] for i in info], [self.state_path(cid, chunk + 1) for cid in cids],
                    *(self.states[cid] for cid in cids))
            every.append(refs)
        rec_refs, state_refs = every[0][:len(cids)], every[0][len(cids):]  # the first worker's: it saves states
        all_recs = [ref for refs in every for ref in refs[:len(cids)]]
        local = [None if self.states[cid] is None or slot_index not in self.slot_nodes
                 else self.state_nodes.get(cid) == self.slot_nodes[slot_index] for cid in cids]
        self.inflight[rec_refs[0]] = (slot_index, cids, chunk, joins, all_recs, state_refs, local, time.time())
        for refs in every:  # the loop watches every worker's first record
            self.watch[refs[0]] = rec_refs[0]
        for cid in cids:
            if self.kills.get((cid, chunk + 1)):
                self.kills[(cid, chunk + 1)] -= 1
                warn(f"injected fault ({KILL_SLOT}): killing the slot training {cid} chunk {chunk + 1}")
                ray.kill(workers[0])
                break

    def collect(self, ref) -> int:
        slot_index, cids, chunk, joins, all_recs, state_refs, local, t0 = self.inflight.pop(ref)
        try:
            ray.get(joins)
        except ray.exceptions.RayTaskError as e:
            raise RapidfireError(f"experiment.resources.workers: slot {slot_index}'s {len(self.slots[slot_index])} workers "
                                 f"could not form a torch.distributed group ({str(e).splitlines()[-1][:200]}); check "
                                 "that the nodes reach each other, or use workers: 1") from None
        except ray.exceptions.RayActorError:
            pass  # a worker lost while joining: the chunk's results below say so
        try:
            every = ray.get(all_recs)
            records = every[:len(cids)]  # the first worker's
        except ray.exceptions.RayActorError as e:
            self.replace_slot(slot_index)  # a fresh slot; its configs retrain this chunk
            for cid in cids:
                self.lost[cid] = self.lost.get(cid, 0) + 1
                reason = f"its slot was lost {self.lost[cid]} time(s) ({str(e).splitlines()[0][:120]})"
                if self.lost[cid] >= SLOT_LOSSES:
                    self.sched.failed(cid, reason)
                    warn(f"config {cid} failed: {reason}")
                else:
                    self.sched.returned(cid)
                    warn(f"config {cid}: {reason}; chunk {chunk + 1} runs again from its last boundary")
            return slot_index
        except ray.exceptions.RayTaskError as e:
            cause = e.cause if getattr(e, "cause", None) is not None else e
            reason = f"{type(cause).__name__}: {str(cause).splitlines()[0][:200] if str(cause) else ''}"
            if len(self.slots[slot_index]) > 1:
                self.replace_slot(slot_index)  # its other workers may wait in a collective for the failed one
            if len(cids) > 1:  # which member failed is unknown: each trains this chunk again alone
                for cid in cids:
                    self.sched.configs[cid].solo = True
                    self.sched.returned(cid)
                warn(f"co-batched configs {', '.join(cids)} failed in chunk {chunk + 1} ({reason}); each trains "
                     "it again alone")
                return slot_index
            cid = cids[0]
            self.sched.failed(cid, f"chunk {chunk + 1}: {reason}")
            warn(f"config {cid} ({short_values(self.cands[cid].values)}) failed in chunk {chunk + 1}: {reason}")
            self.write("running")
            return slot_index
        for cid, record, state_ref, was_local in zip(cids, records, state_refs, local):
            self.states[cid] = state_ref
            if record.get("node"):
                self.slot_nodes[slot_index] = self.state_nodes[cid] = record["node"]
            record.update(chunk=chunk + 1, slot=slot_index, wall_s=time.time() - t0, at_s=time.time() - self.t0,
                          state_on_node=was_local)
            if len(every) > len(cids):  # a multi-worker slot: the nodes its workers ran on
                record["nodes"] = sorted({r["node"] for r in every if r.get("node")})
            busy = record["train_s"] + record["eval_s"] + record["swap_in_s"] + record["swap_out_s"]
            record["swap_fraction"] = (record["swap_in_s"] + record["swap_out_s"]) / busy if busy else 0.0
            record["score"] = record[self.exp.spec.metric]
            self.history[cid].append(record)
            self.sched.finished(cid, record["score"])
            together = f" | co-batched x{len(cids)}" if len(cids) > 1 else ""
            say(f"chunk {chunk + 1}/{self.exp.spec.num_chunks} | {cid} ({short_values(self.cands[cid].values)}) | "
                f"{self.exp.spec.metric} {record['score']:.4f} | train loss {record['train_loss']:.4f} | "
                f"{record['steps']} steps {record['train_s']:.1f}s | swap in {record['swap_in_s']:.2f}s out "
                f"{record['swap_out_s']:.2f}s ({100 * record['swap_fraction']:.1f}%){together}")
        self.write("running")
        for cid in cids:
            self.prune_states(cid, chunk + 1)
        return slot_index

    def publish(self) -> None:
        if self.controller is not None:
            self.controller.publish.remote(summary_of(self, "running"))

    def write(self, status: str, wall_s: float | None = None, error: str | None = None) -> dict:
        summary = summary_of(self, status, wall_s, error)
        os.makedirs(self.folder, exist_ok=True)
        atomic_write_json(os.path.join(self.folder, SUMMARY), summary)
        if self.controller is not None and status == "running":
            self.controller.publish.remote(summary)
        if self.tracker is not None:
            if status == "running":
                self.tracker.sync(summary)
            else:
                self.tracker.close(summary)
        return summary

