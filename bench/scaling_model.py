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

    python bench/scaling_model.py project              # the README table: 7B / 70B on 8xA100 nodes
    python bench/scaling_model.py check RESULTS.json [--out CHECK.json]
                                                       # predicted vs measured (bench/comm_bound.py)
"""
from __future__ import annotations

import argparse
import json
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


def project(args) -> list[dict]:
    rows = []
    for label, params in (("7B", 7_000_000_000), ("70B", 70_000_000_000)):
        compute = a100_compute_s(params, args.tokens_per_gpu, args.mfu)
        for link in LINKS:
            x = StepInputs(params=params, compute_s=compute, nodes=args.nodes, codec=args.codec,
                           codec_gbps=args.codec_gbps, warmup_share=args.warmup_share)
            row = {"model": label, "link": link.name, "nodes": args.nodes, "compute_s": round(compute, 3)}
            for mode in MODES:
                row[f"{mode}_step_s"] = round(step_s(mode, x, link), 3)
            row["speedup_compressed"] = round(row["allreduce_step_s"] / row["allreduce_compressed_step_s"], 2)
            row["speedup_rapidfire_adamw"] = round(row["allreduce_step_s"] / row["rapidfire_adamw_step_s"], 2)
            rows.append(row)
    return rows


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
    pr.add_argument("--tokens-per-gpu", type=int, default=16384, help="tokens per GPU per step")
    pr.add_argument("--mfu", type=float, default=0.4)
    pr.add_argument("--codec", default="1bit")
    pr.add_argument("--codec-gbps", type=float, default=200.0,
                    help="encode+decode GB/s per node on its accelerators: an assumption, not measured here "
                         "(no GPU); the CPU codecs measure ~0.25 GB/s per core (bench/codecs.py)")
    pr.add_argument("--warmup-share", type=float, default=0.2)
    ch = sub.add_parser("check")
    ch.add_argument("results")
    ch.add_argument("--out", help="also write the rows and verdicts as JSON here "
                                  "(bench/results/comm_bound_scaling_check.json)")
    args = p.parse_args()
    if args.cmd == "check" and args.out:
        report = check_report(args.results)
        with open(args.out + ".tmp", "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
        os.replace(args.out + ".tmp", args.out)
        rows = report["rows"]
    else:
        rows = project(args) if args.cmd == "project" else check(args.results)
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
