"""The Ray Data pipeline and tokenisation on real files, with the tiny-random tokenizer."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from rapidfire_ray.config import load_config
from rapidfire_ray.data.prepare import build_sft_dataset
from rapidfire_ray.data.tokenize import SFTTokenizer, tokenize_batch
from rapidfire_ray.errors import RapidfireError


def cfg_for(path, fmt="prompt_completion", **extra):
    return load_config(None, {"model.name": "tiny-random", "data.path": str(path), "data.format": fmt,
                              "data.max_length": 64, **extra})


def write_jsonl(path, lines):
    with open(path, "wb") as f:
        for line in lines:
            f.write(line if isinstance(line, bytes) else json.dumps(line).encode())
            f.write(b"\n")
    return path


def batch_of(**cols):
    n = len(next(iter(cols.values())))
    base = {k: [""] * n for k in ("source", "text", "prompt", "completion", "messages")}
    base.update(cols)
    base["source"] = [f"x:{i}" for i in range(n)]
    return base


def test_prompt_completion_trains_on_completion_and_eos_only():
    tok = SFTTokenizer("tiny-random", "prompt_completion", 64)
    out = tok(batch_of(prompt=["Q: 1+1?"], completion=[" 2"]))
    ids, mask = out["input_ids"][0], out["loss_mask"][0]
    prompt_len = len(tok.tokenizer("Q: 1+1?", add_special_tokens=False)["input_ids"])
    assert mask[:prompt_len].sum() == 0 and mask[prompt_len:].all()
    assert ids[-1] == tok.tokenizer.eos_token_id
    assert tok.tokenizer.decode(ids[prompt_len:-1]) == " 2"


def test_chat_trains_on_assistant_replies_only_and_truncates():
    tok = SFTTokenizer("tiny-random", "messages", 40)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "bye"}, {"role": "assistant", "content": "ciao"}]
    full = SFTTokenizer("tiny-random", "messages", 10_000)(batch_of(messages=[json.dumps(msgs)]))
    ids, mask = full["input_ids"][0], full["loss_mask"][0]
    text = tok.tokenizer.apply_chat_template(msgs, tokenize=False)
    assert tok.tokenizer.decode(ids) == text
    trained = tok.tokenizer.decode(ids[mask == 1])
    assert "hello" in trained and "ciao" in trained and "hi" not in trained and "bye" not in trained
    assert "assistant" not in trained  # the role header is prompt, not target
    short = tok(batch_of(messages=[json.dumps(msgs)]))
    assert len(short["input_ids"][0]) == 40 and short["truncated"][0]


def test_text_rows_are_trained_on_entirely():
    out = SFTTokenizer("tiny-random", "text", 64)(batch_of(text=["hello world"]))
    assert out["loss_mask"][0].all() and not out["truncated"][0]


class CountingTokenizer:
    """Stands in for a tokenizer class: counts how often one is built."""
    built = 0

    def __init__(self, model_dir: str, max_length: int):
        CountingTokenizer.built += 1
        self.max_length = max_length

    def __call__(self, batch):
        return {"n": [self.max_length] * len(batch["source"])}


def test_a_task_worker_builds_its_tokenizer_once_and_again_when_the_files_change(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    batch = batch_of(text=["a", "b"])
    before = CountingTokenizer.built
    assert tokenize_batch(batch, CountingTokenizer, (str(tmp_path), 7)) == {"n": [7, 7]}
    assert tokenize_batch(batch, CountingTokenizer, (str(tmp_path), 7)) == {"n": [7, 7]}
    assert CountingTokenizer.built == before + 1
    assert tokenize_batch(batch, CountingTokenizer, (str(tmp_path), 9)) == {"n": [9, 9]}  # other arguments
    assert CountingTokenizer.built == before + 2
    (tmp_path / "tokenizer.json").write_text('{"changed": true}')  # same name, new files: built again
    tokenize_batch(batch, CountingTokenizer, (str(tmp_path), 7))
    assert CountingTokenizer.built == before + 3


def test_pipeline_reads_tokenises_and_reports(ray_cluster, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(30)])
    ds, report = build_sft_dataset(cfg_for(path))
    assert report.rows == 30 == ds.count() and report.bad_rows == 0
    rows = ds.take_all()
    assert sorted(r["source"] for r in rows) == sorted(f"d.jsonl:{i + 1}" for i in range(30))
    assert [r["source"] for r in rows] != [f"d.jsonl:{i + 1}" for i in range(30)]  # shuffled
    assert report.tokens == sum(len(r["input_ids"]) for r in rows)
    assert report.trained_tokens == sum(int(np.sum(r["loss_mask"])) for r in rows) > 0


def test_bad_rows_are_skipped_and_reported(ray_cluster, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"prompt": "a", "completion": "b"}, {"prompt": "a"}, b"\xff\xfe not utf8", {"prompt": "a", "completion": 3},
        {"prompt": "c", "completion": "d"}])
    ds, report = build_sft_dataset(cfg_for(path))
    assert (report.rows, report.bad_rows, report.rows_read) == (2, 3, 5)
    assert [e["source"] for e in report.bad_examples] == ["d.jsonl:2", "d.jsonl:3", "d.jsonl:4"]
    assert "completion" in report.bad_examples[0]["error"] and "UTF-8" in report.bad_examples[1]["error"]
    assert "skipped 3 bad row(s), e.g. d.jsonl:2" in report.describe()


def test_on_bad_row_fail_names_the_row(ray_cluster, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "completion": "b"}, {"prompt": "a", "completion": ""}])
    with pytest.raises(RapidfireError, match=r"bad row d.jsonl:2: .*completion.*data.on_bad_row=skip"):
        build_sft_dataset(cfg_for(path, **{"data.on_bad_row": "fail"}))


def test_empty_after_filtering_is_an_error(ray_cluster, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "wrong format"}])
    with pytest.raises(RapidfireError, match="no usable rows .* check data.format"):
        build_sft_dataset(cfg_for(path))


def test_oasst_sample_becomes_conversations(ray_cluster):
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # byte-level tiny tokenizer + ChatML's default system prompt: conversations need room
    cfg = cfg_for(f"{repo}/jobs/data/oasst_sample.jsonl", "oasst", **{"data.max_length": 2048})
    ds, report = build_sft_dataset(cfg)
    assert report.rows == 20 and report.bad_rows == 1


def test_overlong_rows_are_truncated_or_dropped_and_counted(ray_cluster, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p", "completion": "short"},
                                              {"prompt": "p", "completion": "x" * 200}])
    ds, report = build_sft_dataset(cfg_for(path))  # max_length 64, byte-level tokenizer
    assert (report.rows, report.truncated_rows, report.dropped_overlong) == (2, 1, 0)
    assert max(len(r["input_ids"]) for r in ds.take_all()) == 64
    ds, report = build_sft_dataset(cfg_for(path, **{"data.overlong": "drop"}))
    assert (report.rows, report.truncated_rows, report.dropped_overlong) == (1, 0, 1)
    assert "dropped 1 row(s) longer than data.max_length" in report.describe()
