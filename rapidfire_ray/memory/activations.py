"""int8 compression of the activations autograd saves for backward (`optimizer.params.compression.act: int8`).

The mechanism is `torch.autograd.graph.saved_tensors_hooks`: every tensor an op saves for backward goes through
`pack`, which may store something smaller, and `unpack` rebuilds it when backward needs it.

A saved float tensor becomes int8 with a bf16 absmax scale per block of 32 elements of a
last-dim row (1.0625 bytes per element); parameters and their forms, tensors that do not
require grad, subclasses and small or non-float tensors are kept exact; a tensor saved by
several ops is compressed once. `Int8Activations.attach` compresses only inside the decoder
layers (the loss head needs exact log-probabilities). The code's error bounds, what is kept and
why, and where it is sound: docs/memory.md.
"""
from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .checkpointing import apply_checkpointing, checkpointed_indices
from .checkpointing import decoder_layers as checkpointable_layers

MIN_NUMEL = 1024  # smaller saved tensors are kept as they are
BLOCK = 32  # elements of a last-dim row per scale


class Int8Payload:
    """A saved tensor in int8: `data` (int8, the last dim split into blocks) times `scale` (bf16, one per block)."""

    __slots__ = ("data", "scale", "dtype", "__weakref__")

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        self.data, self.scale, self.dtype = data, scale, dtype

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scale.numel() * self.scale.element_size()


def _block_size(n: int, block: int) -> int:
    return block if n % block == 0 else n


def quantize_int8(t: torch.Tensor, block: int = BLOCK) -> Int8Payload:
    """Symmetric absmax int8 with one bf16 scale per `block` elements of the last dim (per row if it does not
    divide the last dim)."""
    n = t.shape[-1]
    x = t.detach().unflatten(-1, (n // _block_size(n, block), _block_size(n, block)))  # a view, strides kept
    lo, hi = torch.aminmax(x, dim=-1, keepdim=True)
    scale = (torch.maximum(-lo, hi).float() / 127).to(torch.bfloat16)
    divisor = torch.where(scale > 0, scale, 1).float()
    rounded = torch.div(x, divisor).round_().clamp_(-127, 127)
    data = torch.empty_like(x, dtype=torch.int8)  # keeps a dense tensor's strides
    data.copy_(rounded)
    return Int8Payload(data, scale, t.dtype)


def dequantize_int8(payload: Int8Payload) -> torch.Tensor:
    out = torch.empty_like(payload.data, dtype=payload.dtype)
    torch.mul(payload.data, payload.scale.float(), out=out)  # computed in fp32, rounded once to the dtype
    return out.flatten(-2)


class ActivationStats:
    """What the hooks saw since the last `reset()`.

    Counts are per save (one `pack` call): `compressed` (answered with an int8 payload; `shared` of them reused
    the payload of an earlier save of the same tensor), `kept` (activations kept as they are), `parameters`
    (parameters and forms of them, kept; their bytes belong to the model and are not counted below).
    Bytes count memory once however often it is saved: `raw_bytes` is the size of each distinct activation
    storage saved (what autograd would hold without compression), `stored_bytes` the size of each distinct int8
    payload (data + scales) plus each distinct storage kept.
    """

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.raw_bytes = self.stored_bytes = 0
        self.compressed = self.shared = self.kept = self.parameters = 0
        self._storages = WeakIdKeyDictionary()  # storage counted in raw_bytes -> also counted as kept
        self._payloads: weakref.WeakSet[Int8Payload] = weakref.WeakSet()

    def as_dict(self) -> dict:
        return {"raw_bytes": self.raw_bytes, "stored_bytes": self.stored_bytes,
                "ratio": round(self.stored_bytes / self.raw_bytes, 4) if self.raw_bytes else None,
                "compressed": self.compressed, "shared": self.shared, "kept": self.kept,
                "parameters": self.parameters}

    def _count_storage(self, storage: torch.UntypedStorage, kept: bool) -> None:
        if storage not in self._storages:
            self._storages[storage] = False
            self.raw_bytes += storage.nbytes()
        if kept and not self._storages[storage]:
            self._storages[storage] = True
            self.stored_bytes += storage.nbytes()

    def count_kept(self, t: torch.Tensor) -> None:
        self.kept += 1
        self._count_storage(t.untyped_storage(), kept=True)

    def count_compressed(self, t: torch.Tensor, payload: Int8Payload) -> None:
        self.compressed += 1
        self._count_storage(t.untyped_storage(), kept=False)
        if payload in self._payloads:
            self.shared += 1
        else:
            self._payloads.add(payload)
            self.stored_bytes += payload.nbytes


def _storage_ptrs(items: Iterable[torch.nn.Module | torch.Tensor]) -> set[int]:
    tensors = []
    for item in items:
        tensors.extend([item] if isinstance(item, torch.Tensor) else [*item.parameters(), *item.buffers()])
    return {t.untyped_storage().data_ptr() for t in tensors}


def _from_one_parameter(t: torch.Tensor, max_ops: int = 3) -> bool:
    """True when `t` is computed from a single parameter alone, in at most `max_ops` ops, and has as many
    elements: a transpose, a reshape, autocast's cast of a weight (an embedding lookup has another size)."""
    fn = t.grad_fn
    for _ in range(max_ops):
        inputs = [f for f, _ in fn.next_functions if f is not None] if fn is not None else []
        if len(inputs) != 1:
            return False
        fn = inputs[0]
        leaf = getattr(fn, "variable", None)  # AccumulateGrad
        if leaf is not None:
            return isinstance(leaf, torch.nn.Parameter) and leaf.numel() == t.numel()
    return False


class _Packer:
    """The pack/unpack pair, with payloads shared between saves of one tensor."""

    def __init__(self, *, min_numel: int, block: int, stats: ActivationStats | None,
                 exclude: Iterable[torch.nn.Module | torch.Tensor] = (), compress: bool = True):
        self.min_numel, self.block, self.stats, self.compress = min_numel, block, stats, compress
        self.excluded = _storage_ptrs(exclude)  # storages of parameters and buffers: kept
        self._payloads = WeakIdKeyDictionary()  # storage -> {(offset, shape, strides, dtype, version): payload ref}
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def is_parameter(self, t: torch.Tensor) -> bool:
        return (isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)
                or t.untyped_storage().data_ptr() in self.excluded or _from_one_parameter(t))

    def worth_compressing(self, t: torch.Tensor) -> bool:
        if (not t.is_floating_point() or t.dtype == torch.float64 or not t.requires_grad or t.dim() == 0
                or t.numel() < max(self.min_numel, 1)):
            return False
        payload = t.numel() * (1 + 2 / _block_size(t.shape[-1], self.block))
        return payload <= 2 / 3 * min(t.numel() * t.element_size(), t.untyped_storage().nbytes())

    def pack(self, t: torch.Tensor):
        if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):  # a tensor subclass
            return t
        if self.is_parameter(t):
            if self.stats is not None:
                self.stats.parameters += 1
            return t
        if not self.compress or not self.worth_compressing(t):
            if self.stats is not None:
                self.stats.count_kept(t)
            return t
        views = self._payloads.setdefault(t.untyped_storage(), {})
        key = (t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t._version)
        payload = views[key]() if key in views else None
        if payload is None:
            payload = quantize_int8(t, self.block)
            views[key] = weakref.ref(payload)
        if self.stats is not None:
            self.stats.count_compressed(t, payload)
        return payload

    @staticmethod
    def unpack(saved):
        return dequantize_int8(saved) if isinstance(saved, Int8Payload) else saved


