"""Each stage's settings, with the checks of those settings (``check``): what every stage has
(:class:`StageConfig`), what the RL algorithms share (:class:`RLConfig`), and each algorithm's own."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, Literal

from jaxrlhf.config.sections import (LORA_TARGETS, PRECISIONS, KLConfig, LoraConfig,
                                     OptimizerConfig, RewardConfig)


class _Checks:
  """Collects one-line problems ``FIELD=VALUE: RULE`` for :func:`validate`."""

  def __init__(self):
    self.problems: list[str] = []

  def need(self, ok: bool, field: str, value, rule: str):
    if not ok:
      self.problems.append(f"{field}={value!r}: {rule}")

  def at_least(self, obj, prefix: str, names, low: int):
    for n in names:
      v = getattr(obj, n)
      self.need(v >= low, f"{prefix}.{n}", v, f"must be >= {low}")

  def finite(self, obj, prefix: str, n: str, low: float = 0.0, rule: str = ""):
    v = getattr(obj, n)
    self.need(math.isfinite(v) and v >= low, f"{prefix}.{n}", v,
              rule or f"must be a number >= {low:g}")

  def optimizer(self, o: OptimizerConfig, prefix: str):
    self.finite(o, prefix, "lr", rule="must be a number >= 0 (the peak learning rate, e.g. 1e-4)")
    for n in ("end_lr_ratio", "weight_decay", "grad_clip"):
      self.finite(o, prefix, n)
    self.finite(o, prefix, "eps", 1e-30, "must be a number > 0")
    for n in ("b1", "b2"):
      v = getattr(o, n)
      self.need(0.0 <= v < 1.0, f"{prefix}.{n}", v, "must be in [0, 1)")
    self.at_least(o, prefix, ("warmup_steps", "max_consecutive_skips"), 0)
    self.at_least(o, prefix, ("grad_accum",), 1)

  def precision(self, o: OptimizerConfig, prefix: str, model):
    self.need(o.precision in PRECISIONS, f"{prefix}.precision", o.precision,
              f"must be one of {', '.join(PRECISIONS)} (fp32: float32 masters)")
    self.need(o.moment_dtype in ("float32", "bfloat16"), f"{prefix}.moment_dtype",
              o.moment_dtype, "must be float32 or bfloat16")
    self.need(o.precision != "bf16_sr" or model.param_dtype in ("bfloat16", "float32"),
              f"{prefix}.precision", o.precision, f"rounds updates to bfloat16 but the model's "
              f"param_dtype is {model.param_dtype}; use precision=fp32 (float32 masters)")

  def lora(self, lo: LoraConfig, prefix: str):
    self.at_least(lo, prefix, ("rank",), 0)
    if not lo.rank:
      return
    self.finite(lo, prefix, "alpha", 1e-30, "must be a number > 0 (e.g. 16, or 2 x rank)")
    bad = [t for t in lo.targets if t not in LORA_TARGETS]
    self.need(bool(lo.targets) and not bad, f"{prefix}.targets", lo.targets,
              f"must be one or more of {','.join(LORA_TARGETS)}"
              + (f" ({', '.join(bad)} is not a projection)" if bad else ""))
    roles = ("policy", "value", "reward")
    self.need(bool(lo.roles) and all(r in roles for r in lo.roles), f"{prefix}.roles",
              lo.roles, f"must be one or more of {','.join(roles)}")
    # Dropout on the adapters' input would make the log-probs of one batch differ between the
    # rollout, the reference and the update (and between two evaluations); not supported.
    self.need(lo.dropout == 0.0, f"{prefix}.dropout", lo.dropout,
              "adapter dropout is not supported (0 only); regularise with "
              "optim.weight_decay or a smaller rank instead")


@dataclasses.dataclass(frozen=True)
class StageConfig:
  """What every stage has: a step budget, a batch, an optimizer, an evaluation interval.
  Each stage's :meth:`check` lists the problems of its settings (one place for them all)."""

  # Training steps of the stage, one batch each.
  steps: int = 100
  # Examples per step, over all devices and micro-batches.
  batch_size: int = 32
  # The optimizer of the role the stage trains (optim_role), and its precision.
  optim: OptimizerConfig = OptimizerConfig(lr=1e-4, warmup_steps=5, schedule="constant")
  # Evaluate every this many steps and at the stage's last step (several stages also before
  # training).  0: no evaluation at all.
  eval_every: int = 20
  # What scores an evaluation's responses (docs/data.md): "auto" (the stage's correctness
  # reward when it has one, host:math_verify or an exact match among its reward sources, else
  # exact match), "exact_match", "reward" (an RL stage's own weighted reward sources),
  # "rule:NAME" or "host:..." (any rule or host reward source).
  eval_reward: str = "auto"
  # > 0: also sample this many responses per evaluation prompt (rollout.temperature) and report
  # their mean reward, pass@k and maj@k beside the greedy accuracy; 0: greedy only.
  eval_samples_k: int = 0
  # Low-rank adapters for the roles this stage trains (rank 0: full fine-tuning).
  lora: LoraConfig = LoraConfig()
  # The role ``optim`` trains (its model's param_dtype decides what ``optim.precision`` means).
  optim_role: ClassVar[str] = "policy"
  # The kind of held-out data the stage evaluates on: "prompts" (greedy answers, exact
  # match) or "pairs" (preference accuracy): which data.*_eval_path it reads.
  eval_data: ClassVar[str] = "prompts"

  def check(self, name: str, cfg, c: _Checks) -> None:
    """Adds the problems of this stage's settings to ``c``; ``cfg`` is the whole
    ExperimentConfig (for the sections a stage's settings depend on, e.g. the rollout)."""
    c.at_least(self, name, ("steps", "batch_size"), 1)
    c.at_least(self, name, ("eval_every", "eval_samples_k"), 0)
    c.need(isinstance(self.eval_reward, str) and bool(self.eval_reward), f"{name}.eval_reward",
           self.eval_reward, "must be auto, exact_match, reward, rule:NAME or host:...")
    c.optimizer(self.optim, f"{name}.optim")
    c.precision(self.optim, f"{name}.optim", cfg.role_model(self.optim_role))
    c.lora(self.lora, f"{name}.lora")


