"""Gradient codecs (bytes on the wire, decode, exact wire size) and error feedback.

    from rapidfire_ray.compression import ErrorFeedback, get_codec

    codec = get_codec("1bit", chunk_size=2048)
    feedback = ErrorFeedback()
    encoded = feedback.compress("model.layers.0.mlp.up_proj.weight", grad, codec)
    send(encoded.payload)                 # encoded.nbytes == codec.wire_bytes(grad.numel())
    approx = codec.decode(encoded)        # float32, grad's shape and device

Codecs: "none" (float32), "fp16", "1bit" (signs + a scale per chunk), "2bit" (four levels + a
scale per chunk, and the largest 1% sent exactly). See each module for its format and why.
"""
from __future__ import annotations

import inspect
from types import MappingProxyType

from .codec import Codec, Encoded, NonFiniteGradient
from .error_feedback import ErrorFeedback
from .fp16 import Fp16Codec
from .none import NoneCodec
from .onebit import OneBitCodec
from .twobit import TwoBitCodec

#: Codec name -> class; the names the config (`optimizer.params.compression.grad`) will accept.
CODECS = MappingProxyType({"none": NoneCodec, "fp16": Fp16Codec, "1bit": OneBitCodec, "2bit": TwoBitCodec})


def get_codec(name: str, **opts) -> Codec:
    """A codec by name with its options (1bit: chunk_size, scale; 2bit: chunk_size,
    sparse_fraction). An unknown name or option is a ValueError with a one-line reason."""
    try:
        cls = CODECS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown codec {name!r}; choose one of: {', '.join(CODECS)}") from None
    allowed = list(inspect.signature(cls).parameters)
    unknown = sorted(set(opts) - set(allowed))
    if unknown:
        takes = f"options {', '.join(allowed)}" if allowed else "no options"
        raise ValueError(f"codec {name!r} takes {takes}; got {', '.join(unknown)}")
    return cls(**opts)


__all__ = ["CODECS", "Codec", "Encoded", "ErrorFeedback", "Fp16Codec", "NonFiniteGradient", "NoneCodec",
           "OneBitCodec", "TwoBitCodec", "get_codec"]