def int8_saved_tensors(*, min_numel: int = MIN_NUMEL, block: int = BLOCK, stats: ActivationStats | None = None,
                       exclude: Iterable[torch.nn.Module | torch.Tensor] = ()
                       ) -> torch.autograd.graph.saved_tensors_hooks:
    """A context manager compressing the tensors saved for backward inside it (docs/memory.md says what
    is kept). `exclude`: modules (their parameters and buffers) or tensors whose storage is kept exact; parameters
    are recognised without it too, unless used through `.data` or `.detach()`."""
    return _Packer(min_numel=min_numel, block=block, stats=stats, exclude=exclude).hooks


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside DDP / FSDP-style wrappers (`.module`)."""
    while isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return model


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """A causal LM's transformer blocks: its `GradientCheckpointingLayer`s, else `model.model.layers`."""
    model = unwrap(model)
    layers = checkpointable_layers(model) or list(getattr(getattr(model, "model", None), "layers", None) or [])
    if not layers:
        raise ValueError(f"{type(model).__name__}: no decoder layers found (no GradientCheckpointingLayer, no "
                         "model.model.layers); compress without a model only if it has no log-softmax head")
    return layers


class Int8Activations:
    """int8 saved activations inside a model's decoder layers: `handle = Int8Activations().attach(model)`, then
    train as usual; `handle.remove()` detaches."""

    def __init__(self, *, min_numel: int = MIN_NUMEL, block: int = BLOCK, stats: ActivationStats | None = None):
        self.min_numel, self.block, self.stats = min_numel, block, stats

    def attach(self, model: torch.nn.Module) -> AttachedHooks:
        model = unwrap(model)
        packer = _Packer(min_numel=self.min_numel, block=self.block, stats=self.stats, exclude=[model])
        return AttachedHooks(model, decoder_layers(model), packer)


