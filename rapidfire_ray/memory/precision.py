"""The precision a run computes in: `train.precision` (auto | fp32 | fp16 | bf16 | fp8).

`auto` follows the article's rule by parameter count, then the hardware:

| parameters | on a CUDA GPU                                             | on CPU                        |
|------------|-----------------------------------------------------------|-------------------------------|
| < 7B       | fp16 with dynamic loss scaling                            | fp32 (bf16 only with AMX)     |
| 7B - 20B   | bf16 (fp16 where the GPU has no bf16: before Ampere)      | same                          |
| > 20B      | fp8 where the GPU has it (compute capability 8.9+ and     | same                          |
|            | torchao installed), else bf16, saying why                 |                               |

Weights, gradients and optimizer state stay fp32 in every mode (mixed precision). Why `auto`
keeps fp32 on CPU without AMX, and how fp16 and fp8 are applied: docs/memory.md.

An explicit request the hardware cannot honour is an error naming the key and what to use
instead, never a silent fallback; `auto` falls back and logs the reason.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import RapidfireError

CHOICES = ("auto", "fp32", "fp16", "bf16", "fp8")
SMALL, LARGE = 7e9, 20e9  # the article's parameter-count boundaries
FP8_CAPABILITY = (8, 9)  # Ada / Hopper and later have fp8 tensor cores (A100 is 8.0: none)


@dataclass(frozen=True)
class Hardware:
    """What the worker computes on, as far as precision is concerned."""

    kind: str  # "cuda" | "cpu"
    name: str
    capability: tuple[int, int] | None = None  # CUDA compute capability
    cpu_amx: bool = False  # CPU with AMX tiles (native bf16 matmuls)

    @classmethod
    def detect(cls, device: torch.device | None = None) -> Hardware:
        if device is not None and device.type == "cuda" or device is None and torch.cuda.is_available():
            index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
            return cls("cuda", torch.cuda.get_device_name(index), tuple(torch.cuda.get_device_capability(index)))
        return cls("cpu", "CPU", cpu_amx=bool(torch.cpu._is_amx_tile_supported()))

    @classmethod
    def cpu(cls) -> Hardware:
        """A CPU worker, as the driver knows it from the config (scaling.use_gpu false)."""
        return cls("cpu", "CPU")

    @property
    def has_bf16(self) -> bool:
        return self.kind == "cpu" or self.capability is not None and self.capability >= (8, 0)

    @property
    def has_fp8(self) -> bool:
        return self.kind == "cuda" and self.capability is not None and self.capability >= FP8_CAPABILITY

    def describe(self) -> str:
        if self.kind == "cuda":
            return f"{self.name} (compute capability {self.capability[0]}.{self.capability[1]})"
        return "CPU with AMX" if self.cpu_amx else "CPU without AMX"


@dataclass(frozen=True)
class Precision:
    requested: str
    compute: str  # fp32 | fp16 | bf16 | fp8
    reason: str

    @property
    def loss_scaling(self) -> str | None:
        return "dynamic" if self.compute == "fp16" else None

    @property
    def activation_bytes(self) -> int:
        """Bytes per element of what autocast saves for backward (fp8 keeps bf16 activations)."""
        return 4 if self.compute == "fp32" else 2

    def trainer_flags(self) -> dict:
        """transformers TrainingArguments flags: fp16 -> autocast + GradScaler; bf16 and fp8 -> bf16 autocast."""
        return {"fp16": self.compute == "fp16", "bf16": self.compute in ("bf16", "fp8")}

    def describe(self) -> str:
        scaling = ", dynamic loss scaling" if self.loss_scaling else ""
        return f"precision {self.compute}{scaling} (train.precision {self.requested}: {self.reason})"

    def to_dict(self) -> dict:
        return {"requested": self.requested, "compute": self.compute, "loss_scaling": self.loss_scaling,
                "reason": self.reason}


def fp8_backend_missing() -> str | None:
    """Why fp8 training cannot run in this Python environment (None when it can)."""
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return "torchao is not installed (pip install 'rapidfire-ray[fp8]')"
    return None


def choose(requested: str, num_params: int, hw: Hardware) -> Precision:
    """The compute precision for a model of `num_params` parameters on `hw` (see the module doc)."""
    billions = f"{num_params / 1e9:.2f}B parameters"
    if requested not in CHOICES:
        raise RapidfireError(f"train.precision: {requested!r} is not one of: {', '.join(CHOICES)}")
    if requested == "fp32":
        return Precision(requested, "fp32", "as asked")
    if requested == "fp16":
        if hw.kind != "cuda":
            raise RapidfireError("train.precision: fp16 needs a CUDA GPU (its loss scaling and kernels are "
                                 "GPU-only); on CPU use bf16 or fp32")
        return Precision(requested, "fp16", "as asked")
    if requested == "bf16":
        if not hw.has_bf16:
            raise RapidfireError(f"train.precision: bf16 is not supported by {hw.describe()}; use fp16 or fp32")
        return Precision(requested, "bf16", "as asked")
    if requested == "fp8":
        if not hw.has_fp8:
            raise RapidfireError(f"train.precision: fp8 needs an NVIDIA GPU with compute capability 8.9 or "
                                 f"later (H100, H200, L40S); this worker has {hw.describe()}; use bf16")
        missing = fp8_backend_missing()
        if missing:
            raise RapidfireError(f"train.precision: fp8: {missing}")
        return Precision(requested, "fp8", "as asked")

    # auto
    if hw.kind == "cpu":
        if hw.cpu_amx:
            return Precision(requested, "bf16", f"{billions}; a CPU with AMX computes bf16 natively")
        return Precision(requested, "fp32", f"{billions} on a {hw.describe()}: bf16 autocast would not be faster "
                                            "here and fp32 is exact")
    if num_params < SMALL:
        return Precision(requested, "fp16", f"{billions} (< 7B): the article's rule")
    if num_params <= LARGE:
        if hw.has_bf16:
            return Precision(requested, "bf16", f"{billions} (7B-20B): the article's rule")
        return Precision(requested, "fp16", f"{billions} (7B-20B) but {hw.describe()} has no bf16")
    if not hw.has_fp8:
        fallback = "bf16" if hw.has_bf16 else "fp16"
        return Precision(requested, fallback, f"{billions} (> 20B) calls for fp8, but {hw.describe()} has none")
    missing = fp8_backend_missing()
    if missing:
        return Precision(requested, "bf16", f"{billions} (> 20B) calls for fp8, but {missing}")
    return Precision(requested, "fp8", f"{billions} (> 20B) on {hw.describe()}: the article's rule")


def convert_to_fp8(model: torch.nn.Module) -> int:
    """Swap the decoder's linear layers for torchao Float8Linear; returns how many were swapped.
    The output head and layers whose sizes fp8 matmuls cannot take (dimensions not multiples of 16)
    stay as they are."""
    from torchao.float8 import convert_to_float8_training

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    swapped = []

    def eligible(module: torch.nn.Module, fqn: str) -> bool:
        ok = (isinstance(module, torch.nn.Linear) and module is not head
              and module.in_features % 16 == 0 and module.out_features % 16 == 0)
        if ok:
            swapped.append(fqn)
        return ok

    convert_to_float8_training(model, module_filter_fn=eligible)
    return len(swapped)