@dataclasses.dataclass(frozen=True)
class SFTConfig(StageConfig):
  # SFT's step budget (stop_accuracy may end it sooner).
  steps: int = 300
  # Examples (prompt + response) per step.
  batch_size: int = 64
  # The loss on the response tokens only (in chats, every assistant turn); false: on every
  # real token, the prompt's too.
  response_only: bool = True
  # The policy's optimizer.
  optim: OptimizerConfig = OptimizerConfig(lr=3e-3)
  # Evaluate the greedy answers (scored by sft.eval_reward) every this many steps.  0: never.
  eval_every: int = 100
  # Stop at the first evaluation (every ``eval_every`` steps) whose held-out exact match
  # reaches this; 0 trains all ``steps``.  A stage stopped here counts as finished.
  stop_accuracy: float = 0.0
  # Near its target a small model's accuracy can rise sharply (2-digit addition: 13% -> 63%
  # in 10 steps), so a check every ``eval_every`` steps overshoots the target by as much.
  # Once an evaluation reaches ``stop_eval_from`` x ``stop_accuracy``, held-out accuracy is
  # evaluated every ``stop_eval_every`` steps instead (0: only every ``eval_every``).
  stop_eval_every: int = 0
  # The fraction of stop_accuracy from which held-out accuracy is evaluated every
  # stop_eval_every steps.
  stop_eval_from: float = 0.2

  def check(self, name, cfg, c):
    super().check(name, cfg, c)
    c.at_least(self, name, ("stop_eval_every",), 0)
    c.need(0.0 <= self.stop_eval_from <= 1.0, f"{name}.stop_eval_from", self.stop_eval_from,
           f"must be in [0, 1] (a fraction of {name}.stop_accuracy)")
    stop = self.stop_accuracy
    c.need(0.0 <= stop <= 1.0, f"{name}.stop_accuracy", stop,
           f"must be in [0, 1] (0 trains all {name}.steps)")
    c.need(not (stop > 0 and self.eval_every <= 0), f"{name}.stop_accuracy", stop,
           f"is checked at evaluations, but {name}.eval_every={self.eval_every}; set "
           f"--set={name}.eval_every=10 (or any positive number of steps)")


