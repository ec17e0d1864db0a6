"""Gradient codec speed on CPU: encode+decode throughput in GB/s of float32 input, per codec,
next to the cast torch's `fp16_compress_hook` does (`t.half().float()`) and the arithmetic of
torch's `powerSGD_hook` (rank 1 and 4, with its error feedback), in one run.

The input is the gradient set of smollm2-135m: its 272 tensors (embedding, 30 layers of
attention, MLP and norms) at their real relative sizes, 538 MB in float32; `--size` scales every
tensor by the same factor (default 64 MB, under a minute on 2 shared cores; `--size 538` for the
full set). Values are N(0, 1e-3^2), like a gradient; the codecs' speed barely depends on them
(2bit's top-k slightly). Each codec is timed over the whole set, encode and decode separately
and with error feedback (residual add, encode, decode, residual update: the per-step cost in
training); the best of `--repeats` runs is reported (the machine is shared, the minimum is the
least disturbed). One torch thread by default, so the figures are per core: on an
oversubscribed machine several threads slow each other down unpredictably. Also reports bytes
on the wire, the ratio to float32, and the relative error
||decode(encode(g)) - g|| / ||g|| of one pass.
Then, side by side in the same run, the flat-bucket codecs (the training path: the gradients
packed into DDP-sized buckets, `--bucket-mb`, one call per bucket): the reference path against
the fused path (compression/fused.py, its compiled kernels: RAPIDFIRE_CODEC_NATIVE=off) against,
for 1bit on CPU, the native one-pass kernels (compression/native.py) against a same-size copy
(`clone` of each bucket), for each codec without error feedback (encode + decode) and with it
(`compressed_allreduce` at world size 1: error add, encode, decode, residual), GB/s of float32
input and the ratio to the copy.
Compile time is excluded (one warm-up call per bucket size; it is reported separately).
Prints the tables and writes bench/results/codecs.json. A benchmark, not a test.

    python bench/codecs.py [--size MB] [--repeats 5] [--threads 1] [--bucket-mb 25] [--device cpu]
                           [--buckets-only] [--out bench/results/codecs.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

from rapidfire_ray.compression import ErrorFeedback, fused, get_codec, native
from rapidfire_ray.exchange.allreduce import AllreduceState, compressed_allreduce

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

HIDDEN, INTERMEDIATE, LAYERS, VOCAB, KV = 576, 1536, 30, 49152, 192  # smollm2-135m


def smollm2_135m_gradient_sizes() -> dict[str, int]:
    """Parameter name -> element count, as the model's state dict has them (tied embedding)."""
    sizes = {"model.embed_tokens.weight": VOCAB * HIDDEN}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        sizes |= {p + "self_attn.q_proj.weight": HIDDEN * HIDDEN, p + "self_attn.k_proj.weight": HIDDEN * KV,
                  p + "self_attn.v_proj.weight": HIDDEN * KV, p + "self_attn.o_proj.weight": HIDDEN * HIDDEN,
                  p + "mlp.gate_proj.weight": HIDDEN * INTERMEDIATE, p + "mlp.up_proj.weight": HIDDEN * INTERMEDIATE,
                  p + "mlp.down_proj.weight": INTERMEDIATE * HIDDEN, p + "input_layernorm.weight": HIDDEN,
                  p + "post_attention_layernorm.weight": HIDDEN}
    sizes["model.norm.weight"] = HIDDEN
    return sizes


def make_gradients(size_mb: float) -> dict[str, torch.Tensor]:
    sizes = smollm2_135m_gradient_sizes()
    factor = size_mb * 1e6 / (4 * sum(sizes.values()))
    g = torch.Generator().manual_seed(0)
    return {name: torch.randn(max(1, round(n * factor)), generator=g) * 1e-3 for name, n in sizes.items()}


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def best_time(fn, repeats: int) -> float:
    fn()  # warm-up: allocator, first-call dispatch, compiling
    _sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - start)
    return min(times)


def make_buckets(grads: dict[str, torch.Tensor], bucket_mb: float, device: str) -> list[torch.Tensor]:
    """The gradients flattened into buckets of about `bucket_mb` MB in reverse parameter order,
    as DDP fills them (a tensor larger than a bucket gets one of its own)."""
    buckets, current, size = [], [], 0
    for g in reversed(list(grads.values())):
        current.append(g)
        size += 4 * g.numel()
        if size >= bucket_mb * 1e6:
            buckets.append(torch.cat(current))
            current, size = [], 0
    if current:
        buckets.append(torch.cat(current))
    return [b.to(device) for b in buckets]


