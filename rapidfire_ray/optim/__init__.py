"""Optimizers. `RapidfireAdamW`: AdamW for a warm-up, then 1-bit Adam's compressed momentum
exchange (arXiv 2102.02888), on gloo and NCCL.

    optimizer = RapidfireAdamW(model.named_parameters(), lr=2e-5, weight_decay=0.0,
                               freeze_step=default_freeze_step(total_steps), codec="1bit")
    ddp_model.register_comm_hook(optimizer, local_gradient_hook)
"""
from .ddp_hook import local_gradient_hook
from .rapidfire_adamw import RapidfireAdamW, default_freeze_step, frozen_denom

__all__ = ["RapidfireAdamW", "default_freeze_step", "frozen_denom", "local_gradient_hook"]
