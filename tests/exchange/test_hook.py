"""The DDP communication hook: on a 2-process gloo DDP model (parity with plain DDP, training
with 1bit, non-finite gradients on one rank, grad: auto measured and agreed across ranks) and, in one
process, on hand-made buckets (slots, migration of error feedback, state dicts)."""
from __future__ import annotations

import io
import statistics

import pytest
import torch

from rapidfire_ray.exchange import (
    CompressionPolicy,
    HookState,
    compressed_allreduce_hook,
    layout,
)
from rapidfire_ray.exchange.auto import CodecSpeed, LinkRate, choose_codec
from rapidfire_ray.telemetry.timing import PHASES

pytestmark = pytest.mark.timeout(120)


def ddp(group2, key):
    return [r["ddp"][key] for r in group2]


# --- 2 processes ----------------------------------------------------------------------------------


def test_policy_none_gives_plain_ddp_gradients(group2):
    for rank in ddp(group2, "plain"):
        for plain, hooked in rank["grads"]:  # 3 iterations: buckets are rebuilt after the first
            assert plain.keys() == hooked.keys()
            for name in plain:
                assert torch.equal(plain[name], hooked[name]), name
        assert rank["stats"]["bytes_sent"] > 0
        # plain allreduce bytes, plus the 4-byte agreement allreduce per bucket: just under 1
        assert 0.99 < rank["stats"]["compression_ratio"] <= 1.0


def test_1bit_training_loss_falls_and_ranks_agree(group2):
    one, none = ddp(group2, "train_1bit"), ddp(group2, "train_none")
    losses = [(a + b) / 2 for a, b in zip(one[0]["losses"], one[1]["losses"])]
    baseline = [(a + b) / 2 for a, b in zip(none[0]["losses"], none[1]["losses"])]
    start, end = statistics.mean(losses[:5]), statistics.mean(losses[-10:])
    assert end < 0.15 * start, (start, end)
    assert end < 5 * statistics.mean(baseline[-10:]) + 0.1
    assert torch.equal(one[0]["params"], one[1]["params"])  # identical averaged gradients on both ranks
    assert one[0]["codecs"] == {"0.weight": "1bit", "0.bias": "fp16", "2.weight": "1bit", "2.bias": "fp16",
                                "4.weight": "fp16", "4.bias": "fp16"}  # 4.weight: 128 < min_numel
    for taken in one[0]["stats"]:
        assert taken["compression_ratio"] > 20 and taken["comm_calls"] >= 1
        assert taken["bytes_sent"] == taken["bytes_received"] > 0
    state = torch.load(io.BytesIO(one[0]["hook_state"]), weights_only=True)  # checkpoints load it so
    fresh = HookState([], CompressionPolicy("1bit"))
    fresh.load_state_dict(state)
    again = fresh.state_dict()
    assert [s["names"] for s in again["slots"]] == [s["names"] for s in state["slots"]] == [["2.weight", "0.weight"]]
    assert torch.equal(again["slots"][0]["state"]["worker_error"], state["slots"][0]["state"]["worker_error"])


def test_overlap_matches_the_synchronous_hook_bit_for_bit(group2):
    """The exchange thread (own process group, buckets processed while backward goes on) gives the
    same gradients, parameters, error feedback and non-finite handling as the synchronous hook."""
    for rank in ddp(group2, "overlap"):
        for label, runs in rank.items():
            sync, over = runs[False], runs[True]
            assert over["stats"]["comm_calls"] == sync["stats"]["comm_calls"] > 6, label  # several buckets
            for step, (a, b) in enumerate(zip(sync["steps"], over["steps"])):
                assert a["nonfinite"] == b["nonfinite"] == (["2.weight"] if step == 3 else []), (label, step)
                for name in a["grads"]:
                    assert torch.equal(a["grads"][name], b["grads"][name]), (label, step, name)
            assert sync["skipped"] == over["skipped"] == 1
            assert torch.equal(sync["params"], over["params"]), label
            for s_slot, o_slot in zip(sync["state"]["slots"], over["state"]["slots"], strict=True):
                assert s_slot["names"] == o_slot["names"]
                for key in s_slot["state"]:
                    assert torch.equal(s_slot["state"][key], o_slot["state"][key]), (label, key)


