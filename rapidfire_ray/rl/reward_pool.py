"""The reward pool: `rl.reward.num_actors` Ray actors each hosting the reward model (a
sequence-classification checkpoint, eval mode, no grad), and the client the policy workers score
their rollouts through, combined with the rule rewards.

- Placement: each actor asks for `rl.reward.cpus_per_actor` CPUs, a GPU with `rl.reward.use_gpu`
  and any custom resources in `rl.reward.resources`, so the pool can sit on other nodes or GPUs
  than the policy workers. Actors are named `rapidfire-reward-<run>-<i>` (the dashboard's actor
  list shows them by name).
- Text, not tokens, crosses the boundary: an actor renders prompt + completion with its own
  tokenizer (a chat prompt through its chat template, a string prompt as prompt + completion +
  eos, as TRL's RewardTrainer trains), so a reward model whose tokenizer differs from the
  policy's works. `check_reward_model` refuses, in one line, a checkpoint that is not a
  sequence classifier, whose tokenizer has no pad token (the classifier scores the last non-pad
  token), or whose tokenizer is larger than its embedding.
- Batching: `RewardPool.score` cuts the pairs into batches of `rl.reward.batch_size` and spreads
  them over the actors at once.
- Faults: actors are created with `max_restarts`; a batch whose actor died
  (`RayActorError`/`ActorDiedError`) is submitted again (to the next actor, or the same one once
  Ray has restarted it), so no rollout goes unscored; re-submissions are counted
  (`RewardPool.retries`). An actor that answers `ActorUnavailableError` (restarting) is asked
  again after a short back-off, for up to `RESTART_WAIT_S`.
"""
from __future__ import annotations

import logging
import os
import time

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from ..errors import RapidfireError
from .rules import RULES, completion_text

log = logging.getLogger(__name__)

ACTOR_ERRORS = (RayActorError, ActorDiedError)  # the task was lost with its actor
RESTART_WAIT_S = 600.0  # how long a batch waits for a restarting actor


def actor_name(run_name: str, index: int) -> str:
    return f"rapidfire-reward-{run_name}-{index}"


# --------------------------------------------------------------------------------------------
# checks (driver side, before any actor starts)


def check_reward_model(path: str, key: str = "rl.reward.model"):
    """The checkpoint's tokenizer after the checks in the module doc; RapidfireError otherwise."""
    from transformers import AutoConfig, AutoTokenizer

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise RapidfireError(f"{key}: '{path}' is not a model directory (no config.json); point it at a "
                             "sequence-classification checkpoint such as the reward stage's runs/<name>/model")
    config = AutoConfig.from_pretrained(path)
    archs = config.architectures or []
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        raise RapidfireError(f"{key}: '{path}' holds {', '.join(archs) or 'an unknown architecture'}, not a "
                             "sequence-classification model; use a reward model (train.stage reward writes one)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - any failure here means "no usable tokenizer"
        raise RapidfireError(f"{key}: '{path}' has no usable tokenizer ({str(e).splitlines()[0][:160]}); save the "
                             "tokenizer with the model (tokenizer.save_pretrained)") from None
    if tokenizer.pad_token is None and getattr(config, "pad_token_id", None) is None:
        raise RapidfireError(f"{key}: '{path}': its tokenizer has no pad token and its config no pad_token_id, so "
                             "the classifier cannot find each row's last token in a batch; set pad_token in "
                             "tokenizer_config.json (e.g. to the eos token)")
    vocab = getattr(config, "vocab_size", None) or getattr(getattr(config, "text_config", None), "vocab_size", None)
    if vocab is not None and len(tokenizer) > vocab:
        raise RapidfireError(f"{key}: '{path}': its tokenizer has {len(tokenizer)} tokens but the model embeds only "
                             f"{vocab}; the checkpoint's tokenizer and weights do not belong together")
    return tokenizer


def same_vocabulary(a, b) -> bool:
    """Whether two tokenizers map text to the same ids (the value model reads the policy's ids)."""
    return len(a) == len(b) and a.get_vocab() == b.get_vocab()


# --------------------------------------------------------------------------------------------
# the actor


def render(tokenizer, prompt, completion) -> str:
    """The text the reward model scores for one (prompt, completion) pair."""
    text = completion_text(completion)
    if isinstance(prompt, list):
        messages = list(prompt) + [{"role": "assistant", "content": text}]
        if not getattr(tokenizer, "chat_template", None):
            from ..models.tiny import CHATML_TEMPLATE

            return tokenizer.apply_chat_template(messages, tokenize=False, chat_template=CHATML_TEMPLATE)
        return tokenizer.apply_chat_template(messages, tokenize=False)
    return prompt + text + (tokenizer.eos_token or "")


class RewardModelActor:
    """Hosts one copy of the reward model; `score` returns one float per (prompt, completion)."""

    def __init__(self, path: str, num_threads: int = 1, max_length: int = 2048):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        torch.set_num_threads(max(1, num_threads))
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).to(self.device)
        self.model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token_id = self.model.config.pad_token_id
        self.max_length = max_length
        self.pairs_scored = 0
        self.calls = 0
        self._crash_after: int | None = None

    def ready(self) -> dict:
        return {"node_id": ray.get_runtime_context().get_node_id(), "device": self.device,
                "pid": os.getpid()}

    def crash_after(self, calls: int) -> None:
        """Fault injection (tests): the process exits inside the `calls`-th next `score` call."""
        self._crash_after = self.calls + calls

    def score(self, prompts: list, completions: list) -> list[float]:
        import torch

        self.calls += 1
        if self._crash_after is not None and self.calls >= self._crash_after:
            os._exit(1)
        texts = [render(self.tokenizer, p, c) for p, c in zip(prompts, completions)]
        enc = self.tokenizer(texts, return_tensors="pt", padding=True, padding_side="right", truncation=True,
                             max_length=self.max_length, add_special_tokens=False)
        with torch.inference_mode():
            logits = self.model(**{k: v.to(self.device) for k, v in enc.items()}).logits[:, 0]
        self.pairs_scored += len(texts)
        return [float(x) for x in logits.float().cpu()]

    def stats(self) -> dict:
        """Counts since this process started; `restarted`: Ray restarted the actor at least once."""
        return {"calls": self.calls, "pairs_scored": self.pairs_scored, "pid": os.getpid(),
                "restarted": ray.get_runtime_context().was_current_actor_reconstructed}


