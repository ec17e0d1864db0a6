"""The reward and RL sample data (jobs/data/make_pipeline_data.py): the committed files are what the
script writes, pairs are correct vs. flawed by the task's own scorer, and held-out prompts never
appear in a training file."""
from __future__ import annotations

import importlib.util
import json
import os
from collections import Counter

import pytest

from paths import REPO, SAMPLE
from rapidfire_ray.tasks import score_completion

DATA = os.path.join(REPO, "jobs", "data")


def _script():
    spec = importlib.util.spec_from_file_location("make_pipeline_data", os.path.join(DATA, "make_pipeline_data.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read(name: str) -> list[dict]:
    with open(os.path.join(DATA, name), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def files() -> dict[str, list[dict]]:
    return {key: read(name) for key, name in _script().FILES.items()}


def test_committed_files_are_what_the_script_writes(files, tmp_path):
    script = _script()
    made = script.make_all()
    assert made == files
    script.write_jsonl(tmp_path / "x.jsonl", made["preference_train"])
    with open(os.path.join(DATA, "preference_train.jsonl"), "rb") as f:
        assert (tmp_path / "x.jsonl").read_bytes() == f.read()


def test_row_fields_sizes_and_ids(files):
    assert [len(files[k]) for k in ("preference_train", "preference_heldout", "rl_prompts_train",
                                    "rl_prompts_heldout")] == [480, 120, 260, 104]
    for key, rows in files.items():
        fields = ["id", "task", "prompt", "chosen", "rejected", "answer"] if key.startswith("preference") \
            else ["id", "task", "prompt", "answer"]
        assert all(list(r) == fields for r in rows), key
        assert len({r["id"] for r in rows}) == len(rows)
        assert all(len(r["prompt"]) <= 150 and r["answer"] for r in rows)
    assert len(Counter(r["task"] for r in files["preference_train"])) == 12


def test_chosen_is_correct_and_rejected_flawed_by_the_task_scorer(files):
    for key in ("preference_train", "preference_heldout"):
        for r in files[key]:
            assert score_completion(r["chosen"], r["answer"]) == 1.0, r
            assert score_completion(r["rejected"], r["answer"]) == 0.0, r
            assert r["chosen"] != r["rejected"]


def test_rl_prompts_ask_for_the_answer_only(files):
    for key in ("rl_prompts_train", "rl_prompts_heldout"):
        assert all("only" in r["prompt"] for r in files[key])


def test_held_out_prompts_are_not_in_any_training_file(files):
    with open(SAMPLE, encoding="utf-8") as f:
        train = {json.loads(line)["prompt"] for line in f}
    train |= {r["prompt"] for r in files["preference_train"]} | {r["prompt"] for r in files["rl_prompts_train"]}
    for key in ("preference_heldout", "rl_prompts_heldout"):
        prompts = [r["prompt"] for r in files[key]]
        assert len(set(prompts)) == len(prompts)
        assert not set(prompts) & train, key
