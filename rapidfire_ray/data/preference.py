"""Preference pairs (`data.format: preference`) for reward-model training: validate a row, tokenise
both sides inside Ray Data, and batch pairs in the layout TRL's `RewardTrainer` expects.

Row forms (JSON Lines or Parquet):
- strings: ``{"prompt": "...", "chosen": "...", "rejected": "..."}``; ``prompt`` may be left out
  when the prompt is already part of both completions;
- chat: ``{"prompt": [messages], "chosen": [messages], "rejected": [messages]}`` with
  ``{"role", "content"}`` messages; ``prompt`` may be left out (then ``chosen`` and ``rejected``
  are whole conversations). ``chosen`` and ``rejected`` need an assistant message with content.

Bad rows (counted and skipped, or the run stops naming the row, per `data.on_bad_row`): a missing
or empty ``chosen``/``rejected``, ``chosen`` equal to ``rejected``, a prompt of the other form
than the completions, malformed messages.

Normalised record (see `formats.py`): ``prompt``, ``chosen``, ``rejected`` hold the strings; for a
chat row ``messages`` holds the prompt's messages as JSON (``"[]"`` when there is none: a
non-empty ``messages`` marks a chat pair) and ``chosen``/``rejected`` their message lists as JSON.

Tokenised pair (one Ray Data row): ``chosen_ids``, ``rejected_ids`` (int32), ``num_tokens``
(``2 x`` the longer side: the padded tokens the pair takes in a batch, which is what dynamic
batching budgets with), ``num_trained`` (real tokens of both sides; 0 when truncation made the
two sides equal, and the pair is then skipped as having nothing to train on). Strings are
tokenised as prompt + completion + eos (TRL's convention); chat pairs through the chat template.
Sides longer than `data.max_length` lose tokens from the start (the prompt), because a reward
model scores the end of the sequence, where chosen and rejected differ.

In a batch (`collate_pairs`) the chosen sides come first and the rejected second, padded together:
``input_ids``/``attention_mask`` of ``2 x pairs`` rows, exactly what TRL's
`DataCollatorForPreference` makes and `RewardTrainer.compute_loss` splits with ``torch.chunk``.
"""
from __future__ import annotations

import json
from typing import Any

import numpy as np

NAME = "preference"
PAIR_COLUMNS = ("chosen_ids", "rejected_ids")


# --------------------------------------------------------------------------------------------
# validation (pure functions, run inside Ray Data tasks)


def normalise_preference(obj: dict) -> dict:
    """One decoded row -> record content fields (``error`` and the content keys of formats.py)."""
    from .formats import _check_messages, _check_string, _dump_messages, type_name

    def bad(reason: str) -> dict:
        return {"error": reason}

    for name in ("chosen", "rejected"):
        if name not in obj:
            return bad(f"missing field {name!r}")
    chosen, rejected, prompt = obj["chosen"], obj["rejected"], obj.get("prompt")
    chat = isinstance(chosen, list) or isinstance(rejected, list)
    if chat:
        for name, value in (("chosen", chosen), ("rejected", rejected)):
            if not isinstance(value, list):
                return bad(f"field {name!r} must be a list of messages like the other side, got {type_name(value)}")
        p_msgs: list = []
        if prompt is not None:
            if not isinstance(prompt, list):
                return bad(f"field 'prompt' must be a list of messages like 'chosen' and 'rejected', got "
                           f"{type_name(prompt)}")
            p_msgs, err = _check_messages(prompt, "prompt", need_assistant=False)
            if err:
                return bad(err)
        c_msgs, err = _check_messages(chosen, "chosen", need_assistant=True)
        if err:
            return bad(err)
        r_msgs, err = _check_messages(rejected, "rejected", need_assistant=True)
        if err:
            return bad(err)
        if c_msgs == r_msgs:
            return bad("'chosen' equals 'rejected' (a pair must differ)")
        return {"error": "", "messages": _dump_messages(p_msgs), "chosen": _dump_messages(c_msgs),
                "rejected": _dump_messages(r_msgs)}
    for name, value in (("chosen", chosen), ("rejected", rejected)):
        err = _check_string(value, name)
        if err:
            return bad(err)
    if prompt is None:
        prompt = ""
    err = _check_string(prompt, "prompt", allow_empty=True)
    if err:
        return bad(err)
    if chosen == rejected:
        return bad("'chosen' equals 'rejected' (a pair must differ)")
    return {"error": "", "prompt": prompt, "chosen": chosen, "rejected": rejected}


