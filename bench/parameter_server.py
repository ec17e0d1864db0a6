"""Parameter-server mode against synchronous allreduce, side by side in one run (issue 5).

All runs are the real `rapidfire train` path (Python API) on one embedded Ray cluster, SFT of a
small randomly initialised Llama (byte tokenizer; --hidden/--layers set its size, default about
3.3M parameters, so a step is mostly compute and not start-up) on jobs/data/sft_sample.jsonl.

Parts (`--parts`, default all):
- straggler: 4 workers, rank 3 slowed --slow-factor x by an injected delay
  (RAPIDFIRE_INJECT_SLOW_RANKS, rapidfire_ray/faults.py: after its forward+backward the worker
  sleeps (factor - 1) x the compute it just did). `allreduce` (AdamW, fp32) against
  `parameter_server` (2 shards, --codec, --staleness, --ps-optimizer). Reported: samples/s
  while every worker trains (from the first step every worker has finished to the first
  worker's last step: the
  system's throughput with a straggler in it) and end to end (all samples / training wall
  time). Every worker trains its own shard of the data for the same number of steps in both
  modes, so end to end the run still waits for the straggler's last step.
- convergence: 2 workers, no straggler, the same samples: the loss of the final model on
  held-out rows (the last --heldout rows of the sample data, never trained on; the same rows
  for every run), and the final and last-quarter training loss, of `parameter_server` (AdamW
  with codec none and --codec, and `rapidfire_adamw` with --codec) against `allreduce`; bytes
  per step each way. The training loss of a parameter-server run is rank 0's own batch (there
  is no gather), allreduce's the mean over both workers: the held-out loss is the comparison.
  `max_staleness` --conv-staleness (default 1).
- shards: 4 workers, `parameter_server` with 1, 2 and 4 shards: updates/s per shard and in all,
  push/pull latency, the workers' admission wait: whether the server is the bottleneck.

On this 2-core machine N workers share 2 cores (no GPU): compute per step grows with the number
of busy workers, which favours a mode whose straggler sleeps. Writes
bench/results/parameter_server.json.

    python bench/parameter_server.py [--parts straggler convergence shards] [--steps 16]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time

os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from heldout import heldout_loss, split_data  # noqa: E402  (bench/heldout.py, beside this script)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "jobs", "configs", "tiny.yaml")


def say(msg: str) -> None:
    print(f"[bench] {msg}", flush=True)


def make_model(path: str, hidden: int, layers: int) -> int:
    """A randomly initialised Llama with tiny-random's byte tokenizer, saved as an HF directory."""
    import torch
    from transformers import LlamaForCausalLM

    from rapidfire_ray.models import tiny

    tokenizer = tiny.build_tokenizer()
    config = tiny.build_config(len(tokenizer))
    config.hidden_size, config.intermediate_size, config.num_hidden_layers = hidden, 2 * hidden, layers
    config.num_attention_heads, config.num_key_value_heads = max(4, hidden // 64), max(2, hidden // 128)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


@contextlib.contextmanager
def env(**values):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update({k: v for k, v in values.items() if v is not None})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run(args, model_dir: str, out: str, name: str, workers: int, slow: str | None = None, **overrides) -> dict:
    import rapidfire_ray

    base = {"run.name": name, "run.output_dir": out, "model.name": model_dir, "data.path": args.train_data,
            "data.max_length": args.max_length, "train.max_steps": args.steps,
            "train.per_device_batch_size": args.batch, "optimizer.params.lr": args.lr,
            "checkpoint.every_steps": 0, "scaling.num_workers": workers, "scaling.cpus_per_worker": 1}
    say(f"{name}: {workers} workers, {args.steps} steps" + (f", slowed ranks {slow}" if slow else ""))
    with env(RAPIDFIRE_INJECT_SLOW_RANKS=slow):
        t0 = time.perf_counter()
        s = rapidfire_ray.train(TINY, overrides={**base, **overrides})
        wall = time.perf_counter() - t0
    with open(os.path.join(out, name, "steps.jsonl"), encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    result = {"name": name, "workers": workers, "overrides": overrides, "slow_ranks": slow,
              "final_loss": s["final_loss"], "first_loss": s["first_loss"],
              "loss_history": [h["loss"] for h in s["loss_history"]], "samples": s["samples"],
              "train_time_s": s["train_time_s"], "call_wall_s": round(wall, 2),
              "samples_per_s_end_to_end": round(s["samples"] / s["train_time_s"], 3),
              "while_all_train": while_all_train(records),
              "communication": s["communication"], "parameter_server": s.get("parameter_server")}
    if args.heldout_rows:
        result["heldout_loss"] = round(heldout_loss(os.path.join(out, name, "model"), args.heldout_rows,
                                                    args.max_length), 4)
    ps = s.get("parameter_server")
    say(f"  loss {s['first_loss']:.4f} -> {s['final_loss']:.4f}"
        + (f", held-out {result['heldout_loss']:.4f}" if "heldout_loss" in result else "") + "; samples/s end to end "
        f"{result['samples_per_s_end_to_end']}, while all train {result['while_all_train']['samples_per_s']}"
        + (f"; staleness {ps['staleness_hist']}, updates/s per shard {ps['updates_per_s_per_shard']}" if ps else ""))
    return result


def while_all_train(records: list[dict]) -> dict:
    """Samples/s over the window in which every worker is training: from the moment every rank
    has finished its first step to the moment the first rank finishes its last one; samples
    counted at the step ends inside it."""
    by_rank: dict[int, list[dict]] = {}
    for r in records:
        by_rank.setdefault(r["rank"], []).append(r)
    for rs in by_rank.values():
        rs.sort(key=lambda r: r["time"])
    start = max(rs[0]["time"] for rs in by_rank.values())
    end = min(rs[-1]["time"] for rs in by_rank.values())
    samples = sum(r["samples"] for rs in by_rank.values() for r in rs if start < r["time"] <= end)
    steps = {rank: sum(1 for r in rs if start < r["time"] <= end) for rank, rs in by_rank.items()}
    span = end - start
    return {"window_s": round(span, 3), "samples": samples, "steps_per_rank": steps,
            "samples_per_s": round(samples / span, 3) if span > 0 else None}


def ps_numbers(r: dict) -> dict:
    ps = r["parameter_server"]
    return {k: ps.get(k) for k in ("num_shards", "pushes", "applied", "staleness_hist", "staleness_max",
                                   "updates_per_s_per_shard", "push_latency_p50_s", "push_latency_p99_s",
                                   "pull_latency_p50_s", "pull_latency_p99_s", "bytes_pushed_per_step",
                                   "bytes_pulled_per_step", "queue_depth_max", "refusals")}


def straggler(args, model_dir: str, out: str) -> dict:
    slow = f"3:{args.slow_factor:g}"
    sync = run(args, model_dir, out, "straggler-allreduce", 4, slow)
    ps = run(args, model_dir, out, "straggler-ps", 4, slow, **{
        "communication.mode": "parameter_server", "communication.ps.num_shards": 2,
        "communication.ps.max_staleness": args.staleness, "optimizer.params.compression.grad": args.codec,
        "optimizer.type": args.ps_optimizer})
    ratio = ps["while_all_train"]["samples_per_s"] / sync["while_all_train"]["samples_per_s"]
    e2e = ps["samples_per_s_end_to_end"] / sync["samples_per_s_end_to_end"]
    say(f"straggler: samples/s while all train {ratio:.2f}x allreduce (target >= 1.5x); end to end {e2e:.2f}x")
    return {"allreduce": sync, "parameter_server": ps, "ps_numbers": ps_numbers(ps),
            "samples_per_s_ratio_while_all_train": round(ratio, 3), "samples_per_s_ratio_end_to_end": round(e2e, 3)}


def tail_loss(r: dict) -> float:
    """Mean loss of the last quarter of the steps (at least 2): one step's loss on its own batch
    swings by several percent from step to step."""
    h = r["loss_history"]
    return statistics.mean(h[-max(2, len(h) // 4):])


def convergence(args, model_dir: str, out: str) -> dict:
    sync = run(args, model_dir, out, "conv-allreduce", 2)
    res = {"allreduce": {**sync, "tail_loss": round(tail_loss(sync), 4)}}
    variants = [("adamw", c) for c in dict.fromkeys(["none", args.codec])]
    if args.codec != "none":
        variants.append(("rapidfire_adamw", args.codec))
    for optimizer, codec in variants:
        key = f"parameter_server_{codec}" + ("_rapidfire_adamw" if optimizer == "rapidfire_adamw" else "")
        r = run(args, model_dir, out, key.replace("parameter_server", "conv-ps").replace("_", "-"), 2, **{
            "communication.mode": "parameter_server", "communication.ps.num_shards": 2,
            "communication.ps.max_staleness": args.conv_staleness, "optimizer.type": optimizer,
            "optimizer.params.compression.grad": codec})
        gap = r["final_loss"] / sync["final_loss"] - 1
        tail_gap = tail_loss(r) / tail_loss(sync) - 1
        heldout_gap = r["heldout_loss"] / sync["heldout_loss"] - 1
        ps = r["parameter_server"]
        fp32 = sync["communication"]["bytes_sent_per_step"]
        res[key] = {**r, "ps_numbers": ps_numbers(r), "final_loss_gap": round(gap, 4),
                    "tail_loss": round(tail_loss(r), 4), "tail_loss_gap": round(tail_gap, 4),
                    "heldout_loss_gap": round(heldout_gap, 4),
                    "bytes_pushed_vs_allreduce": round(ps["bytes_pushed_per_step"] / fp32, 4),
                    "bytes_pulled_vs_allreduce": round(ps["bytes_pulled_per_step"] / fp32, 4)}
        say(f"convergence ({optimizer}, {codec}): held-out loss {r['heldout_loss']:.4f} vs allreduce "
            f"{sync['heldout_loss']:.4f} ({heldout_gap:+.2%}; target within 3%); training loss: final "
            f"{r['final_loss']:.4f} vs {sync['final_loss']:.4f} ({gap:+.2%}), last quarter {tail_loss(r):.4f} vs "
            f"{tail_loss(sync):.4f} ({tail_gap:+.2%}); bytes per step per worker pushed {ps['bytes_pushed_per_step']:,} "
            f"pulled {ps['bytes_pulled_per_step']:,}, allreduce sent {fp32:,}")
    return res


def shards(args, model_dir: str, out: str) -> dict:
    res = {}
    for n in (1, 2, 4):
        r = run(args, model_dir, out, f"shards-{n}", 4, **{
            "communication.mode": "parameter_server", "communication.ps.num_shards": n,
            "communication.ps.max_staleness": args.staleness, "optimizer.params.compression.grad": args.codec,
            "optimizer.type": args.ps_optimizer})
        ps = r["parameter_server"]
        waits = [w.get("wait_s") for w in ps.get("workers", []) if w.get("wait_s") is not None]
        res[str(n)] = {**ps_numbers(r), "updates_per_s_total": round(sum(ps["updates_per_s_per_shard"]), 3),
                       "samples_per_s_end_to_end": r["samples_per_s_end_to_end"],
                       "worker_wait_s_mean": round(statistics.mean(waits), 4) if waits else None}
        say(f"{n} shard(s): updates/s per shard {ps['updates_per_s_per_shard']}, push p50 "
            f"{ps['push_latency_p50_s']} s, samples/s {r['samples_per_s_end_to_end']}")
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", nargs="+", default=["straggler", "convergence", "shards"],
                   choices=["straggler", "convergence", "shards"])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--codec", default="1bit", choices=["none", "fp16", "1bit", "2bit"])
    p.add_argument("--staleness", type=int, default=16, help="communication.ps.max_staleness of the 4-worker runs")
    p.add_argument("--ps-optimizer", default="rapidfire_adamw", choices=["adamw", "rapidfire_adamw"],
                   help="optimizer.type of the straggler and shards parts' parameter-server runs")
    p.add_argument("--conv-staleness", type=int, default=1,
                   help="communication.ps.max_staleness of the convergence part (0: no stale update)")
    p.add_argument("--slow-factor", type=float, default=3.0)
    p.add_argument("--heldout", type=int, default=120,
                   help="last rows of the sample data kept out of training for the held-out loss (0: none)")
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results", "parameter_server.json"))
    args = p.parse_args()
    import ray

    ray.init(num_cpus=8, runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}}, log_to_driver=False)
    result = {"benchmark": "parameter_server", "date": time.strftime("%Y-%m-%d"),
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0],
                          "note": "one embedded Ray cluster offering 8 logical CPUs on these cores; workers share them"},
              "settings": dict(vars(args))}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            args.train_data, args.heldout_rows = split_data(tmp, args.heldout)
            model_dir = os.path.join(tmp, "model")
            result["settings"]["parameters"] = make_model(model_dir, args.hidden, args.layers)
            say(f"model: {result['settings']['parameters']:,} parameters")
            for part in args.parts:
                result[part] = {"straggler": straggler, "convergence": convergence, "shards": shards}[part](
                    args, model_dir, tmp)
    finally:
        ray.shutdown()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".tmp", "w") as f:
        json.dump(result, f, indent=2)
    os.replace(args.out + ".tmp", args.out)
    say(f"wrote {args.out}")


if __name__ == "__main__":
    main()