@dataclasses.dataclass(frozen=True)
class RMConfig(StageConfig):
  # Held-out preference pairs (pair accuracy).
  eval_data: ClassVar[str] = "pairs"
  # rm.optim trains the reward model (its param_dtype decides what optim.precision means).
  optim_role: ClassVar[str] = "reward"
  # Reward-model training steps.
  steps: int = 200
  # Preference pairs per step (two sequences each).
  batch_size: int = 64
  # The reward model's optimizer.
  optim: OptimizerConfig = OptimizerConfig(lr=1e-3)
  # Evaluate pair accuracy every this many steps.  0: never.
  eval_every: int = 100


@dataclasses.dataclass(frozen=True)
class RLConfig(StageConfig):
  """What every RL algorithm shares: prompts and samples per step, the clipped policy loss
  over ``ppo_epochs`` x ``num_minibatches``, the KL to the reference, the reward sources."""

  # Whether the algorithm's step takes rollout.refill (groups of a queue decoded in flight).
  supports_refill: ClassVar[bool] = False
  # Responses sampled per prompt.
  num_samples: int = 1
  # Passes of the update over each step's rollout.
  ppo_epochs: int = 1
  # Shuffled minibatches per epoch, one optimizer update each; batch_size x num_samples must
  # divide by it.
  num_minibatches: int = 1
  # The ratio is clipped below at 1 - clip_low (CISPO: a value >= 1 removes the lower bound).
  clip_low: float = 0.2
  # The ratio is clipped above at 1 + clip_high (above clip_low: DAPO's clip-higher).
  clip_high: float = 0.2
  # Dual-clip PPO (policy_loss=ppo only): c > 1 bounds the loss of negative-advantage tokens
  # at -c x A.  0: off.
  dual_clip: float = 0.0
  # Weight of the entropy bonus (-entropy_coef x the aggregated entropy, added to the loss).
  entropy_coef: float = 0.0
  # How the token losses make the loss: "token_mean" over every valid token of the batch;
  # "seq_mean_token_mean" the mean of each sequence's mean; "seq_mean_token_sum_norm" the mean of
  # each sequence's sum / rollout.max_new_tokens (Dr. GRPO).
  loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = "token_mean"
  # The policy loss (jaxrlhf.algorithms.POLICY_LOSSES): "ppo" the clipped token surrogate;
  # "gspo" / "gspo_token" the sequence-level ratio (GSPO; clips of a few 1e-4, and
  # loss_agg=seq_mean_token_mean, as the paper); "cispo" REINFORCE with a clipped, stopped
  # importance weight (MiniMax-M1).
  policy_loss: Literal["ppo", "gspo", "gspo_token", "cispo"] = "ppo"
  # Rollout/trainer mismatch: the trainer's log-probs of the rollout (one more forward pass)
  # become the ratio's denominator and the loss is weighted by pi_trainer / pi_behaviour:
  # "tis" truncated at off_policy_cap, "mis" tokens outside [1/cap, cap] masked, "seq_tis" /
  # "seq_mis" the same on each sequence's ratio; "none": the behaviour log-probs as they are.
  off_policy: Literal["none", "tis", "mis", "seq_tis", "seq_mis"] = "none"
  # The off_policy weights' cap (> 1): "tis" truncates at it, "mis" masks the tokens (or
  # sequences) whose weight is outside [1 / cap, cap].
  off_policy_cap: float = 2.0
  # The KL penalty to the frozen reference.
  kl: KLConfig = KLConfig()
  # Where the rewards come from and how they are shaped.
  reward: RewardConfig = RewardConfig()

  def check(self, name, cfg, c):
    super().check(name, cfg, c)
    c.at_least(self, name, ("num_samples", "ppo_epochs", "num_minibatches"), 1)
    # Decoupled clips (DAPO's clip-higher: clip_high > clip_low, e.g. 0.2 / 0.28).
    c.finite(self, name, "clip_low", rule="must be a number >= 0 (e.g. 0.2)")
    c.finite(self, name, "clip_high", rule="must be a number >= 0 (e.g. 0.28 for clip-higher)")
    if self.policy_loss != "cispo":
      c.need(self.clip_low < 1.0, f"{name}.clip_low", self.clip_low,
             f"must be < 1 (the ratio's lower bound is 1 - clip_low); only "
             f"{name}.policy_loss=cispo allows no lower bound")
    clipped_surrogate = self.policy_loss == "ppo"  # not a stage name: the loss's
    c.need(not (self.dual_clip and not clipped_surrogate), f"{name}.dual_clip",
           self.dual_clip, f"applies to {name}.policy_loss=ppo only; set it to 0 for "
           f"{self.policy_loss!r}")
    if self.off_policy != "none":
      c.need(math.isfinite(self.off_policy_cap) and self.off_policy_cap > 1.0,
             f"{name}.off_policy_cap", self.off_policy_cap, "must be a number > 1 (e.g. 2)")
      c.need(cfg.pools.is_correction == 0, f"{name}.off_policy", self.off_policy,
             f"and pools.is_correction={cfg.pools.is_correction} both correct the same lag; "
             f"keep one (set pools.is_correction=0)")
    buf = self.reward.overlong_buffer
    c.need(0 <= buf <= cfg.rollout.max_new_tokens, f"{name}.reward.overlong_buffer", buf,
           f"must be in [0, rollout.max_new_tokens={cfg.rollout.max_new_tokens}] (0 is off)")
    c.finite(self.reward, f"{name}.reward", "overlong_penalty")
    c.finite(self.reward, f"{name}.reward", "timeout_s", 0.0,
             "must be a number of seconds >= 0 (a host reward call running longer is abandoned; "
             "0: no limit)")
    c.finite(self.kl, f"{name}.kl", "coef")
    r = self.reward
    if len(r.weights) != len(r.sources):
      c.problems.append(f"{name}.reward.weights has {len(r.weights)} entries but "
                        f"{name}.reward.sources has {len(r.sources)}; give one weight per source")
    rows = self.batch_size * self.num_samples
    if self.num_minibatches >= 1 and rows % self.num_minibatches:
      c.problems.append(f"{name}: batch_size*num_samples={rows} must divide into "
                        f"num_minibatches={self.num_minibatches}")
    ro = cfg.rollout
    c.at_least(ro, "rollout", ("max_new_tokens",), 1)
    c.at_least(ro, "rollout", ("top_k",), 0)
    c.finite(ro, "rollout", "temperature", rule="must be a number >= 0 (0 is greedy)")
    c.need(0.0 < ro.top_p <= 1.0, "rollout.top_p", ro.top_p,
           "must be in (0, 1] (1 turns top-p off)")
    c.need(0 <= ro.length_buckets <= ro.max_new_tokens, "rollout.length_buckets",
           ro.length_buckets, f"must be in [0, rollout.max_new_tokens={ro.max_new_tokens}] "
           "(0 is off; e.g. 4: the update runs on a quarter, half, ... of the slots)")
    P = cfg.data.max_prompt_len
    c.need(0 <= ro.prompt_buckets <= P, "rollout.prompt_buckets", ro.prompt_buckets,
           f"must be in [0, data.max_prompt_len={P}] (0 is off; e.g. 4: prompts padded to a "
           "quarter, half, ... of max_prompt_len, the batch's longest rounded up)")
    c.at_least(ro, "rollout", ("pack_buckets",), 1)
    if ro.pack and getattr(self, "dynamic_sampling", False):
      # The layout is made from the generated rows; the selection then replaces them.
      c.problems.append(f"rollout.pack=true with {name}.dynamic_sampling=true: the packed "
                        "layout is made before the selection changes the batch's rows; set "
                        "one of them to false")
    if ro.pack and cfg.kernels.attention == "cudnn":
      c.problems.append("rollout.pack=true with kernels.attention=cudnn: cuDNN's attention "
                        "takes no segment ids (packed rows); set kernels.attention=auto (or "
                        "xla, pallas), or rollout.pack=false")
    c.need(ro.kv_page_size >= 0, "rollout.kv_page_size", ro.kv_page_size,
           "must be >= 0 (0: a contiguous cache; e.g. 16)")
    c.need(ro.kv_pages >= 0, "rollout.kv_pages", ro.kv_pages,
           "must be >= 0 (0: enough for every row)")
    if ro.kv_page_size and not (cfg.env.name or ro.refill):
      c.problems.append(f"rollout.kv_page_size={ro.kv_page_size}: the paged KV cache runs "
                        "multi-turn episodes (env.name) and in-flight refill (rollout.refill) "
                        "only; set rollout.kv_page_size=0, or rollout.refill=true")
    if ro.refill:
      _check_refill(self, name, cfg, c)
    if ro.continue_kv != "recompute" and not (ro.refill and ro.refill_leftover == "continue"):
      c.problems.append(f"rollout.continue_kv={ro.continue_kv!r} applies to partial rollouts "
                        "only; set rollout.refill=true and rollout.refill_leftover=continue, or "
                        "rollout.continue_kv=recompute")
    if not ro.refill and ro.refill_leftover != "drop":
      c.problems.append(f"rollout.refill_leftover={ro.refill_leftover!r} applies to in-flight "
                        "refill only, which is off; set rollout.refill=true or "
                        "rollout.refill_leftover=drop")


