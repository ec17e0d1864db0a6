"""The one typed schema for `train_config.yaml` (OmegaConf structured dataclasses).

Longer than 400 lines because it is the one schema: every key with its rules, nowhere else.
Every tunable lives here with its default, a one-line doc and what `load.validate` accepts
(`choices`, an inclusive `range`); a section's own rules are its `check()`, and rules across
sections are `rules.cross_checks`. Anything else is a one-line error, so a value that is accepted
always does what it says.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, fields
from typing import Any, Dict, List, Optional

from omegaconf import OmegaConf

from ..errors import RapidfireError


def field(default: Any, doc: str, *, choices: tuple | None = None, range: tuple | None = None):  # noqa: A002
    """A config key: its default, a one-line doc (shown by `rapidfire config --reference`) and what
    it accepts: one of `choices`, or a number in `range` (low, high or None), both ends included."""
    meta = {"doc": doc}
    if choices is not None:
        meta["choices"] = choices
    if range is not None:
        meta["range"] = range
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def section(cls: type):
    """A nested section of the config tree."""
    return dataclasses.field(default_factory=cls)


def optional_section(cls: type, doc: str):
    """A nested section that is off (null) by default; setting any of its keys (or `{}`) turns it on
    with the defaults of the others."""
    return dataclasses.field(default=None, metadata={"doc": doc, "section": cls})


def subsection(f: dataclasses.Field) -> type | None:
    """The section class a field holds (an optional section's too), or None for a key."""
    return f.default_factory if dataclasses.is_dataclass(f.default_factory) else f.metadata.get("section")


def show(value: Any) -> str:
    return repr(value) if isinstance(value, str) else str(value)


def listed(values) -> str:
    return ", ".join("null" if v is None else str(v) for v in values)


# A section's `check(self)` is called with its (already merged) DictConfig node once every key in it
# has passed its choices and range; it raises RapidfireError naming the key, the value and what is allowed.


@dataclass
class RunSection:
    name: str = field("rapidfire-run", "run name: folder under output_dir, Ray Train run name")
    output_dir: str = field("runs", "where checkpoints, the final model and run_summary.json go")
    seed: int = field(42, "seeds torch, data order and model init", range=(0, 2**32 - 1))

    def check(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", self.name):
            raise RapidfireError(f"run.name: {show(self.name)} is invalid; allowed: letters, digits, '.', "
                                 "'_', '-' (it names a folder), at most 100 characters")


@dataclass
class LoraSection:
    r: int = field(8, "LoRA rank of each adapted layer; setting any model.lora key turns LoRA on (model.lora null, "
                      "the default: full fine-tuning)", range=(1, None))
    alpha: float = field(16.0, "LoRA scaling numerator (the update is scaled by alpha / r), above 0",
                         range=(0.0, None))  # 0: check()
    dropout: float = field(0.05, "dropout on the adapters' input, in [0, 1)", range=(0.0, 1.0))  # 1: check()
    target_modules: Any = field("all-linear", "layers that get adapters: a list of module names (e.g. [q_proj, "
                                              "v_proj]) or all-linear (every linear layer but the output head)")
    export: str = field("merged", "the final model in <run>/model: merged (the adapter merged into the base "
                                  "weights: a plain Hugging Face model) or adapter (adapter files only; "
                                  "adapter_config.json names the base model)", choices=("merged", "adapter"))

    def check(self) -> None:
        if self.alpha <= 0.0:
            raise RapidfireError(f"model.lora.alpha: {self.alpha} is out of range; allowed: above 0 (e.g. 16)")
        if self.dropout >= 1.0:
            raise RapidfireError(f"model.lora.dropout: {self.dropout} is out of range; allowed: 0 <= dropout < 1 "
                                 "(e.g. 0.05)")
        targets = self.target_modules
        if isinstance(targets, str):
            if targets != "all-linear":
                raise RapidfireError(f"model.lora.target_modules: {show(targets)} is invalid; allowed: all-linear or "
                                     "a list of module names, e.g. [q_proj, v_proj]")
            return
        targets = list(targets) if not isinstance(targets, (int, float, bool)) and targets is not None else None
        if not targets or not all(isinstance(t, str) and t.strip() for t in targets):
            raise RapidfireError(f"model.lora.target_modules: {self.target_modules} is invalid; allowed: all-linear "
                                 "or a non-empty list of module names, e.g. [q_proj, v_proj]")


@dataclass
class ModelSection:
    name: str = field("smollm2-135m",
                      "a built-in name (smollm2-135m, tiny-random), a local HF model directory or a hub id")
    lora: Optional[LoraSection] = optional_section(LoraSection, "LoRA adapters on the frozen base model "
                                                               "(null: full fine-tuning)")

    def check(self) -> None:
        if not self.name.strip():
            raise RapidfireError("model.name: '' is empty; use smollm2-135m, tiny-random, a local model "
                                 "directory or a Hugging Face id")


@dataclass
class DynamicBatchSection:
    strategy: str = field("fixed", "how batches are cut: fixed rows, a token budget, or from free memory",
                          choices=("fixed", "token_budget", "memory_aware"))
    min: Optional[int] = field(None, "memory_aware: smallest batch (rows) it may pick (null: 1; met where max >= "
                                     "2 x min - 1)", range=(1, None))
    max: Optional[int] = field(None, "largest batch (rows) a dynamic strategy may pick (null: no cap)",
                               range=(1, None))
    max_tokens: Optional[int] = field(None, "token_budget: padded tokens per batch per worker "
                                            "(null: per_device_batch_size x data.max_length)", range=(8, None))
    window: int = field(1024, "dynamic strategies: rows sorted by length together before cutting batches",
                        range=(1, None))
    max_padding: float = field(0.05, "dynamic strategies: padding tokens a batch may hold, as a fraction of its "
                                     "tokens", range=(0.0, 1.0))
    memory_threshold: float = field(0.8, "share of the worker's free memory (GPU; on CPU its memory limit) a step "
                                         "may use, in (0, 1]: memory_aware batch sizes and memory level1+ "
                                         "checkpointing plans are sized to it", range=(0.0, 1.0))  # 0: check()

    def check(self) -> None:
        if self.strategy == "fixed":
            for key in ("min", "max", "max_tokens"):
                if getattr(self, key) is not None:
                    raise RapidfireError(f"data.dynamic_batch.{key}: only used by a dynamic strategy (token_budget, "
                                         "memory_aware); remove it with strategy 'fixed' (the batch is "
                                         "train.per_device_batch_size rows)")
        if self.strategy == "token_budget" and self.min is not None:
            raise RapidfireError("data.dynamic_batch.min: not used by token_budget (the budget sets the batch); "
                                 "remove it, or cap rows with data.dynamic_batch.max")
        if self.strategy == "memory_aware" and self.max_tokens is not None:
            raise RapidfireError("data.dynamic_batch.max_tokens: not used by memory_aware (free memory sets the "
                                 "batch); remove it, or use strategy token_budget")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise RapidfireError(f"data.dynamic_batch.min: {self.min} is larger than data.dynamic_batch.max "
                                 f"{self.max}; make min <= max")
        if self.memory_threshold <= 0.0:
            raise RapidfireError(f"data.dynamic_batch.memory_threshold: {self.memory_threshold} is out of range; "
                                 "allowed: above 0 and at most 1 (e.g. 0.8)")


@dataclass
class DataSection:
    path: str = field("jobs/data/sft_sample.jsonl", "a .jsonl/.parquet file or a folder of them")
    format: str = field("prompt_completion", "row layout of the data files (see the README)",
                        choices=("text", "prompt_completion", "messages", "oasst", "prompt", "preference"))
    max_length: int = field(512, "tokens per row at most (see overlong)", range=(8, None))
    overlong: str = field("truncate", "rows longer than max_length: truncate them, or drop them (counted)",
                          choices=("truncate", "drop"))
    on_bad_row: str = field("skip", "skip: count and report bad rows; fail: stop at the first, naming it",
                            choices=("skip", "fail"))
    prefetch_depth: int = field(3, "batches prepared ahead of the step that needs them", range=(0, 64))
    shard_by_node: bool = field(True, "each worker reads rows from blocks on its own node where possible "
                                      "(always every row once per epoch)")
    dynamic_batch: DynamicBatchSection = section(DynamicBatchSection)
    eval_path: Optional[str] = field(None, "train.stage reward: held-out preference pairs (same format as "
                                           "data.path) scored after training: pairwise accuracy and reward margin "
                                           "in the summary (null: none)")

    def check(self) -> None:
        max_tokens = self.dynamic_batch.max_tokens
        if max_tokens is not None and max_tokens < self.max_length:
            raise RapidfireError(f"data.dynamic_batch.max_tokens: {max_tokens} is smaller than one row of "
                                 f"data.max_length {self.max_length} tokens; raise it to >= {self.max_length}")
        if self.format == "preference" and max_tokens is not None and max_tokens < 2 * self.max_length:
            raise RapidfireError(f"data.dynamic_batch.max_tokens: {max_tokens} cannot hold one preference pair (two "
                                 f"rows of up to data.max_length {self.max_length} tokens); raise it to >= "
                                 f"{2 * self.max_length}")
        if self.eval_path is not None and not self.eval_path.strip():
            raise RapidfireError(f"data.eval_path: {show(self.eval_path)} is empty; point it at a .jsonl/.parquet "
                                 "file of held-out pairs, or set it to null")
        if not self.path.strip():
            raise RapidfireError("data.path: '' is empty; point it at a .jsonl/.parquet file or a folder")


@dataclass
class TrainSection:
    stage: str = field("sft", "what to train: SFT, a reward model, RL, or all three in a row",
                       choices=("sft", "rl", "reward", "pipeline"))
    max_steps: int = field(-1, "optimizer steps; -1 runs `epochs` epochs (as in transformers)")
    epochs: float = field(1.0, "passes over the data when max_steps is -1", range=(0.001, None))
    per_device_batch_size: int = field(4, "rows per worker per micro-batch", range=(1, None))
    gradient_accumulation_steps: int = field(1, "micro-batches per optimizer step", range=(1, None))
    grad_clip: float = field(1.0, "max global gradient norm; 0 disables clipping", range=(0.0, None))
    lr_scheduler: str = field("linear", "learning-rate schedule after warm-up",
                              choices=("constant", "linear", "cosine"))
    warmup_steps: int = field(0, "steps of linear learning-rate warm-up", range=(0, None))
    log_every_steps: int = field(1, "progress and metric reports, in optimizer steps", range=(1, None))
    precision: str = field("auto", "compute precision (weights and optimizer stay fp32); auto: by parameter count "
                                   "and hardware (< 7B fp16, 7-20B bf16, > 20B fp8 where the GPU has it; CPU fp32, "
                                   "bf16 with AMX), logged with its reason",
                           choices=("auto", "fp32", "fp16", "bf16", "fp8"))

    def check(self) -> None:
        if self.max_steps != -1 and self.max_steps < 1:
            raise RapidfireError(f"train.max_steps: {self.max_steps} is out of range; allowed: -1 (run "
                                 "train.epochs epochs) or >= 1")


@dataclass
class CompressionSection:
    grad: str = field("none", "gradient codec on the wire (allreduce_compressed; parameter_server: pushes and "
                              "pulled deltas), or rapidfire_adamw's momentum codec (with communication.mode "
                              "allreduce or allreduce_compressed: both mean its momentum exchange); auto "
                              "(allreduce_compressed): measures the link and the codecs when training starts and "
                              "picks per bucket the fastest of none, fp16, 1bit and 2bit, keep_fp16 tensors "
                              "staying fp16", choices=("none", "fp16", "1bit", "2bit", "auto"))
    act: Optional[str] = field(None, "compression of activations saved for backward inside the decoder blocks "
                                     "(null: int8 from memory.optim_level level2 up, else none)",
                               choices=("none", "int8", None))
    keep_fp16: List[str] = field(["*o_proj*", "*out_proj*", "*c_proj*", "*norm*", "*ln_*", "*.bias"],
                                 "parameter-name patterns (fnmatch) whose gradients stay fp16: attention output "
                                 "projections, norms, biases; [] compresses everything")
    min_numel: int = field(4096, "tensors with fewer elements stay fp16 (0: no size rule)", range=(0, None))
    chunk_size: int = field(2048, "elements per scale of the 1bit/2bit codecs", range=(8, None))
    auto_interval: int = field(100, "auto: steps between measurements of the link and codecs (each followed by "
                                    "a new decision per bucket)", range=(1, None))


@dataclass
class OptimizerParams:
    lr: float = field(2.0e-5, "peak learning rate", range=(0.0, 1.0))
    weight_decay: float = field(0.0, "decoupled (AdamW) weight decay", range=(0.0, 1.0))
    betas: List[float] = field([0.9, 0.999], "Adam beta1, beta2")
    eps: float = field(1.0e-8, "Adam epsilon", range=(0.0, 1.0))
    freeze_step: Optional[int] = field(None, "rapidfire_adamw: full-precision warm-up steps before the variance "
                                             "freezes and momentum is exchanged compressed (null: 20% of the run)",
                                       range=(1, None))
    compression: CompressionSection = section(CompressionSection)

    def check(self) -> None:
        betas = list(self.betas)
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise RapidfireError(f"optimizer.params.betas: {betas} is invalid; allowed: two numbers in [0, 1), "
                                 "e.g. [0.9, 0.999]")


@dataclass
class OptimizerSection:
    type: str = field("adamw", "optimizer: torch AdamW, or the 1-bit Adam variant",
                      choices=("adamw", "rapidfire_adamw"))
    params: OptimizerParams = section(OptimizerParams)


@dataclass
class ElasticSection:
    batch: str = field("accumulate", "elastic runs (scaling.num_workers [min, max]): how the global batch follows "
                                     "the worker count. accumulate: gradient accumulation x max/workers (the global "
                                     "batch of max workers kept, to the nearest whole step); scale_lr: the learning "
                                     "rate x workers/max (linear scaling rule); none: per-worker batch and learning "
                                     "rate unchanged", choices=("accumulate", "scale_lr", "none"))
    resize_interval_s: float = field(60.0, "elastic runs: seconds between two checks for more workers' resources "
                                           "while training (a resize restarts the workers from the latest "
                                           "checkpoint)", range=(1.0, None))


@dataclass
class ScalingSection:
    num_workers: Any = field(2, "Ray Train workers (one process each); [min, max] for an elastic run that starts "
                                "once min fit, grows to max as nodes join and shrinks (down to min) when nodes "
                                "leave, resuming from its latest checkpoint each time")
    elastic: ElasticSection = section(ElasticSection)
    use_gpu: bool = field(False, "one GPU per worker when true")
    cpus_per_worker: int = field(1, "CPUs reserved per worker; also its torch thread count", range=(1, None))
    placement: str = field("PACK", "where Ray puts the workers: PACK (fill a node first) or SPREAD (one per node "
                                   "where possible)", choices=("PACK", "SPREAD"))
    hybrid_parallel: bool = field(False, "shard parameters within a node, replicate them across nodes (for models "
                                         "above 20B; see the README for the supported combinations)")
    max_failures: int = field(0, "worker-group restarts Ray Train may make after a worker dies (each resumes from "
                                 "the latest checkpoint); 0 ends the run at the first failure", range=(0, None))
    resources_per_worker: Dict[str, float] = field({}, "extra Ray resources each worker asks for, e.g. "
                                                       "{accelerator: 1} for a custom resource or {GPU: 8} (needs "
                                                       "use_gpu); the autoscaler adds nodes that have them ({}: "
                                                       "CPUs, and a GPU with use_gpu)")
    placement_timeout_s: float = field(900.0, "seconds the driver waits for the cluster (or its autoscaler) to "
                                              "place every worker, printing what it waits for, before it fails with "
                                              "one line; 0 waits forever", range=(0.0, None))

    def check(self) -> None:
        """num_workers: a count, or [min, max] for an elastic run ([n, n] becomes n); extra resources."""
        n = self.num_workers
        if isinstance(n, bool) or not (isinstance(n, (int, list, tuple)) or OmegaConf.is_list(n)):
            raise RapidfireError(f"scaling.num_workers: {show(n)} is invalid; allowed: a number of workers >= 1, "
                                 "or [min, max] for an elastic run (e.g. [1, 4])")
        if isinstance(n, int) and n < 1:
            raise RapidfireError(f"scaling.num_workers: {n} is out of range; allowed: >= 1")
        if not isinstance(n, int):
            n = list(n)
            if len(n) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in n) \
                    or not 1 <= n[0] <= n[1]:
                raise RapidfireError(f"scaling.num_workers: {n} is invalid; allowed: [min, max] with 1 <= min <= "
                                     "max (e.g. [1, 4]), or one number for a fixed worker count")
            self.num_workers = n[0] if n[0] == n[1] else n  # a plain list, whatever node type the merge made
        for name, amount in self.resources_per_worker.items():
            key = f"scaling.resources_per_worker.{name}"
            if name == "CPU":
                raise RapidfireError(f"{key}: set CPUs with scaling.cpus_per_worker (it is also the workers' torch "
                                     "thread count); remove CPU here")
            if name == "GPU" and not self.use_gpu:
                raise RapidfireError(f"{key}: {amount:g} GPUs per worker need scaling.use_gpu=true (the workers run "
                                     "on CPU otherwise); set it, or remove GPU here")
            if not (amount > 0 and amount < float("inf")):
                raise RapidfireError(f"{key}: {amount} is out of range; allowed: a number above 0 (e.g. 1, or 0.5 "
                                     "to share one between two workers)")


@dataclass
class ParameterServerSection:
    num_shards: Optional[int] = field(None, "parameter_server: shard actors, each owning a byte-balanced part of "
                                            "the parameters (null: one per node)", range=(1, None))
    max_staleness: int = field(2, "parameter_server: most updates (versions) a shard may apply between the version "
                                  "a worker's gradient was computed on and that gradient's own update",
                               range=(0, None))
    snapshot_every: int = field(100, "parameter_server: a shard writes its state to the run folder every N updates "
                                     "it applies, and restores it after a crash (0: never)", range=(0, None))
    lr_staleness_scaling: str = field("none", "parameter_server: inverse divides an update's learning rate by "
                                              "1 + its staleness", choices=("none", "inverse"))
    lr_per_push: str = field("mean", "parameter_server: mean applies each worker's push with lr / workers (a push "
                                     "is one worker's share of the global batch: all workers' pushes move the "
                                     "parameters as far as one synchronous step); full applies each push with the "
                                     "whole lr", choices=("mean", "full"))


@dataclass
class CommunicationSection:
    mode: str = field("allreduce", "how gradients are exchanged between workers: plain DDP allreduce, a DDP hook "
                                   "exchanging optimizer.params.compression.grad bytes, or parameter-server actors "
                                   "(asynchronous, no allreduce)",
                      choices=("allreduce", "allreduce_compressed", "parameter_server"))
    on_nonfinite: str = field("skip", "a NaN/inf gradient: skip the step on every worker (counted, named), or fail",
                              choices=("skip", "fail"))
    overlap: bool = field(True, "allreduce_compressed: encode and send each gradient bucket on a thread of its own "
                                "(CUDA: a side stream) while backward computes the next ones; false: in the "
                                "backward thread, one bucket at a time")
    bucket_cap_mb: Optional[float] = field(None, "DDP gradient bucket size in MB (null: torch's 25); smaller "
                                                 "buckets start exchanging earlier in backward, more of them cost "
                                                 "more calls", range=(0.001, None))
    ps: ParameterServerSection = section(ParameterServerSection)


@dataclass
class MemorySection:
    optim_level: str = field("level0", "level0: none; level1: selective gradient checkpointing sized to the memory "
                                       "budget; level2: + int8 saved activations + allocator defragmentation; "
                                       "level3: + DeepSpeed ZeRO-3 sharding across workers",
                             choices=("level0", "level1", "level2", "level3"))
    offload_optimizer: bool = field(False, "level3: keep the optimizer state in CPU memory (ZeRO-Offload)")
    max_forward_tokens: Optional[int] = field(None, "padded tokens one forward/backward pass may hold; a larger "
                                                    "batch is split into pieces accumulated in the same step (null: "
                                                    "whole batches; a live knob of rapidfire monitor)",
                                              range=(8, None))


@dataclass
class GuardSection:
    max_consecutive: int = field(3, "NaN guard: steps in a row with a non-finite loss or gradient (each skipped, "
                                    "parameters unchanged) before the run stops with a diagnosis", range=(1, None))


@dataclass
class CheckpointSection:
    every_steps: int = field(50, "save a Ray Train checkpoint every N optimizer steps (0: only at the end)",
                             range=(0, None))
    keep: int = field(2, "newest checkpoints kept on storage", range=(1, None))
    on_preemption: bool = field(True, "save a checkpoint right after the current step when a node of the run gets "
                                      "a preemption notice (a Ray node drain, e.g. a spot interruption); not with "
                                      "communication.mode parameter_server")


@dataclass
class RewardSection:
    model: Optional[str] = field(None, "rl: a sequence-classification checkpoint directory scoring prompt + "
                                       "completion text (e.g. the reward stage's runs/<name>/model), hosted by the "
                                       "reward actors; null: rule rewards only")
    model_required: bool = field(True, "rl: false lets a profile name a reward model an earlier stage may not have "
                                       "written: a missing rl.reward.model directory is then skipped (rule rewards "
                                       "only), with a warning")
    functions: List[str] = field(["answer_match"], "rl: built-in rule rewards added to the model's score: "
                                                   "answer_match (1.0 when the completion states the row's `answer`)")
    weights: Dict[str, float] = field({}, "rl: weight of each reward in the sum, by name ('model' or a function "
                                          "name); unnamed ones weigh 1")
    num_actors: int = field(1, "rl: reward-model actors in the pool, each holding one copy of the model",
                            range=(1, None))
    batch_size: int = field(16, "rl: (prompt, completion) pairs one actor scores per call", range=(1, None))
    use_gpu: bool = field(False, "rl: one GPU per reward actor (the pool may sit on other GPUs or nodes than the "
                                 "policy workers)")
    cpus_per_actor: float = field(1.0, "rl: CPUs reserved per reward actor (also its torch thread count, at least "
                                       "1)", range=(0.0, None))
    resources: Dict[str, float] = field({}, "rl: extra Ray resources each reward actor asks for, e.g. "
                                            "{reward_node: 1} to place the pool on the nodes that advertise that "
                                            "resource")
    max_restarts: int = field(3, "rl: times Ray restarts a dead reward actor; the batch it held is scored again",
                              range=(0, None))


@dataclass
class PPOSection:
    epochs: int = field(4, "ppo: passes over each rollout batch", range=(1, None))
    minibatch_size: int = field(4, "ppo: completions per worker per update (divides train.per_device_batch_size)",
                                range=(1, None))
    clip_range: float = field(0.2, "ppo: policy ratio clip epsilon", range=(0.0, 10.0))
    value_clip_range: float = field(0.2, "ppo: value prediction clip around the rollout's values", range=(0.0, None))
    gamma: float = field(1.0, "ppo: discount per token", range=(0.0, 1.0))
    lam: float = field(0.95, "ppo: GAE lambda", range=(0.0, 1.0))
    vf_coef: float = field(0.1, "ppo: weight of the value loss in the total loss", range=(0.0, None))
    value_init: str = field("auto", "ppo: value model initialised from the reward model (reward), the policy's "
                                    "base model (policy), or auto: the reward model when rl.reward.model is set",
                            choices=("auto", "reward", "policy"))


@dataclass
class RLSection:
    algorithm: str = field("grpo", "train.stage rl: GRPO or RLOO (TRL's trainers) or classic PPO with a value model",
                           choices=("grpo", "rloo", "ppo"))
    num_generations: int = field(4, "completions sampled per prompt (grpo/rloo: the group compared); "
                                    "train.per_device_batch_size counts completions and must be a multiple of it",
                                 range=(1, None))
    max_new_tokens: int = field(64, "most tokens generated per completion; prompts may use data.max_length minus "
                                    "this", range=(1, None))
    temperature: float = field(1.0, "sampling temperature of the rollouts", range=(0.01, 10.0))
    kl_beta: float = field(0.04, "weight of the KL penalty to a frozen reference copy of the starting policy "
                                 "(0: no reference model)", range=(0.0, None))
    eval_path: Optional[str] = field(None, "held-out prompts (data.format prompt): task score (answer_match) and "
                                           "mean reward of the policy before and after training, greedy decoding")
    eval_max_prompts: int = field(64, "held-out prompts evaluated at most", range=(1, None))
    reward: RewardSection = section(RewardSection)
    ppo: PPOSection = section(PPOSection)


@dataclass
class MonitorSection:
    adjust: str = field("off", "auto: rules change the knobs in monitor.allowed while the run trains, each change "
                               "logged with its reason; off: only watch (--adjust_parameters on train and monitor)",
                        choices=("auto", "off"))
    allowed: List[str] = field(["data.prefetch_depth", "memory.max_forward_tokens"],
                               "knobs the rules may change (data.prefetch_depth, memory.max_forward_tokens, and "
                               "with allreduce_compressed optimizer.params.compression.grad); [] none")
    interval_s: float = field(1.0, "seconds between two evaluations of the rules on the workers' step records",
                              range=(0.1, 3600.0))
    window_steps: int = field(4, "steps (of every worker) a rule looks at; a changed knob is judged again only "
                                 "after a full window with its new value", range=(1, None))
    data_wait_fraction: float = field(0.05, "data wait above this share of step time doubles data.prefetch_depth",
                                      range=(0.0, 1.0))
    max_prefetch_depth: int = field(16, "the prefetch rule raises data.prefetch_depth up to this", range=(1, 64))
    oom_splits: int = field(2, "this many out-of-memory batch splits in a window halve memory.max_forward_tokens",
                            range=(1, None))
    memory_headroom: float = field(0.5, "peak memory below this share of every worker's memory (and no split) "
                                        "doubles memory.max_forward_tokens again, up to whole batches",
                                   range=(0.0, 1.0))
    comm_latency_p99_s: float = field(0.5, "comm latency p99 above this (seconds): the next stronger codec where "
                                           "optimizer.params.compression.grad is an allowed live knob "
                                           "(allreduce_compressed), otherwise advice (a stronger codec or a larger "
                                           "staleness bound)", range=(0.0, None))

    def check(self) -> None:
        from ..telemetry.rules import KNOBS  # noqa: PLC0415 - the knobs live with the rules

        for knob in self.allowed:
            if knob not in KNOBS:
                raise RapidfireError(f"monitor.allowed: {show(knob)} is not a knob a live run can change; use some "
                                     f"of: {', '.join(KNOBS)} (the parameter server's staleness bound is fixed per "
                                     "run)")


@dataclass
class PipelineSection:
    stages: List[str] = field(["sft", "reward", "rl"], "train.stage pipeline: the stages to run, in this order, "
                                                       "each from the previous one's model")
    sft: Dict[str, Any] = field({}, "pipeline: config sections for the SFT stage on top of this file's (e.g. "
                                    "{train: {max_steps: 30}})")
    reward: Dict[str, Any] = field({}, "pipeline: config sections for the reward stage (its preference data, "
                                       "data.format preference); model.name defaults to the SFT stage's model")
    rl: Dict[str, Any] = field({}, "pipeline: config sections for the RL stage (its prompts, rl.*); the policy "
                                   "defaults to the SFT model, rl.reward.model to the reward stage's model")


@dataclass
class RapidfireConfig:
    run: RunSection = section(RunSection)
    model: ModelSection = section(ModelSection)
    data: DataSection = section(DataSection)
    train: TrainSection = section(TrainSection)
    optimizer: OptimizerSection = section(OptimizerSection)
    scaling: ScalingSection = section(ScalingSection)
    communication: CommunicationSection = section(CommunicationSection)
    memory: MemorySection = section(MemorySection)
    checkpoint: CheckpointSection = section(CheckpointSection)
    guard: GuardSection = section(GuardSection)
    rl: RLSection = section(RLSection)
    monitor: MonitorSection = section(MonitorSection)
    pipeline: PipelineSection = section(PipelineSection)


def reference_markdown() -> str:
    """The config reference as a Markdown table (docs/config.md is this output)."""
    lines = ["| key | default | allowed | meaning |", "|---|---|---|---|"]

    def walk(cls, prefix: str) -> None:
        for f in fields(cls):
            key = f"{prefix}{f.name}"
            if subsection(f):
                walk(subsection(f), f"{key}.")
                continue
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            allowed = ""
            if "choices" in f.metadata:
                allowed = ", ".join("`null`" if v is None else f"`{v}`" for v in f.metadata["choices"])
            elif "range" in f.metadata:
                low, high = f.metadata["range"]
                allowed = f">= {low}" if high is None else f"{low} .. {high}"
            shown = "null" if default is None else default
            lines.append(f"| `{key}` | `{shown}` | {allowed} | {f.metadata.get('doc', '')} |")

    walk(RapidfireConfig, "")
    return "\n".join(lines) + "\n"
