"""Co-batching: k LoRA configs trained in one forward/backward pass vs one after another.

The first k configs of an experiment profile (default jobs/configs/experiment_smollm2.yaml:
SmolLM2-135M, LoRA r 8 and 16, four learning rates) on the same tokenised rows, in one process
on one device, side by side in one run:
  1. one at a time: each config's ConfigRun (the slot's solo step) trains the rows;
  2. co-batched: one CoBatchRun trains all k on the same rows (experiment.co_batch: k).
Each way first trains one warm-up step per config (allocator, kernels, threads) on fresh
adapters, not timed; then the timed pass starts from fresh adapters (same seeds) again.
Reported: aggregate trained tokens/s (k x the rows' tokens / training seconds) of both ways and
their ratio (issue 20's target: >= 1.3x for 4 adapters), and each config's final step loss and
held-out loss both ways (target: within 1%; with lora.dropout > 0 the masks differ, see
experiments/cobatch.py).

    python bench/cobatch.py [--profile P] [--configs 4] [--rows 32] [--eval-rows 16]
                            [--max-length 128] [--batch 4] [--device cpu|cuda] [--threads N] [--model M]
                            [--out bench/results/cobatch.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import warnings

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def say(msg: str) -> None:
    print(f"[bench cobatch] {msg}", flush=True)


def tokenised_rows(cfg, n: int) -> list[dict]:
    """The first `n` rows of data.path, tokenised by the SFT stage's own tokenizer (no Ray)."""
    from rapidfire_ray.data.tokenize import SFTTokenizer

    with open(cfg.data.path, encoding="utf-8") as f:
        records = [json.loads(line) for _, line in zip(range(n), f)]
    batch = {"source": ["bench"] * n, "messages": [json.dumps(r["messages"]) if r.get("messages") else "" for r in records],
             "text": [r.get("text", "") for r in records], "prompt": [r.get("prompt", "") for r in records],
             "completion": [r.get("completion", "") for r in records]}
    out = SFTTokenizer(cfg.model.name, cfg.data.format, cfg.data.max_length)(batch)
    return [{"input_ids": ids, "loss_mask": mask} for ids, mask in zip(out["input_ids"], out["loss_mask"])]