class SavedBytesCounter:
    """Counts (without changing anything) what autograd saves during the whole model's forward, loss
    included: `SavedBytesCounter(stats).attach(model)`. Inside decoder layers with `Int8Activations`
    attached too, the layers' own hooks take over (innermost hooks win) and count what they store,
    so `stats` holds the step's saved-activation bytes at every memory level.

    `layers_only`: count inside the decoder layers only. Under DeepSpeed ZeRO-3 the loss head must
    stay free of saved-tensor hooks: TRL's chunked log-prob loss saves the head's weight and needs
    back the very Parameter object (it reads DeepSpeed's attributes on it), and a hook hands back
    a plain tensor."""

    def __init__(self, stats: ActivationStats, *, layers_only: bool = False):
        self.stats, self.layers_only = stats, layers_only

    def attach(self, model: torch.nn.Module) -> AttachedHooks:
        model = unwrap(model)
        packer = _Packer(min_numel=MIN_NUMEL, block=BLOCK, stats=self.stats, exclude=[model], compress=False)
        return AttachedHooks(model, decoder_layers(model) if self.layers_only else [model], packer)


class AttachedHooks:
    """Forward hooks entering the packer's saved-tensor hooks around each decoder layer's forward.

    The exit hook is `always_call`, so a forward that raises (an out-of-memory error the trainer retries with a
    smaller batch) still leaves; each layer counts its own entries, so an exit never pops what it did not push.
    The model's own forward refreshes the parameter storages to keep (parameters may have moved)."""

    def __init__(self, model: torch.nn.Module, layers: list[torch.nn.Module], packer: _Packer):
        self._packer = packer
        self._counts_only = not packer.compress  # a SavedBytesCounter: nothing to do while not counting
        self.enabled = True
        self._depth: dict[torch.nn.Module, int] = {}
        self._handles = [model.register_forward_pre_hook(self._refresh)]
        for layer in layers:
            self._handles.append(layer.register_forward_pre_hook(self._enter))
            self._handles.append(layer.register_forward_hook(self._exit, always_call=True))

    def _refresh(self, model, args) -> None:
        self._packer.excluded = _storage_ptrs([model])

    def count(self, stats: ActivationStats | None) -> None:
        """Count saves into `stats` from the next forward on (None: stop counting; a counter's
        hooks then stay out of the forward)."""
        self._packer.stats = stats
        self.enabled = stats is not None or not self._counts_only

    def _enter(self, layer, args) -> None:
        if not self.enabled:
            return
        self._packer.hooks.__enter__()
        self._depth[layer] = self._depth.get(layer, 0) + 1

    def _exit(self, layer, args, output) -> None:
        if self._depth.get(layer):
            self._depth[layer] -= 1
            self._packer.hooks.__exit__(None, None, None)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


@contextlib.contextmanager
def optimized_graph(model: torch.nn.Module | None = None, *, act: str | None = "int8", checkpoint: bool = False,
                    min_numel: int = MIN_NUMEL, stats: ActivationStats | None = None
                    ) -> Iterator[ActivationStats | None]:
    """Memory-lean autograd graphs in your own loop: `with optimized_graph(model): loss = model(**batch).loss`
    (`loss.backward()` may be inside or after). Yields `stats`.

    With a model, `act="int8"` compresses the activations saved inside its decoder layers only: the loss head's
    fp32 log-softmax must stay exact (docs/memory.md); the embedding and final norm cost little.
    `checkpoint=True` also checkpoints every decoder layer (non-reentrant, in training mode) for the duration,
    through `memory.checkpointing.apply_checkpointing` (which also turns the model's KV cache off, for good).
    Without a model, every saved float tensor that is not a parameter (nor a constant) is compressed: only safe
    for models that save no log-softmax or other exp-sensitive tensor, e.g. an MLP with a regression loss.
    `act="none"` (or None) compresses nothing.
    """
    if act not in ("int8", "none", None):
        raise ValueError(f"act: {act!r}; use 'int8' or 'none'")
    if model is None and checkpoint:
        raise ValueError("checkpoint=True needs the model, to find its decoder layers")
    with contextlib.ExitStack() as stack:
        if checkpoint:
            layers = len(checkpointable_layers(unwrap(model)))
            if not layers:
                raise ValueError(f"{type(unwrap(model)).__name__}: no decoder layer supports gradient checkpointing")
            stack.callback(apply_checkpointing, model, checkpointed_indices(model))
            apply_checkpointing(model, range(layers))
        if act == "int8" and model is not None:
            stack.callback(Int8Activations(min_numel=min_numel, stats=stats).attach(model).remove)
        elif act == "int8":
            stack.enter_context(int8_saved_tensors(min_numel=min_numel, stats=stats))
        yield stats