def _check_refill(scfg, name, cfg, c):
  """What in-flight refill (``rollout.refill``) does not support, each with its fix."""
  ro = cfg.rollout
  c.need(math.isfinite(ro.refill_queue) and ro.refill_queue >= 1.0, "rollout.refill_queue",
         ro.refill_queue, "must be a number >= 1 (prompts queued per trained prompt, e.g. 2)")
  if not scfg.supports_refill:
    c.problems.append(f"rollout.refill=true is supported for grpo only, not {name}; set "
                      f"rollout.refill=false")
  if cfg.env.name:
    c.problems.append(f"rollout.refill=true with env.name={cfg.env.name!r}: multi-turn "
                      "episodes run their own host loop and cannot refill; set "
                      "rollout.refill=false")
  if ro.kv_page_size and ro.kv_pages:
    _check_refill_pool(scfg, cfg, c)
  if getattr(scfg, "dynamic_sampling", False):
    c.problems.append(f"rollout.refill=true with {name}.dynamic_sampling=true: both choose "
                      f"which groups of an over-sized queue train; set one of them to false")
  host = [s for s in scfg.reward.sources if s.partition(":")[0] == "host"]
  if ro.refill_leftover != "drop" and host:
    # A host reward's examples follow the queue on the host (HostInputs.take); carried
    # prompts live in the device state (and its checkpoint), which has no place for them.
    c.problems.append(f"rollout.refill_leftover={ro.refill_leftover} with host reward sources "
                      f"{host} "
                      f"({name}.reward.sources): the examples a host reward reads cannot be "
                      f"carried to the next step (nor through a checkpoint); set "
                      f"rollout.refill_leftover=drop, or use device rewards (rule:NAME, model)")


