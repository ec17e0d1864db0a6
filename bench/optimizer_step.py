"""The part of a step after backward, in one run on 2 gloo ranks (one core each) with
SmolLM2-135M's parameters (random init, real shapes): plain data-parallel AdamW (fp32 allreduce
of the gradients in DDP-sized 25 MB buckets, then torch.optim.AdamW) against RapidfireAdamW's
compressed stage (1-bit momentum exchange with error feedback, then its update). The two are
timed alternately on the same gradients; medians and their ratio go to
bench/results/optimizer_step.json. A benchmark, not a test.

    python bench/optimizer_step.py [--steps 6] [--out bench/results/optimizer_step.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model_params() -> list[tuple[str, torch.Size]]:
    from transformers import AutoConfig, AutoModelForCausalLM

    from rapidfire_ray.models import smollm2

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(smollm2.ensure_cache()))
    return [(name, p.shape) for name, p in model.named_parameters()]


def _groups(params: list[tuple[str, torch.nn.Parameter]]) -> list[dict]:
    decay = [p for name, p in params if p.dim() >= 2]
    rest = [p for name, p in params if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}]


def _allreduce_grads(params: list[torch.nn.Parameter], ws: int) -> None:
    """DDP's exchange: gradients copied into ~25 MB buckets, each all_reduced and divided."""
    bucket: list[torch.nn.Parameter] = []
    size = 0

    def flush():
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])
        dist.all_reduce(flat)
        flat.div_(ws)
        at = 0
        for p in bucket:
            p.grad.copy_(flat[at:at + p.numel()].view_as(p.grad))
            at += p.numel()

    for p in reversed(params):  # DDP's bucket order: last layers first
        bucket.append(p)
        size += p.numel() * 4
        if size >= BUCKET_BYTES:
            flush()
            bucket, size = [], 0
    if bucket:
        flush()


def _worker(rank: int, ws: int, port: int, steps: int, shapes, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ws,
                            timeout=datetime.timedelta(seconds=300))
    from rapidfire_ray.optim import RapidfireAdamW

    torch.manual_seed(0)
    named = {way: [(n, torch.nn.Parameter(torch.randn(s) * 0.02)) for n, s in shapes] for way in ("plain", "ours")}
    opts = {"plain": torch.optim.AdamW(_groups(named["plain"]), lr=1e-4),
            "ours": RapidfireAdamW(_groups(named["ours"]), lr=1e-4, freeze_step=1)}
    times: dict[str, list[float]] = {"plain": [], "ours": []}
    g = torch.Generator().manual_seed(rank)
    for step in range(steps + 2):  # step 0: RapidfireAdamW's warm-up; step 1: first compressed (compiles)
        grads = [torch.randn(s, generator=g) * 1e-3 for _, s in shapes]
        for way in ("plain", "ours") if step % 2 else ("ours", "plain"):
            params = [p for _, p in named[way]]
            for p, grad in zip(params, grads):
                p.grad = grad.clone()
            dist.barrier()
            start = time.perf_counter()
            if way == "plain" or step == 0:
                _allreduce_grads(params, ws)
            opts[way].step()
            took = time.perf_counter() - start
            if step >= 2:
                times[way].append(took)
        if rank == 0:
            print(f"[bench] step {step}: plain {times['plain'][-1] if step >= 2 else float('nan'):.2f} s, "
                  f"ours {times['ours'][-1] if step >= 2 else float('nan'):.2f} s", flush=True)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"times": times}, f)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6, help="timed steps per way (after 2 untimed)")
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results", "optimizer_step.json"))
    args = p.parse_args()
    shapes = _model_params()
    numel = sum(s.numel() for _, s in shapes)
    print(f"[bench] SmolLM2-135M shapes: {len(shapes)} tensors, {numel / 1e6:.1f}M parameters; 2 gloo ranks, "
          f"{args.steps} timed steps per way", flush=True)
    raw = os.path.join(os.path.dirname(os.path.abspath(args.out)), ".optimizer_step_raw.json")
    mp.spawn(_worker, args=(2, _free_port(), args.steps, shapes, raw), nprocs=2)
    with open(raw) as f:
        got = json.load(f)
    os.remove(raw)
    plain, ours = (statistics.median(got["times"][k]) for k in ("plain", "ours"))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    result = {"what": "seconds after backward per step, rank 0, median: fp32 allreduce (25 MB buckets) + "
                      "torch AdamW vs RapidfireAdamW compressed stage (1-bit momentum exchange + update)",
              "date": datetime.date.today().isoformat(), "commit": commit, "machine": platform.processor() or
              platform.machine(), "cpus": os.cpu_count(), "ranks": 2, "threads_per_rank": 1,
              "parameters": numel, "plain_s": round(plain, 3), "rapidfire_adamw_s": round(ours, 3),
              "speedup": round(plain / ours, 2), "plain_all_s": [round(t, 3) for t in got["times"]["plain"]],
              "rapidfire_adamw_all_s": [round(t, 3) for t in got["times"]["ours"]]}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(f"[bench] plain allreduce + AdamW {plain:.2f} s, RapidfireAdamW {ours:.2f} s per step "
          f"(median): {plain / ours:.2f}x; wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
