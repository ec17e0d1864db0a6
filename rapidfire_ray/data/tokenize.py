"""Turn normalised records into token ids and a loss mask, inside Ray Data (`map_batches`).

One row becomes `input_ids` (int32) and `loss_mask` (int8: 1 where the token is trained on).
What is trained on follows TRL's SFT conventions: all of a `text` row; the completion of a
`prompt_completion` row; the assistant turns of a chat (`messages`, `oasst`).
"""
from __future__ import annotations

import json
import os
from collections import OrderedDict
from typing import Any

import numpy as np

# Tokenizers loaded in this process, newest last (see `tokenize_batch`).
_LOADED: OrderedDict = OrderedDict()
_KEEP = 4


def _files_fingerprint(model_name: str) -> tuple:
    """What the tokenizer is loaded from, as far as it can change under the same name: the
    top-level files of a local model directory (name, size, mtime)."""
    if not os.path.isdir(model_name):
        return ()
    entries = []
    for entry in os.scandir(model_name):
        if entry.is_file():
            st = entry.stat()
            entries.append((entry.name, st.st_size, st.st_mtime_ns))
    return tuple(sorted(entries))


def tokenize_batch(batch: dict[str, Any], cls: type, args: tuple) -> dict[str, Any]:
    """A `map_batches` function (Ray Data tasks): ``cls(*args)(batch)`` with the callable built
    once per worker process and kept. Ray reuses task worker processes, so a tokenizer loads once
    per process as it would in an actor pool, without starting actors (seconds each) per dataset."""
    key = (cls.__module__, cls.__qualname__, repr(args), _files_fingerprint(str(args[0])))
    fn = _LOADED.pop(key, None) or cls(*args)
    _LOADED[key] = fn
    while len(_LOADED) > _KEEP:
        _LOADED.popitem(last=False)
    return fn(batch)


class SFTTokenizer:
    """Records -> token ids (run by `tokenize_batch` in Ray Data tasks)."""

    def __init__(self, model_name: str, fmt: str, max_length: int):
        from ..models import load_tokenizer

        self.tokenizer = load_tokenizer(model_name)
        self.fmt = fmt
        self.max_length = max_length
        eos = self.tokenizer.eos_token_id
        self.eos = [] if eos is None else [int(eos)]

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, list] = {"input_ids": [], "loss_mask": [], "source": [], "truncated": []}
        for i in range(len(batch["source"])):
            if batch["messages"][i]:
                ids, mask = self._chat(json.loads(batch["messages"][i]))
            elif batch["completion"][i]:
                ids, mask = self._prompt_completion(str(batch["prompt"][i]), str(batch["completion"][i]))
            else:
                ids = self._encode(str(batch["text"][i])) + self.eos
                mask = [1] * len(ids)
            truncated = len(ids) > self.max_length
            ids, mask = ids[: self.max_length], mask[: self.max_length]
            out["input_ids"].append(np.asarray(ids, dtype=np.int32))
            out["loss_mask"].append(np.asarray(mask, dtype=np.int8))
            out["source"].append(str(batch["source"][i]))
            out["truncated"].append(truncated)
        return out

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _prompt_completion(self, prompt: str, completion: str) -> tuple[list[int], list[int]]:
        p = self._encode(prompt)
        c = self._encode(completion) + self.eos
        return p + c, [0] * len(p) + [1] * len(c)

    def _chat(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        # Render growing prefixes of the conversation and tokenise each new segment, so every
        # token is attributed to exactly one message (chat templates such as ChatML are
        # prefix-stable). Assistant replies are trained on, everything else is prompt.
        ids: list[int] = []
        mask: list[int] = []
        rendered = ""
        for n, message in enumerate(messages, start=1):
            text = self.tokenizer.apply_chat_template(messages[:n], tokenize=False)
            if not text.startswith(rendered):  # not prefix-stable: fall back to the whole text
                rendered, ids, mask = "", [], []
            if message["role"] == "assistant":
                # the "<|im_start|>assistant" header is prompt, the reply and its end token are trained on
                head = self.tokenizer.apply_chat_template(messages[: n - 1], tokenize=False,
                                                          add_generation_prompt=True) if n > 1 else rendered
                if not (head.startswith(rendered) and text.startswith(head)):
                    head = rendered
                head_ids = self._encode(head[len(rendered):])
                body_ids = self._encode(text[len(head):])
                ids += head_ids + body_ids
                mask += [0] * len(head_ids) + [1] * len(body_ids)
            else:
                seg_ids = self._encode(text[len(rendered):])
                ids += seg_ids
                mask += [0] * len(seg_ids)
            rendered = text
        return ids, mask