def _check_refill_pool(scfg, cfg, c):
  """A refill pool handed out by live tokens (``rollout.kv_pages`` > 0) must hold one group's
  worst case, and cannot take the kept pages of ``rollout.continue_kv=keep``."""
  ro = cfg.rollout
  n = getattr(scfg, "num_samples", 1)
  rows = getattr(scfg, "batch_size", 1) * n
  _, _, group = ro.refill_pages(cfg.data.max_prompt_len, rows, n)
  full = rows // n * group  # every group's worst case at once
  if ro.refill_leftover == "continue" and ro.continue_kv == "keep":
    c.problems.append(f"rollout.kv_pages={ro.kv_pages} with rollout.continue_kv=keep: the "
                      "kept keys and values are each row's whole buffer, which a pool handed "
                      "out by live tokens does not hold; set rollout.kv_pages=0 (every row's "
                      "pages reserved) or rollout.continue_kv=recompute")
  elif ro.kv_pages < group:
    c.problems.append(f"rollout.kv_pages={ro.kv_pages} cannot hold one group's responses "
                      f"({n} x (data.max_prompt_len + rollout.max_new_tokens) slots in pages of "
                      f"rollout.kv_page_size={ro.kv_page_size}: {group} pages); raise "
                      f"rollout.kv_pages to at least {group} ({full} run every group at once), "
                      "or set 0")


