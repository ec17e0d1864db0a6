"""GPU side-by-side checks in one run (issue "Fast on GPUs", item 6). Writes bench/results/gpu.json.

Parts, each guarded (a failure is recorded with its traceback and the next part runs) and each
skipped once the time budget is spent:
  env       versions and device
  models    random-init SmolLM2 shapes (135M, and 1.7B: hidden 2048, 24 layers, 32 heads), saved
            beside the tokenizer (--tokenizer-dir) so both runs load the same weights
  codecs    bench/codecs.py on this device: the reference and the fused flat-bucket codecs against
            a same-size copy, GB/s of float32 input
  o135      plain TRL SFTTrainer vs `rapidfire train` (1 worker) at 135M on the same batches in
            the same order: tokens/s over the loop, first 10 steps included, and median step
  o1p7      the same at 1.7B
  mem       1.7B level0 vs level2: peak memory, step time, saved-activation bytes
  aware     what a user feels: rapidfire with memory_aware batches and precision auto against
            plain TRL with its defaults and with packing=True on the same data: real tokens/s;
            the memory model's estimate against the measured peak
  cobatch   bench/cobatch.py at 135M: 4 LoRA configs one at a time vs co-batched in one pass
            (aggregate tokens/s, losses both ways)
Run folders are deleted as it goes (a 1.7B checkpoint is 20 GB). On the GPU machine, from the
repository root, with the bundle of ../shared/device copied to .gpu/ (git-ignored):

    source .gpu/setup.sh . && python bench/gpu.py --tokenizer-dir .gpu/model135 --out $OUT/gpu.json

`--smoke` runs every part on CPU with the tiny random model and a few steps (what the tests and
a machine without a GPU can check: that the script itself works, not a figure).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import traceback

os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORDS = ("the of and to in is that for it as with was on be by at this are from or have an not they which one "
         "you were all we her she there would their will when who him been has more if no out so said what up "
         "its about into than them can only other new some could time these two may then do first any my now "
         "such like our over even most made after also did many before must through back years where much your "
         "way well down should because each just those people how too little state good very make world still "
         "gradient batch memory cluster worker node model train token layer weight learning rate optimizer").split()

SHAPES = {"m135": {}, "m1p7": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 24,
                                "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 64}}


class Bench:
    """The parts' shared state: settings, results, the time budget, the run folders."""

    def __init__(self, args):
        self.args = args
        self.results: dict = {"benchmark": "gpu", "date": time.strftime("%Y-%m-%d"), "smoke": args.smoke}
        self.t0 = time.time()
        self.work = tempfile.mkdtemp(prefix="rf-gpu-")
        self.models: dict[str, str] = {}
        self.data = os.path.join(self.work, "data.jsonl")
        make_data(self.data, 200 if args.smoke else 3000)

    def save(self) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(self.args.out)), exist_ok=True)
        tmp = self.args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.results, f, indent=1, default=str)
        os.replace(tmp, self.args.out)

    def part(self, name: str, fn) -> None:
        left = self.args.budget_s - (time.time() - self.t0)
        if left < 25:
            self.results[name] = {"skipped": f"time budget: {left:.0f} s left"}
            self.save()
            return
        print(f"[gpu] {name} (t={time.time() - self.t0:.0f} s)", flush=True)
        t = time.time()
        try:
            self.results[name] = {"ok": True, **(fn(self) or {}), "wall_s": round(time.time() - t, 1)}
        except BaseException as e:  # noqa: BLE001 (recorded, the next part runs; Ctrl-C still stops below)
            self.results[name] = {"ok": False, "wall_s": round(time.time() - t, 1),
                                  "error": f"{type(e).__name__}: {e}"[:2000], "traceback": traceback.format_exc()[-4000:]}
            print(traceback.format_exc(), flush=True)
            if isinstance(e, KeyboardInterrupt):
                raise
        self.save()
        print(f"[gpu] {name}: {json.dumps(_short(self.results[name]), default=str)[:1200]}", flush=True)

    @property
    def cuda(self) -> bool:
        return not self.args.smoke

    def steps(self, n: int) -> int:
        return 4 if self.args.smoke else n

    def model(self, key: str) -> str:
        return "tiny-random" if self.args.smoke else self.models[key]


