"""Injected faults for benchmarks and tests, switched on by environment variables of the driver
(passed on to the training workers); off unless set.

RAPIDFIRE_INJECT_SLOW_RANKS="RANK:FACTOR[,RANK:FACTOR...]": those ranks' forward and backward
take FACTOR times as long (after computing, the worker sleeps FACTOR - 1 times the compute it
just did, communication left out): a straggler, as a slower or busier accelerator would make
one. Used by `bench/parameter_server.py` (straggler) and the staleness tests.

RAPIDFIRE_INJECT_CRASH="STAGE:STEP": in a run of train.stage STAGE, rank 0 raises
`InjectedCrash` when it starts optimizer step STEP (an interruption, e.g. to test that a pipeline
resumes at the stage where it stopped; the callback is `worker.parts.CrashAt`).

RAPIDFIRE_DATA_DELAY_S="SECONDS": every training worker's data loader waits SECONDS before each
batch it prepares: a slow data source (a real wait, counted as data wait).

RAPIDFIRE_INJECT_KILL_SLOT="CONFIG:CHUNK[:TIMES][,...]": in an experiment, the driver kills the
slot actor (`ray.kill`) right after handing it config CONFIG's chunk CHUNK (1-based), the first
TIMES times (default 1): a slot lost mid-chunk, as a dead node makes one.

RAPIDFIRE_INJECT_OOM_ROWS="N": in an experiment, a slot's forward pass over more than N rows
raises `torch.OutOfMemoryError`: a device too small for a co-batched group (k configs' rows in one
pass) that fits each config alone.

This module stays free of torch and transformers: the driver imports it before it starts Ray.
"""
from __future__ import annotations

import os
import time

from .errors import RapidfireError

SLOW_RANKS = "RAPIDFIRE_INJECT_SLOW_RANKS"
CRASH = "RAPIDFIRE_INJECT_CRASH"
KILL_SLOT = "RAPIDFIRE_INJECT_KILL_SLOT"
OOM_ROWS = "RAPIDFIRE_INJECT_OOM_ROWS"
DATA_DELAY = "RAPIDFIRE_DATA_DELAY_S"
ENV_KEYS = (SLOW_RANKS, CRASH, DATA_DELAY)


class InjectedCrash(RuntimeError):
    """The failure RAPIDFIRE_INJECT_CRASH asked for."""


def parse_slow_ranks(text: str) -> dict[int, float]:
    out: dict[int, float] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        rank, sep, factor = item.partition(":")
        try:
            r, f = int(rank), float(factor)
        except ValueError:
            r, f = -1, 0.0
        if not sep or r < 0 or f < 1.0:
            raise RapidfireError(f"{SLOW_RANKS}={text!r}: '{item}' is not RANK:FACTOR with RANK >= 0 and "
                                 "FACTOR >= 1 (e.g. 1:3 slows rank 1 three times)")
        out[r] = f
    return out


def slowdown_for_rank(rank: int, environ=os.environ) -> float:
    """The compute slowdown factor injected for `rank` (1.0: none)."""
    return parse_slow_ranks(environ.get(SLOW_RANKS, "")).get(rank, 1.0)


def crash_step(stage: str, rank: int, environ=os.environ) -> int | None:
    """The optimizer step at which this worker must crash (None: never)."""
    text = environ.get(CRASH, "")
    if not text:
        return None
    where, sep, step = text.partition(":")
    if not sep or not step.strip().isdigit() or int(step) < 1:
        raise RapidfireError(f"{CRASH}={text!r}: expected STAGE:STEP with STEP >= 1 (e.g. reward:3)")
    return int(step) if where.strip() == stage and rank == 0 else None


def data_delay_s(environ=os.environ) -> float:
    """Seconds the data loader waits before each batch (RAPIDFIRE_DATA_DELAY_S; 0: none)."""
    text = environ.get(DATA_DELAY, "").strip()
    try:
        delay = float(text or 0.0)
    except ValueError:
        delay = -1.0
    if not delay >= 0.0:
        raise RapidfireError(f"{DATA_DELAY}={text!r}: expected seconds >= 0 (e.g. 0.5)")
    return delay


def slot_kills(environ=os.environ) -> dict[tuple[str, int], int]:
    """(config id, chunk) -> how many times its slot is killed (RAPIDFIRE_INJECT_KILL_SLOT)."""
    text = environ.get(KILL_SLOT, "")
    out: dict[tuple[str, int], int] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        parts = item.split(":")
        ok = len(parts) in (2, 3) and parts[0] and all(x.isdigit() and int(x) >= 1 for x in parts[1:])
        if not ok:
            raise RapidfireError(f"{KILL_SLOT}={text!r}: '{item}' is not CONFIG:CHUNK[:TIMES] with CHUNK, TIMES "
                                 ">= 1 (e.g. c0:2 kills c0's slot in chunk 2 once)")
        out[(parts[0], int(parts[1]))] = int(parts[2]) if len(parts) == 3 else 1
    return out


def oom_rows(environ=os.environ) -> int | None:
    """The most rows a slot's forward pass may take before an injected out-of-memory (None: no limit)."""
    text = environ.get(OOM_ROWS, "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise RapidfireError(f"{OOM_ROWS}={text!r}: expected a number of rows >= 1 (e.g. 8)")
    return int(text)


def slot_env(environ=os.environ) -> dict[str, str]:
    """The experiment slots' fault-injection variables set on the driver, checked, for their runtime env."""
    return {OOM_ROWS: str(oom_rows(environ))} if oom_rows(environ) is not None else {}


def cap_forward_rows(model, environ=os.environ) -> None:
    """Make `model`'s forward raise torch.OutOfMemoryError over RAPIDFIRE_INJECT_OOM_ROWS rows (if set)."""
    limit = oom_rows(environ)
    if limit is None:
        return
    import torch

    def check(module, args):
        if args[0].shape[0] > limit:
            raise torch.OutOfMemoryError(f"injected: a forward pass over {args[0].shape[0]} rows, more than the "
                                         f"{limit} this device holds ({OOM_ROWS})")

    # on the input embedding: every forward reaches it through its call (a PEFT wrapper calls the
    # model's forward method directly, past the model's own hooks)
    model.get_input_embeddings().register_forward_pre_hook(check)


def worker_env(environ=os.environ) -> dict[str, str]:
    """The fault-injection variables set on the driver, checked, for the workers' runtime env."""
    if SLOW_RANKS in environ:
        parse_slow_ranks(environ[SLOW_RANKS])
    if CRASH in environ:
        crash_step("", 0, environ)
    data_delay_s(environ)
    return {k: environ[k] for k in ENV_KEYS if k in environ}


class Straggler:
    """An injected slow rank: after each forward+backward it sleeps (factor - 1) times the compute
    it just did (communication in flight left out)."""

    def __init__(self, factor: float):
        self.factor = factor

    @classmethod
    def for_rank(cls, rank: int, environ=os.environ) -> Straggler | None:
        factor = slowdown_for_rank(rank, environ)
        return cls(factor) if factor > 1.0 else None

    def slow_down(self, start: float, timer) -> None:
        compute = time.perf_counter() - start - timer.comm_seconds_since(start)
        time.sleep((self.factor - 1.0) * max(0.0, compute))