@dataclasses.dataclass(frozen=True)
class PPOConfig(RLConfig):
  # Prompts per step (each with num_samples responses).
  batch_size: int = 32
  # New values are clipped to the rollout's values +- this in the value loss; <= 0: the plain
  # squared error.
  value_clip: float = 0.2
  # Weight of the value loss in the step's loss.
  vf_coef: float = 0.5
  # GAE's discount per response token.
  gamma: float = 1.0
  # GAE's lambda: 1 takes the full return, lower values lean on the value model.
  lam: float = 0.95
  # Z-score the advantages over the batch's valid tokens before the update.
  whiten_advantages: bool = True
  # One model with two heads: the value head on the policy, trained with ppo.optim
  # (value_model must be unset; docs/training.md).
  shared_backbone: bool = False
  # The value model's optimizer (unused with shared_backbone).
  value_optim: OptimizerConfig = OptimizerConfig(lr=1e-4, warmup_steps=5, schedule="constant")

  def check(self, name, cfg, c):
    super().check(name, cfg, c)
    c.optimizer(self.value_optim, f"{name}.value_optim")
    c.precision(self.value_optim, f"{name}.value_optim", cfg.role_model("value"))
    if self.shared_backbone and cfg.value_model is not None and cfg.value_model != cfg.model:
      # One model, two heads: the value head reads the policy's own hidden states, and the
      # value loss trains the shared backbone too (with ppo.optim; ppo.value_optim is unused).
      c.problems.append(f"{name}.shared_backbone=true: the value head sits on the policy, so "
                        "value_model must be unset (or equal to model); drop the value_model "
                        f"settings or set {name}.shared_backbone=false")
    if self.shared_backbone and self.lora.rank:
      c.problems.append(f"{name}.shared_backbone=true with {name}.lora.rank={self.lora.rank}: "
                        "adapters on a policy that carries the value head are not supported; "
                        f"set {name}.shared_backbone=false (the value model can take its own "
                        "adapters on the reward model's frozen backbone)")


@dataclasses.dataclass(frozen=True)
class GRPOConfig(RLConfig):
  # GRPO's step takes rollout.refill.
  supports_refill: ClassVar[bool] = True
  # Prompts per step, each a group of num_samples responses.
  batch_size: int = 16
  # The group size: responses per prompt, whose rewards are compared.
  num_samples: int = 8
  # Group advantages: "grpo" (r - mean) / (std + std_eps); "drgrpo" r - mean; "rloo" r - the
  # mean of the others; "reinforce_pp" r - group mean, z-scored over the batch.
  advantage: Literal["grpo", "drgrpo", "rloo", "reinforce_pp"] = "grpo"
  # Added to the std of the advantages' z-scores ("grpo", "reinforce_pp"), so a group of
  # equal rewards gets 0 rather than NaN; must be > 0.
  std_eps: float = 1e-6
  # The KL penalty to the frozen reference.
  kl: KLConfig = KLConfig(coef=0.04, estimator="k3", placement="loss")
  # Where the rewards come from and how they are shaped.
  reward: RewardConfig = RewardConfig(sources=("rule:exact_match",))
  # DAPO's dynamic sampling: generate ceil(batch_size * max_oversample) prompts' groups and
  # train on the first batch_size whose rewards are not all equal; short of them, the rest
  # are masked (dynamic/shortfall_groups).  Shapes stay fixed (docs/training.md).
  dynamic_sampling: bool = False
  # dynamic_sampling: prompts generated per trained prompt (at least 1).
  max_oversample: float = 2.0

  @property
  def prompts_per_step(self) -> int:
    """Prompts generated per step (over-sampled for dynamic sampling)."""
    if not self.dynamic_sampling:
      return self.batch_size
    return max(self.batch_size, math.ceil(self.batch_size * self.max_oversample))

  def check(self, name, cfg, c):
    super().check(name, cfg, c)
    if self.advantage in ("grpo", "drgrpo", "rloo"):  # not a stage name
      c.need(self.num_samples >= 2, f"{name}.num_samples", self.num_samples,
             f"must be >= 2: {name}.advantage={self.advantage!r} compares the samples of one "
             "prompt, so one sample gives every advantage 0")
    # A group whose rewards are all equal has std 0: std_eps is what keeps its advantages
    # 0 / (0 + eps) = 0 rather than 0 / 0 = NaN.
    c.need(math.isfinite(self.std_eps) and self.std_eps > 0, f"{name}.std_eps", self.std_eps,
           "must be a finite number > 0 (e.g. 1e-6): a group of equal rewards has std 0, and "
           "0 would make its advantages 0/0 = NaN")
    if self.dynamic_sampling:
      c.need(math.isfinite(self.max_oversample) and self.max_oversample >= 1.0,
             f"{name}.max_oversample", self.max_oversample,
             "must be a number >= 1 (prompts generated per trained prompt, e.g. 2)")
      c.need(self.num_samples >= 2, f"{name}.num_samples", self.num_samples,
             f"must be >= 2 for {name}.dynamic_sampling: it keeps groups whose samples' "
             "rewards differ")


