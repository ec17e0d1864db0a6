"""A scaling model of one data-parallel training step: compute time plus gradient exchange, per
communication mode, from measured or assumed inputs.

    step = compute + exchange                      (no overlap: the Amdahl view; --overlap uses max)
    allreduce             exchange = 2 (n-1)/n * S / B + 2 (n-1) * latency,  S = 4 P bytes (fp32)
    allreduce_compressed  exchange = 2 (n-1)/n * C / B + 3 (n-1) * latency + codec,  C = wire bytes
                          (phase 1 sends n-1 chunks, phase 2 all-gathers the server chunks, plus one
                          flag per bucket); codec = 4 P bytes / codec throughput (encode + decode)
    rapidfire_adamw       warm-up share w at fp32 allreduce, the rest like allreduce_compressed:
                          w * allreduce + (1 - w) * compressed

allreduce_compressed under a per-layer policy (`codec_params`: gradient elements per wire codec,
e.g. {"fp16": 16704, "1bit": 90496}): C sums each codec's wire bytes; every fp16/none group is
one more plain allreduce (+ 2 (n-1) latency), every 1bit/2bit group one two-phase allreduce
(+ 3 (n-1) latency), and only the 1bit/2bit elements pay the codec time.

`n` is the number of nodes (inside a node, NVLink/shared memory is taken as free next to the
network), `B` the per-node link bandwidth in bytes/s, of which payload gets B / overhead: a
link's rate counts frames, and over TCP every MSS of payload travels in a frame with headers
while the node's own egress also carries the ACKs for what it receives (`Link.wire_overhead`;
TCP/IPv4 with timestamps over 1500-byte Ethernet: 1514/1448 + 66/(2*1448) = 1.068 with one
delayed ACK per two segments; 1.0 leaves it out). Wire bytes per codec come from the
codecs' formulas (`rapidfire_ray.compression`), so the model and the code agree by construction.

    python bench/scaling_model.py project [--out bench/results/scaling_projection.json]
                                                       # the README table: 7B / 70B on 8xA100 nodes,
                                                       # fp32 vs 1bit vs what `auto` picks
    python bench/scaling_model.py check RESULTS.json [--out CHECK.json]
                                                       # predicted vs measured (bench/comm_bound.py)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass

MODES = ("allreduce", "allreduce_compressed", "rapidfire_adamw")


def wire_bytes(codec: str, numel: int, chunk_size: int = 2048) -> int:
    """Bytes one rank hands to the network for `numel` gradient elements with `codec`."""
    from rapidfire_ray.compression import get_codec

    opts = {"chunk_size": chunk_size} if codec in ("1bit", "2bit") else {}
    return get_codec(codec, **opts).wire_bytes(numel)


@dataclass(frozen=True)
class Link:
    name: str
    bandwidth_bytes_s: float  # per node, one direction
    latency_s: float
    wire_overhead: float = 1.0  # link bytes per payload byte (headers, ACKs); see the module docstring


def tcp_wire_overhead(mtu: int = 1500, ethernet_header: int = 14, ip_tcp_headers: int = 52) -> float:
    """Link bytes per payload byte of a symmetric TCP exchange (each node sends what it receives):
    each MSS (mtu - IP/TCP headers, timestamps on) goes in an mtu + Ethernet header frame, and one
    header-only ACK frame per two received segments leaves by the same egress."""
    mss = mtu - ip_tcp_headers
    frame = ethernet_header + ip_tcp_headers
    return (mss + frame) / mss + frame / (2 * mss)


@dataclass(frozen=True)
class StepInputs:
    params: int  # gradient elements exchanged per step
    compute_s: float  # forward + backward + optimizer, no communication
    nodes: int
    codec: str = "1bit"
    codec_gbps: float = 0.25  # encode+decode throughput in GB/s of fp32 input (bench/codecs.py)
    warmup_share: float = 0.2  # rapidfire_adamw: share of steps in full-precision warm-up
    # allreduce_compressed with a per-layer policy: ((codec, elements), ...); None: all `codec`
    codec_params: tuple[tuple[str, int], ...] | None = None


def exchange_s(mode: str, x: StepInputs, link: Link) -> float:
    n = x.nodes
    if n <= 1:
        return 0.0
    ring = 2 * (n - 1) / n
    payload_bytes_s = link.bandwidth_bytes_s / link.wire_overhead
    fp32 = ring * 4 * x.params / payload_bytes_s + 2 * (n - 1) * link.latency_s
    compressed = (ring * wire_bytes(x.codec, x.params) / payload_bytes_s + 3 * (n - 1) * link.latency_s
                  + 4 * x.params / (x.codec_gbps * 1e9))
    if mode == "allreduce":
        return fp32
    if mode == "allreduce_compressed":
        if x.codec_params:
            return sum(ring * wire_bytes(codec, numel) / payload_bytes_s
                       + (2 if codec in ("none", "fp16") else 3) * (n - 1) * link.latency_s
                       + (0.0 if codec in ("none", "fp16") else 4 * numel / (x.codec_gbps * 1e9))
                       for codec, numel in x.codec_params if numel)
        return compressed
    if mode == "rapidfire_adamw":
        return x.warmup_share * fp32 + (1 - x.warmup_share) * compressed
    raise ValueError(f"unknown mode {mode!r}; one of {MODES}")


def step_s(mode: str, x: StepInputs, link: Link, overlap: bool = False) -> float:
    comm = exchange_s(mode, x, link)
    return max(x.compute_s, comm) if overlap else x.compute_s + comm


def amdahl_limit(compute_s: float, comm_s: float, ratio: float) -> float:
    """Best speed-up from shrinking communication `ratio` times: 1 / (compute + comm / ratio)."""
    total = compute_s + comm_s
    return total / (compute_s + comm_s / ratio)


LINKS = (Link("100GbE", 100e9 / 8, 10e-6), Link("400Gb/s EFA", 400e9 / 8, 15e-6))


def a100_compute_s(params: int, tokens_per_gpu: int, mfu: float = 0.4, flops: float = 312e12) -> float:
    """6 P tokens / (A100 bf16 peak x MFU): forward + backward of a dense transformer."""
    return 6 * params * tokens_per_gpu / (flops * mfu)


# --- the projection: what `compression.grad: auto` would pick on 8xA100 nodes ---------------------

CODECS_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "codecs.json")
#: Measured on one H200 (torch 2.11 cu130, main at 1c08870), ../shared/device/README.md, 2026-12-04:
#: GB/s of float32 input over SmolLM2-135M's 538 MB gradient set.
H200_2026_12_04 = {"date": "2026-12-04", "source": "../shared/device/README.md (one H200, main at 1c08870)",
                   "tensor_copy": 152.0, "fp16_cast": 79.0, "1bit": 3.3, "1bit_error_feedback": 2.3, "2bit": 1.5}
#: Issue 19 item 2's targets for the flat-bucket codecs on an H200 (not measured).
TARGET_GBPS = {"1bit": 300.0, "2bit": 150.0}
BUCKET_ELEMENTS = 25 * 2**20 // 4  # DDP's default bucket_cap_mb (25) in float32 elements
# Llama-style shapes: the attention output projections (hidden^2 per layer) are what the default
# keep_fp16 patterns keep (norms and biases are negligible next to them).
MODELS = (("7B", 6_738_415_616, 4096, 32), ("70B", 68_976_648_192, 8192, 80))


def _per_element(gbps: float) -> float:
    return 4 / (gbps * 1e9)


def cpu_codec_speeds(path: str = CODECS_JSON) -> tuple[dict, dict]:
    """Codec speeds per element from bench/codecs.py's result (this machine's CPU, one thread):
    1bit/2bit round trip = with error feedback, decode alone; fp16's preparation = the
    fp16_compress_hook cast; none's = the none codec's encode (a copy, for the hook's divide)."""
    from rapidfire_ray.exchange.auto import CodecSpeed

    with open(path, encoding="utf-8") as f:
        result = json.load(f)
    n = result["input"]["elements"]
    rows = {r["codec"]: r for r in result["results"] if not r.get("options")}
    try:
        speeds = {"none": CodecSpeed(rows["none"]["encode_s"] / n),
                  "fp16": CodecSpeed(rows["fp16_compress_hook cast"]["encode_decode_s"] / n)}
        for c in ("1bit", "2bit"):
            speeds[c] = CodecSpeed(rows[c]["with_error_feedback_s"] / n, rows[c]["decode_s"] / n)
    except (KeyError, TypeError) as e:
        raise SystemExit(f"{path}: no {e} figure; rerun python bench/codecs.py") from None
    meta = {"label": f"CPU, measured {result.get('date')}", "measured": True, "source": os.path.relpath(path),
            "machine": result.get("machine"),
            "gbps": {c: round(4 / s.roundtrip_s / 1e9, 3) for c, s in speeds.items()}}
    return speeds, meta


def _decode_shares(cpu: dict) -> dict[str, float]:
    """Decode alone as a share of the round trip with error feedback (measured on CPU only)."""
    return {c: cpu[c].decode_s / cpu[c].roundtrip_s for c in ("1bit", "2bit")}


def h200_codec_speeds(cpu: dict) -> tuple[dict, dict]:
    """The H200 figures of 2026-12-04. Measured: copy, fp16 cast, 1bit with error feedback, 2bit
    without. Assumed: 2bit with error feedback slowed as much as 1bit was (2.3/3.3), decode alone
    the same share of the round trip as on CPU."""
    from rapidfire_ray.exchange.auto import CodecSpeed

    h = H200_2026_12_04
    share = _decode_shares(cpu)
    twobit_ef = h["2bit"] * h["1bit_error_feedback"] / h["1bit"]
    speeds = {"none": CodecSpeed(_per_element(h["tensor_copy"])), "fp16": CodecSpeed(_per_element(h["fp16_cast"])),
              "1bit": CodecSpeed(_per_element(h["1bit_error_feedback"]),
                                 share["1bit"] * _per_element(h["1bit_error_feedback"])),
              "2bit": CodecSpeed(_per_element(twobit_ef), share["2bit"] * _per_element(twobit_ef))}
    meta = {"label": f"H200, measured {h['date']}", "measured": True, "source": h["source"],
            "gbps": {c: round(4 / s.roundtrip_s / 1e9, 3) for c, s in speeds.items()},
            "assumed": ["2bit with error feedback = 2bit x (1bit with / without error feedback)",
                        "decode alone = the CPU's decode share of the round trip",
                        "an A100 runs them as fast as the H200 (its HBM is ~2.4x slower: memory-bound codecs "
                        "would be slower)"]}
    return speeds, meta


def target_codec_speeds(cpu: dict) -> tuple[dict, dict]:
    """Issue 19's codec targets (1bit 300 GB/s, 2bit 150 GB/s with error feedback) with the
    H200's measured copy and fp16 cast: what the projection becomes once the codecs are fast."""
    from rapidfire_ray.exchange.auto import CodecSpeed

    h, share = H200_2026_12_04, _decode_shares(cpu)
    speeds = {"none": CodecSpeed(_per_element(h["tensor_copy"])), "fp16": CodecSpeed(_per_element(h["fp16_cast"]))}
    for c, gbps in TARGET_GBPS.items():
        speeds[c] = CodecSpeed(_per_element(gbps), share[c] * _per_element(gbps))
    meta = {"label": "target (issue 19 item 2), assumed", "measured": False,
            "gbps": {c: round(4 / s.roundtrip_s / 1e9, 3) for c, s in speeds.items()},
            "assumed": ["1bit 300 GB/s and 2bit 150 GB/s with error feedback (targets, not measurements)",
                        "decode alone = the CPU's decode share of the round trip"]}
    return speeds, meta


def node_link_rate(link: Link, nodes: int, gpus_per_node: int):
    """What each of the nodes x gpus ranks gets from a per-node line rate, for the two traffic
    patterns auto measures (NVLink inside a node taken as free):
    allreduce: NCCL's rings carry 2 (n-1)/n x S through each node's NIC, so a rank's ring-convention
    2 (W-1)/W x S bytes move at B (W-1)/W x n/(n-1);
    two-phase exchange (flat over all W ranks, as the hook runs it): each rank sends 2 (W-1)
    chunks, W-g of them off-node, and the g ranks of a node share its NIC: B (W-1) / (g (W-g)).
    Fixed costs as the scaling model's: 2 (n-1) and 3 (n-1) link latencies."""
    from rapidfire_ray.exchange.auto import LinkRate

    b, n, g = link.bandwidth_bytes_s / link.wire_overhead, nodes, gpus_per_node
    w = n * g
    if n <= 1:
        return LinkRate(math.inf, 0.0, math.inf, 0.0)
    return LinkRate(allreduce_bytes_s=b * (w - 1) / w * n / (n - 1), allreduce_latency_s=2 * (n - 1) * link.latency_s,
                    exchange_bytes_s=b * (w - 1) / (g * (w - g)), exchange_latency_s=3 * (n - 1) * link.latency_s)


def exchange_per_step(params: int, kept_share: float, world: int, rate, speeds: dict, grad: str,
                      bucket: int = BUCKET_ELEMENTS) -> tuple[float, str, dict]:
    """Seconds of gradient exchange per step, one rank, with `grad` ("none": plain fp32
    allreduce of every bucket; "1bit": the kept share in fp16 and the rest 1-bit; "auto": the
    kept share in fp16 and the rest as `choose_codec` picks), the codec used for the non-kept
    part and choose_codec's predicted seconds per bucket. Every bucket holds `bucket` elements,
    `kept_share` of them kept."""
    from rapidfire_ray.exchange.auto import choose_codec, predict_s

    buckets = params / bucket
    if grad == "none":
        return buckets * predict_s("none", bucket, world, rate, speeds["none"]), "none", {}
    kept = round(kept_share * bucket)
    rest = bucket - kept
    kept_s = predict_s("fp16", kept, world, rate, speeds["fp16"])
    candidates = ("1bit",) if grad == "1bit" else ("none", "fp16", "1bit", "2bit")
    codec, predicted = choose_codec(rest, world, rate, {c: speeds[c] for c in candidates})
    return buckets * (kept_s + predicted[codec]), codec, predicted


def project(args) -> dict:
    """7B and 70B on `nodes` 8xA100 nodes over 100 GbE and 400 Gbit/s EFA, per codec-speed set:
    step time with plain fp32 allreduce, with 1bit, and with the codec `auto` picks."""
    cpu, cpu_meta = cpu_codec_speeds(args.codecs)
    sets = [(cpu, cpu_meta), h200_codec_speeds(cpu), target_codec_speeds(cpu)]
    rows = []
    world = args.nodes * args.gpus_per_node
    for label, params, hidden, layers in MODELS:
        compute = a100_compute_s(params, args.tokens_per_gpu, args.mfu)
        kept_share = hidden * hidden * layers / params
        for link in LINKS:
            rate = node_link_rate(link, args.nodes, args.gpus_per_node)
            for speeds, meta in sets:
                fp32, _, _ = exchange_per_step(params, kept_share, world, rate, speeds, "none")
                onebit, _, _ = exchange_per_step(params, kept_share, world, rate, speeds, "1bit")
                auto, codec, predicted = exchange_per_step(params, kept_share, world, rate, speeds, "auto")
                rows.append({
                    "model": label, "link": link.name, "codec_speeds": meta["label"], "nodes": args.nodes,
                    "gpus": world, "compute_s": round(compute, 3),
                    "fp32_exchange_s": round(fp32, 3), "fp32_step_s": round(compute + fp32, 3),
                    "fp32_overlapped_step_s": round(max(compute, fp32), 3),
                    "onebit_step_s": round(compute + onebit, 3),
                    "auto_codec": codec, "auto_step_s": round(compute + auto, 3),
                    "auto_vs_fp32": round((compute + fp32) / (compute + auto), 3),
                    "onebit_vs_fp32": round((compute + fp32) / (compute + onebit), 3),
                    "bucket_predicted_ms": {c: round(t * 1e3, 3) for c, t in predicted.items()},
                })
    h = H200_2026_12_04
    return {
        "command": "python bench/scaling_model.py project" + (f" --nodes {args.nodes}" if args.nodes != 4 else ""),
        "model": "step = compute + exchange (the compressed hook blocks: no overlap); fp32_overlapped_step_s: "
                 "plain DDP's best case, its allreduce hidden behind compute. Exchange per bucket from "
                 "rapidfire_ray.exchange.auto.predict_s/choose_codec, the functions the run's auto uses.",
        "inputs": {
            "measured": {"cpu_codecs": cpu_meta, "h200_codecs": {k: v for k, v in h.items()}},
            "assumed": {
                "compute": f"6 P x {args.tokens_per_gpu} tokens per GPU / (312 TFLOP/s bf16 x MFU {args.mfu})",
                "links": {link.name: {"bytes_s_per_node": link.bandwidth_bytes_s, "latency_s": link.latency_s}
                          for link in LINKS},
                "topology": f"{args.nodes} nodes x {args.gpus_per_node} A100, NVLink inside a node free; "
                            "allreduce through NCCL rings, the two-phase exchange flat over all ranks (as built)",
                "buckets": f"{BUCKET_ELEMENTS:,} float32 elements (DDP's 25 MB)",
                "kept_fp16": "attention output projections of Llama-style shapes (hidden^2 x layers): "
                             + ", ".join(f"{m} {h_ * h_ * n_ / p:.1%}" for m, p, h_, n_ in MODELS),
                "codec_speed_sets": [meta for _, meta in sets],
            },
        },
        "rows": rows,
    }


def markdown_table(result: dict) -> str:
    lines = ["| model | link | codec speeds | fp32 allreduce step | 1bit step | auto picks | auto step | auto vs fp32 |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['model']} | {r['link']} | {r['codec_speeds']} | {r['fp32_step_s']:.2f} s | "
                     f"{r['onebit_step_s']:.2f} s ({r['onebit_vs_fp32']:.2f}x) | {r['auto_codec']} | "
                     f"{r['auto_step_s']:.2f} s | {r['auto_vs_fp32']:.2f}x |")
    return "\n".join(lines)


def link_bound_s(link_bytes: float, mode: str, x: StepInputs, link: Link) -> float:
    """The link-bound view of a step: the busiest link direction must carry every byte that
    crosses it in a step (veth counters: the gradient payload with TCP/IP framing and ACKs, plus
    Ray's own control and data traffic), at the link's rate, and the exchange still pays its
    latency and codec terms. A lower bound on the step, like compute + exchange; `check` takes
    the larger of the two."""
    n = x.nodes
    if n <= 1:
        return 0.0
    wire = link_bytes / link.bandwidth_bytes_s
    fp32_lat = 2 * (n - 1) * link.latency_s
    comp_lat = 3 * (n - 1) * link.latency_s + 4 * x.params / (x.codec_gbps * 1e9)
    if mode == "allreduce":
        return wire + fp32_lat
    if mode == "allreduce_compressed":
        if x.codec_params:
            lat = sum((2 if codec in ("none", "fp16") else 3) * (n - 1) * link.latency_s
                      + (0.0 if codec in ("none", "fp16") else 4 * numel / (x.codec_gbps * 1e9))
                      for codec, numel in x.codec_params if numel)
            return wire + lat
        return wire + comp_lat
    if mode == "rapidfire_adamw":
        return wire + x.warmup_share * fp32_lat + (1 - x.warmup_share) * comp_lat
    raise ValueError(f"unknown mode {mode!r}; one of {MODES}")


def _link_bytes(node_counts: list[dict]) -> dict[tuple[str, int], float]:
    """(variant, nodes) -> bytes per measured step through the busiest link direction."""
    out = {}
    for nr in node_counts:
        for variant, run in nr.get("runs", {}).items():
            per_node = run.get("link_bytes_per_measured_step")
            if per_node:
                out[(variant, nr["nodes"])] = max(max(d["out"], d["in"]) for d in per_node)
    return out


def check(path: str) -> list[dict]:
    """Predicted vs measured step time for runs recorded by bench/comm_bound.py: each run gives
    nodes, params, the measured compute time (unshaped calibration run), the link, and the
    measured step. `predicted_s` is compute + exchange with the bytes from the codec formulas.
    Where the result file has the link's own byte counters, `predicted_roofline_s` is the larger
    of that and `link_bound_s` (all bytes the busiest link carried per step at its rate): Ray's
    reports, data blocks and heartbeats share the link but much of that traffic flows while the
    workers compute, so it bounds the step from below rather than adding to it (adding it all,
    as an earlier version did, overshot pure 1-bit by 26-33%)."""
    with open(path, encoding="utf-8") as f:
        result = json.load(f)
    runs = result["runs"]
    link_bytes = _link_bytes(result.get("node_counts", []))
    out = []
    for r in runs:
        link = Link("measured", r["bandwidth_bytes_s"], r.get("latency_s", 0.0), r.get("wire_overhead", 1.0))
        x = StepInputs(params=r["params"], compute_s=r["compute_s"], nodes=r["nodes"], codec=r.get("codec", "1bit"),
                       codec_gbps=r.get("codec_gbps", 0.25), warmup_share=r.get("warmup_share", 0.0),
                       codec_params=tuple(sorted(r["codec_params"].items())) if r.get("codec_params") else None)
        predicted = step_s(r["mode"], x, link)
        row = {"mode": r["mode"], **({"variant": r["variant"]} if "variant" in r else {}), "nodes": r["nodes"],
               "measured_s": r["step_s"], "predicted_s": round(predicted, 4),
               "error": round(predicted / r["step_s"] - 1, 3)}
        lb = link_bytes.get((r.get("variant", r["mode"]), r["nodes"]))
        if lb is not None:
            # the link counters count frames: no wire_overhead on top
            raw = Link("measured", r["bandwidth_bytes_s"], r.get("latency_s", 0.0))
            bound = link_bound_s(lb, r["mode"], x, raw)
            roofline = max(predicted, bound)
            row.update({"link_bytes_per_step": round(lb), "link_bound_s": round(bound, 4),
                        "predicted_roofline_s": round(roofline, 4),
                        "error_roofline": round(roofline / r["step_s"] - 1, 3)})
        out.append(row)
    return out


def check_report(path: str, tolerance: float = 0.2) -> dict:
    """`check` with its verdicts: what bench/results/comm_bound_scaling_check.json holds."""
    rows = check(path)
    with_counters = [r for r in rows if "error_roofline" in r]
    return {"command": f"python bench/scaling_model.py check {path}", "rows": rows, "tolerance": tolerance,
            "within_tolerance": all(abs(r["error"]) <= tolerance for r in rows),
            "within_tolerance_roofline": bool(with_counters) and len(with_counters) == len(rows)
            and all(abs(r["error_roofline"]) <= tolerance for r in with_counters),
            "worst_error": max((r["error"] for r in rows), key=abs),
            "worst_error_roofline": max((r["error_roofline"] for r in with_counters), key=abs, default=None)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pr = sub.add_parser("project")
    pr.add_argument("--nodes", type=int, default=4, help="8xA100 nodes")
    pr.add_argument("--gpus-per-node", type=int, default=8)
    pr.add_argument("--tokens-per-gpu", type=int, default=16384, help="tokens per GPU per step")
    pr.add_argument("--mfu", type=float, default=0.4)
    pr.add_argument("--codecs", default=CODECS_JSON, help="bench/codecs.py's result (the CPU codec speeds)")
    pr.add_argument("--out", default=os.path.join(os.path.dirname(CODECS_JSON), "scaling_projection.json"))
    ch = sub.add_parser("check")
    ch.add_argument("results")
    ch.add_argument("--out", help="also write the rows and verdicts as JSON here "
                                  "(bench/results/comm_bound_scaling_check.json)")
    args = p.parse_args()
    if args.cmd == "project":
        result = project(args)
        with open(args.out + ".tmp", "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
        os.replace(args.out + ".tmp", args.out)
        print(markdown_table(result))
        print(f"written to {os.path.relpath(args.out)}")
        return
    if args.out:
        report = check_report(args.results)
        with open(args.out + ".tmp", "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
        os.replace(args.out + ".tmp", args.out)
        rows = report["rows"]
    else:
        rows = check(args.results)
    if not rows:
        sys.exit("no rows")
    keys = list(rows[0])
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(str(r.get(k, "")) for k in keys))
    if args.cmd == "check":
        report = check_report(args.results)
        print(f"within {report['tolerance']:.0%}: formula {report['within_tolerance']} (worst "
              f"{report['worst_error']:+.1%}); roofline {report['within_tolerance_roofline']}"
              + (f" (worst {report['worst_error_roofline']:+.1%})" if report["worst_error_roofline"] is not None else ""))


if __name__ == "__main__":
    main()
