"""Prompts for the RL stage (`data.format: prompt`): validate rows, measure them against the
generation budget inside Ray Data, and hand them to the workers.

Row forms (JSON Lines or Parquet): ``{"prompt": "...", "answer": "...", ...}`` or
``{"prompt": [{"role": "user", "content": "..."}], ...}``. Every column besides ``prompt`` is kept
(as the record's ``extra``, a JSON object) and reaches the reward functions by name, as TRL passes
dataset columns to ``reward_funcs``; ``answer_match`` reads ``answer``.

Bad rows, counted and skipped or a one-line error per `data.on_bad_row`: a missing or empty
prompt, malformed messages, a chat prompt ending with an assistant message, a column a configured
reward function needs (e.g. ``answer``) missing, and a prompt longer than the generation budget
``data.max_length - rl.max_new_tokens`` tokens (string prompts as the tokenizer encodes them,
chat prompts through the chat template with the generation prompt: what TRL's trainers feed the
model).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial
from typing import Any

import ray
import ray.data
from ray.data.expressions import col

from ..errors import RapidfireError
from .row_report import RowReport


def normalise_prompt(obj: dict) -> dict:
    """One decoded row -> record content fields: ``prompt`` (a string prompt) or ``messages`` (a
    chat prompt as JSON), ``extra`` (the other columns as a JSON object), and ``error``."""
    from .formats import _check_messages, _check_string, _dump_messages

    if "prompt" not in obj:
        return {"error": "missing field 'prompt'"}
    prompt = obj["prompt"]
    try:
        extra = json.dumps({k: v for k, v in obj.items() if k != "prompt"}, ensure_ascii=False, default=str)
    except (TypeError, ValueError) as e:
        return {"error": f"columns besides 'prompt' cannot be kept ({e})"}
    if isinstance(prompt, list):
        msgs, err = _check_messages(prompt, "prompt", need_assistant=False)
        if err:
            return {"error": err}
        if msgs[-1]["role"] == "assistant":
            return {"error": "the chat prompt ends with an assistant message; end it with the user's turn"}
        if not any(m["content"].strip() for m in msgs):
            return {"error": "empty text in 'prompt' (every message is empty)"}
        return {"error": "", "messages": _dump_messages(msgs), "extra": extra}
    err = _check_string(prompt, "prompt")
    return {"error": err} if err else {"error": "", "prompt": prompt, "extra": extra}


def row_prompt(record: dict) -> str | list[dict]:
    """A stored row's prompt as TRL takes it: the string, or the list of chat messages."""
    return json.loads(record["messages"]) if record.get("messages") else record["prompt"]


def row_columns(record: dict) -> dict[str, Any]:
    """A stored row as a dict for the trainers: ``prompt`` plus its extra columns."""
    out = json.loads(record["extra"]) if record.get("extra") else {}
    out.pop("prompt", None)
    out["prompt"] = row_prompt(record)
    return out


@dataclass
class PromptReport(RowReport):
    overlong_prompts: int = 0
    rows: int = 0
    prompt_tokens: int = 0
    budget: int = 0

    def describe(self) -> str:
        return (f"prompts: {self.rows} rows ({self.prompt_tokens} prompt tokens) from {len(self.files)} file(s); "
                f"prompt budget {self.budget} tokens") + self.bad_rows_note()


class PromptMeasure:
    """A `map_batches` callable: prompt length in tokens, over-budget and missing-column errors."""

    def __init__(self, model_name: str, budget: int, needs: dict[str, str]):
        from ..models import load_tokenizer

        self.tokenizer = load_tokenizer(model_name)
        self.budget = budget
        self.needs = needs  # reward function -> the column it reads

    def _length(self, prompt: str, messages: str) -> int:
        if messages:
            ids = self.tokenizer.apply_chat_template(json.loads(messages), add_generation_prompt=True, tokenize=True,
                                                     return_dict=True)["input_ids"]
            return len(ids)
        return len(self.tokenizer(text=prompt)["input_ids"])

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        lengths, errors = [], []
        for prompt, messages, extra in zip(batch["prompt"], batch["messages"], batch["extra"]):
            columns = json.loads(extra) if extra else {}
            missing = [(fn, c) for fn, c in self.needs.items() if columns.get(c) is None]
            n = self._length(str(prompt), str(messages))
            lengths.append(n)
            if missing:
                fn, column = missing[0]
                errors.append(f"missing column {column!r} (rl.reward.functions {fn} reads it)")
            elif n > self.budget:
                errors.append(f"prompt is {n} tokens, more than the generation budget of {self.budget} "
                              "(data.max_length - rl.max_new_tokens)")
            else:
                errors.append("")
        batch["prompt_tokens"] = lengths
        batch["error"] = errors
        return batch


def build_prompt_dataset(cfg, path: str, *, num_cpus: int = 1, what: str = "data.path"):
    """Return (materialised dataset of prompt rows in a seeded order, PromptReport). Rows keep
    ``source``, ``prompt``, ``messages``, ``extra`` and ``prompt_tokens``."""
    from ..rl.rules import NEEDS
    from . import rows
    from .row_report import read_records
    from .sources import list_data_files
    from .tokenize import tokenize_batch

    files = list_data_files(path)
    budget = cfg.data.max_length - cfg.rl.max_new_tokens
    report = PromptReport(files=files, budget=budget)
    records = read_records(files, "prompt")
    report.rows_read = records.count()
    parse_bad = records.filter(expr=col("error") != "")
    needs = {fn: NEEDS[fn] for fn in cfg.rl.reward.functions if fn in NEEDS}
    blocks = max(1, min(4 * num_cpus, report.rows_read // 512 + 1))
    measured = (records.filter(expr=col("error") == "").repartition(blocks)
                .map_batches(partial(tokenize_batch, cls=PromptMeasure, args=(cfg.model.name, budget, needs)),
                             batch_size=256,
                             compute=ray.data.TaskPoolStrategy(size=max(1, min(num_cpus, blocks))))
                .materialize())
    # Bad rows are few: bring their source, reason and length over in one pass.
    bad = [r for r in parse_bad.select_columns(["source", "error"]).take_all()]
    measured_bad = measured.filter(expr=col("error") != "").select_columns(["source", "error", "prompt_tokens"])
    bad_measured = measured_bad.take_all()
    report.overlong_prompts = sum(1 for r in bad_measured if r["prompt_tokens"] > budget)
    report.record_bad_rows(len(bad) + len(bad_measured), bad + bad_measured, cfg.data.on_bad_row, what)
    ds = (measured.filter(expr=col("error") == "")
          .map_batches(partial(rows.order_key, seed=cfg.run.seed), batch_size=1024)
          .sort("order")
          .select_columns(["source", "prompt", "messages", "extra", "prompt_tokens"])
          .materialize())
    report.rows = ds.count()
    if report.rows == 0:
        raise RapidfireError(f"{what} '{path}': no usable prompt rows ({report.rows_read} read, {report.bad_rows} bad); "
                             "check data.format (prompt) matches the file")
    report.prompt_tokens = rows.column_sums(ds, ["prompt_tokens"])["prompt_tokens"]
    return ds, report