@dataclasses.dataclass(frozen=True)
class DPOConfig(StageConfig):
  # Held-out preference pairs (pair accuracy).
  eval_data: ClassVar[str] = "pairs"
  # Preference pairs per step (two sequences each).
  batch_size: int = 32
  # The implicit reward's scale, beta x (policy - reference log-prob) (SimPO: of the
  # length-normalised log-prob); IPO's target margin is 1 / (2 beta); ORPO's lambda.
  beta: float = 0.1
  # sigmoid / ipo / cdpo: DPO and its variants; simpo, orpo: reference-free (no reference
  # model in memory) (jaxrlhf.algorithms.losses; beta is ORPO's lambda).
  loss: Literal["sigmoid", "ipo", "cdpo", "simpo", "orpo"] = "sigmoid"
  # cDPO's label smoothing (losses sigmoid and cdpo): the assumed chance that a pair's
  # preference is wrong.  0: plain DPO.
  label_smoothing: float = 0.0
  # SimPO's target reward margin.
  simpo_gamma: float = 1.0
  # RPO: + sft_weight x the chosen responses' per-token NLL (0: off; not with orpo, whose
  # loss has its own SFT term).
  sft_weight: float = 0.0
  # Reference log-probs: "step" computes them inside every step; "cache" precomputes once.
  reference: Literal["step", "cache"] = "step"

  @property
  def needs_reference(self) -> bool:
    return self.loss not in ("simpo", "orpo")

  def check(self, name, cfg, c):
    super().check(name, cfg, c)
    c.finite(self, name, "beta", 1e-30, "must be a number > 0 (e.g. 0.1)")
    ls = self.label_smoothing
    c.need(math.isfinite(ls) and 0.0 <= ls < 0.5, f"{name}.label_smoothing", ls,
           "must be in [0, 0.5): the assumed chance that a pair's preference is wrong (0.5 "
           "would make every pair uninformative; e.g. 0.1)")
    c.need(self.needs_reference or self.reference == "step", f"{name}.reference",
           self.reference, f"{name}.loss={self.loss!r} reads no reference model; leave "
           f"{name}.reference=step")
    c.finite(self, name, "simpo_gamma")
    c.finite(self, name, "sft_weight", 0.0, "must be a number >= 0 (0 is off; e.g. 1.0)")
    c.need(not (self.sft_weight and self.loss == "orpo"), f"{name}.sft_weight",
           self.sft_weight, f"{name}.loss=orpo has its own SFT term (weighted 1, its odds "
           f"term by {name}.beta); set {name}.sft_weight=0")


@dataclasses.dataclass(frozen=True)
class KTOConfig(StageConfig):
  """KTO on unpaired examples (data.unpaired_path, or each pair's two sides)."""
  # Held-out preference pairs (pair accuracy).
  eval_data: ClassVar[str] = "pairs"

  # Examples per step (from pairs: both sides of half as many pairs).
  batch_size: int = 64
  # The implicit reward's scale, beta x (policy - reference summed log-prob).
  beta: float = 0.1
  # lambda_D, lambda_U: the paper keeps lambda_D n_D / (lambda_U n_U) in [1, 4/3].
  desirable_weight: float = 1.0
  # lambda_U: the weight of the undesirable examples' loss (desirable_weight is lambda_D).
  undesirable_weight: float = 1.0

  def check(self, name, cfg, c):
    super().check(name, cfg, c)
    c.finite(self, name, "beta", 1e-30, "must be a number > 0 (e.g. 0.1)")
    for n in ("desirable_weight", "undesirable_weight"):
      c.finite(self, name, n)
    # The reference point is the whole batch's mean log-ratio: micro-batches would each
    # estimate their own, and their summed gradient would not be the batch's.
    c.need(self.optim.grad_accum == 1, f"{name}.optim.grad_accum", self.optim.grad_accum,
           f"must be 1 for KTO (its reference point is the batch's); lower {name}.batch_size "
           "to fit memory instead")
