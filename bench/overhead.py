"""Overhead of rapidfire-ray over plain TRL, side by side in one run.

The same SFT job (model, data, max_length, batch, steps, threads) twice:
  1. plain TRL `SFTTrainer` in this process (TRL tokenises and collates the dataset itself);
  2. `rapidfire_ray.train` with 1 Ray Train worker (Ray Data tokenises; our loader feeds TRL).
Both see the same rows in the same order (plain TRL gets the order our loader produces, with
sequential sampling), so batches and padding are identical. Both are timed by one rule: tokens
that are not padding, over the wall time of the training loop (first step start to last step
end), so model loading and Ray start-up are excluded.
Prints the ratio ours/plain and writes bench/results/overhead.json.

    python bench/overhead.py [--model smollm2-135m] [--steps 30] [--batch 4] [--max-length 256]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(REPO, "jobs", "data", "sft_sample.jsonl")


def overrides(args, out: str) -> dict:
    return {"run.name": "bench-overhead", "run.output_dir": out, "run.seed": 42, "model.name": args.model,
            "data.path": DATA, "data.format": "prompt_completion", "data.max_length": args.max_length,
            "train.max_steps": args.steps, "train.per_device_batch_size": args.batch,
            "train.lr_scheduler": "linear", "train.log_every_steps": 1, "optimizer.params.lr": 5e-5,
            "scaling.num_workers": 1, "scaling.cpus_per_worker": args.threads, "checkpoint.every_steps": 0}


def our_row_order(args) -> list[int]:
    """Line numbers of the sample file in the order a 1-worker rapidfire run trains on them."""
    import ray

    from rapidfire_ray.config import load_config
    from rapidfire_ray.data.loader import ShardLoader
    from rapidfire_ray.data.prepare import build_sft_dataset
    from rapidfire_ray.data.sharding import TRAIN, ExactSplitDataConfig
    from rapidfire_ray.driver.cluster import connect

    cfg = load_config(None, overrides(args, tempfile.gettempdir()))
    connect(None, cfg)
    ds, report = build_sft_dataset(cfg, num_cpus=max(1, int(ray.available_resources().get("CPU", 1)) - 1))
    [shard] = [its[TRAIN] for its in ExactSplitDataConfig().configure({TRAIN: ds}, 1, None, None)]
    loader = ShardLoader(shard, num_rows=report.rows, rank=0, world_size=1, batch_size=args.batch,
                         pad_id=0, seed=cfg.run.seed, with_sources=True)
    sources = [s for batch in loader for s in batch["sources"]]
    return [int(s.rsplit(":", 1)[1]) for s in sources[: args.steps * args.batch]]


def plain_trl(args, order: list[int]) -> dict:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from rapidfire_ray.models import load_model, load_tokenizer

    torch.set_num_threads(args.threads)
    rows = [json.loads(line) for line in open(DATA, encoding="utf-8")]
    ds = Dataset.from_list([{"prompt": rows[n - 1]["prompt"], "completion": rows[n - 1]["completion"]}
                            for n in order])
    tokenizer, model = load_tokenizer(args.model), load_model(args.model)

    class Clock(TrainerCallback):
        """Times the training loop the way our run summary does, and keeps TRL's logs."""

        def __init__(self):
            self.start = self.end = None
            self.step_times = []
            self.logs = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.start = self.end = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            self.step_times.append(now - self.end)
            self.end = now

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs or {}))

    clock = Clock()
    with tempfile.TemporaryDirectory() as out:
        cfg = SFTConfig(output_dir=out, max_steps=args.steps, per_device_train_batch_size=args.batch,
                        learning_rate=5e-5, max_length=args.max_length, use_cpu=True, bf16=False, fp16=False,
                        activation_checkpointing=False, report_to="none", logging_steps=1, save_strategy="no",
                        disable_tqdm=True, seed=42, train_sampling_strategy="sequential")
        trainer = SFTTrainer(model=model, args=cfg, train_dataset=ds, processing_class=tokenizer,
                             callbacks=[clock])
        trainer.train()
    logs = clock.logs
    tokens = max(int(float(entry.get("num_tokens", 0))) for entry in logs)
    seconds = clock.end - clock.start
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "final_loss": float(next(e["loss"] for e in reversed(logs) if "loss" in e)),
            "step_times_s": clock.step_times}


def rapidfire(args) -> dict:
    import rapidfire_ray

    with tempfile.TemporaryDirectory() as out:
        s = rapidfire_ray.train(None, overrides=overrides(args, out))
        with open(os.path.join(out, "bench-overhead", "steps.jsonl"), encoding="utf-8") as f:
            steps = [json.loads(line) for line in f]
    return {"tokens": s["tokens"], "seconds": s["train_time_s"], "tokens_per_s": s["tokens_per_s"],
            "final_loss": s["final_loss"], "time_breakdown": s["time_breakdown"],
            "step_times_s": [r["phases"]["step"] for r in steps if r["rank"] == 0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results", "overhead.json"))
    args = p.parse_args()

    print(f"[bench] plain TRL SFTTrainer: {args.model}, {args.steps} steps, batch {args.batch}, "
          f"max_length {args.max_length}, {args.threads} threads", flush=True)
    order = our_row_order(args)
    plain = plain_trl(args, order)
    print(f"[bench] plain TRL: {plain['tokens_per_s']:.1f} tokens/s", flush=True)
    print("[bench] rapidfire train, 1 worker", flush=True)
    ours = rapidfire(args)
    ratio = ours["tokens_per_s"] / plain["tokens_per_s"]
    # Both runs train on identical batches, so step i of one pairs with step i of the other; the
    # median of per-step ratios (first step, the warm-up, left out) resists the machine's noise.
    paired = statistics.median(p / o for p, o in zip(plain["step_times_s"][1:], ours["step_times_s"][1:]))
    print(f"[bench] rapidfire: {ours['tokens_per_s']:.1f} tokens/s; ratio ours/plain = {ratio:.3f}, "
          f"median per-step ratio = {paired:.3f} (target >= 0.95)", flush=True)
    result = {"benchmark": "overhead", "date": time.strftime("%Y-%m-%d"), "machine": {
        "cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0]},
        "settings": vars(args), "plain_trl": plain, "rapidfire": ours, "ratio_tokens_per_s": round(ratio, 4),
        "median_paired_step_ratio": round(paired, 4)}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    tmp = f"{args.out}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=2)
    os.replace(tmp, args.out)
    print(f"[bench] wrote {args.out}")


if __name__ == "__main__":
    main()
