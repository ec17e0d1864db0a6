"""compression.grad auto: the choice from given link rates and codec speeds (pure, table of
cases), the formula itself, and the policy's per-bucket decisions on top of it. The measurement
path on a real 2-process gloo group is in test_hook.py (group2's "auto" scenario)."""
from __future__ import annotations

import pytest
import torch

from rapidfire_ray.compression import get_codec
from rapidfire_ray.exchange import CompressionPolicy, layout
from rapidfire_ray.exchange.auto import CodecSpeed, LinkRate, Measurement, choose_codec, predict_s


def per_element(gbps: float) -> float:
    """Seconds per float32 element at `gbps` GB/s of fp32 input."""
    return 4 / (gbps * 1e9)


def speeds(onebit: float, twobit: float, fp16: float = 79.0, none: float = 152.0, decode_share: float = 0.5) -> dict:
    """Codec speeds in GB/s of fp32 input (round trip with error feedback); decode alone at
    `decode_share` of the round trip's time."""
    out = {"none": CodecSpeed(per_element(none)), "fp16": CodecSpeed(per_element(fp16))}
    for name, gbps in (("1bit", onebit), ("2bit", twobit)):
        out[name] = CodecSpeed(per_element(gbps), decode_share * per_element(gbps))
    return out


def link(gbit: float, latency_s: float = 30e-6, exchange_share: float = 1.0) -> LinkRate:
    """A link of `gbit` Gbit/s for allreduces; the two-phase exchange gets `exchange_share` of it."""
    rate = gbit * 1e9 / 8
    return LinkRate(rate, latency_s, rate * exchange_share, 2 * latency_s)


H200_TODAY = speeds(onebit=2.3, twobit=1.5, fp16=79.0, none=152.0)  # ../shared/device/README.md, 2026-12-04
H200_TARGET = speeds(onebit=300.0, twobit=150.0)  # issue 19's targets for the flat-bucket codecs
CPU = speeds(onebit=0.30, twobit=0.13, fp16=6.0, none=10.0)  # bench/results/codecs.json, 2026-12-02
BUCKET = 25 * 2**20 // 4  # DDP's default bucket, in float32 elements
SMOLLM = 134_500_000  # smollm2-135m's gradient elements


def only(candidates, table):
    return {c: table[c] for c in candidates}


CASES = [
    # (what, numel, world size, link, speeds, candidates, expected)
    ("one worker: nothing to send, none costs least", BUCKET, 1, link(1), CPU, ("none", "fp16", "1bit"), "none"),
    ("100 Gbit/s, today's H200 1-bit: fp16 (half the bytes, cheap cast)", BUCKET, 8, link(100), H200_TODAY,
     ("none", "fp16", "1bit"), "fp16"),
    ("400 Gbit/s, today's H200 1-bit: fp16", BUCKET, 8, link(400), H200_TODAY, ("none", "fp16", "1bit"), "fp16"),
    ("fast link, cast slower than the bytes it saves: none", BUCKET, 2, link(400), speeds(2.3, 1.5, fp16=5.0),
     ("none", "fp16", "1bit"), "none"),
    ("100 Gbit/s with 300 GB/s codecs: 1bit", BUCKET, 8, link(100), H200_TARGET, ("none", "fp16", "1bit"), "1bit"),
    ("100 Mbit/s, CPU codecs: 1bit", BUCKET, 2, link(0.1), CPU, ("none", "fp16", "1bit"), "1bit"),
    ("100 Mbit/s, CPU codecs, concentrated bucket: 2bit", BUCKET, 2, link(0.1), CPU, ("none", "fp16", "2bit"),
     "2bit"),
    ("1 Gbit/s, CPU codecs: a 0.3 GB/s codec still costs more than fp16's bytes", BUCKET, 2, link(1), CPU,
     ("none", "fp16", "1bit"), "fp16"),
    ("10 Gbit/s between CPU workers: the CPU 1-bit codec costs more than the bytes", BUCKET, 2, link(10), CPU,
     ("none", "fp16", "1bit"), "fp16"),
    ("the 135M model's whole gradient at 27 Gbit/s, today's H200 1-bit: still fp16", SMOLLM, 2, link(27),
     H200_TODAY, ("none", "fp16", "1bit"), "fp16"),
    ("slow link, tiny bucket: the two-phase exchange's fixed cost dominates", 4096, 2, link(1, latency_s=5e-3),
     H200_TARGET, ("none", "fp16", "1bit"), "fp16"),
    ("exchange pattern 8x slower than the allreduce (8 GPUs share a NIC): fp16 at 100 Gbit/s", BUCKET, 32,
     link(100, exchange_share=1 / 8), speeds(20.0, 10.0), ("none", "fp16", "1bit"), "fp16"),
    ("free link and free codecs: ties go to the least lossy", BUCKET, 4,
     LinkRate(float("inf"), 0.0, float("inf"), 0.0), {c: CodecSpeed(0.0) for c in ("none", "fp16", "1bit")},
     ("none", "fp16", "1bit"), "none"),
]