def _short(value):
    if isinstance(value, dict):
        return {k: _short(v) for k, v in value.items() if k not in ("traceback", "step_times_s", "summary")}
    return value


def make_data(path: str, n: int, seed: int = 0) -> None:
    """Prompt/completion rows with log-normal lengths (median about 300 tokens, a long tail)."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            lp = min(600, max(8, int(rng.lognormvariate(math.log(60), 0.7))))
            lc = min(900, max(8, int(rng.lognormvariate(math.log(160), 0.8))))
            f.write(json.dumps({"prompt": " ".join(rng.choice(WORDS) for _ in range(lp)),
                                "completion": " ".join(rng.choice(WORDS) for _ in range(lc))}) + "\n")


# --- parts -----------------------------------------------------------------------------------

def env(b: Bench) -> dict:
    import ray
    import torch
    import transformers
    import trl

    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
           "trl": trl.__version__, "ray": ray.__version__, "cpus": os.cpu_count()}
    if torch.cuda.is_available():
        out.update(device=torch.cuda.get_device_name(0),
                   memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1))
    elif not b.args.smoke:
        raise RuntimeError("no CUDA device: run with --smoke to check the script on CPU")
    try:
        import subprocess

        out["commit"] = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True, timeout=10).stdout.strip() or None
    except Exception:  # noqa: BLE001 (no git on the machine)
        out["commit"] = None
    return out


def models(b: Bench) -> dict:
    if b.args.smoke:
        return {"models": "tiny-random"}
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    src = b.args.tokenizer_dir
    with open(os.path.join(src, "config.json"), encoding="utf-8") as f:
        base = {k: v for k, v in json.load(f).items() if not k.startswith("_")}
    params = {}
    for name, over in SHAPES.items():
        folder = os.path.join(b.work, name)
        os.makedirs(folder, exist_ok=True)
        for fn in os.listdir(src):
            if fn != "config.json" and not fn.endswith((".safetensors", ".bin")):
                shutil.copy(os.path.join(src, fn), folder)
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = LlamaForCausalLM(LlamaConfig(**{**base, **over}))
        model.to(torch.bfloat16).save_pretrained(folder)
        params[name] = sum(p.numel() for p in model.parameters())
        b.models[name] = folder
        del model
        torch.cuda.empty_cache()
    return {"params": params}


def codecs(b: Bench) -> dict:
    import importlib.util  # bench/codecs.py by path ("codecs" is a standard library module)

    spec = importlib.util.spec_from_file_location("bench_codecs", os.path.join(REPO, "bench", "codecs.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.measure(device="cuda" if b.cuda else "cpu", scale=1.0 if b.cuda else 0.02, repeats=3)


def _overrides(b: Bench, name: str, out: str, model: str, steps: int, batch: int, **extra) -> dict:
    return {"run.name": name, "run.output_dir": out, "run.seed": 42, "model.name": model, "data.path": b.data,
            "data.format": "prompt_completion", "data.max_length": b.args.max_length, "train.max_steps": steps,
            "train.per_device_batch_size": batch, "train.log_every_steps": 1, "optimizer.params.lr": 5e-5,
            "scaling.num_workers": 1, "scaling.use_gpu": b.cuda, "checkpoint.every_steps": 0,
            "scaling.cpus_per_worker": 1 if b.args.smoke else 4,
            "train.precision": "bf16" if b.cuda else "fp32", **extra}


def ours(b: Bench, name: str, model: str, steps: int, batch: int, **extra) -> dict:
    """One `rapidfire train` run; its folder is deleted afterwards."""
    import rapidfire_ray

    out = tempfile.mkdtemp(dir=b.work)
    try:
        s = rapidfire_ray.train(None, overrides=_overrides(b, name, out, model, steps, batch, **extra))
        with open(os.path.join(out, name, "steps.jsonl"), encoding="utf-8") as f:
            records = [json.loads(line) for line in f]
    finally:
        shutil.rmtree(out, ignore_errors=True)
    mine = [r for r in records if r["rank"] == 0]
    times = [r["phases"]["step"] for r in mine]
    first = mine[:10]
    return {"tokens": s["tokens"], "seconds": s["train_time_s"], "tokens_per_s": s["tokens_per_s"],
            "first10_tokens_per_s": sum(r["tokens"] for r in first) / max(1e-9, sum(r["phases"]["step"] for r in first)),
            "median_step_s": statistics.median(times[3:] or times), "final_loss": s["final_loss"],
            "peak_memory_bytes": s.get("peak_memory_bytes"), "padding_fraction": s.get("padding_fraction"),
            "time_breakdown": s.get("time_breakdown"), "memory": s.get("memory"),
            "memory_model": s.get("memory_model"), "step_times_s": times}


def row_order(b: Bench, model: str, steps: int, batch: int) -> list[int]:
    """Line numbers of the data file in the order a 1-worker rapidfire run trains on them."""
    import ray

    from rapidfire_ray.config import load_config
    from rapidfire_ray.data.loader import ShardLoader
    from rapidfire_ray.data.prepare import build_sft_dataset
    from rapidfire_ray.data.sharding import TRAIN, ExactSplitDataConfig
    from rapidfire_ray.driver.cluster import connect

    cfg = load_config(None, _overrides(b, "order", b.work, model, steps, batch))
    connect(None, cfg)
    ds, report = build_sft_dataset(cfg, num_cpus=max(1, int(ray.available_resources().get("CPU", 1)) - 1))
    [shard] = [its[TRAIN] for its in ExactSplitDataConfig().configure({TRAIN: ds}, 1, None, None)]
    loader = ShardLoader(shard, num_rows=report.rows, rank=0, world_size=1, batch_size=batch, pad_id=0,
                         seed=cfg.run.seed, with_sources=True)
    sources = [s for rows in loader for s in rows["sources"]]
    return [int(s.rsplit(":", 1)[1]) for s in sources[: steps * batch]]


def plain_trl(b: Bench, model: str, steps: int, batch: int | None, order: list[int] | None = None,
              **sft_args) -> dict:
    """Plain TRL SFTTrainer on the rows `order` (sequential sampling: the same batches as ours), or
    on the file as it is with TRL's own sampling; `batch` None: TRL's default batch size."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from rapidfire_ray.models import load_model, load_tokenizer

    with open(b.data, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    if order is not None:
        rows = [rows[n - 1] for n in order]
    cuda = b.cuda

    def sync():
        if cuda:
            torch.cuda.synchronize()

    class Clock(TrainerCallback):
        def __init__(self):
            self.start = self.end = None
            self.step_times, self.logs = [], []

        def on_train_begin(self, args, state, control, **kwargs):
            sync()
            self.start = self.end = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            sync()
            now = time.perf_counter()
            self.step_times.append(now - self.end)
            self.end = now

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs or {}))

    clock = Clock()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    tokenizer, net = load_tokenizer(model), load_model(model)
    out = tempfile.mkdtemp(dir=b.work)
    try:
        cfg = SFTConfig(output_dir=out, max_steps=steps, learning_rate=5e-5, max_length=b.args.max_length,
                        bf16=cuda, fp16=False, use_cpu=not cuda, report_to="none", logging_steps=1,
                        save_strategy="no", disable_tqdm=True, seed=42,
                        **({"per_device_train_batch_size": batch} if batch else {}),
                        **({"train_sampling_strategy": "sequential"} if order is not None else {}), **sft_args)
        trainer = SFTTrainer(model=net, args=cfg, train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                             callbacks=[clock])
        trainer.train()
    finally:
        shutil.rmtree(out, ignore_errors=True)
    tokens = max(int(float(e.get("num_tokens", 0))) for e in clock.logs)
    seconds = clock.end - clock.start
    result = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
              "median_step_s": statistics.median(clock.step_times[3:] or clock.step_times),
              "final_loss": next((e["loss"] for e in reversed(clock.logs) if "loss" in e), None),
              "batch": cfg.per_device_train_batch_size, "step_times_s": clock.step_times}
    if cuda:
        result["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
    del trainer, net
    if cuda:
        torch.cuda.empty_cache()
    return result


def _overhead(b: Bench, key: str, steps: int, batch: int) -> dict:
    model, steps = b.model(key), b.steps(steps)
    order = row_order(b, model, steps, batch)
    plain = plain_trl(b, model, steps, batch, order)
    mine = ours(b, f"overhead-{key}", model, steps, batch)
    paired = statistics.median(p / o for p, o in zip(plain["step_times_s"][1:], mine["step_times_s"][1:]))
    return {"plain_trl": plain, "rapidfire": mine,
            "ratio_tokens_per_s": round(mine["tokens_per_s"] / plain["tokens_per_s"], 4),
            "median_paired_step_ratio": round(paired, 4),
            "targets": {"tokens_per_s >= 0.97x": mine["tokens_per_s"] >= 0.97 * plain["tokens_per_s"],
                        "median step >= 0.98x": paired >= 0.98}}


def o135(b: Bench) -> dict:
    return _overhead(b, "m135", 60, 16)


def o1p7(b: Bench) -> dict:
    return _overhead(b, "m1p7", 25, 8)


def mem(b: Bench) -> dict:
    model, steps = b.model("m1p7"), b.steps(15)
    runs = {level: ours(b, f"mem-{level}", model, steps, 8, **{"memory.optim_level": level})
            for level in ("level0", "level2")}
    base = runs["level0"]
    return {"runs": runs, "ratios_level2": {
        "peak_memory": (runs["level2"]["peak_memory_bytes"] or 0) / max(1, base["peak_memory_bytes"] or 0),
        "median_step": runs["level2"]["median_step_s"] / base["median_step_s"],
        "saved_activation_bytes": ((runs["level2"]["memory"] or {}).get("saved_activation_bytes") or 0)
        / max(1, (base["memory"] or {}).get("saved_activation_bytes") or 1)}}


def aware(b: Bench) -> dict:
    model, steps = b.model("m1p7"), b.steps(25)
    mine = ours(b, "aware", model, steps, 8, **{"data.dynamic_batch.strategy": "memory_aware",
                                                "data.dynamic_batch.max": 64, "train.precision": "auto"})
    defaults = plain_trl(b, model, steps, None)
    packed = plain_trl(b, model, steps, None, packing=True)
    check = mine.get("memory_model") or {}
    estimate, measured = check.get("estimated_peak_bytes"), check.get("measured_peak_bytes")
    return {"rapidfire_memory_aware": mine, "plain_trl_defaults": defaults, "plain_trl_packing": packed,
            "real_tokens_per_s_vs_defaults": round(mine["tokens_per_s"] / defaults["tokens_per_s"], 3),
            "real_tokens_per_s_vs_packing": round(mine["tokens_per_s"] / packed["tokens_per_s"], 3),
            "estimate_vs_measured_peak": round(estimate / measured, 3) if estimate and measured else None}


def cobatch(b: Bench) -> dict:
    """bench/cobatch.py at 135M: 4 LoRA configs one at a time vs co-batched in one pass."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_cobatch", os.path.join(REPO, "bench", "cobatch.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.measure(os.path.join(REPO, "jobs", "configs", "experiment_smollm2.yaml"), configs=4,
                          rows=8 if b.args.smoke else 64, eval_rows=4 if b.args.smoke else 16,
                          max_length=min(b.args.max_length, 512), batch=4 if b.args.smoke else 8,
                          device="cuda" if b.cuda else "cpu", model=b.model("135m"))


PARTS = {"env": env, "models": models, "codecs": codecs, "o135": o135, "o1p7": o1p7, "mem": mem, "aware": aware,
         "cobatch": cobatch}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, in order: {','.join(PARTS)}")
    p.add_argument("--tokenizer-dir", default=os.path.join(REPO, ".gpu", "model135"),
                   help="a SmolLM2 folder with config.json and the tokenizer files (weights are not used)")
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--budget-s", type=float, default=470.0, help="parts starting after this many seconds are skipped")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny random model, 4 steps: checks the script only")
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results", "gpu.json"))
    args = p.parse_args(argv)
    if args.smoke:
        args.max_length = min(args.max_length, 128)
    parts = [x for x in args.parts.split(",") if x]
    unknown = [x for x in parts if x not in PARTS]
    if unknown:
        p.error(f"--parts: unknown {unknown}; choose from {','.join(PARTS)}")
    b = Bench(args)
    try:
        for name in parts:
            b.part(name, PARTS[name])
    finally:
        b.results["total_s"] = round(time.time() - b.t0, 1)
        b.save()
        shutil.rmtree(b.work, ignore_errors=True)
    print(f"[gpu] wrote {args.out} in {b.results['total_s']:.0f} s", flush=True)
    return b.results


if __name__ == "__main__":
    main()