def launch_reward_actors(cfg, path: str) -> list:
    """Start the pool's actors for run `cfg.run.name` and wait until each has loaded the model."""
    from ..driver.cluster import cpu_share

    r = cfg.rl.reward
    actor_cls = ray.remote(RewardModelActor)
    actors = []
    for i in range(r.num_actors):
        actors.append(actor_cls.options(
            name=actor_name(cfg.run.name, i), max_restarts=r.max_restarts, max_task_retries=0,
            num_cpus=cpu_share(r.cpus_per_actor), num_gpus=1 if r.use_gpu else 0, resources=dict(r.resources) or None,
        ).remote(path, max(1, int(r.cpus_per_actor)), cfg.data.max_length))
    try:
        ray.get([a.ready.remote() for a in actors], timeout=600)
    except ray.exceptions.GetTimeoutError:
        kill_actors(actors)
        raise RapidfireError(f"rl.reward: the {r.num_actors} reward actor(s) did not start within 600 s; check "
                             "that the cluster has rl.reward.cpus_per_actor CPUs (and a GPU with use_gpu, and "
                             "rl.reward.resources) free beside the training workers") from None
    except ray.exceptions.RayError as e:
        kill_actors(actors)
        raise RapidfireError(f"rl.reward.model: the reward actor could not load '{path}' "
                             f"({str(e).strip().splitlines()[-1][:200]})") from None
    return actors


def kill_actors(actors: list) -> None:
    for a in actors:
        try:
            ray.kill(a)
        except Exception:  # noqa: BLE001 - already gone
            pass


# --------------------------------------------------------------------------------------------
# the client (in each policy worker)