def test_overlap_timer_counts_exposed_and_in_flight_communication(group2):
    for rank in ddp(group2, "overlap"):
        for label, runs in rank.items():
            for phases, in_flight in runs[True]["phases"]:
                assert in_flight > 0, label
                assert 0 < phases["communication"] <= in_flight + 1e-9, label
                total = sum(phases[p] for p in (*PHASES, "other"))
                assert total == pytest.approx(phases["step"], rel=1e-6, abs=1e-6), label


def test_nonfinite_on_one_rank_zeroes_the_bucket_everywhere(group2):
    ranks = ddp(group2, "nonfinite")
    for rank in ranks:
        ok0, bad, ok2 = rank["steps"]
        assert ok0["nonfinite"] == [] and ok2["nonfinite"] == []
        assert bad["nonfinite"] == ["2.weight"]  # rank 0 names it too, though its gradient was fine
        assert not bad["grads"]["2.weight"].any()
        assert bad["grads"]["0.weight"].any()  # another bucket went through
        assert all(torch.isfinite(g).all() for g in bad["grads"].values())
        # the bad bucket's error feedback did not change
        slot_before = [s for s in bad["before"]["slots"] if "2.weight" in s["names"]]
        slot_after = [s for s in bad["after"]["slots"] if "2.weight" in s["names"]]
        assert slot_before and [s["names"] for s in slot_before] == [s["names"] for s in slot_after]
        for b, a in zip(slot_before, slot_after):
            assert torch.equal(b["state"]["worker_error"], a["state"]["worker_error"])
            assert torch.equal(b["state"]["server_error"], a["state"]["server_error"])
        assert rank["skipped_buckets"] == 1
    for step in (0, 1, 2):  # and the ranks agree on every gradient
        for name, g in ranks[0]["steps"][step]["grads"].items():
            assert torch.equal(g, ranks[1]["steps"][step]["grads"][name])


def test_auto_measures_the_link_and_every_rank_makes_the_same_choice(group2):
    ranks = ddp(group2, "auto")
    r0, r1 = ranks
    assert r0["seen"] == r1["seen"] and r0["steps"] == 5
    # measured (and every bucket decided) at steps 0, 2 and 4: auto_interval 2
    assert [round_ for _, round_, _ in r0["seen"]] == [1, 1, 2, 2, 3]
    assert [m["step"] for m in r0["report"]["measurements"]] == [0, 2, 4]
    # the agreed numbers are the same on both ranks, down to the last bit (measure_s: each rank's own time)
    def agreed(m):
        return {k: v for k, v in m.items() if k != "measure_s"}

    assert r0["report"]["decisions"] == r1["report"]["decisions"]
    assert [agreed(m) for m in r0["report"]["measurements"]] == [agreed(m) for m in r1["report"]["measurements"]]
    assert agreed(r0["alone"]) == agreed(r1["alone"])
    for m in r0["report"]["measurements"] + [r0["alone"]]:
        link = m["link"]
        assert m["world_size"] == 2 and all(0 < v < float("inf") for v in link.values())
        assert all(s["roundtrip_s"] > 0 for s in m["speeds"].values())
    probe = r0["alone"]["probe"]
    assert 16 * 1024 <= probe["allreduce_bytes"] <= 64 * 1024 and probe["exchange_chunk_bytes"] <= 32 * 1024
    # each decision is choose_codec of the agreed numbers, over all four codecs
    decisions = r0["report"]["decisions"]
    assert decisions and all(d["step"] == 4 for d in decisions)
    measured = r0["report"]["measurements"][-1]
    link = LinkRate(**measured["link"])
    speeds = {c: CodecSpeed(**s) for c, s in measured["speeds"].items()}
    assert sorted(speeds) == ["1bit", "2bit", "fp16", "none"]
    for d in decisions:
        assert choose_codec(d["numel"], 2, link, speeds) == (d["codec"], d["predicted_s"])
    choices, _, _ = r0["seen"][-1]
    assert sorted(choices) == r0["auto_names"] == ["embed.weight", "proj.weight"]  # the kept ones never decided
    assert sum(d["numel"] for d in decisions) == 2000 * 16 + 16 * 512
    for name, g in r0["grads"].items():
        assert torch.equal(g, r1["grads"][name])
    # the agreement primitives: the largest of each number, on every rank; a disagreement stops
    # both ranks with the same error instead of hanging in mismatched collectives
    assert r0["agreed"] == r1["agreed"] == [1.0, 10.0]
    for r in ranks:
        assert r["checks"]["same"] is None
        assert "chose different codecs for bucket 7 (none .. 1bit)" in r["checks"]["different"]


