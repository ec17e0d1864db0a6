"""Co-batching: k LoRA configs in one forward/backward give each config the gradients, steps and
states it gets alone (CPU, tiny model, dropout 0 so nothing random differs)."""
from __future__ import annotations

import pytest
import torch

from rapidfire_ray.data.loader import collate
from rapidfire_ray.experiments.cobatch import CoBatchRun, cobatch_key
from rapidfire_ray.experiments.slot import ConfigRun, Slot, _summed_loss, dumps, loads, steps_for
from rapidfire_ray.models import load_model

from .helpers import plain_config, sample_rows

ROWS = sample_rows(24)
CHUNKS = [ROWS[:8], ROWS[8:16]]
EVAL = ROWS[16:]


def _configs() -> list[dict]:
    """Three configs that may share a pass: other learning rates, ranks, alphas, decay, clipping, seeds."""
    return [plain_config(**{"model.lora.dropout": 0.0}),
            plain_config(**{"model.lora.dropout": 0.0, "optimizer.params.lr": 3e-3, "model.lora.r": 2,
                            "model.lora.alpha": 2.0, "run.seed": 7, "train.grad_clip": 0.05}),
            plain_config(**{"model.lora.dropout": 0.0, "optimizer.params.lr": 2e-2, "optimizer.params.weight_decay": 0.0,
                            "train.lr_scheduler": "constant", "run.seed": 3})]


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape, what
    assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), f"{what}: max diff {(a - b).abs().max():.3g}"


def test_cobatched_gradients_equal_each_config_alone():
    cfgs = _configs()
    base = load_model("tiny-random")
    states = []  # trained a chunk alone first: nonzero B matrices, so every layer's routing counts
    for cfg in cfgs:
        run = ConfigRun(base, cfg, 4)
        run.train_rows(CHUNKS[0], 0)
        states.append(run.state())
        base = run.release()
    batch = collate(CHUNKS[1][:4], 0)
    co = CoBatchRun(base, cfgs, [4] * 3, states)
    co._block_losses(batch).sum().backward()
    grads = [[p.grad.clone() for p in params] for params in co.params]
    base = co.release()
    assert not any(isinstance(m, type(co.layers)) for m in base.modules())
    for j, cfg in enumerate(cfgs):
        alone = ConfigRun(base, cfg, 4, states[j])
        _summed_loss(alone.model, batch, "cpu").backward()
        own = [p.grad for p in alone.model.parameters() if p.requires_grad]
        assert len(own) == len(grads[j]) and any(g.abs().sum() > 0 for g in own)
        for i, (g, h) in enumerate(zip(grads[j], own)):
            _close(g, h, f"config {j} gradient {i}")
        base = alone.release()


def test_cobatched_chunks_train_evaluate_and_save_as_each_config_alone():
    cfgs = _configs()
    totals = [sum(steps_for(len(c), cfg) for c in CHUNKS) for cfg in cfgs]
    base = load_model("tiny-random")
    alone = []  # every config alone: chunk 0, eval, chunk 1, eval
    for cfg, total in zip(cfgs, totals):
        run = ConfigRun(base, cfg, total)
        first = run.train_rows(CHUNKS[0], 0)
        eval0 = run.evaluate(EVAL, 0)
        second = run.train_rows(CHUNKS[1], 0)
        alone.append((first, eval0, second, run.evaluate(EVAL, 0), run.state()))
        base = run.release()

    # chunk 0 co-batched, states out as bytes; chunk 1: configs 0 and 2 co-batched again, config 1 alone
    co = CoBatchRun(base, cfgs, totals, [None] * 3)
    losses = co.train_rows(CHUNKS[0], 0)
    evals = co.evaluate(EVAL, 0)
    saved = [dumps(co.state(j)) for j in range(3)]
    base = co.release()
    for j in range(3):
        assert losses[j] == pytest.approx(alone[j][0], rel=1e-5) and evals[j] == pytest.approx(alone[j][1], rel=1e-5)
        assert co.steps[j] == 2
    pair = CoBatchRun(base, [cfgs[0], cfgs[2]], [totals[0], totals[2]], [loads(saved[0]), loads(saved[2])])
    pair_losses = pair.train_rows(CHUNKS[1], 0)
    pair_evals = pair.evaluate(EVAL, 0)
    ends = {0: pair.state(0), 2: pair.state(1)}
    base = pair.release()
    solo = ConfigRun(base, cfgs[1], totals[1], loads(saved[1]))
    solo_losses = solo.train_rows(CHUNKS[1], 0)
    ends[1] = solo.state()
    solo_eval = solo.evaluate(EVAL, 0)
    base = solo.release()

    got = {0: (pair_losses[0], pair_evals[0]), 1: (solo_losses, solo_eval), 2: (pair_losses[1], pair_evals[1])}
    for j in range(3):
        _, _, second, eval1, state = alone[j]
        assert got[j][0] == pytest.approx(second, rel=1e-5) and got[j][1] == pytest.approx(eval1, rel=1e-5), j
        assert ends[j]["step"] == state["step"] == 4 and ends[j]["schedule"] == state["schedule"]
        assert ends[j]["scheduler"] == state["scheduler"]
        assert ends[j]["adapter"].keys() == state["adapter"].keys()
        for key in state["adapter"]:
            _close(ends[j]["adapter"][key], state["adapter"][key], f"config {j} {key}")
        for i, (sa, sb) in enumerate(zip(ends[j]["optimizer"]["state"].values(), state["optimizer"]["state"].values())):
            _close(sa["exp_avg"], sb["exp_avg"], f"config {j} exp_avg {i}")
            _close(sa["exp_avg_sq"], sb["exp_avg_sq"], f"config {j} exp_avg_sq {i}")
    # the slot's base came back with its own layers and weights
    assert {type(m).__name__ for m in base.modules()}.isdisjoint({"RoutedLoRALinear", "LoraLayer"})


