"""Experiment profiles: grid and random expansion, the section's validation, per-config validation."""
from __future__ import annotations

import pytest

from rapidfire_ray.errors import RapidfireError
from rapidfire_ray.experiments.spec import expand, load_experiment

from tests.paths import TINY_PROFILE

BASE = {"run": {"name": "exp-t", "seed": 3}, "model": {"name": "tiny-random", "lora": {"r": 4}},
        "data": {"path": "jobs/data/sft_sample.jsonl", "max_length": 64}}


def _profile(**experiment) -> dict:
    return {**BASE, "experiment": {"search": {"optimizer.params.lr": [1e-3, 3e-3]}, **experiment}}


def test_grid_is_every_combination_in_key_order():
    got = expand({"a": [1, 2], "b": ["x", "y", "z"]}, None, 0)
    assert got == [{"a": 1, "b": "x"}, {"a": 1, "b": "y"}, {"a": 1, "b": "z"},
                   {"a": 2, "b": "x"}, {"a": 2, "b": "y"}, {"a": 2, "b": "z"}]


def test_random_sampling_is_seeded_and_inside_its_ranges():
    search = {"lr": {"low": 1e-5, "high": 1e-2, "log": True}, "r": {"low": 2, "high": 16, "int": True},
              "sched": ["linear", "cosine"]}
    a, b, c = expand(search, 20, 5), expand(search, 20, 5), expand(search, 20, 6)
    assert a == b and a != c and len(a) == 20
    assert all(1e-5 <= s["lr"] <= 1e-2 and 2 <= s["r"] <= 16 and isinstance(s["r"], int) for s in a)
    assert {s["sched"] for s in a} == {"linear", "cosine"}


def test_profile_expands_and_validates_each_config():
    exp = load_experiment(_profile(num_chunks=2), ["experiment.search.model.lora.r=[2, 4]"])
    assert exp.name == "exp-t" and exp.spec.num_chunks == 2
    assert [c.values for c in exp.candidates] == [
        {"optimizer.params.lr": 1e-3, "model.lora.r": 2}, {"optimizer.params.lr": 1e-3, "model.lora.r": 4},
        {"optimizer.params.lr": 3e-3, "model.lora.r": 2}, {"optimizer.params.lr": 3e-3, "model.lora.r": 4}]
    assert all(c.error is None for c in exp.candidates)
    assert exp.candidates[2].cfg.optimizer.params.lr == 3e-3 and exp.candidates[2].cfg.model.lora.r == 2


def test_one_bad_config_is_marked_failed_and_the_others_stay():
    exp = load_experiment(_profile(search={"optimizer.params.lr": [1e-3, 5.0, 2e-3]}))
    errors = [c.error for c in exp.candidates]
    assert errors[0] is None and errors[2] is None
    assert "optimizer.params.lr" in errors[1] and "out of range" in errors[1]


def test_a_key_no_config_can_take_stops_the_experiment():
    with pytest.raises(RapidfireError, match="experiment.search.optimizer.params.lrr: unknown config key .* lr, weight_decay"):
        load_experiment(_profile(search={"optimizer.params.lrr": [1e-3, 2e-3]}))


@pytest.mark.parametrize("experiment, match", [
    ({"num_chunks": 0}, r"experiment.num_chunks: 0 is out of range"),
    ({"policy": "asha"}, r"experiment.policy: 'asha' is not one of: none, successive_halving"),
    ({"chunks": 3}, r"unknown key 'experiment.chunks'"),
    ({"search": {}}, r"experiment.search: empty"),
    ({"search": {"data.max_length": [32, 64]}}, r"experiment.search.data.max_length: cannot be searched"),
    ({"search": {"optimizer.params.lr": {"low": 1e-4, "high": 1e-2}}}, r"set experiment.num_samples"),
    ({"search": {"optimizer.params.lr": {"low": 0, "high": 1, "log": True}}, "num_samples": 2}, r"log: true needs low > 0"),
    ({"search": {"optimizer.params.lr": 0.1}}, r"neither a list of values nor a range"),
    ({"resources": {"cpus": 0}}, r"experiment.resources.cpus: 0.0 is out of range"),
])
def test_bad_experiment_sections_fail_in_one_line_naming_the_key(experiment, match):
    with pytest.raises(RapidfireError, match=match) as e:
        load_experiment(_profile(**experiment))
    assert "\n" not in str(e.value)


def test_a_profile_without_an_experiment_section_says_what_to_add():
    with pytest.raises(RapidfireError, match="no 'experiment' section"):
        load_experiment(TINY_PROFILE)


def test_configs_without_lora_are_failed_with_the_fix():
    profile = _profile()
    profile["model"] = {"name": "tiny-random"}
    with pytest.raises(RapidfireError, match="model.lora: null; an experiment swaps LoRA adapters"):
        load_experiment(profile)


def test_pbt_perturbs_ranges_inside_their_bounds_lists_to_a_neighbour_and_keeps_the_adapter_shape():
    import random

    from rapidfire_ray.experiments.spec import perturb

    search = {"optimizer.params.lr": {"low": 1e-4, "high": 1e-2, "log": True},
              "train.gradient_accumulation_steps": {"low": 1, "high": 8, "int": True},
              "optimizer.params.weight_decay": [0.0, 0.01, 0.1], "model.lora.r": [4, 8]}
    values = {"optimizer.params.lr": 1e-3, "train.gradient_accumulation_steps": 4,
              "optimizer.params.weight_decay": 0.01, "model.lora.r": 4}
    seen = [perturb(values, search, random.Random(i)) for i in range(40)]
    assert {s["optimizer.params.lr"] for s in seen} == {0.0008, 0.0012}
    assert {s["train.gradient_accumulation_steps"] for s in seen} == {3, 5}
    assert {s["optimizer.params.weight_decay"] for s in seen} == {0.0, 0.1}
    assert {s["model.lora.r"] for s in seen} == {4}  # a warm clone keeps its parent's adapter
    edge = perturb({"optimizer.params.lr": 1e-2, "optimizer.params.weight_decay": 0.1}, search, random.Random(0),
                   factors=(1.5,))
    assert edge["optimizer.params.lr"] == 1e-2  # kept inside the range
    assert edge["optimizer.params.weight_decay"] == 0.01  # at the end of the list: its only neighbour
    assert perturb(values, search, random.Random(3)) == perturb(values, search, random.Random(3))
