"""`ParameterShard`'s logic in-process (no Ray): exact and bounded pulls, exactly-once pushes,
admission under bounded staleness, snapshots and lost-update accounting."""
from __future__ import annotations

import os

import pytest
import torch

from rapidfire_ray.compression import ErrorFeedback, get_codec
from rapidfire_ray.ps import ParameterShard, snapshot_path


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(3000, generator=g), "b": torch.randn(10, 7, generator=g) + 0.5}


def _worker_loop(shard, codec_name, steps, seed=1):
    """One worker against one shard: returns (per-step max |server - worker|, per-step max
    update norm)."""
    codec = get_codec(codec_name)
    feedback = ErrorFeedback()
    first = shard.pull("w", None, True, True)
    assert first["kind"] == "full"
    held = {n: t.clone() for n, t in first["tensors"].items()}
    version = first["version"]
    g = torch.Generator().manual_seed(seed)
    errors, moves = [], []
    for step in range(steps):
        before = shard.state()["params"]
        grads = {n: torch.randn(t.shape, generator=g) + 0.3 for n, t in held.items()}
        reply = shard.push("w", step + 1, version, {n: feedback.compress(n, x, codec) for n, x in grads.items()})
        assert reply["status"] == "applied" and reply["staleness"] == 0
        after = shard.state()["params"]
        moves.append(max((after[n] - before[n]).norm().item() for n in after))
        pulled = shard.pull("w", version, True)
        for n, enc in pulled["tensors"].items():
            decoded = codec.decode(enc)
            held[n] = decoded.clone() if pulled["kind"] == "values" else held[n] + decoded
        version = pulled["version"]
        errors.append(max((after[n] - held[n]).norm().item() for n in after))
    return errors, moves, held


def test_codec_none_pull_is_exact():
    shard = ParameterShard(0, _params(), codec="none", optimizer={"lr": 0.01})
    errors, _, held = _worker_loop(shard, "none", 20)
    assert errors == [0.0] * 20
    state = shard.state()
    assert state["version"] == 20
    assert all(torch.equal(state["params"][n], held[n]) for n in held)
    stats = shard.stats()
    assert stats["pushes"] == stats["applied"] == 20 and stats["duplicates"] == 0
    assert stats["bytes_out"] == 4 * 3070 * 21  # one full pull + 20 pulls of values


def test_1bit_pull_error_stays_bounded_by_error_feedback():
    shard = ParameterShard(0, _params(), codec="1bit", optimizer={"lr": 0.01})
    errors, moves, _ = _worker_loop(shard, "1bit", 80)
    step = max(moves)
    # The residual (server - worker copy) never exceeds a couple of updates' size, and does
    # not grow: contractive codec + server-side error feedback.
    assert max(errors) <= 2.0 * step, (max(errors), step)
    assert sum(errors[-20:]) / 20 <= 1.5 * sum(errors[20:40]) / 20
    stats = shard.stats()
    assert stats["bytes_out"] < 4 * 3070 * 81 / 10  # ~30x fewer bytes than float32 after the full pull


def test_duplicate_push_applied_once_and_gap_counted_as_lost():
    shard = ParameterShard(0, _params(), codec="none", optimizer={"lr": 0.01})
    shard.pull("w", None, True, True)
    enc = {"a": get_codec("none").encode(torch.ones(3000))}
    assert shard.push("w", 1, 0, enc)["status"] == "applied"
    assert shard.push("w", 1, 0, enc) == {"status": "duplicate", "version": 1, "staleness": None, "lost": 0}
    assert shard.push("w", 4, 1, enc)["lost"] == 2  # pushes 2 and 3 were acknowledged elsewhere
    s = shard.stats()
    assert (s["pushes"], s["applied"], s["duplicates"], s["lost_updates"]) == (3, 2, 1, 2)
    with pytest.raises(ValueError, match="does not own"):
        shard.push("w", 5, 2, {"zzz": enc["a"]})


def test_admission_bounds_staleness_and_is_first_come_first_served():
    shard = ParameterShard(0, _params(), codec="none", max_staleness=1, optimizer={"lr": 0.01})
    enc = {"a": get_codec("none").encode(torch.ones(3000))}
    assert shard.pull("x", None, True, True)["admitted"]
    assert shard.pull("y", None, True, True)["admitted"]      # one other admitted: staleness <= 1
    assert not shard.pull("z", None, True, True)["admitted"]  # a third could make x's push 2 stale
    assert shard.push("x", 1, 0, enc)["staleness"] == 0
    # y's slack is now used up (1 update since its base): nobody new until y pushes.
    assert not shard.pull("x", 1, True)["admitted"]
    assert shard.push("y", 1, 0, enc)["staleness"] == 1
    assert not shard.pull("x", 1, True)["admitted"]  # z asked first
    assert shard.pull("z", None, True, True)["admitted"]
    assert shard.pull("x", 1, True)["admitted"]
    assert shard.stats()["bound_violations"] == 0 and shard.stats()["staleness_hist"] == {0: 1, 1: 1}

    serial = ParameterShard(0, _params(), codec="none", max_staleness=0, optimizer={"lr": 0.01})
    assert serial.pull("x", None, True, True)["admitted"]
    assert not serial.pull("y", None, True, True)["admitted"]
    serial.push("x", 1, 0, enc)
    assert serial.pull("y", None, True, True)["admitted"]
    with pytest.raises(ValueError, match="max_staleness must be an integer >= 0"):
        ParameterShard(0, _params(), max_staleness=-1)