# --------------------------------------------------------------------------------------------
# tokenisation (a map_batches callable)


class PreferenceTokenizer:
    """Records -> tokenised pairs (run by `tokenize.tokenize_batch` in Ray Data tasks)."""

    def __init__(self, model_name: str, max_length: int):
        from ..models import load_tokenizer

        self.tokenizer = load_tokenizer(model_name)
        self.max_length = max_length
        eos = self.tokenizer.eos_token_id
        self.eos = [] if eos is None else [int(eos)]

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, list] = {"chosen_ids": [], "rejected_ids": [], "source": [], "truncated": [],
                                "num_tokens": [], "num_trained": []}
        for i in range(len(batch["source"])):
            chosen, rejected = self.pair(str(batch["prompt"][i]), str(batch["chosen"][i]),
                                         str(batch["rejected"][i]), str(batch["messages"][i]))
            truncated = max(len(chosen), len(rejected)) > self.max_length
            # Keep the end: that is where the reward is read and where the two sides differ.
            chosen, rejected = chosen[-self.max_length:], rejected[-self.max_length:]
            out["chosen_ids"].append(np.asarray(chosen, dtype=np.int32))
            out["rejected_ids"].append(np.asarray(rejected, dtype=np.int32))
            out["source"].append(str(batch["source"][i]))
            out["truncated"].append(int(truncated))
            out["num_tokens"].append(2 * max(len(chosen), len(rejected)))
            out["num_trained"].append(0 if chosen == rejected else len(chosen) + len(rejected))
        return out

    def pair(self, prompt: str, chosen: str, rejected: str, messages: str) -> tuple[list[int], list[int]]:
        """Token ids of both sides of one normalised record (untruncated)."""
        if messages:
            before = json.loads(messages)
            return (self._chat(before + json.loads(chosen)), self._chat(before + json.loads(rejected)))
        p = self._encode(prompt) if prompt else []
        return p + self._encode(chosen) + self.eos, p + self._encode(rejected) + self.eos

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _chat(self, messages: list[dict]) -> list[int]:
        return self._encode(self.tokenizer.apply_chat_template(messages, tokenize=False))


# --------------------------------------------------------------------------------------------
# batching


def is_pair_row(row: dict) -> bool:
    return "chosen_ids" in row


def collate_pairs(rows: list[dict], pad_id: int) -> dict:
    """Pairs -> TRL's reward batch: chosen sides then rejected sides, right-padded together."""
    from trl.trainer.reward_trainer import DataCollatorForPreference

    examples = [{"chosen_ids": np.asarray(r["chosen_ids"], dtype=np.int64),
                 "rejected_ids": np.asarray(r["rejected_ids"], dtype=np.int64)} for r in rows]
    batch = DataCollatorForPreference(pad_token_id=pad_id)(examples)
    return {"input_ids": batch["input_ids"].long(), "attention_mask": batch["attention_mask"].long()}


def split_pairs(batch: dict, parts: int) -> list[dict]:
    """Split a reward batch into `parts` batches of whole pairs (each still chosen-then-rejected,
    trimmed to its own longest row). Each piece carries ``rf_weight``, its share of the pairs, so
    the pieces' mean losses add up to the whole batch's mean loss."""
    import torch

    rows = batch["input_ids"].shape[0]
    pairs = rows // 2
    parts = max(1, min(parts, pairs))
    pieces = []
    for k in range(parts):
        start, end = k * pairs // parts, (k + 1) * pairs // parts
        index = torch.cat([torch.arange(start, end), torch.arange(pairs + start, pairs + end)])
        piece = {key: value[index] for key, value in batch.items()
                 if torch.is_tensor(value) and value.dim() > 0 and value.shape[0] == rows}
        width = int(piece["attention_mask"].sum(dim=1).max())
        piece = {key: value[:, :width] if value.dim() == 2 else value for key, value in piece.items()}
        piece["rf_weight"] = (end - start) / pairs * float(batch.get("rf_weight", 1.0))
        pieces.append(piece)
    return pieces


def sample_rows(ds, n: int = 2) -> list[dict]:
    """A few tokenised pairs as plain lists, for the trainer's start-up checks."""
    return [{"chosen_ids": [int(t) for t in r["chosen_ids"]], "rejected_ids": [int(t) for t in r["rejected_ids"]]}
            for r in ds.take(n)]
