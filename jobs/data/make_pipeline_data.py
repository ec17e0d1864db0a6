"""Write the reward-model and RL sample data of the sample task (the SFT rows' task families):

- ``preference_train.jsonl``, ``preference_heldout.jsonl``: ``{"id", "task", "prompt", "chosen",
  "rejected", "answer"}`` pairs (``data.format: preference``); ``chosen`` is a correct completion,
  ``rejected`` a flawed one (a number off by a plausible slip, a wrong word, the wrong case, a
  list cut short or out of order, a final answer that contradicts the working before it);
- ``rl_prompts_train.jsonl``, ``rl_prompts_heldout.jsonl``: ``{"id", "task", "prompt", "answer"}``
  prompts for RL (``data.format: prompt``), scored with ``rapidfire_ray.tasks.score_completion``.

Held-out prompts appear in no training file (these two nor ``sft_sample.jsonl``). Every chosen
completion scores 1.0 against ``answer`` and every rejected one 0.0 (the tests check both).

Deterministic: standard library only, seeded ``random.Random``; reuses the task generators of
``make_sft_sample.py``. Run from anywhere:

    python jobs/data/make_pipeline_data.py [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from make_sft_sample import CAPITALS, MAKERS, make_rows as make_sft_rows  # noqa: E402

SEED = 7
MAX_PROMPT_CHARS = 150  # short prompts: a small model on CPU trains on them in minutes
EXPLAIN_FRACTION = 0.5  # preference pairs with a worked explanation before the answer

# Pairs / prompts per task family. The families are the SFT sample's, minus word_count (long
# sentences, and counting words is beyond a 135M reward model either way).
PAIR_TASKS = {
    "addition": 40, "subtraction": 30, "multiplication": 30, "reverse_word": 40, "count_letter": 30,
    "unit_conversion": 40, "uppercase": 50, "lowercase": 50, "sort_words": 40, "capital": 50,
    "multiples": 40, "max_number": 40,
}
PREFERENCE_TRAIN, PREFERENCE_HELDOUT = 1.0, 0.25  # x PAIR_TASKS: 480 and 120 pairs
RL_TASKS = {"addition": 30, "subtraction": 20, "multiplication": 20, "reverse_word": 25, "unit_conversion": 25,
            "uppercase": 25, "lowercase": 25, "sort_words": 20, "capital": 30, "multiples": 20, "max_number": 20}
RL_TRAIN, RL_HELDOUT = 1.0, 0.4  # 260 and 104 prompts

FILES = {
    "preference_train": "preference_train.jsonl",
    "preference_heldout": "preference_heldout.jsonl",
    "rl_prompts_train": "rl_prompts_train.jsonl",
    "rl_prompts_heldout": "rl_prompts_heldout.jsonl",
}

NUMERIC = {"addition", "subtraction", "multiplication", "count_letter", "unit_conversion", "max_number"}


# --------------------------------------------------------------------------------------------
# flawed answers


def _wrong_number(rng: random.Random, answer: str, task: str, prompt: str) -> str:
    """A plausible slip: off by one or two, off by ten, two digits swapped; for max_number
    another number of the list (the second largest when there is one)."""
    value = int(answer)
    if task == "max_number":
        listed = [int(x) for x in prompt.split(":", 1)[1].split("?", 1)[0].split(",")]
        others = sorted({x for x in listed if x != value})
        if others:
            return str(others[-1])
    choices = [value + 1, value - 1, value + 2, value - 2, value + 10, value - 10]
    digits = list(answer.lstrip("-"))
    if len(digits) >= 2 and digits[-1] != digits[-2]:
        digits[-1], digits[-2] = digits[-2], digits[-1]
        choices.append(int(("-" if answer.startswith("-") else "") + "".join(digits)))
    choices = [c for c in choices if c != value and (c >= 0 or value < 0)]
    return str(rng.choice(choices))


def _wrong_case(rng: random.Random, answer: str, upper: bool) -> str:
    """The text with the wrong case: unchanged, capitalised words, or some words missed."""
    source = answer.lower() if upper else answer.upper()
    words = answer.split()
    options = [source, " ".join(w.capitalize() for w in words)]
    if len(words) >= 2:  # one word left in the case it had
        k = rng.randrange(len(words))
        options.append(" ".join((w.lower() if upper else w.upper()) if i == k else w for i, w in enumerate(words)))
    options = [o for o in options if o != answer]
    return rng.choice(options)


def _wrong_list(rng: random.Random, answer: str, sort: bool) -> str:
    """A list cut short (last item dropped), or (sorted lists) two neighbours swapped, or
    (multiples) one item off by the step."""
    items = answer.split(", ")
    options = []
    if len(items) >= 2:
        options.append(", ".join(items[:-1]))
        if sort:
            i = rng.randrange(len(items) - 1)
            swapped = items[:i] + [items[i + 1], items[i]] + items[i + 2:]
            options.append(", ".join(swapped))
        else:
            step = int(items[0])
            i = rng.randrange(1, len(items))
            bumped = items[:i] + [str(int(items[i]) + step)] + items[i + 1:]
            options.append(", ".join(bumped))
    return rng.choice([o for o in options if o != answer])


def _wrong_word(rng: random.Random, answer: str, task: str, prompt: str) -> str:
    if task == "capital":
        return rng.choice(sorted(c for c in CAPITALS.values() if c != answer))
    # reverse_word: the word not reversed, or reversed with two letters swapped
    word = answer[::-1]
    options = [word]
    if len(answer) >= 3:
        i = rng.randrange(len(answer) - 1)
        swapped = answer[:i] + answer[i + 1] + answer[i] + answer[i + 2:]
        options.append(swapped)
    return rng.choice([o for o in options if o != answer])


def wrong_answer(rng: random.Random, task: str, prompt: str, answer: str) -> str:
    if task in NUMERIC:
        return _wrong_number(rng, answer, task, prompt)
    if task in ("uppercase", "lowercase"):
        return _wrong_case(rng, answer, upper=task == "uppercase")
    if task in ("sort_words", "multiples"):
        return _wrong_list(rng, answer, sort=task == "sort_words")
    return _wrong_word(rng, answer, task, prompt)


def flawed_completion(completion: str, answer: str, wrong: str) -> str:
    """The completion stating `wrong` instead of `answer` (the working before "The answer is"
    kept as it was: the final answer then contradicts it)."""
    marker = "The answer is "
    if marker in completion:
        head = completion[: completion.rindex(marker)]
        return f"{head}{marker}{wrong}."
    return wrong


# --------------------------------------------------------------------------------------------
# rows


def _draw(rng: random.Random, task: str, explain: bool, taken: set[str]):
    """A fresh (prompt, completion, answer) of `task` whose prompt is short and not in `taken`."""
    for _ in range(10_000):
        prompt, completion, answer = MAKERS[task](rng, explain)
        if len(prompt) <= MAX_PROMPT_CHARS and prompt not in taken:
            taken.add(prompt)
            return prompt, completion, answer
    raise RuntimeError(f"could not draw a fresh short prompt for {task}")


def make_pairs(rng: random.Random, scale: float, taken: set[str], prefix: str) -> list[dict]:
    rows = []
    for task, count in PAIR_TASKS.items():
        for _ in range(round(count * scale)):
            prompt, completion, answer = _draw(rng, task, rng.random() < EXPLAIN_FRACTION, taken)
            rejected = flawed_completion(completion, answer, wrong_answer(rng, task, prompt, answer))
            rows.append({"task": task, "prompt": prompt, "chosen": completion, "rejected": rejected,
                         "answer": answer})
    rng.shuffle(rows)
    return [{"id": f"{prefix}-{i:06d}", **row} for i, row in enumerate(rows)]


def make_prompts(rng: random.Random, scale: float, taken: set[str], prefix: str) -> list[dict]:
    rows = []
    for task, count in RL_TASKS.items():
        for _ in range(round(count * scale)):
            prompt, _completion, answer = _draw(rng, task, False, taken)  # answer-only prompts: short rollouts
            rows.append({"task": task, "prompt": prompt, "answer": answer})
    rng.shuffle(rows)
    return [{"id": f"{prefix}-{i:06d}", **row} for i, row in enumerate(rows)]


def make_all() -> dict[str, list[dict]]:
    """Every file's rows. Training files are drawn first; held-out prompts are drawn against
    every training prompt (SFT's too), so none repeats one."""
    rng = random.Random(SEED)
    train_taken = {row["prompt"] for row in make_sft_rows()}
    pref_taken, rl_taken = set(train_taken), set(train_taken)
    out = {"preference_train": make_pairs(rng, PREFERENCE_TRAIN, pref_taken, "pref-train"),
           "rl_prompts_train": make_prompts(rng, RL_TRAIN, rl_taken, "rl-train")}
    heldout_taken = pref_taken | rl_taken
    out["preference_heldout"] = make_pairs(rng, PREFERENCE_HELDOUT, heldout_taken, "pref-heldout")
    out["rl_prompts_heldout"] = make_prompts(rng, RL_HELDOUT, heldout_taken, "rl-heldout")
    return out


def write_jsonl(path: str, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default=HERE, help=f"output folder (default {HERE})")
    args = parser.parse_args()
    for key, rows in make_all().items():
        path = os.path.join(args.out_dir, FILES[key])
        write_jsonl(path, rows)
        print(f"wrote {len(rows)} rows to {path}")


if __name__ == "__main__":
    main()
