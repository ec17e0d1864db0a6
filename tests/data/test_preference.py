"""Preference pairs (data.format preference): row validation, bad rows under skip and fail, the pair
tokenizer, and the batch layout TRL's RewardTrainer expects."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from rapidfire_ray.config import load_config
from rapidfire_ray.data.formats import normalise
from rapidfire_ray.data.preference import PreferenceTokenizer, collate_pairs, split_pairs
from rapidfire_ray.data.sources import parse_file
from rapidfire_ray.errors import RapidfireError
from record_checks import check_records


def norm(obj):
    return normalise(obj, "preference")


def user(text):
    return {"role": "user", "content": text}


def bot(text):
    return {"role": "assistant", "content": text}


# ----- validation --------------------------------------------------------------------------


def test_string_pair():
    rec = norm({"prompt": "2+2?", "chosen": "4", "rejected": "5", "id": 1})
    assert rec["error"] == "" and (rec["prompt"], rec["chosen"], rec["rejected"]) == ("2+2?", "4", "5")
    assert rec["messages"] == ""  # not a chat pair


def test_string_pair_without_prompt():
    rec = norm({"chosen": "Q: 2+2? A: 4", "rejected": "Q: 2+2? A: 5"})
    assert rec["error"] == "" and rec["prompt"] == ""


def test_chat_pair_with_and_without_prompt():
    rec = norm({"prompt": [user("2+2?")], "chosen": [bot("4")], "rejected": [bot("5")]})
    assert rec["error"] == ""
    assert json.loads(rec["messages"]) == [user("2+2?")]
    assert json.loads(rec["chosen"]) == [bot("4")] and json.loads(rec["rejected"]) == [bot("5")]
    rec = norm({"chosen": [user("2+2?"), bot("4")], "rejected": [user("2+2?"), bot("5")]})
    assert rec["error"] == "" and json.loads(rec["messages"]) == []


@pytest.mark.parametrize("obj, reason", [
    ({"prompt": "p", "chosen": "same", "rejected": "same"}, "'chosen' equals 'rejected'"),
    ({"prompt": "p", "chosen": "", "rejected": "b"}, "empty text in 'chosen'"),
    ({"prompt": "p", "chosen": "a", "rejected": "   "}, "empty text in 'rejected'"),
    ({"prompt": "p", "chosen": "a"}, "missing field 'rejected'"),
    ({"prompt": "p", "rejected": "a"}, "missing field 'chosen'"),
    ({"prompt": "p", "chosen": 3, "rejected": "a"}, "field 'chosen' must be a string, got int"),
    ({"prompt": 3, "chosen": "a", "rejected": "b"}, "field 'prompt' must be a string, got int"),
    ({"chosen": [user("q"), bot("a")], "rejected": [user("q"), bot("a")]}, "'chosen' equals 'rejected'"),
    ({"chosen": [user("q"), bot("a")], "rejected": [user("q")]}, "no assistant message with non-empty content in "
                                                                 "'rejected'"),
    ({"chosen": [bot("a")], "rejected": "b"}, "field 'rejected' must be a list of messages"),
    ({"prompt": "q", "chosen": [bot("a")], "rejected": [bot("b")]}, "field 'prompt' must be a list of messages"),
    ({"chosen": [bot("a")], "rejected": []}, "empty list in 'rejected'"),
])
def test_bad_pairs(obj, reason):
    rec = norm(obj)
    assert reason in rec["error"]
    assert all(rec[k] == "" for k in rec if k != "error")


def test_bad_rows_are_named_in_file_order(tmp_path):
    rows = [{"prompt": "p", "chosen": "a", "rejected": "b"}, {"prompt": "p", "chosen": "x", "rejected": "x"},
            {"prompt": "p", "chosen": "", "rejected": "b"}]
    content = "\n".join(json.dumps(r) for r in rows).encode()
    records = check_records(parse_file(str(tmp_path / "pairs.jsonl"), content, "preference"))
    assert [(r["source"], r["error"][:30]) for r in records] == [
        ("pairs.jsonl:1", ""), ("pairs.jsonl:2", "'chosen' equals 'rejected' (a "),
        ("pairs.jsonl:3", "empty text in 'chosen'")]


# ----- tokenisation and batches ------------------------------------------------------------


@pytest.fixture(scope="module")
def tok():
    return PreferenceTokenizer("tiny-random", max_length=64)


def test_string_pair_is_prompt_completion_eos(tok):
    chosen, rejected = tok.pair("2+2? ", "4", "5", "")
    eos = tok.tokenizer.eos_token_id
    assert tok.tokenizer.decode(chosen[:-1]) == "2+2? 4" and chosen[-1] == eos
    assert tok.tokenizer.decode(rejected[:-1]) == "2+2? 5" and rejected[-1] == eos


def test_chat_pair_uses_the_chat_template(tok):
    rec = norm({"prompt": [user("2+2?")], "chosen": [bot("4")], "rejected": [bot("5")]})
    chosen, rejected = tok.pair(rec["prompt"], rec["chosen"], rec["rejected"], rec["messages"])
    text = tok.tokenizer.decode(chosen)
    assert text == tok.tokenizer.apply_chat_template([user("2+2?"), bot("4")], tokenize=False)
    assert chosen != rejected


def test_tokenizer_keeps_the_end_of_long_pairs_and_counts_pairs_truncated_to_equal(tok):
    long_prompt = "x" * 200
    out = tok({"source": ["f:1"], "prompt": [long_prompt], "chosen": ["good"], "rejected": ["bad"],
               "messages": [""]})
    chosen = out["chosen_ids"][0]
    assert len(chosen) == 64 and tok.tokenizer.decode(chosen[:-1]).endswith("good")  # the end is kept
    assert out["truncated"] == [1]
    assert out["num_tokens"][0] == 2 * 64  # the padded size of the pair in a batch
    assert out["num_trained"][0] == len(out["chosen_ids"][0]) + len(out["rejected_ids"][0])
    same = tok({"source": ["f:3"], "prompt": [""], "chosen": ["A" + "z" * 100], "rejected": ["B" + "z" * 100],
                "messages": [""]})
    assert same["num_trained"] == [0]  # equal once truncated: nothing to learn, skipped by prepare.py


def test_collate_pairs_is_trls_layout():
    from trl.trainer.reward_trainer import DataCollatorForPreference

    rows = [{"chosen_ids": np.array([1, 2, 3], np.int32), "rejected_ids": np.array([4, 5], np.int32)},
            {"chosen_ids": np.array([6], np.int32), "rejected_ids": np.array([7, 8, 9, 10], np.int32)}]
    batch = collate_pairs(rows, pad_id=0)
    trl = DataCollatorForPreference(pad_token_id=0)([{k: r[k].tolist() for k in r} for r in rows])
    assert torch.equal(batch["input_ids"], trl["input_ids"]) and torch.equal(batch["attention_mask"],
                                                                             trl["attention_mask"])
    assert batch["input_ids"].tolist() == [[1, 2, 3, 0], [6, 0, 0, 0], [4, 5, 0, 0], [7, 8, 9, 10]]
    assert batch["input_ids"].dtype == torch.long


def test_split_pairs_keeps_pairs_together_and_weights_add_to_one():
    rows = [{"chosen_ids": np.arange(1, 2 + i), "rejected_ids": np.arange(100, 103 + i)} for i in range(5)]
    batch = collate_pairs(rows, pad_id=0)
    pieces = split_pairs(batch, 2)
    assert [p["input_ids"].shape[0] for p in pieces] == [4, 6]
    assert sum(p["rf_weight"] for p in pieces) == pytest.approx(1.0)
    seen = []
    for p in pieces:
        chosen, rejected = torch.chunk(p["input_ids"], 2)
        for c, r in zip(chosen, rejected):
            c, r = c[c != 0].tolist(), r[r != 0].tolist()
            assert r[0] == 100 and len(r) == len(c) + 2  # the rejected side of the same pair
            seen.append(len(c))
    assert sorted(seen) == [1, 2, 3, 4, 5]
    assert batch["input_ids"].shape[1] == 7 and pieces[0]["input_ids"].shape[1] == 4  # trimmed to its longest row


# ----- through Ray Data: bad rows under skip and fail ------------------------------------


def _write(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


@pytest.fixture
def bad_file(tmp_path):
    rows = [{"prompt": f"q{i}", "chosen": f"yes {i}", "rejected": f"no {i}"} for i in range(6)]
    rows[2] = {"prompt": "q2", "chosen": "same", "rejected": "same"}
    rows[4] = {"prompt": "q4", "chosen": "", "rejected": "no"}
    return _write(tmp_path / "pairs.jsonl", rows)


def test_bad_pairs_are_counted_and_skipped(ray_cluster, bad_file):
    from rapidfire_ray.data.prepare import build_sft_dataset

    cfg = load_config(None, {"data.path": bad_file, "data.format": "preference", "train.stage": "reward",
                             "model.name": "tiny-random", "data.max_length": 32})
    ds, report = build_sft_dataset(cfg)
    assert (report.rows_read, report.bad_rows, report.rows) == (6, 2, 4)
    assert [e["source"] for e in report.bad_examples] == ["pairs.jsonl:3", "pairs.jsonl:5"]
    assert "skipped 2 bad row(s), e.g. pairs.jsonl:3: 'chosen' equals 'rejected'" in report.describe()
    assert set(ds.columns()) == {"chosen_ids", "rejected_ids", "source", "num_tokens"}
    rows = ds.take_all()
    assert sorted(r["source"] for r in rows) == ["pairs.jsonl:1", "pairs.jsonl:2", "pairs.jsonl:4", "pairs.jsonl:6"]
    for r in rows:
        assert r["num_tokens"] == 2 * max(len(r["chosen_ids"]), len(r["rejected_ids"]))
    assert report.tokens == sum(len(r["chosen_ids"]) + len(r["rejected_ids"]) for r in rows)


def test_bad_pair_fails_the_run_naming_the_row(ray_cluster, bad_file):
    from rapidfire_ray.data.prepare import build_sft_dataset

    cfg = load_config(None, {"data.path": bad_file, "data.format": "preference", "train.stage": "reward",
                             "model.name": "tiny-random", "data.on_bad_row": "fail"})
    with pytest.raises(RapidfireError, match=r"^data.path: bad row pairs.jsonl:3: 'chosen' equals 'rejected' .*"
                                             r"\(2 bad row\(s\) in all\); fix the row or set data.on_bad_row=skip"):
        build_sft_dataset(cfg)


def test_token_budget_counts_both_sides_of_a_pair():
    from rapidfire_ray.data.loader import DynamicBatches

    cfg = load_config(None, {"data.format": "preference", "train.stage": "reward", "data.max_length": 32,
                             "train.per_device_batch_size": 4, "data.dynamic_batch.strategy": "token_budget",
                             "data.dynamic_batch.max_padding": 1.0})
    lengths = np.array([2 * 32] * 10 + [2 * 16] * 8)  # num_tokens of a pair: 2 x its longer side
    batches = DynamicBatches.token_budget(cfg, lengths)
    plan = batches.plan(1)[0]
    # default budget 2 x 4 pairs x 32 tokens: 4 pairs at full length, 8 at half length
    assert sorted(len(b) for b in plan) == [2, 4, 4, 8]
    assert all(len(b) * int(lengths[b].max()) <= 2 * 4 * 32 for b in plan)
