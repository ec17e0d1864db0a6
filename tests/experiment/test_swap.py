"""A config swapped out and back in between chunks continues exactly as one never swapped (CPU)."""
from __future__ import annotations

import pytest
import torch

from rapidfire_ray.experiments.slot import ConfigRun, Slot, dumps, loads, steps_for
from rapidfire_ray.models import load_model

from .helpers import plain_config, sample_rows

ROWS = sample_rows(24)
CHUNKS = [ROWS[:8], ROWS[8:16]]
EVAL = ROWS[16:]


def _adapter(run: ConfigRun) -> dict:
    return {k: v.clone() for k, v in run.state()["adapter"].items()}


def test_swapped_config_continues_bit_identically():
    torch.manual_seed(0)
    a, b = plain_config(), plain_config(**{"optimizer.params.lr": 3e-3, "model.lora.r": 2, "run.seed": 7})
    total = sum(steps_for(len(c), a) for c in CHUNKS)
    pad = 0

    # never swapped: one ConfigRun trains both chunks, evaluating at the boundary as the slot does
    base = load_model("tiny-random")
    alone = ConfigRun(base, a, total)
    alone_losses = alone.train_rows(CHUNKS[0], pad)
    alone_eval0 = alone.evaluate(EVAL, pad)
    alone_losses += alone.train_rows(CHUNKS[1], pad)
    expected, expected_opt = _adapter(alone), alone.optimizer.state_dict()
    expected_eval = alone.evaluate(EVAL, pad)
    alone.release()

    # swapped: A chunk 0, out (bytes); B chunk 0 on the same base in between; A back in, chunk 1
    base = load_model("tiny-random")
    run = ConfigRun(base, a, total)
    losses = run.train_rows(CHUNKS[0], pad)
    eval0 = run.evaluate(EVAL, pad)
    saved = dumps(run.state())
    base = run.release()
    other = ConfigRun(base, b, total)
    other.train_rows(CHUNKS[0], pad)
    base = other.release()
    run = ConfigRun(base, a, total, loads(saved))
    losses += run.train_rows(CHUNKS[1], pad)

    assert losses == alone_losses and eval0 == alone_eval0
    got = _adapter(run)
    assert got.keys() == expected.keys()
    for k in expected:
        assert torch.equal(got[k], expected[k]), k
    for sa, sb in zip(run.optimizer.state_dict()["state"].values(), expected_opt["state"].values()):
        assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])
    assert run.evaluate(EVAL, pad) == expected_eval
    assert run.scheduler.get_last_lr() == alone.scheduler.get_last_lr()
    assert run.step == total == 4


def test_state_round_trip_restores_every_part():
    cfg = plain_config()
    run = ConfigRun(load_model("tiny-random"), cfg, 4)
    run.train_rows(CHUNKS[0], 0)
    state = run.state()
    back = loads(dumps(state))
    assert back["step"] == state["step"] == 2
    assert torch.equal(back["rng"], state["rng"])
    assert back["scheduler"] == state["scheduler"]
    for k, v in state["adapter"].items():
        assert torch.equal(back["adapter"][k], v)


def test_slot_keeps_its_base_model_and_reports_swaps(tmp_path):
    slot = Slot("tiny-random")
    base = slot.base
    weights = {k: v.clone() for k, v in base.state_dict().items()}
    cfg = plain_config()
    record, data = slot.train_chunk(cfg, None, CHUNKS[0], EVAL, 4, str(tmp_path / "c0" / "state.pt"))
    assert slot.base is base  # the same loaded model, its own weights untouched (LoRA trains adapters only)
    assert base.state_dict().keys() == weights.keys()
    assert all(torch.equal(base.state_dict()[k], v) for k, v in weights.items())
    assert record["steps"] == 2 and record["swap_in_s"] >= 0 and record["swap_out_s"] >= 0
    assert (tmp_path / "c0" / "state.pt").read_bytes() == data
    record2, _ = slot.train_chunk(cfg, data, CHUNKS[1], EVAL, 4, None)
    assert record2["step"] == 4


def test_warm_start_with_a_new_learning_rate_uses_it_from_the_parents_step():
    parent_cfg = plain_config()
    run = ConfigRun(load_model("tiny-random"), parent_cfg, 4)
    run.train_rows(CHUNKS[0], 0)
    state = run.state()
    base = run.release()
    child_cfg = plain_config(**{"optimizer.params.lr": 1e-3})
    child = ConfigRun(base, child_cfg, 4, state)
    # linear decay over 4 steps, 2 done: half of the child's own peak learning rate
    assert child.step == 2 and child.optimizer.param_groups[0]["lr"] == pytest.approx(0.5e-3)
    assert torch.equal(child.optimizer.state_dict()["state"][0]["exp_avg"], state["optimizer"]["state"][0]["exp_avg"])
