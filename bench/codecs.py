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
Prints a table and writes bench/results/codecs.json. A benchmark, not a test.

    python bench/codecs.py [--size MB] [--repeats 5] [--threads 1] [--out bench/results/codecs.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

from rapidfire_ray.compression import ErrorFeedback, get_codec

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


def best_time(fn, repeats: int) -> float:
    fn()  # warm-up: allocator, first-call dispatch
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


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
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results", "codecs.json"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    grads = make_gradients(args.size)
    numel = sum(g.numel() for g in grads.values())
    fp32_bytes = 4 * numel
    print(f"[bench] {len(grads)} gradient tensors, {numel:,} elements, {fp32_bytes / 1e6:.1f} MB float32; "
          f"{args.threads} threads, best of {args.repeats}", flush=True)

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

    result = {"benchmark": "codecs", "date": time.strftime("%Y-%m-%d"),
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0],
                          "torch": torch.__version__},
              "settings": vars(args),
              "input": {"model": "smollm2-135m", "tensors": len(grads), "elements": numel, "fp32_bytes": fp32_bytes},
              "note": "GB/s = float32 input bytes / wall time, best of repeats; fp16 cast = t.half().float()",
              "results": rows}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    tmp = f"{args.out}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    os.replace(tmp, args.out)
    print(f"[bench] wrote {args.out}")


if __name__ == "__main__":
    main()