def test_cobatch_key_groups_configs_that_differ_only_in_free_keys():
    a, b, c = _configs()
    assert cobatch_key(a) == cobatch_key(b) == cobatch_key(c)
    assert cobatch_key(a) != cobatch_key(plain_config(**{"model.lora.dropout": 0.0, "train.per_device_batch_size": 2}))
    assert cobatch_key(a) != cobatch_key(plain_config(**{"model.lora.dropout": 0.0,
                                                        "model.lora.target_modules": ["q_proj", "v_proj"]}))
    with pytest.raises(ValueError, match="differ only in"):
        CoBatchRun(load_model("tiny-random"), [a, plain_config(**{"train.per_device_batch_size": 2})], [4, 4],
                   [None, None])


def test_slot_trains_a_group_and_writes_every_members_state(tmp_path):
    slot = Slot("tiny-random")
    base = slot.base
    weights = {k: v.clone() for k, v in base.state_dict().items()}
    cfgs = _configs()[:2]
    paths = [str(tmp_path / f"c{j}" / "state-chunk1.pt") for j in range(2)]
    out = slot.train_group(cfgs, CHUNKS[0], EVAL, [4, 4], paths, None, None)
    records, blobs = out[:2], out[2:]
    assert slot.base is base and base.state_dict().keys() == weights.keys()
    assert all(torch.equal(base.state_dict()[k], v) for k, v in weights.items())
    for j, (record, data) in enumerate(zip(records, blobs)):
        assert record["steps"] == 2 and record["step"] == 2 and record["co_batch"] == 2
        assert (tmp_path / f"c{j}" / "state-chunk1.pt").read_bytes() == data
    assert records[0]["eval_loss"] != records[1]["eval_loss"]  # each its own adapter
    record, _ = slot.train_chunk(cfgs[1], blobs[1], CHUNKS[1], EVAL, 4, None)  # on alone from the group's state
    assert record["step"] == 4


def test_cobatch_bench_measures_both_ways_on_the_same_rows():
    """bench/cobatch.py on the tiny profile: both ways run and train the same losses (the script
    works; its timing ratio is a benchmark figure, not checked here)."""
    from tests.paths import REPO, load_script

    bench = load_script(f"{REPO}/bench/cobatch.py", "bench_cobatch")
    result = bench.measure(f"{REPO}/jobs/configs/experiment_tiny.yaml", configs=3, rows=8, eval_rows=4, batch=4)
    assert result["steps_per_config"] == 2 and len(result["co_batched"]["per_config"]) == 3
    assert result["losses_within_1pct"] and result["max_rel_loss_diff"] < 1e-4
    assert result["one_at_a_time"]["tokens_per_s"] > 0 and result["co_batched"]["tokens_per_s"] > 0