BUCKET_CODECS = [("none", {}), ("fp16", {}), ("1bit", {}), ("1bit", {"scale": "rms"}), ("2bit", {})]


class _native_mode:
    """RAPIDFIRE_CODEC_NATIVE set to `value` inside the block."""

    def __init__(self, value: str):
        self.value = value

    def __enter__(self):
        self.saved = os.environ.get(native.NATIVE_ENV)
        os.environ[native.NATIVE_ENV] = self.value

    def __exit__(self, *exc):
        if self.saved is None:
            os.environ.pop(native.NATIVE_ENV, None)
        else:
            os.environ[native.NATIVE_ENV] = self.saved


def bench_buckets(buckets: list[torch.Tensor], repeats: int) -> dict:
    """Reference vs fused vs native vs copy on flat buckets, in one run (see the module docstring)."""
    with _native_mode("off"):
        return _bench_buckets(buckets, repeats)


def _bench_buckets(buckets: list[torch.Tensor], repeats: int) -> dict:
    fp32_bytes = 4 * sum(b.numel() for b in buckets)
    copies = []
    rows = []
    for name, opts in BUCKET_CODECS:
        # The copy is timed again before each codec and the best kept: on a shared machine one
        # early measurement alone can land in a busy moment.
        copies.append(best_time(lambda: [b.clone() for b in buckets], repeats))
        codec = get_codec(name, **opts)
        row = {"codec": name, "options": opts}
        start = time.perf_counter()
        for b in buckets:  # compiles (once per kernel and size pattern) outside the timings
            fused.roundtrip(codec, b)
            compressed_allreduce(b, codec, AllreduceState(), fused=True)
        _sync()
        row["fused_warmup_s"] = time.perf_counter() - start
        row["reference_s"] = best_time(lambda: [codec.decode(codec.encode(b)) for b in buckets], repeats)
        row["fused_s"] = best_time(lambda: [fused.roundtrip(codec, b) for b in buckets], repeats)
        ref_states = [AllreduceState() for _ in buckets]
        fused_states = [AllreduceState() for _ in buckets]
        row["reference_ef_s"] = best_time(lambda: [compressed_allreduce(b, codec, st, fused=False)
                                                   for b, st in zip(buckets, ref_states)], repeats)
        row["fused_ef_s"] = best_time(lambda: [compressed_allreduce(b, codec, st, fused=True)
                                               for b, st in zip(buckets, fused_states)], repeats)
        if name == "1bit" and not opts and buckets[0].device.type == "cpu":
            with _native_mode("always"):
                start = time.perf_counter()
                native.module()
                row["native_build_s"] = time.perf_counter() - start  # or its load, when built before
                native_states = [AllreduceState() for _ in buckets]
                row["native_s"] = best_time(lambda: [fused.roundtrip(codec, b) for b in buckets], repeats)
                row["native_ef_s"] = best_time(lambda: [compressed_allreduce(b, codec, st, fused=True)
                                                        for b, st in zip(buckets, native_states)], repeats)
        rows.append(row)
    copy_s = min(copies)
    for row in rows:
        for key in ("reference", "fused", "reference_ef", "fused_ef", "native", "native_ef"):
            if f"{key}_s" not in row:
                continue
            row[f"{key}_gbps"] = fp32_bytes / 1e9 / row[f"{key}_s"]
            row[f"{key}_vs_copy"] = copy_s / row[f"{key}_s"]
        row["fused_speedup"] = row["reference_s"] / row["fused_s"]
        row["fused_ef_speedup"] = row["reference_ef_s"] / row["fused_ef_s"]
    return {"buckets": len(buckets), "bucket_elements": [b.numel() for b in buckets], "fp32_bytes": fp32_bytes,
            "copy_s": copy_s, "copy_gbps": fp32_bytes / 1e9 / copy_s, "copy_s_each": copies,
            "compile": {"mode": os.environ.get(fused.COMPILE_ENV, "auto"), "failures": fused.compile_failures()},
            "results": rows}