# --- one process, hand-made buckets ----------------------------------------------------------------


class FakeBucket:
    """What the hook uses of dist.GradBucket: gradients are views into the buffer."""

    def __init__(self, index, params, grads):
        self._index = index
        self._params = params
        self._buffer = torch.cat([g.reshape(-1) for g in grads])
        self._grads, at = [], 0
        for g in grads:
            self._grads.append(self._buffer[at:at + g.numel()].view_as(g))
            at += g.numel()

    def index(self):
        return self._index

    def is_last(self):
        return False

    def buffer(self):
        return self._buffer

    def gradients(self):
        return self._grads

    def parameters(self):
        return self._params


def params(*sizes):
    return {name: torch.nn.Parameter(torch.zeros(n)) for name, n in sizes}


def grad(n, seed):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def run(state, index, named, seed):
    bucket = FakeBucket(index, [p for _, p in named], [grad(p.numel(), seed + i) for i, (_, p) in enumerate(named)])
    fut = compressed_allreduce_hook(state, bucket)
    assert fut.done() and fut.value() is bucket.buffer()
    return bucket


def test_world_size_one_groups_by_codec_and_writes_back():
    ps = params(("a.weight", 5000), ("a.bias", 50), ("b.weight", 6000), ("c.o_proj.weight", 5000))
    state = HookState(ps.items(), CompressionPolicy("1bit"))
    bucket = run(state, 0, list(ps.items()), 0)
    out = bucket.buffer()
    # kept tensors go through fp16 (world size 1: a round trip), compressed ones are 1bit +-scale
    assert torch.equal(out[5000:5050], grad(50, 1).half().float())
    assert out[:5000].abs().unique().numel() <= 3  # a few chunk scales
    sd = state.state_dict()
    assert [s["names"] for s in sd["slots"]] == [["a.weight", "b.weight"]]
    assert sd["slots"][0]["codec"] == "1bit"
    assert sd["slots"][0]["state"]["worker_error"].numel() == layout(11000, 1)[1]
    taken = state.stats.take()
    assert taken["comm_calls"] == 1 and taken["bytes_sent"] == 0