class RewardPool:
    """Scores rollouts: the reward model through the actors (batched, re-submitted on actor death)
    plus the rule rewards, combined as a weighted sum.

    `names` are the reward sources in order: "model" first when there is a model, then the rule
    functions; `weights` one per name."""

    def __init__(self, actors: list, functions: list[str], weights: dict[str, float] | None = None,
                 batch_size: int = 16, max_attempts: int = 4):
        self.actors = list(actors)
        self.functions = list(functions)
        self.names = (["model"] if self.actors else []) + self.functions
        weights = dict(weights or {})
        self.weights = [float(weights.get(n, 1.0)) for n in self.names]
        self.batch_size = batch_size
        self.max_attempts = max_attempts
        self._next = 0  # round-robin start, so one worker's small calls still spread over the actors
        # counters since the last take(): pairs asked for, pairs the model scored, batches re-submitted
        self.requested = 0
        self.scored = 0
        self.retries = 0
        self.model_seconds = 0.0
        self.total = {"requested": 0, "scored": 0, "retries": 0}

    @classmethod
    def from_config(cls, cfg: dict, actors: list) -> RewardPool:
        r = cfg["rl"]["reward"]
        return cls(actors, r["functions"], r["weights"], r["batch_size"],
                   max_attempts=(r["max_restarts"] + 1) * max(1, len(actors)) + 1)

    def score_model(self, prompts: list, completions: list) -> list[float]:
        """The reward model's score of every pair; a batch lost with its actor is scored again."""
        n = len(prompts)
        self.requested += n
        if not self.actors or n == 0:
            return []
        t0 = time.perf_counter()
        starts = list(range(0, n, self.batch_size))
        results: list[list[float] | None] = [None] * len(starts)
        pending = {}

        def submit(b: int, actor_index: int, attempt: int) -> None:
            s = starts[b]
            ref = self.actors[actor_index].score.remote(prompts[s:s + self.batch_size],
                                                        completions[s:s + self.batch_size])
            pending[ref] = (b, actor_index, attempt)

        for b in range(len(starts)):
            submit(b, (self._next + b) % len(self.actors), 1)
        self._next = (self._next + len(starts)) % len(self.actors)
        waits = [0] * len(starts)  # consecutive "unavailable" answers per batch
        deadline = time.monotonic() + RESTART_WAIT_S
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            b, actor_index, attempt = pending.pop(ready[0])
            try:
                results[b] = ray.get(ready[0])
                waits[b] = 0
            except ActorUnavailableError as e:
                # Restarting (or briefly unreachable): ask again after a short wait; scoring is
                # idempotent, so a call that did run before the actor went away does no harm.
                if time.monotonic() > deadline:
                    raise RuntimeError(f"reward actor {actor_index} stayed unavailable for {RESTART_WAIT_S} s; "
                                       "giving up") from e
                if waits[b] == 0:  # the submission was lost: count it once, however long the restart takes
                    self.retries += 1
                    log.warning("reward actor %d became unavailable while scoring a batch (%s); scoring it again",
                                actor_index, type(e).__name__)
                waits[b] += 1
                time.sleep(min(2.0, 0.05 * 2 ** waits[b]))
                submit(b, (actor_index + waits[b]) % len(self.actors), attempt)
            except ACTOR_ERRORS as e:
                # The actor died with the batch: Ray restarts it (max_restarts); score the batch again.
                if attempt >= self.max_attempts:
                    raise RuntimeError(f"reward actor {actor_index} failed {attempt} times on one batch; giving up "
                                       f"({type(e).__name__}); raise rl.reward.max_restarts or check the actor's "
                                       "log for why it dies") from e
                self.retries += 1
                waits[b] = 0
                log.warning("reward actor %d died while scoring a batch of %d (%s); scoring it again", actor_index,
                            min(self.batch_size, n - starts[b]), type(e).__name__)
                submit(b, (actor_index + 1) % len(self.actors), attempt + 1)
        scores = [x for part in results for x in part]
        if len(scores) != n:
            raise RuntimeError(f"reward pool returned {len(scores)} scores for {n} completions")
        self.scored += n
        self.model_seconds += time.perf_counter() - t0
        return scores

    def score_rules(self, name: str, prompts: list, completions: list, rows: list[dict]) -> list[float]:
        fn = RULES[name]
        return [float(fn(p, c, r)) for p, c, r in zip(prompts, completions, rows)]

    def score(self, prompts: list, completions: list, rows: list[dict]) -> tuple[list[float], dict[str, list[float]]]:
        """(weighted total per pair, {source name: raw scores})."""
        parts: dict[str, list[float]] = {}
        if self.actors:
            parts["model"] = self.score_model(prompts, completions)
        else:
            self.requested += len(prompts)
            self.scored += len(prompts)
        for name in self.functions:
            parts[name] = self.score_rules(name, prompts, completions, rows)
        total = [sum(w * parts[n][i] for n, w in zip(self.names, self.weights)) for i in range(len(prompts))]
        return total, parts

    def take(self) -> dict:
        """Counters since the last call (for a step record)."""
        out = {"reward_requested": self.requested, "reward_scored": self.scored, "reward_retries": self.retries}
        self.total["requested"] += self.requested
        self.total["scored"] += self.scored
        self.total["retries"] += self.retries
        self.requested = self.scored = self.retries = 0
        return out


def rows_from_columns(n: int, columns: dict[str, list]) -> list[dict]:
    """TRL hands reward functions columns (lists); rule rewards read one row at a time."""
    keys = [k for k, v in columns.items() if isinstance(v, list) and len(v) == n]
    return [{k: columns[k][i] for k in keys} for i in range(n)]