def print_buckets(section: dict) -> None:
    print(f"[bench] flat buckets: {section['buckets']} buckets, {section['fp32_bytes'] / 1e6:.1f} MB; "
          f"copy (clone) {section['copy_gbps']:.2f} GB/s")
    header = (f"{'codec':<18}{'ref GB/s':>9}{'fused':>9}{'x copy':>8}{'ref+EF':>8}{'fused+EF':>9}{'x copy':>8}"
              f"{'speedup':>8}{'EF spd':>8}{'warm-up s':>10}")
    print(header)
    print("-" * len(header))
    for row in section["results"]:
        label = row["codec"] + "".join(f" {k}={v}" for k, v in row["options"].items())
        print(f"{label:<18}{row['reference_gbps']:>9.2f}{row['fused_gbps']:>9.2f}{row['fused_vs_copy']:>8.2f}"
              f"{row['reference_ef_gbps']:>8.2f}{row['fused_ef_gbps']:>9.2f}{row['fused_ef_vs_copy']:>8.2f}"
              f"{row['fused_speedup']:>8.1f}{row['fused_ef_speedup']:>8.1f}{row['fused_warmup_s']:>10.1f}")
        if "native_s" in row:
            print(f"{'  native (C++)':<18}{'':>9}{row['native_gbps']:>9.2f}{row['native_vs_copy']:>8.2f}{'':>8}"
                  f"{row['native_ef_gbps']:>9.2f}{row['native_ef_vs_copy']:>8.2f}{'':>16}{row['native_build_s']:>10.1f}")


def measure(device: str = "cpu", scale: float = 1.0, repeats: int = 3, bucket_mb: float = 25.0) -> dict:
    """The flat-bucket section alone on `device` (bench/gpu.py calls this); `scale` 1.0 is the
    whole 538 MB gradient set."""
    sizes = smollm2_135m_gradient_sizes()
    grads = make_gradients(scale * 4 * sum(sizes.values()) / 1e6)
    section = bench_buckets(make_buckets(grads, bucket_mb, device), repeats)
    section["device"] = str(device) if device == "cpu" else torch.cuda.get_device_name()
    print_buckets(section)
    return section


def bench_codec(name: str, opts: dict, grads: dict[str, torch.Tensor], repeats: int) -> dict:
    codec = get_codec(name, **opts)
    encoded = {k: codec.encode(g, name=k) for k, g in grads.items()}
    encode_s = best_time(lambda: [codec.encode(g, name=k) for k, g in grads.items()], repeats)
    decode_s = best_time(lambda: [codec.decode(e) for e in encoded.values()], repeats)
    both_s = best_time(lambda: [codec.decode(codec.encode(g, name=k)) for k, g in grads.items()], repeats)
    feedback = ErrorFeedback()
    feedback_s = best_time(lambda: [codec.decode(feedback.compress(k, g, codec)) for k, g in grads.items()],
                           repeats)
    err2 = sum(float((codec.decode(encoded[k]) - g).double().pow(2).sum()) for k, g in grads.items())
    ref2 = sum(float(g.double().pow(2).sum()) for g in grads.values())
    wire = sum(e.nbytes for e in encoded.values())
    assert wire == sum(codec.wire_bytes(g.numel()) for g in grads.values())
    return {"codec": name, "options": opts, "wire_bytes": wire, "encode_s": encode_s, "decode_s": decode_s,
            "encode_decode_s": both_s, "with_error_feedback_s": feedback_s,
            "relative_error": (err2 / ref2) ** 0.5}