def test_new_composition_takes_over_worker_errors_by_name():
    ps = params(("x.weight", 5000), ("y.weight", 6000), ("z.weight", 7000))
    state = HookState(ps.items(), CompressionPolicy("1bit"))
    run(state, 0, [("x.weight", ps["x.weight"]), ("y.weight", ps["y.weight"])], 0)
    run(state, 1, [("z.weight", ps["z.weight"])], 10)
    old = {s["names"][0]: s for s in state.state_dict()["slots"]}
    err_y = old["x.weight"]["state"]["worker_error"][5000:11000]
    err_z = old["z.weight"]["state"]["worker_error"][:7000]
    # rebuilt buckets: (y, z) now travel together, x alone. The hook asks for the slot of the
    # new composition; it starts from y's and z's errors.
    slot = state._slot("1bit", ("y.weight", "z.weight"), (6000, 7000), 1, torch.device("cpu"))
    assert torch.equal(slot.state.worker_error[:6000], err_y)
    assert torch.equal(slot.state.worker_error[6000:13000], err_z)
    assert slot.state.server_error is None
    run(state, 0, [("y.weight", ps["y.weight"]), ("z.weight", ps["z.weight"])], 20)
    assert state._slots[("1bit", ("y.weight", "z.weight"))] is slot
    sd = state.state_dict()
    # the (z) slot lost its only tensor and is gone; (x, y) still holds x's error
    assert sorted(tuple(s["names"]) for s in sd["slots"]) == [("x.weight", "y.weight"), ("y.weight", "z.weight")]
    run(state, 1, [("x.weight", ps["x.weight"])], 30)
    assert sorted(tuple(s["names"]) for s in state.state_dict()["slots"]) == [("x.weight",), ("y.weight", "z.weight")]


def test_state_dict_round_trip_and_resume_with_another_world_size():
    ps = params(("x.weight", 5000), ("y.weight", 6000))
    named = list(ps.items())
    state = HookState(named, CompressionPolicy("2bit"))
    run(state, 0, named, 0)
    sd = state.state_dict()
    resumed = HookState(named, CompressionPolicy("2bit"))
    resumed.load_state_dict(sd)
    a, b = run(state, 0, named, 5), run(resumed, 0, named, 5)
    assert torch.equal(a.buffer(), b.buffer())  # a resumed run sends what the live one does
    # a checkpoint written by a 3-rank run: padded sizes differ, worker errors are re-laid by name
    m, padded = layout(11000, 3)
    err = torch.arange(padded, dtype=torch.float32)
    err[11000:] = 0
    moved = HookState(named, CompressionPolicy("2bit"))
    moved.load_state_dict({**sd, "slots": [{"codec": "2bit", "names": ["x.weight", "y.weight"], "numels": [5000, 6000],
                                            "state": {"worker_error": err, "server_error": torch.ones(m)}}]})
    slot = moved._slot("2bit", ("x.weight", "y.weight"), (5000, 6000), 1, torch.device("cpu"))
    assert slot.state.worker_error.numel() == layout(11000, 1)[1]
    assert torch.equal(slot.state.worker_error[:11000], err[:11000]) and slot.state.server_error is None


def test_nonfinite_in_one_process_zeroes_and_names():
    ps = params(("x.weight", 5000), ("y.weight", 6000))
    state = HookState(ps.items(), CompressionPolicy("1bit"))
    run(state, 0, list(ps.items()), 0)
    before = state.state_dict()
    bucket = FakeBucket(0, list(ps.values()), [grad(5000, 1), torch.full((6000,), float("inf"))])
    compressed_allreduce_hook(state, bucket)
    assert not bucket.buffer().any()
    assert state.nonfinite == ["y.weight"] and state.skipped_buckets == 1
    after = state.state_dict()
    assert torch.equal(before["slots"][0]["state"]["worker_error"], after["slots"][0]["state"]["worker_error"])


def test_unnamed_parameters_get_a_placeholder_name():
    p = torch.nn.Parameter(torch.zeros(5000))
    state = HookState([], CompressionPolicy("1bit"))
    run(state, 3, [("?", p)], 0)
    assert state.state_dict()["slots"][0]["names"] == ["<bucket3.param0>"]


def test_timer_gets_each_bucket_interval():
    class Timer:
        def __init__(self):
            self.spans = []

        def comm_interval(self, start, end):
            self.spans.append((start, end))

    ps = params(("x.weight", 100))
    timer = Timer()
    state = HookState(ps.items(), CompressionPolicy("none"), timer=timer)
    run(state, 0, list(ps.items()), 0)
    run(state, 0, list(ps.items()), 1)
    assert len(timer.spans) == 2 and all(e >= s for s, e in timer.spans)