def test_snapshot_restore_resumes_and_counts_lost(tmp_path):
    kwargs = {"codec": "none", "optimizer": {"lr": 0.01, "weight_decay": 0.1}, "snapshot_every": 3,
              "snapshot_dir": str(tmp_path)}
    shard = ParameterShard(0, _params(), **kwargs)
    shard.pull("w", None, True, True)
    enc = {"a": get_codec("none").encode(torch.ones(3000))}
    for seq in range(1, 6):  # snapshot after updates 3; updates 4 and 5 are not in it
        shard.push("w", seq, seq - 1, enc)
    assert shard.stats()["snapshots"] == 1 and os.path.exists(snapshot_path(str(tmp_path), 0))
    assert not [f for f in os.listdir(tmp_path) if ".tmp-" in f]
    at_snapshot = ParameterShard(0, _params(), codec="none", optimizer={"lr": 0.01, "weight_decay": 0.1})
    at_snapshot.pull("w", None, True, True)
    for seq in range(1, 4):
        at_snapshot.push("w", seq, seq - 1, enc)

    restored = ParameterShard(0, _params(), **kwargs)  # what Ray's restart runs
    assert restored.version == 3 and restored.stats()["restored_from_version"] == 3
    assert all(torch.equal(restored.state()["params"][n], at_snapshot.state()["params"][n]) for n in _params())
    assert restored.pull("w", 5, True)["kind"] == "full"  # no mirror survives a restart
    reply = restored.push("w", 6, 5, enc)
    assert reply["lost"] == 2 and reply["staleness"] == 0 and restored.stats()["base_ahead"] == 1
    at_snapshot.push("w", 4, 3, enc)  # same optimizer state and step count: same result
    assert all(torch.equal(restored.state()["params"][n], at_snapshot.state()["params"][n]) for n in _params())
    assert restored.stats()["lost_updates"] == 2


def test_update_push_applies_lr_times_update_with_decay_and_holds_zero_variance_still():
    shard = ParameterShard(0, _params(), codec="none", optimizer={"lr": 0.1, "weight_decay": 0.5})
    none = get_codec("none")
    grads = {"a": torch.randn(3000), "b": torch.zeros(10, 7)}
    grads["b"][0] = 1.0  # row 0 of b has a gradient, the rest none: v == 0 there
    shard.push("w", 1, 0, {n: none.encode(t) for n, t in grads.items()})  # one AdamW step
    pre = shard.preconditioner()
    assert pre["step"] == 1 and pre["betas"] == (0.9, 0.999)
    v = shard.optimizer.state[shard.params["a"]]["exp_avg_sq"]
    torch.testing.assert_close(pre["denom"]["a"], v.sqrt() / (1 - 0.999) ** 0.5 + 1e-8)
    torch.testing.assert_close(pre["exp_avg"]["a"], 0.1 * grads["a"])
    assert pre["zero_variance"]["b"][1:].all() and not pre["zero_variance"]["b"][0].any()
    before = shard.state()["params"]
    update = {"a": torch.full((3000,), 0.5), "b": torch.ones(10, 7)}
    reply = shard.push("w", 2, 1, {n: none.encode(t) for n, t in update.items()}, lr=0.01, kind="update")
    assert reply["status"] == "applied" and shard.stats()["applied_by_kind"] == {"grad": 1, "update": 1}
    after = shard.state()["params"]
    torch.testing.assert_close(after["a"], before["a"] * (1 - 0.01 * 0.5) - 0.01 * 0.5)
    torch.testing.assert_close(after["b"][0], before["b"][0] * (1 - 0.01 * 0.5) - 0.01)
    torch.testing.assert_close(after["b"][1:], before["b"][1:] * (1 - 0.01 * 0.5))  # decay only
    # the AdamW state is left alone by an update push
    assert shard.optimizer.state[shard.params["a"]]["step"] == 1
    with pytest.raises(ValueError, match="push kind must be one of grad, update"):
        shard.push("w", 3, 2, {}, kind="delta")