@pytest.mark.parametrize("what,numel,ws,rate,table,candidates,expected", CASES, ids=[c[0] for c in CASES])
def test_choose_codec_table(what, numel, ws, rate, table, candidates, expected):
    codec, predicted = choose_codec(numel, ws, rate, only(candidates, table))
    assert codec == expected, predicted
    assert set(predicted) == set(candidates)
    assert predicted[codec] == min(predicted.values())


def test_predicted_times_follow_the_formula():
    rate = link(10)  # 1.25e9 B/s
    table = speeds(onebit=1.0, twobit=0.5, fp16=8.0, none=16.0)
    n, ws = 1_000_003, 4
    # none: preparation + latency + a ring allreduce's 2 (n-1)/n of 4 bytes per element
    assert predict_s("none", n, ws, rate, table["none"]) == pytest.approx(
        n * 4 / 16e9 + 30e-6 + 2 * 3 / 4 * 4 * n / 1.25e9)
    assert predict_s("fp16", n, ws, rate, table["fp16"]) == pytest.approx(
        n * 4 / 8e9 + 30e-6 + 2 * 3 / 4 * 2 * n / 1.25e9)
    # 1bit: round trip of the padded tensor and the server chunk, decode of 2 (n-1) received
    # chunks, the exchange's fixed cost, and 2 (n-1) encoded chunks sent
    m, padded = layout(n, ws)
    onebit = table["1bit"]
    wire = 2 * 3 * get_codec("1bit", chunk_size=64).wire_bytes(m)
    assert predict_s("1bit", n, ws, rate, onebit, chunk_size=64) == pytest.approx(
        onebit.roundtrip_s * (padded + m) + onebit.decode_s * 2 * 3 * m + 60e-6 + wire / 1.25e9)
    assert predict_s("2bit", 0, ws, rate, table["2bit"]) == 0.0
    assert predict_s("1bit", n, 1, rate, onebit) == pytest.approx(onebit.roundtrip_s * layout(n, 1)[1])


def test_choose_codec_rejects_unknown_candidates():
    with pytest.raises(ValueError, match="candidates"):
        choose_codec(10, 2, link(1), {"3bit": CodecSpeed(0.0)})
    with pytest.raises(ValueError, match="candidates"):
        choose_codec(10, 2, link(1), {})


def measured(rate: LinkRate, table: dict, ws: int = 2) -> Measurement:
    return Measurement(ws, rate, table, {"codec_elements": 1}, 0.0)


NAMES = ["model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.down_proj.weight"]


