"""Rule-based rewards a program can compute from the completion and the prompt row's columns
(`rl.reward.functions`). Each takes (prompt, completion, row) and returns a float."""
from __future__ import annotations

from typing import Callable

from ..tasks import score_completion


def completion_text(completion) -> str:
    """A completion as text: TRL hands chat completions over as [{"role": "assistant", "content": ...}]."""
    if isinstance(completion, list):
        return "".join(m.get("content", "") for m in completion if isinstance(m, dict))
    return str(completion)


def answer_match(prompt, completion, row: dict) -> float:
    """1.0 when the completion states the row's `answer` (see `rapidfire_ray.tasks`), else 0.0."""
    answer = row.get("answer")
    if answer is None:
        raise KeyError("answer")
    return score_completion(completion_text(completion), str(answer))


RULES: dict[str, Callable] = {"answer_match": answer_match}
# The prompt-row column each rule needs (checked against the data before training starts).
NEEDS: dict[str, str] = {"answer_match": "answer"}