def bench_powersgd(grads: dict[str, torch.Tensor], rank: int, repeats: int) -> dict:
    """What torch's `powerSGD_hook` computes per gradient matrix, with its error feedback and warm-
    started Q: M += error; P = M Q; orthogonalise P; Q = M^T P; approx = P Q^T; error = M - approx.
    (The hook itself needs a live DDP bucket; this is its arithmetic, with torch's own
    `_orthogonalize`, on the same gradients reshaped to near-square matrices.) Tensors under
    `rank x (rows + cols)` elements go uncompressed, as the hook's `min_compression_rate` rule does."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize

    mats, plain = {}, {}
    for k, g in grads.items():
        rows = max(1, int(g.numel() ** 0.5))
        cols = -(-g.numel() // rows)
        if (rows + cols) * rank >= g.numel():
            plain[k] = g
            continue
        m = torch.zeros(rows * cols)
        m[:g.numel()] = g
        mats[k] = m.view(rows, cols)
    gen = torch.Generator().manual_seed(0)
    qs = {k: torch.randn(m.shape[1], rank, generator=gen) for k, m in mats.items()}
    errors = {k: torch.zeros_like(m) for k, m in mats.items()}

    def step():
        for k, m in mats.items():
            full = m + errors[k]
            p = full @ qs[k]
            _orthogonalize(p.unsqueeze(0))  # batched (1, rows, rank) view, in place
            qs[k] = full.t() @ p
            approx = p @ qs[k].t()
            errors[k] = full - approx

    seconds = best_time(step, repeats)
    wire = sum((m.shape[0] + m.shape[1]) * rank * 4 for m in mats.values()) + sum(4 * g.numel() for g in plain.values())
    return {"codec": f"powerSGD_hook rank {rank}", "options": {}, "wire_bytes": wire, "encode_s": None,
            "decode_s": None, "encode_decode_s": None, "with_error_feedback_s": seconds, "relative_error": None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=float, default=64.0, help="float32 MB of gradients (538 = the whole model)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: GB/s per core)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="flat bucket size (DDP's default: 25)")
    p.add_argument("--device", default="cpu", help="device of the flat-bucket section")
    p.add_argument("--buckets-only", action="store_true", help="only the flat-bucket section")
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results", "codecs.json"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    grads = make_gradients(args.size)
    numel = sum(g.numel() for g in grads.values())
    fp32_bytes = 4 * numel
    print(f"[bench] {len(grads)} gradient tensors, {numel:,} elements, {fp32_bytes / 1e6:.1f} MB float32; "
          f"{args.threads} threads, best of {args.repeats}", flush=True)

    print("[bench] flat buckets: reference vs fused vs copy", flush=True)
    buckets = bench_buckets(make_buckets(grads, args.bucket_mb, args.device), args.repeats)
    print_buckets(buckets)
    if args.buckets_only:
        _write(args, grads, numel, fp32_bytes, [], buckets)
        return

    cast_s = best_time(lambda: [g.half().float() for g in grads.values()], args.repeats)
    rows = [{"codec": "fp16_compress_hook cast", "options": {}, "wire_bytes": fp32_bytes // 2, "encode_s": None,
             "decode_s": None, "encode_decode_s": cast_s, "with_error_feedback_s": None,
             "relative_error": None}]
    for r in (1, 4):
        print(f"[bench] powerSGD rank {r}", flush=True)
        rows.append(bench_powersgd(grads, r, args.repeats))
    for name, opts in [("none", {}), ("fp16", {}), ("1bit", {}), ("1bit", {"scale": "rms"}), ("2bit", {})]:
        print(f"[bench] {name} {opts or ''}", flush=True)
        rows.append(bench_codec(name, opts, grads, args.repeats))

    def gbps(seconds):
        return None if seconds is None else fp32_bytes / 1e9 / seconds

    for row in rows:
        row["ratio_vs_fp32"] = fp32_bytes / row["wire_bytes"]
        for key in ("encode", "decode", "encode_decode", "with_error_feedback"):
            row[f"{key}_gbps"] = gbps(row[f"{key}_s"])

    def cell(v, fmt):
        return "-" if v is None else format(v, fmt)

    header = f"{'codec':<26}{'wire MB':>9}{'x fp32':>8}{'enc GB/s':>10}{'dec GB/s':>10}{'enc+dec':>9}{'+EF':>8}" \
             f"{'rel err':>9}"
    print(header)
    print("-" * len(header))
    for row in rows:
        label = row["codec"] + "".join(f" {k}={v}" for k, v in row["options"].items())
        print(f"{label:<26}{row['wire_bytes'] / 1e6:>9.2f}{row['ratio_vs_fp32']:>8.1f}"
              f"{cell(row['encode_gbps'], '.2f'):>10}{cell(row['decode_gbps'], '.2f'):>10}"
              f"{cell(row['encode_decode_gbps'], '.2f'):>9}{cell(row['with_error_feedback_gbps'], '.2f'):>8}"
              f"{cell(row['relative_error'], '.4f'):>9}")

    _write(args, grads, numel, fp32_bytes, rows, buckets)


def _commit() -> str | None:
    import subprocess

    try:
        return subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _write(args, grads, numel, fp32_bytes, rows, buckets) -> None:
    result = {"benchmark": "codecs", "date": time.strftime("%Y-%m-%d"), "commit": _commit(),
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0],
                          "torch": torch.__version__},
              "settings": vars(args),
              "input": {"model": "smollm2-135m", "tensors": len(grads), "elements": numel, "fp32_bytes": fp32_bytes},
              "note": "GB/s = float32 input bytes / wall time, best of repeats; fp16 cast = t.half().float()",
              "results": rows, "flat_buckets": buckets}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    tmp = f"{args.out}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    os.replace(tmp, args.out)
    print(f"[bench] wrote {args.out}")


if __name__ == "__main__":
    main()