def test_policy_decides_buckets_from_the_measurement(capsys):
    policy = CompressionPolicy("auto")
    assert policy.measurement_due(0) and policy.codec_for(NAMES[0], _param(10_000)) == "none"
    policy.set_measurement(measured(link(0.1), CPU), step=0)
    assert "compression auto: measured at step 0 on 2 worker(s)" in capsys.readouterr().out
    assert policy.decision_due(NAMES)
    # 100 Mbit/s: 1bit, and never 2bit, whose bytes and codec both cost more (concentrated or not)
    assert policy.decide_bucket(0, NAMES, BUCKET, step=0) == "1bit"
    assert policy.decide_bucket(1, ["model.embed_tokens.weight"], BUCKET, step=0) == "1bit"
    out = capsys.readouterr().out
    assert "bucket 0 (2 tensors, 6,553,600 elements) -> 1bit (predicted none" in out and "bucket 1" in out
    assert not policy.decision_due(NAMES) and policy.codec_for(NAMES[1], _param(10_000)) == "1bit"
    # kept tensors are fp16 under auto: never decided
    assert policy.codec_for("model.norm.weight", _param(10_000)) == "fp16" and policy.rule(NAMES[0], 4095) == "fp16"

    # a re-measurement every auto_interval steps; on a fast link the same bucket goes uncompressed
    assert not policy.measurement_due(99) and policy.measurement_due(100)
    policy.set_measurement(measured(link(400), CPU), step=100)
    assert policy.decision_due(NAMES)
    assert policy.decide_bucket(0, NAMES, BUCKET, step=100) == "none"  # the CPU cast costs more than it saves
    taken_measurement, taken = policy.take_new()
    assert taken_measurement["step"] == 100 and [d["codec"] for d in taken] == ["1bit", "1bit", "none"]
    assert policy.take_new() == (None, [])
    report = policy.report()
    assert [m["step"] for m in report["measurements"]] == [0, 100]
    assert [(d["bucket"], d["codec"], d["step"]) for d in report["decisions"]] == [(0, "none", 100), (1, "1bit", 0)]
    assert set(report["decisions"][0]["predicted_s"]) == {"none", "fp16", "1bit", "2bit"}


def test_policy_state_carries_choices_and_the_next_step_measures_again():
    policy = CompressionPolicy("auto")
    policy.set_measurement(measured(link(0.1), CPU), step=0)
    policy.decide_bucket(0, NAMES, BUCKET, step=0)
    state = policy.state_dict()
    fresh = CompressionPolicy("auto")
    fresh.load_state_dict(state)
    assert fresh.choices == policy.choices and fresh.state_dict() == state
    assert fresh.measurement_due(5) and fresh.decision_due(NAMES)
    old = {"format": "rapidfire_ray.comm.policy/1", "grad": "auto", "choices": {"w": "2bit"},
           "statistics": {"w": 0.9}, "steps": {"w": 3}, "decided_at": {"w": 0}}
    fresh.load_state_dict(old)  # the per-tensor format of earlier checkpoints
    assert fresh.choices == {"w": "2bit"}
    with pytest.raises(ValueError, match="policy state"):
        fresh.load_state_dict({"choices": {}})
    with pytest.raises(RuntimeError, match="before any measurement"):
        CompressionPolicy("auto").decide_bucket(0, NAMES, 10, 0)


def _param(n):
    import torch

    return torch.empty(n)


@pytest.mark.parametrize("path", ["fused", "reference"])
@pytest.mark.parametrize("name", ["1bit", "2bit"])
def test_codec_timing_runs_the_training_path_and_equals_the_reference(monkeypatch, path, name):
    """auto times `local_roundtrip`/`local_decode`: the fused (or native) kernels training runs,
    with the reference simulation's numbers."""
    from rapidfire_ray.exchange.allreduce import (AllreduceState, local_decode, local_roundtrip,
                                                  simulate_compressed_allreduce)

    monkeypatch.setenv("RAPIDFIRE_CODEC_PATH", path)
    codec = get_codec(name)
    x = torch.randn(10_003, generator=torch.Generator().manual_seed(1))
    mine, ref = AllreduceState(), AllreduceState()
    for _ in range(3):
        got = local_roundtrip(x, codec, mine)
        want = simulate_compressed_allreduce([x], codec, [ref])[0]
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
        assert torch.equal(mine.worker_error.view(torch.int32), ref.worker_error.view(torch.int32))
    encoded = codec.encode(x)
    assert torch.equal(local_decode(codec, encoded.payload, x.numel()), codec.decode(encoded))
