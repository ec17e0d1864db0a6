"""The article's NaN-loss checklist as reusable checks, each returning a list of `Finding`s.

Used before a run by `rapidfire doctor` (on the config and on a sample of tokenised rows) and
during a run by the NaN guard (on the batches that produced a non-finite loss):

- learning rate above 5e-6 (`check_learning_rate`);
- gradient clipping missing (0) or outside 0.5-1.0 (`check_grad_clip`);
- abnormal tokens in token-id rows (`check_token_rows`): ids outside the vocabulary, a run of
  one token of `MAX_TOKEN_RUN` or more, empty or all-padding rows, rows with nothing to train on.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterable, Sequence

SEVERITIES = ("error", "warning", "info")

LR_CEILING = 5e-6  # the article's learning rate for stable fine-tuning
CLIP_RANGE = (0.5, 1.0)  # the article's recommended max gradient norm
# Natural text, code and chat templates rarely repeat one token 64 times in a row; such a run is
# usually a scraping or padding bug (a page of "====", a row padded inside its text, a tokenizer
# falling back to one unknown id), and a batch full of it can drive the loss to inf.
MAX_TOKEN_RUN = 64
IGNORE_INDEX = -100  # label of a token that is not trained on (transformers' convention)


@dataclass(frozen=True)
class Finding:
    """One problem (or note): `where` is a config key, a data row (`file:line`), or a topic."""

    severity: str  # error: the run would fail; warning: it may misbehave; info: for the record
    code: str  # stable short name, e.g. "lr_high", for scripts and tests
    where: str
    message: str
    fix: str = ""

    def __post_init__(self):
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity {self.severity!r} is not one of {SEVERITIES}")

    def __str__(self) -> str:
        fix = f" -> fix: {self.fix}" if self.fix else ""
        return f"{self.severity}: {self.where}: {self.message}{fix}"

    def to_dict(self) -> dict:
        return asdict(self)


def has_errors(findings: Iterable[Finding]) -> bool:
    return any(f.severity == "error" for f in findings)


def check_learning_rate(lr: float, key: str = "optimizer.params.lr") -> list[Finding]:
    """Flag a learning rate above the article's 5e-6 (a common cause of early NaN losses)."""
    if lr <= LR_CEILING:
        return []
    return [Finding("warning", "lr_high", key,
                    f"{lr:g} is {lr / LR_CEILING:.0f}x the {LR_CEILING:g} recommended for stable fine-tuning; "
                    "a high rate is the first suspect when the loss turns NaN early",
                    f"set {key}={LR_CEILING:g} (or add train.warmup_steps)")]


def check_grad_clip(clip: float, key: str = "train.grad_clip") -> list[Finding]:
    """Flag gradient clipping that is off (0) or outside the recommended 0.5-1.0."""
    low, high = CLIP_RANGE
    if clip <= 0:
        return [Finding("warning", "clip_missing", key,
                        "gradient clipping is disabled, so one bad batch can blow up the weights",
                        f"set {key}=1.0")]
    if not low <= clip <= high:
        return [Finding("warning", "clip_range", key,
                        f"{clip:g} is outside the recommended {low:g}-{high:g}",
                        f"set {key}={min(max(clip, low), high):g}")]
    return []


def check_config(cfg) -> list[Finding]:
    """The checklist's config items for a loaded run config (`rapidfire_ray.config.load_config`)."""
    return check_learning_rate(cfg.optimizer.params.lr) + check_grad_clip(cfg.train.grad_clip)


def longest_run(ids: Sequence[int]) -> tuple[int, int]:
    """(length, token id) of the longest run of one repeated token in `ids` ((0, -1) if empty)."""
    best, best_id, cur, prev = 0, -1, 0, None
    for tok in ids:
        cur = cur + 1 if tok == prev else 1
        prev = tok
        if cur > best:
            best, best_id = cur, tok
    return best, best_id


def _as_rows(x) -> list[list[int]] | None:
    if x is None:
        return None
    return [[int(t) for t in row] for row in (x.tolist() if hasattr(x, "tolist") else x)]


def check_token_rows(input_ids, *, vocab_size: int, pad_token_id: int | None = None, attention_mask=None,
                     labels=None, sources: Sequence[str] | None = None,
                     max_run: int = MAX_TOKEN_RUN) -> list[Finding]:
    """Scan token-id rows (lists, or a padded 2-D tensor/array with its `attention_mask`) for
    abnormal tokens. Padding is the positions where the mask is 0; without a mask, trailing
    `pad_token_id`s. `labels` (-100: not trained on) adds rows with nothing to train on, and an
    error when no row of the batch has a trained token (the loss would be 0/0). `sources` names
    the rows (e.g. `data.jsonl:12`); otherwise they are `row N` (0-based)."""
    rows, masks, label_rows = _as_rows(input_ids), _as_rows(attention_mask), _as_rows(labels)
    findings: list[Finding] = []
    trained_rows = 0
    for i, row in enumerate(rows):
        where = sources[i] if sources is not None else f"row {i}"
        if masks is not None:
            ids = [t for t, m in zip(row, masks[i]) if m]
        else:
            end = len(row)
            while pad_token_id is not None and end and row[end - 1] == pad_token_id:
                end -= 1
            ids = row[:end]
        if not ids:
            what = "all padding" if row else "empty"
            findings.append(Finding("warning", "empty_row", where, f"the row is {what}: no tokens to learn from",
                                    "drop the row from the data"))
            continue
        bad = sorted({t for t in ids if t < 0 or t >= vocab_size})
        if bad:
            shown = ", ".join(map(str, bad[:5])) + (", ..." if len(bad) > 5 else "")
            findings.append(Finding("error", "token_out_of_vocab", where,
                                    f"token ids outside the vocabulary [0, {vocab_size}): {shown}",
                                    "tokenise with the model's own tokenizer (model.name), or resize the "
                                    "model's embeddings to the tokenizer"))
        run, tok = longest_run(ids)
        if run >= max_run:
            findings.append(Finding("warning", "token_run", where,
                                    f"token {tok} repeats {run} times in a row (threshold {max_run})",
                                    "clean or drop the row (repeated characters, padding inside the text)"))
        if label_rows is not None:
            if any(t != IGNORE_INDEX for t in label_rows[i]):
                trained_rows += 1
            else:
                findings.append(Finding("info", "nothing_trained", where,
                                        "no token of the row is trained on (all labels -100)",
                                        "check data.format and that completions fit within data.max_length"))
    if label_rows is not None and rows and not trained_rows:
        findings.append(Finding("error", "batch_untrained", "batch",
                                "no row has a trained token: the token-normalised loss is 0/0 (NaN)",
                                "drop rows with nothing to train on"))
    return findings