def measure(profile: str, configs: int = 4, rows: int = 32, eval_rows: int = 16, max_length: int = 128,
            batch: int = 4, device: str = "cpu", threads: int | None = None, model: str | None = None) -> dict:
    """Both ways on the same rows (see the module docstring); the result without writing it."""
    import torch
    from omegaconf import OmegaConf

    from rapidfire_ray.experiments.cobatch import CoBatchRun, cobatch_key
    from rapidfire_ray.experiments.slot import ConfigRun, steps_for
    from rapidfire_ray.experiments.spec import load_experiment
    from rapidfire_ray.log import quiet_libraries
    from rapidfire_ray.models import load_model, load_tokenizer

    quiet_libraries()
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)  # peft's
    if threads:
        torch.set_num_threads(threads)
    over = {"data.max_length": max_length, "train.per_device_batch_size": batch, "run.output_dir": "/tmp"}
    if model:
        over["model.name"] = model
    exp = load_experiment(profile, over)
    cands = [c for c in exp.candidates if c.error is None][:configs]
    cfgs = [OmegaConf.to_container(c.cfg, resolve=True) for c in cands]
    if len(cfgs) < 2 or len({cobatch_key(c) for c in cfgs}) != 1:
        raise SystemExit(f"{profile}: need >= 2 configs that can share a pass; got {len(cfgs)}")
    k = len(cfgs)
    data = tokenised_rows(cands[0].cfg, rows + eval_rows)
    train_rows, held_out = data[:rows], data[rows:]
    tokens = sum(len(r["input_ids"]) for r in train_rows)
    pad = load_tokenizer(cfgs[0]["model"]["name"]).pad_token_id
    base = load_model(cfgs[0]["model"]["name"]).to(device)
    total = steps_for(len(train_rows), cfgs[0])
    warm = train_rows[:batch]
    say(f"{k} configs ({', '.join(c.id for c in cands)}: {[c.values for c in cands]}) on {cfgs[0]['model']['name']}, "
        f"{len(train_rows)} rows ({tokens} tokens, {total} steps each), batch {batch}, device {device}, "
        f"{torch.get_num_threads()} threads")

    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    # one at a time
    for cfg in cfgs:  # warm-up
        run = ConfigRun(base, cfg, total, None, device)
        run.train_rows(warm, pad)
        base = run.release()
    alone, alone_s = [], 0.0
    for cfg in cfgs:
        run = ConfigRun(base, cfg, total, None, device)
        sync()
        t = time.perf_counter()
        losses = run.train_rows(train_rows, pad)
        sync()
        alone_s += time.perf_counter() - t
        alone.append({"final_loss": losses[-1], "eval_loss": run.evaluate(held_out, pad)})
        base = run.release()
    say(f"one at a time: {alone_s:.2f} s, {k * tokens / alone_s:.1f} tokens/s")

    # co-batched
    run = CoBatchRun(base, cfgs, [total] * k, [None] * k, device)  # warm-up
    run.train_rows(warm, pad)
    base = run.release()
    run = CoBatchRun(base, cfgs, [total] * k, [None] * k, device)
    sync()
    t = time.perf_counter()
    losses = run.train_rows(train_rows, pad)
    sync()
    co_s = time.perf_counter() - t
    co_eval = run.evaluate(held_out, pad)
    run.release()
    together = [{"final_loss": losses[j][-1], "eval_loss": co_eval[j]} for j in range(k)]
    say(f"co-batched x{k}: {co_s:.2f} s, {k * tokens / co_s:.1f} tokens/s")

    rel = [max(abs(a[m] - b[m]) / abs(a[m]) for m in ("final_loss", "eval_loss")) for a, b in zip(alone, together)]
    ratio = alone_s / co_s
    say(f"aggregate tokens/s co-batched / one at a time: {ratio:.2f}x (target 1.3x: "
        f"{'met' if ratio >= 1.3 else 'not met'}); losses: max relative difference {100 * max(rel):.3f}%")
    return {
        "benchmark": "cobatch", "date": time.strftime("%Y-%m-%d"),
        "commit": subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True).stdout.strip(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0],
                    "torch": torch.__version__,
                    "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"},
        "settings": {"profile": profile, "configs": configs, "rows": rows, "eval_rows": eval_rows,
                     "max_length": max_length, "batch": batch, "device": device, "threads": torch.get_num_threads(),
                     "model": cfgs[0]["model"]["name"]},
        "configs": [c.values for c in cands], "tokens_per_config": tokens,
        "steps_per_config": total, "lora_dropout": [c["model"]["lora"]["dropout"] for c in cfgs],
        "one_at_a_time": {"train_s": round(alone_s, 3), "tokens_per_s": round(k * tokens / alone_s, 1),
                          "per_config": alone},
        "co_batched": {"train_s": round(co_s, 3), "tokens_per_s": round(k * tokens / co_s, 1),
                       "per_config": together},
        "tokens_per_s_ratio": round(ratio, 3), "target_1_3x_met": ratio >= 1.3,
        "max_rel_loss_diff": round(max(rel), 6), "losses_within_1pct": max(rel) <= 0.01,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", default=os.path.join(REPO, "jobs", "configs", "experiment_smollm2.yaml"))
    p.add_argument("--configs", type=int, default=4, help="k: the profile's first k valid configs")
    p.add_argument("--rows", type=int, default=32, help="training rows every config trains")
    p.add_argument("--eval-rows", type=int, default=16)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="train.per_device_batch_size of every config")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--model", default=None, help="model.name instead of the profile's (e.g. a local folder)")
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results", "cobatch.json"))
    args = p.parse_args()
    result = measure(args.profile, args.configs, args.rows, args.eval_rows, args.max_length, args.batch,
                     args.device, args.threads, args.model)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    say(f"wrote {args.out}")


if __name__ == "__main__":
    main()
