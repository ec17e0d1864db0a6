"""Model and tokenizer loading: built-ins (`smollm2-135m`, `tiny-random`), local directories,
and Hugging Face hub ids."""

from rapidfire_ray.models.registry import (
    BUILTIN_MODELS,
    load_model,
    load_reward_model,
    load_tokenizer,
    model_num_parameters,
    save_pretrained_atomic,
)

__all__ = [
    "BUILTIN_MODELS",
    "load_model",
    "load_reward_model",
    "load_tokenizer",
    "model_num_parameters",
    "save_pretrained_atomic",
]
