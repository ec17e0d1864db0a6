"""Resolve a `model.name` to a tokenizer and a causal LM.

A name is one of the built-ins (`smollm2-135m`, `tiny-random`), a local directory holding a
Hugging Face model (config.json), or a Hugging Face hub id (plain `from_pretrained(name)`).
Tokenizers returned here always have a pad token and a chat template.
"""

from __future__ import annotations

import logging
import os
import shutil

import torch

from rapidfire_ray.atomic import publish_dir
from rapidfire_ray.errors import RapidfireError
from rapidfire_ray.models import smollm2, tiny

log = logging.getLogger(__name__)

BUILTIN_MODELS = ("smollm2-135m", "tiny-random")


# --------------------------------------------------------------------------------------------
# name resolution


def _local_dir(name: str) -> str | None:
    path = os.path.expanduser(name)
    if not os.path.isdir(path):
        return None
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise RapidfireError(
            f"model.name '{name}': the directory has no config.json; point it at a Hugging Face "
            "model directory (one written by save_pretrained) or use a built-in name "
            f"({', '.join(BUILTIN_MODELS)})"
        )
    return path


def _offline() -> bool:
    try:
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)
    except ImportError:  # pragma: no cover
        return False


def _short_reason(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    if "couldn't connect" in text.lower() or "offline mode is enabled" in text.lower():
        how = "offline mode (HF_HUB_OFFLINE) is on" if _offline() else "cannot reach the hub"
        return f"{how} and it is not in the local Hugging Face cache"
    sentence = text.split(". ")[0].rstrip(".")
    return sentence if len(sentence) <= 160 else sentence[:157] + "..."


def _hub_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [OSError]
    try:
        from huggingface_hub.errors import HFValidationError

        errors.append(HFValidationError)
    except ImportError:  # pragma: no cover - older huggingface_hub
        pass
    return tuple(errors)


def _from_hub(name: str, load):
    try:
        return load(name)
    except _hub_errors() as exc:
        raise RapidfireError(
            f"model.name '{name}': not a built-in ({', '.join(BUILTIN_MODELS)}), not a local "
            f"directory, and could not be loaded from the Hugging Face hub ({_short_reason(exc)}); "
            "use a built-in name or a local model directory"
        ) from None


def _load(name: str, load):
    """`load` a local model directory, or else a hub id (with a clear error if that fails)."""
    path = _local_dir(name)
    return load(path) if path is not None else _from_hub(name, load)


# --------------------------------------------------------------------------------------------
# public API


def ensure_tokenizer_defaults(tokenizer):
    """Give the tokenizer a pad token (its eos) and a chat template (ChatML) where it lacks one."""
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise RapidfireError(
                f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has neither a pad nor an "
                "eos token; set pad_token in its tokenizer_config.json"
            )
        tokenizer.pad_token = tokenizer.eos_token
    if not getattr(tokenizer, "chat_template", None):
        log.warning(
            "tokenizer %r has no chat template; using SmolLM2's ChatML template",
            getattr(tokenizer, "name_or_path", ""),
        )
        tokenizer.chat_template = tiny.CHATML_TEMPLATE
    return tokenizer


def load_tokenizer(name: str):
    """The tokenizer (a transformers PreTrainedTokenizerFast) for `name`."""
    from transformers import AutoTokenizer

    if name == tiny.NAME:
        return tiny.build_tokenizer()
    if name == smollm2.NAME:
        tokenizer = smollm2.load_tokenizer()
    else:
        tokenizer = _load(name, AutoTokenizer.from_pretrained)
    return ensure_tokenizer_defaults(tokenizer)


def load_model(name: str, dtype: torch.dtype = torch.float32):
    """A causal LM for `name` in `dtype` (an AutoModelForCausalLM instance, in eval mode as
    from_pretrained leaves it; the caller sets train mode)."""
    from transformers import AutoModelForCausalLM

    if name == tiny.NAME:
        return tiny.build_model(dtype)
    if name == smollm2.NAME:
        return smollm2.load_model(dtype)
    return _load(name, lambda n: AutoModelForCausalLM.from_pretrained(n, dtype=dtype))


def load_reward_model(name: str, dtype: torch.dtype = torch.float32, pad_token_id: int | None = None):
    """A reward model for `name`: its weights under a sequence-classification head with one output
    (AutoModelForSequenceClassification, num_labels=1; the head is new unless `name` is a reward
    model already). `pad_token_id` goes into the config: the head reads the last non-pad token."""
    from transformers import AutoModelForSequenceClassification

    def load(path: str):
        return AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=dtype)

    if name == tiny.NAME:
        model = tiny.build_reward_model(dtype)
    elif name == smollm2.NAME:
        model = load(smollm2.ensure_cache())
    else:
        model = _load(name, load)
    if pad_token_id is not None:
        model.config.pad_token_id = pad_token_id
    return model


def model_num_parameters(name: str) -> int:
    """The number of parameters, from the config alone (the model is built on the meta device)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if name == tiny.NAME:
        return tiny.num_parameters()
    if name == smollm2.NAME:
        source = smollm2.cached_config_dir()
        if source is None:
            return smollm2.NUM_PARAMETERS
        config = AutoConfig.from_pretrained(source)
    else:
        config = _load(name, AutoConfig.from_pretrained)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    # Tied weights are one Parameter, counted once by parameters().
    return sum(p.numel() for p in model.parameters())


def save_pretrained_atomic(model, tokenizer, out_dir: str) -> str:
    """Save `model` (and `tokenizer`, if given) in HF format to `out_dir`, atomically.

    Everything is written to `<out_dir>.tmp-<pid>` first; an existing `out_dir` is moved aside
    and removed only after the new directory is complete and renamed into place.
    """
    out_dir = os.path.abspath(os.path.expanduser(out_dir)).rstrip(os.sep)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = f"{out_dir}.tmp-{os.getpid()}"
    if os.path.lexists(tmp):
        shutil.rmtree(tmp)
    try:
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        publish_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir

