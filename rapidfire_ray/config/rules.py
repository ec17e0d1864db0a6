"""Rules across sections: which keys of different sections go together (each section's own rules
are its `check()` in schema.py), and the worker range that several of them read."""
from __future__ import annotations

from omegaconf import DictConfig

from ..errors import RapidfireError
from .schema import listed, show


def worker_range(cfg) -> tuple[int, int]:
    """(min, max) workers of a validated config: `scaling.num_workers` n is (n, n)."""
    n = cfg["scaling"]["num_workers"]
    if isinstance(n, int):
        return n, n
    return int(n[0]), int(n[1])


def is_elastic(cfg) -> bool:
    lo, hi = worker_range(cfg)
    return lo != hi


def cross_checks(cfg: DictConfig) -> None:
    """Every rule that combines keys of different sections; raise RapidfireError on the first broken one.
    Runs after each key and section passed its own checks, so values are of their kind and in range."""
    stage, fmt, mode = cfg.train.stage, cfg.data.format, cfg.communication.mode
    optimizer, grad = cfg.optimizer.type, cfg.optimizer.params.compression.grad
    level, workers, mem, scaling = cfg.memory.optim_level, worker_range(cfg), cfg.memory, cfg.scaling
    sharded = level == "level3" or scaling.hybrid_parallel
    zero3 = "scaling.hybrid_parallel" if scaling.hybrid_parallel else "memory.optim_level: level3"

    # Elastic runs (scaling.num_workers [min, max]) and what cannot follow a changing worker count.
    if is_elastic(cfg):
        why = None
        if stage in ("rl", "pipeline"):
            why = (f"train.stage {stage} runs its policy workers with a fixed count; use an elastic "
                   "scaling.num_workers for the sft and reward stages, one number here")
        elif mode == "parameter_server":
            why = "communication.mode parameter_server keeps per-worker push state on its shards; use allreduce or " \
                  "allreduce_compressed, or one number of workers"
        elif optimizer == "rapidfire_adamw":
            why = "rapidfire_adamw's error-feedback buffers are laid out for one worker count; use optimizer.type " \
                  "adamw (with communication.mode allreduce_compressed to compress), or one number of workers"
        elif sharded:
            why = "ZeRO-3 checkpoints are partitioned per worker and load only into the same count; use " \
                  "memory.optim_level level2 or lower, or one number of workers"
        elif cfg.train.max_steps == -1 and float(cfg.train.epochs) != int(cfg.train.epochs):
            why = f"elastic runs count whole epochs (train.epochs {cfg.train.epochs}); use a whole number of " \
                  "epochs or train.max_steps"
        if why:
            raise RapidfireError(f"scaling.num_workers: {list(workers)} (elastic): {why}")

    # Optimizer, gradient codec and communication mode.
    if mode == "parameter_server":
        if optimizer == "rapidfire_adamw" and grad == "none":
            raise RapidfireError("optimizer.params.compression.grad: 'none' leaves rapidfire_adamw nothing to "
                                 "compress in the pushes; set it to 1bit (or 2bit, fp16), or use optimizer.type adamw")
        if grad == "auto":
            raise RapidfireError("optimizer.params.compression.grad: 'auto' chooses per bucket inside the compressed "
                                 "allreduce; communication.mode parameter_server uses one codec for every tensor: "
                                 "use none, fp16, 1bit or 2bit")
    elif optimizer == "rapidfire_adamw":
        if grad == "none":
            raise RapidfireError("optimizer.params.compression.grad: 'none' leaves rapidfire_adamw nothing to "
                                 "compress; set it to 1bit (the 1-bit Adam variant), 2bit or fp16, or use "
                                 "optimizer.type adamw")
        if grad == "auto":
            raise RapidfireError("optimizer.params.compression.grad: 'auto' chooses per gradient tensor and is not "
                                 "available for rapidfire_adamw's momentum; use 1bit, 2bit or fp16")
    elif grad != "none" and mode == "allreduce":
        raise RapidfireError(f"optimizer.params.compression.grad: {show(grad)} needs communication.mode "
                             "allreduce_compressed (plain allreduce sends fp32); set communication.mode="
                             "allreduce_compressed, or optimizer.type=rapidfire_adamw to compress momentum")

    # Memory level, ZeRO-3 sharding and precision against the workers and the exchange.
    if sharded and workers[0] < 2:
        raise RapidfireError(f"{zero3} shards parameters across workers, which is meaningless with "
                             "scaling.num_workers 1; use memory.optim_level level2, or 2 or more workers")
    if sharded and mode == "parameter_server":
        raise RapidfireError(f"{zero3}: ZeRO-3 shards parameters across the workers, and communication.mode "
                             "parameter_server keeps them on its shard actors instead; choose one: "
                             "memory.optim_level level2 (or lower) with parameter_server, or communication.mode "
                             "allreduce with ZeRO-3")
    if sharded and (mode != "allreduce" or optimizer == "rapidfire_adamw"):
        chosen = "optimizer.type rapidfire_adamw" if optimizer == "rapidfire_adamw" else f"communication.mode {mode}"
        raise RapidfireError(f"{zero3}: ZeRO-3 exchanges gradients inside DeepSpeed (reduce-scatter), so it cannot "
                             f"be combined with {chosen}; use communication.mode allreduce with optimizer.type "
                             "adamw, or memory.optim_level level2")
    if mem.offload_optimizer and not sharded:
        raise RapidfireError("memory.offload_optimizer: only used with ZeRO-3 (memory.optim_level level3 or "
                             "scaling.hybrid_parallel); set memory.optim_level=level3 or remove it")
    if mem.offload_optimizer and not scaling.use_gpu:
        raise RapidfireError("memory.offload_optimizer: the workers are CPU workers (scaling.use_gpu false), so "
                             "their optimizer state is in CPU memory already; remove it")
    precision = cfg.train.precision
    if not scaling.use_gpu and precision in ("fp16", "fp8"):
        why = "fp8 needs an NVIDIA GPU with compute capability 8.9+ (H100, H200, L40S)" if precision == "fp8" \
            else "fp16 needs a CUDA GPU (its loss scaling and kernels are GPU-only)"
        raise RapidfireError(f"train.precision: {precision} on CPU workers (scaling.use_gpu false): {why}; "
                             "use bf16 or fp32, or scaling.use_gpu=true on a GPU cluster")

    # LoRA adapters (model.lora) and what they do not run with.
    lora = cfg.model.lora
    if lora is not None:
        lora_refusals = [
            (sharded, zero3, "ZeRO-3 builds the model partitioned before the adapters are added, which is not "
             "validated here (the frozen base needs no gradients or optimizer state, so there is little left to "
             "shard); use memory.optim_level level2 or lower with LoRA"),
            (mode == "parameter_server", "communication.mode parameter_server",
             "its shard actors hold the base model's parameters, built on the driver without the adapters; use "
             "allreduce or allreduce_compressed with LoRA"),
            (stage == "rl" and cfg.rl.algorithm == "ppo", "rl.algorithm ppo",
             "ppo trains its policy and value model in its own loop, outside TRL's trainers that take a "
             "peft_config; use grpo or rloo with LoRA"),
            (lora.export == "adapter" and stage == "pipeline", "model.lora.export adapter",
             "each pipeline stage loads the previous stage's model as a full model; use export merged"),
            (lora.export == "adapter" and cfg.data.eval_path is not None, "model.lora.export adapter",
             "data.eval_path scores the exported model, which must be a full model; use export merged"),
        ]
        for bad, what, why in lora_refusals:
            if bad:
                raise RapidfireError(f"{what}: not with model.lora: {why}")

    # The RL stage: prompt rows, its rewards and batch shape, and what it runs with in this release.
    if stage != "rl" and fmt == "prompt":
        raise RapidfireError(f"data.format: 'prompt' rows (prompts without completions) only feed train.stage rl; "
                             f"set train.stage=rl, or use prompt_completion/messages rows for {stage}")
    if stage == "rl":
        rl, batch = cfg.rl, cfg.train.per_device_batch_size
        if fmt != "prompt":
            raise RapidfireError(f"data.format: {show(fmt)} cannot feed train.stage rl, which samples its own "
                                 "completions; set data.format=prompt (rows with `prompt` and columns such as "
                                 "`answer`)")
        from ..rl.rules import RULES  # noqa: PLC0415 - the rule names live with the rules

        for name in rl.reward.functions:
            if name not in RULES:
                raise RapidfireError(f"rl.reward.functions: unknown reward function {show(name)}; built-in: "
                                     f"{', '.join(RULES)}")
        if rl.reward.model is None and not rl.reward.functions:
            raise RapidfireError("rl.reward: no reward: set rl.reward.model to a sequence-classification checkpoint "
                                 "and/or rl.reward.functions (e.g. [answer_match])")
        for name in rl.reward.weights:
            if name != "model" and name not in rl.reward.functions:
                raise RapidfireError(f"rl.reward.weights: {show(name)} names no reward; use 'model' or one of "
                                     f"rl.reward.functions ({listed(rl.reward.functions) or 'none'})")
        if batch % rl.num_generations:
            raise RapidfireError(f"train.per_device_batch_size: {batch} completions per worker is not a multiple "
                                 f"of rl.num_generations {rl.num_generations} (each worker samples whole groups); "
                                 f"use {max(1, batch // rl.num_generations) * rl.num_generations}")
        if rl.algorithm in ("grpo", "rloo") and rl.num_generations < 2:
            raise RapidfireError(f"rl.num_generations: {rl.algorithm} compares the completions of one prompt, so it "
                                 "needs at least 2; set rl.num_generations=4 (or use rl.algorithm=ppo)")
        budget = cfg.data.max_length - rl.max_new_tokens
        if budget < 8:
            raise RapidfireError(f"rl.max_new_tokens: {rl.max_new_tokens} leaves {budget} tokens of data.max_length "
                                 f"{cfg.data.max_length} for the prompt; raise data.max_length or lower "
                                 "rl.max_new_tokens")
        if rl.algorithm == "ppo":
            if batch % rl.ppo.minibatch_size:
                raise RapidfireError(f"rl.ppo.minibatch_size: {rl.ppo.minibatch_size} does not divide "
                                     f"train.per_device_batch_size {batch} (the rollout batch per worker)")
            if cfg.train.gradient_accumulation_steps != 1:
                raise RapidfireError("train.gradient_accumulation_steps: ppo updates on rl.ppo.minibatch_size "
                                     "minibatches of each rollout; leave gradient_accumulation_steps at 1")
            if rl.ppo.value_init == "reward" and rl.reward.model is None:
                raise RapidfireError("rl.ppo.value_init: 'reward' needs rl.reward.model; set it, or "
                                     "value_init=policy")
        # What the RL stage still refuses, and why (README: "RL and the acceleration layers").
        ppo = rl.algorithm == "ppo"
        unsupported = [
            (ppo and mode != "allreduce", f"communication.mode {mode}",
             "ppo's update loop steps its own optimizers outside a transformers Trainer and exchanges plain DDP "
             "gradients; use grpo or rloo for a compressed exchange"),
            (ppo and optimizer != "adamw", f"optimizer.type {optimizer}",
             "ppo's update loop builds its own AdamW; use grpo or rloo for rapidfire_adamw"),
            (mode == "parameter_server", "communication.mode parameter_server",
             "the RL trainers gather rewards and group statistics over all ranks every step, which needs the "
             "process group the parameter server runs without; use allreduce or allreduce_compressed"),
            (level != "level0", f"memory.optim_level {level}",
             "the policy's blocks also run sampling and the reference pass, where checkpointing and int8 "
             "saved-activation hooks are not validated; use level0"),
            (scaling.hybrid_parallel, "scaling.hybrid_parallel", "it needs ZeRO-3 (memory level3); use level0"),
            (cfg.data.dynamic_batch.strategy != "fixed", f"data.dynamic_batch.strategy {cfg.data.dynamic_batch.strategy}",
             "an RL batch is num_generations completions per prompt, sampled each step, not token rows to regroup; "
             "use fixed"),
        ]
        for bad, what, why in unsupported:
            if bad:
                raise RapidfireError(f"{what}: not with train.stage rl ({rl.algorithm}): {why}")

    # The reward stage and the preference pairs that feed it.
    if stage == "reward" and fmt != "preference":
        raise RapidfireError(f"data.format: {show(fmt)} cannot feed train.stage reward, which learns from pairs; "
                             "set data.format=preference (rows with prompt, chosen, rejected)")
    if fmt == "preference" and stage != "reward":
        raise RapidfireError(f"data.format: 'preference' pairs only feed train.stage reward; set "
                             f"train.stage=reward, or use prompt_completion/messages rows for {stage}")
    if cfg.data.eval_path is not None and stage != "reward":
        raise RapidfireError(f"data.eval_path: only used by train.stage reward (held-out pairs scored after "
                             f"training); remove it for train.stage {stage}")
