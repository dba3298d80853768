"""Frozen, typed configuration for every part of a run, and dotted-name overrides.

An experiment (``experiments/NAME.py``) builds one :class:`ExperimentConfig`; the command line
changes fields with ``--set=section.field=value``.  Types drive parsing, and ``Literal`` types
list the valid choices, so a typo fails with a one-line message naming what would work.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import typing
from typing import Literal, Optional


class ConfigError(ValueError):
  """A user-facing configuration error: the message names the field and the fix."""


# ----------------------------------------------------------------------------------- model


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A Llama-family decoder (RMSNorm, RoPE, GQA, SwiGLU)."""

  vocab_size: int = 512
  d_model: int = 128
  n_layers: int = 2
  n_heads: int = 4
  n_kv_heads: int = 4
  head_dim: int = 32
  mlp_dim: int = 512
  max_seq_len: int = 256
  rope_theta: float = 10000.0
  # Rotary frequency scaling of long-context checkpoints: "none"; "linear" (every frequency
  # divided by rope_factor); "llama3" (Llama 3.1+: wavelengths longer than
  # rope_original_max_len / rope_low_freq_factor divided by rope_factor, those shorter than
  # rope_original_max_len / rope_high_freq_factor kept, a smooth ramp between).
  rope_scaling: Literal["none", "linear", "llama3"] = "none"
  rope_factor: float = 1.0
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_max_len: int = 8192
  norm_eps: float = 1e-5
  tie_embeddings: bool = False
  # Qwen2-style biases on the q/k/v projections.
  qkv_bias: bool = False
  param_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
  compute_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
  # What the backward pass keeps: "none" keeps everything, "full" recomputes each layer,
  # "dots" keeps matmul outputs only, "dots_no_batch" keeps weight-only matmuls.
  remat: Literal["none", "full", "dots", "dots_no_batch"] = "none"
  scan_layers: bool = True
  init_std: float = 0.02
  # How a scalar-head model (reward, guard) turns per-token scores into one sequence score:
  # "last" reads the last real token (the usual reward model); "mean" averages the response
  # tokens, so each token's score only has to judge that token.
  score_pool: Literal["last", "mean"] = "last"
  # Load weights from a local Hugging Face model directory (issue: HF interop).
  hf_path: str = ""
  # The checkpoint's real vocabulary when ``vocab_size`` was padded up to a multiple of ``tp``
  # (jaxrlhf.model.hf); ids at or above it are padding that must never be sampled.  0: no padding.
  unpadded_vocab_size: int = 0

  @property
  def group_size(self) -> int:
    return self.n_heads // self.n_kv_heads

  def num_params(self, head: str = "lm") -> int:
    d, f, v, l = self.d_model, self.mlp_dim, self.vocab_size, self.n_layers
    attn = d * self.head_dim * (self.n_heads * 2 + self.n_kv_heads * 2)
    if self.qkv_bias:
      attn += self.head_dim * (self.n_heads + 2 * self.n_kv_heads)
    per_layer = attn + 3 * d * f + 2 * d
    total = v * d + l * per_layer + d
    if head == "lm" and not self.tie_embeddings:
      total += d * v
    if head == "scalar":
      total += d + 1
    return total


# ------------------------------------------------------------------------------------ mesh


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Device mesh ``dp x fsdp x tp``; -1 on one axis means "all remaining devices"."""

  dp: int = -1
  fsdp: int = 1
  tp: int = 1


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
  """Multi-process (multi-host) start-up; used only when asked for (see BUILD.md)."""

  enabled: bool = False
  coordinator_address: str = ""
  num_processes: int = 0
  process_id: int = -1
  # CPU collectives for multi-process CPU runs (tests, laptops): "gloo" or "none".
  cpu_collectives: Literal["gloo", "none"] = "gloo"


# --------------------------------------------------------------------------------- rollout


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  """Generation: sampling settings and lengths."""

  max_new_tokens: int = 16
  temperature: float = 1.0
  top_k: int = 0  # 0: off
  top_p: float = 1.0  # 1.0: off
  # Extra token ids that end a sequence besides the tokenizer's EOS.
  stop_token_ids: tuple[int, ...] = ()


# ------------------------------------------------------------------------------ optimizer


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """optax AdamW with warm-up + decay, global-norm clipping, gradient accumulation."""

  lr: float = 1e-3
  schedule: Literal["constant", "cosine", "linear"] = "cosine"
  warmup_steps: int = 10
  # Final learning rate as a fraction of ``lr`` for decaying schedules.
  end_lr_ratio: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  weight_decay: float = 0.0
  grad_clip: float = 1.0  # 0: off
  grad_accum: int = 1
  # A step whose loss or gradients are not finite is skipped; this many in a row stop the run.
  max_consecutive_skips: int = 5


# ------------------------------------------------------------------------------ algorithms


@dataclasses.dataclass(frozen=True)
class KLConfig:
  """KL to the frozen reference.  ``logr = logp_ref - logp`` per token."""

  coef: float = 0.05
  estimator: Literal["k1", "k2", "k3"] = "k1"
  # "reward": -coef * kl per token in the reward (PPO).  "loss": coef * mean kl in the loss (GRPO).
  placement: Literal["reward", "loss"] = "reward"
  adaptive: bool = False
  target: float = 6.0
  horizon: int = 10000
  # logr is clamped to [-clamp_logr, clamp_logr] before the estimator; the estimate to
  # [-clamp_kl, clamp_kl] after it.
  clamp_logr: float = 20.0
  clamp_kl: float = 10.0


@dataclasses.dataclass(frozen=True)
class RewardConfig:
  """Where rewards come from and how they are normalised."""

  # Weighted sources: "model" (the learned reward model), "rule:NAME" (a jittable rule from
  # jaxrlhf.rewards), "host:NAME" (a host Python function).  Weights align with sources.
  sources: tuple[str, ...] = ("model",)
  weights: tuple[float, ...] = (1.0,)
  normalize: Literal["none", "batch", "running"] = "none"
  clip: float = 0.0  # 0: off; else rewards are clipped to [-clip, clip] after normalisation
  # Sequences without EOS within max_new_tokens: "none", "penalty" (add missing_eos_penalty),
  # or "mask" (drop from the update).
  missing_eos: Literal["none", "penalty", "mask"] = "none"
  missing_eos_penalty: float = -1.0
  # Reward-hacking guard: a smaller scalar-head classifier.
  guard: bool = False
  guard_threshold: float = 0.5
  guard_action: Literal["penalty", "mask"] = "penalty"
  guard_penalty: float = -1.0
  # A host reward that raises or returns a non-number for a response: "mask" scores it as
  # unscorable (masked out of the update, counted in reward/host_errors and
  # reward/host_invalid); "raise" stops the run with the function's error.
  host_errors: Literal["mask", "raise"] = "mask"
  # DAPO's overlong shaping: > 0 adds a penalty over the last this many tokens before
  # rollout.max_new_tokens, falling linearly from 0 to -overlong_penalty at the limit; 0: off.
  overlong_buffer: int = 0
  overlong_penalty: float = 1.0


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


@dataclasses.dataclass(frozen=True)
class StageConfig:
  """What every stage has: a step budget, a batch, an optimizer, an evaluation interval.
  Each stage's :meth:`check` lists the problems of its settings (one place for them all)."""

  steps: int = 100
  batch_size: int = 32
  optim: OptimizerConfig = OptimizerConfig(lr=1e-4, warmup_steps=5, schedule="constant")
  eval_every: int = 20

  def check(self, name: str, cfg: "ExperimentConfig", c: _Checks) -> None:
    c.at_least(self, name, ("steps", "batch_size"), 1)
    c.at_least(self, name, ("eval_every",), 0)
    c.optimizer(self.optim, f"{name}.optim")


@dataclasses.dataclass(frozen=True)
class SFTConfig(StageConfig):
  steps: int = 300
  batch_size: int = 64
  response_only: bool = True
  optim: OptimizerConfig = OptimizerConfig(lr=3e-3)
  eval_every: int = 100
  # Stop at the first evaluation (every ``eval_every`` steps) whose held-out exact match
  # reaches this; 0 trains all ``steps``.  A stage stopped here counts as finished.
  stop_accuracy: float = 0.0

  def check(self, name, cfg, c):
    super().check(name, cfg, c)
    stop = self.stop_accuracy
    c.need(0.0 <= stop <= 1.0, f"{name}.stop_accuracy", stop,
           f"must be in [0, 1] (0 trains all {name}.steps)")
    c.need(not (stop > 0 and self.eval_every <= 0), f"{name}.stop_accuracy", stop,
           f"is checked at evaluations, but {name}.eval_every={self.eval_every}; set "
           f"--set={name}.eval_every=10 (or any positive number of steps)")


@dataclasses.dataclass(frozen=True)
class RMConfig(StageConfig):
  steps: int = 200
  batch_size: int = 64
  optim: OptimizerConfig = OptimizerConfig(lr=1e-3)
  eval_every: int = 100


@dataclasses.dataclass(frozen=True)
class RLConfig(StageConfig):
  """What every RL algorithm shares: prompts and samples per step, the clipped policy loss
  over ``ppo_epochs`` x ``num_minibatches``, the KL to the reference, the reward sources."""

  num_samples: int = 1  # responses per prompt
  ppo_epochs: int = 1
  num_minibatches: int = 1
  clip_low: float = 0.2
  clip_high: float = 0.2
  dual_clip: float = 0.0  # 0: off; else c > 1 bounds the loss for negative advantages
  entropy_coef: float = 0.0
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
  off_policy_cap: float = 2.0
  kl: KLConfig = KLConfig()
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


@dataclasses.dataclass(frozen=True)
class PPOConfig(RLConfig):
  batch_size: int = 32  # prompts per step
  value_clip: float = 0.2
  vf_coef: float = 0.5
  gamma: float = 1.0
  lam: float = 0.95
  whiten_advantages: bool = True
  shared_backbone: bool = False
  value_optim: OptimizerConfig = OptimizerConfig(lr=1e-4, warmup_steps=5, schedule="constant")

  def check(self, name, cfg, c):
    super().check(name, cfg, c)
    c.optimizer(self.value_optim, f"{name}.value_optim")
    if self.shared_backbone and cfg.value_model is not None and cfg.value_model != cfg.model:
      # One model, two heads: the value head reads the policy's own hidden states, and the
      # value loss trains the shared backbone too (with ppo.optim; ppo.value_optim is unused).
      c.problems.append(f"{name}.shared_backbone=true: the value head sits on the policy, so "
                        "value_model must be unset (or equal to model); drop the value_model "
                        f"settings or set {name}.shared_backbone=false")


@dataclasses.dataclass(frozen=True)
class GRPOConfig(RLConfig):
  batch_size: int = 16  # prompts per step
  num_samples: int = 8  # group size
  advantage: Literal["grpo", "drgrpo", "rloo", "reinforce_pp"] = "grpo"
  std_eps: float = 1e-6
  kl: KLConfig = KLConfig(coef=0.04, estimator="k3", placement="loss")
  reward: RewardConfig = RewardConfig(sources=("rule:exact_match",))
  # DAPO's dynamic sampling: generate ceil(batch_size * max_oversample) prompts' groups and
  # train on the first batch_size whose rewards are not all equal; short of them, the rest
  # are masked (dynamic/shortfall_groups).  Shapes stay fixed (docs/training.md).
  dynamic_sampling: bool = False
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
    if self.dynamic_sampling:
      c.need(math.isfinite(self.max_oversample) and self.max_oversample >= 1.0,
             f"{name}.max_oversample", self.max_oversample,
             "must be a number >= 1 (prompts generated per trained prompt, e.g. 2)")
      c.need(self.num_samples >= 2, f"{name}.num_samples", self.num_samples,
             f"must be >= 2 for {name}.dynamic_sampling: it keeps groups whose samples' "
             "rewards differ")


@dataclasses.dataclass(frozen=True)
class DPOConfig(StageConfig):
  batch_size: int = 32  # pairs per step
  beta: float = 0.1
  # sigmoid / ipo / cdpo: DPO and its variants; simpo, orpo: reference-free (no reference
  # model in memory) (jaxrlhf.algorithms.losses; beta is ORPO's lambda).
  loss: Literal["sigmoid", "ipo", "cdpo", "simpo", "orpo"] = "sigmoid"
  label_smoothing: float = 0.0  # cDPO
  simpo_gamma: float = 1.0  # SimPO's target reward margin
  # Reference log-probs: "step" computes them inside every step; "cache" precomputes once.
  reference: Literal["step", "cache"] = "step"

  @property
  def needs_reference(self) -> bool:
    return self.loss not in ("simpo", "orpo")

  def check(self, name, cfg, c):
    super().check(name, cfg, c)
    c.finite(self, name, "beta", 1e-30, "must be a number > 0 (e.g. 0.1)")
    c.need(self.needs_reference or self.reference == "step", f"{name}.reference",
           self.reference, f"{name}.loss={self.loss!r} reads no reference model; leave "
           f"{name}.reference=step")
    c.finite(self, name, "simpo_gamma")


@dataclasses.dataclass(frozen=True)
class KTOConfig(StageConfig):
  """KTO on unpaired examples (data.unpaired_path, or each pair's two sides)."""

  batch_size: int = 64  # examples per step
  beta: float = 0.1
  # lambda_D, lambda_U: the paper keeps lambda_D n_D / (lambda_U n_U) in [1, 4/3].
  desirable_weight: float = 1.0
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


# ------------------------------------------------------------------------------------ data


@dataclasses.dataclass(frozen=True)
class DataConfig:
  # A built-in synthetic task ("addition") or "jsonl" for the user's files below.
  task: str = "addition"
  digits: int = 2
  # Write the sum least-significant digit first ("07+45=" -> "250"): each digit then depends
  # only on two operand digits and the carry already written, which small models learn fast.
  reverse_answer: bool = False
  seed: int = 0
  eval_size: int = 256
  # "char" (built-in tokenizer for synthetic tasks) or a local transformers tokenizer directory.
  tokenizer: str = "char"
  prompts_path: str = ""  # JSONL {"prompt", optional "answer"}
  sft_path: str = ""  # JSONL {"prompt", "response"}
  pairs_path: str = ""  # JSONL {"prompt", "chosen", "rejected"}
  # KTO's unpaired examples, JSONL {"prompt", "completion", "label": true|false}; empty: each
  # pair's two sides (chosen desirable, rejected undesirable).
  unpaired_path: str = ""
  eval_path: str = ""
  max_prompt_len: int = 16
  max_response_len: int = 16
  # Over-long prompts and responses (files only): "error" stops with file:line, "truncate" cuts
  # them (a prompt keeps its last tokens, a response its first), "skip" drops the example;
  # truncations and skips are reported.
  overlong: Literal["error", "truncate", "skip"] = "error"
  # How each data file is read: "auto" by its name (a .parquet file, a folder written by
  # datasets' save_to_disk, else JSONL), or one format for all of them.
  format: Literal["auto", "jsonl", "parquet", "hf_disk"] = "auto"
  # Column renames applied to every row before use, "SOURCE:TARGET" pairs, e.g.
  # ("question:prompt", "solution:answer"); other columns pass through to host rewards.
  fields: tuple[str, ...] = ()
  # Evaluation data per kind of file; empty: data.eval_path if set, else split off the training
  # file by data.eval_split, else the first data.eval_size training examples (said on the
  # console: they are not held out).
  # SFT, PPO and GRPO evaluate greedy answers on prompts with an "answer"; RM and DPO
  # evaluate preference pairs.
  prompts_eval_path: str = ""
  pairs_eval_path: str = ""
  # > 0: this fraction of each training file (chosen by data.seed) is held out for evaluation
  # and never trained on (at most data.eval_size examples of it are evaluated).
  eval_split: float = 0.0


# ---------------------------------------------------------------------- outputs and kernels


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  enabled: bool = True
  every_steps: int = 50
  every_seconds: float = 0.0  # 0: off
  keep: int = 2
  best_metric: str = ""  # e.g. "eval/accuracy"; empty: no best-checkpoint tracking
  best_mode: Literal["max", "min"] = "max"
  async_save: bool = True


Sink = Literal["jsonl", "tensorboard", "wandb", "mlflow"]
# sink -> (the module it needs, the extra that installs it); the others come with jaxrlhf.
SINK_PACKAGES = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
  every_steps: int = 1
  console: bool = True
  # Where the console is not a terminal (CI logs), one plain line per stage at most this often
  # (plus each stage's first and last step); on a terminal the bar updates in place.
  console_every_s: float = 10.0
  # Metrics shown on the console line, when present.
  console_keys: tuple[str, ...] = ("loss", "reward/mean", "kl/mean", "eval/accuracy",
                                   "eval/pair_accuracy", "time/step_s")
  # Where metrics go besides the console: "jsonl" (WORKDIR/metrics.jsonl, always written),
  # "tensorboard", "wandb", "mlflow" (docs/observability.md).
  sinks: tuple[Sink, ...] = ("jsonl", "tensorboard")
  # A sink other than jsonl that raises mid-run: "disable" reports it once and trains on
  # without it; "stop" ends the run (the checkpoints written so far are kept).
  sink_errors: Literal["disable", "stop"] = "disable"
  # Run the step as separately-timed phases (generation, scoring, update) to see where the
  # time goes; the default one-program step reports total time only.
  phase_timing: bool = False


@dataclasses.dataclass(frozen=True)
class KernelsConfig:
  """Which implementation each hot op uses: "auto" picks by backend (Pallas on GPU, XLA
  elsewhere); "pallas_interpret" runs the Pallas kernels in the slow interpreter (debugging)."""

  logprob: Literal["auto", "xla", "pallas", "pallas_interpret", "naive"] = "auto"
  attention: Literal["auto", "xla", "pallas", "pallas_interpret", "cudnn"] = "auto"
  logprob_block_v: int = 8192


@dataclasses.dataclass(frozen=True)
class PlanConfig:
  """Settings for ``--plan``: the cluster a run is sized for."""

  accelerator: str = "h100"
  devices: int = 8
  runs_per_month: float = 1.0


@dataclasses.dataclass(frozen=True)
class PoolsConfig:
  """Disaggregated RL (``--role=actor|critic|all``, docs/pools.md): an actor pool (generation,
  reference, policy update) and a critic pool (reward, guard, value) exchanging batches
  through Redis streams.  The Redis password comes from ``JAXRLHF_REDIS_PASSWORD`` only, so it
  never lands in a saved config."""

  mode: Literal["sync", "async"] = "sync"
  # async: rollouts the actor may generate ahead of its updates (policy-version lag bound).
  max_staleness: int = 1
  # Unread messages a stream may hold before its producer waits (back-pressure).
  max_queue: int = 4
  # > 0: decoupled PPO for stale rollouts, ratio to the current policy times the importance
  # weight current/behaviour truncated at this value; 0: the ratio uses behaviour log-probs.
  is_correction: float = 0.0
  # redis://HOST:PORT/DB; empty: $JAXRLHF_REDIS_URL, else redis://127.0.0.1:6379/0.
  redis_url: str = ""
  # Stream key prefix; empty: "jaxrlhf:EXPERIMENT".
  namespace: str = ""
  # How long a pool keeps retrying an unreachable Redis (with back-off) before giving up.
  redis_wait_s: float = 300.0
  # How long a pool waits for the other pool's next message before giving up.
  peer_wait_s: float = 1800.0


# ------------------------------------------------------------------------------ experiment


# The stages an experiment can run; each has a config field of the same name here and an
# AlgorithmSpec registered under that name (jaxrlhf/train/spec.py).
Stage = Literal["sft", "rm", "ppo", "grpo", "dpo", "kto"]
STAGE_NAMES: tuple[str, ...] = typing.get_args(Stage)


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
  name: str = "unnamed"
  description: str = ""
  # Dotted fields the command line must set before the experiment can run (templates for the
  # user's model and data), e.g. ("model.hf_path", "data.tokenizer"); see validate().
  required: tuple[str, ...] = ()
  seed: int = 0
  # The stages run in order; each later stage starts from the earlier stages' results.
  stages: tuple[Stage, ...] = ("sft",)
  model: ModelConfig = ModelConfig()
  # Reward / value / guard models; None means "same shape as model".
  reward_model: Optional[ModelConfig] = None
  value_model: Optional[ModelConfig] = None
  guard_model: Optional[ModelConfig] = None
  mesh: MeshConfig = MeshConfig()
  distributed: DistributedConfig = DistributedConfig()
  rollout: RolloutConfig = RolloutConfig()
  sft: SFTConfig = SFTConfig()
  rm: RMConfig = RMConfig()
  ppo: PPOConfig = PPOConfig()
  grpo: GRPOConfig = GRPOConfig()
  dpo: DPOConfig = DPOConfig()
  kto: KTOConfig = KTOConfig()
  data: DataConfig = DataConfig()
  checkpoint: CheckpointConfig = CheckpointConfig()
  logging: LoggingConfig = LoggingConfig()
  kernels: KernelsConfig = KernelsConfig()
  plan: PlanConfig = PlanConfig()
  pools: PoolsConfig = PoolsConfig()

  def role_model(self, role: str) -> ModelConfig:
    """The model config of a role: policy, reference, reward, value or guard."""
    if role in ("policy", "reference"):
      return self.model
    other = {"reward": self.reward_model, "value": self.value_model,
             "guard": self.guard_model}.get(role, "missing")
    if other == "missing":
      raise ConfigError(f"unknown role {role!r}; valid: policy, reference, reward, value, guard")
    return other if other is not None else self.model


# ------------------------------------------------------------------------------ validation


def validate(cfg: "ExperimentConfig", required: bool = True) -> "ExperimentConfig":
  """Raises ConfigError for values no run can use, naming the field and the fix; returns
  ``cfg``.  Checked before any work, so a bad setting of a late stage (PPO after SFT and the
  reward model) stops the run at once instead of after the earlier stages have trained.  Checks
  that need the data or the mesh stay with the code that has them.  ``required=False`` skips
  :attr:`ExperimentConfig.required` (to print a template's config)."""
  problems, missing = [], []
  for field in cfg.required if required else ():
    value = cfg
    for part in field.split("."):
      value = getattr(value, part, None)
    if value in (None, "", ()):
      missing.append(field)
  if missing:
    problems.append("this experiment is a template for your model and data; set "
                    + " ".join(f"--set={f}=..." for f in missing)
                    + f" ({', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set)")

  c = _Checks()
  c.problems = problems
  for role, m in (("model", cfg.model), ("reward_model", cfg.reward_model),
                  ("value_model", cfg.value_model), ("guard_model", cfg.guard_model)):
    if m is None:
      continue
    c.at_least(m, role, ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads",
                         "head_dim", "mlp_dim", "max_seq_len"), 1)
    if m.n_heads >= 1 and m.n_kv_heads >= 1 and m.n_heads % m.n_kv_heads:
      problems.append(f"{role}.n_heads={m.n_heads} is not a multiple of {role}.n_kv_heads="
                      f"{m.n_kv_heads}: each key/value head serves a whole group of query heads; "
                      f"pick n_kv_heads dividing n_heads")
  c.at_least(cfg.data, "data", ("max_prompt_len", "max_response_len", "eval_size"), 1)
  _validate_data(cfg, problems)
  for name in cfg.stages:
    getattr(cfg, name).check(name, cfg, c)
  problems += sink_problems(cfg.logging.sinks)
  problems = list(dict.fromkeys(problems))  # rollout checks repeat for PPO and GRPO
  if problems:
    raise ConfigError(f"{cfg.name}: " + "; ".join(problems))
  return cfg


def sink_problems(sinks) -> list[str]:
  """What stops ``logging.sinks`` from working here: an unknown sink, or one whose package is
  not installed (checked without importing it, before any work)."""
  problems = []
  valid = typing.get_args(Sink)
  for name in sinks:
    if name not in valid:
      problems.append(f"logging.sinks: unknown sink {name!r}; choose from {', '.join(valid)}")
    elif name in SINK_PACKAGES and importlib.util.find_spec(SINK_PACKAGES[name][0]) is None:
      module, extra = SINK_PACKAGES[name]
      problems.append(f"logging.sinks has {name!r} but the {module} package is not installed: "
                      f"pip install -e '.[{extra}]' (or drop {name} from logging.sinks)")
  return problems


# The kind of held-out data each stage evaluates on: greedy answers on prompts with an
# "answer" (exact match), or preference pairs (pair accuracy).
EVAL_KIND = {"sft": "prompts", "rm": "pairs", "ppo": "prompts", "grpo": "prompts",
             "dpo": "pairs", "kto": "pairs"}


def _validate_data(cfg: "ExperimentConfig", problems: list) -> None:
  d = cfg.data
  targets = []
  for item in d.fields:
    src, sep, dst = item.partition(":")
    if not sep or not src.strip() or not dst.strip() or ":" in dst:
      problems.append(f"data.fields: {item!r} is not SOURCE:TARGET; write e.g. "
                      f"data.fields=question:prompt,solution:answer")
    else:
      targets.append(dst.strip())
  for dup in sorted({t for t in targets if targets.count(t) > 1}):
    problems.append(f"data.fields: two columns are renamed to {dup!r}; keep one")
  if not (math.isfinite(d.eval_split) and 0.0 <= d.eval_split < 1.0):
    problems.append(f"data.eval_split={d.eval_split!r}: must be in [0, 1) (e.g. 0.05 holds out "
                    f"5% of each training file; 0 turns it off)")
  kinds = sorted({EVAL_KIND[s] for s in cfg.stages})
  if d.task == "jsonl" and d.eval_path and len(kinds) > 1:
    problems.append(f"data.eval_path={d.eval_path!r} serves every stage, but the stages "
                    f"({', '.join(cfg.stages)}) read different kinds of data ({', '.join(kinds)}); "
                    f"give each its own: " + " ".join(f"--set=data.{k}_eval_path=FILE"
                                                      for k in kinds)
                    + " (or --set=data.eval_split=0.05 to hold out part of each training file)")


# ------------------------------------------------------------------------------- overrides


def _type_name(tp) -> str:
  origin = typing.get_origin(tp)
  if origin is Literal:
    return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
  if origin is tuple:
    return "comma-separated " + _type_name(typing.get_args(tp)[0]) + "s"
  return getattr(tp, "__name__", str(tp))


def _parse_value(text: str, tp, where: str):
  """Parses ``text`` as type ``tp``; raises ConfigError naming ``where`` on failure."""
  origin = typing.get_origin(tp)
  args = typing.get_args(tp)
  if origin is typing.Union:  # Optional[X]
    if text.strip().lower() in ("none", "null", ""):
      return None
    inner = [a for a in args if a is not type(None)][0]
    return _parse_value(text, inner, where)
  if origin is Literal:
    for choice in args:
      if str(choice) == text:
        return choice
    raise ConfigError(f"{where}: {text!r} is not valid; choose {_type_name(tp)}")
  if origin is tuple:
    item = args[0]
    # Accept `a,b`, `(a,b)` and `["a", "b"]`: the brackets and quotes people type from habit.
    body = text.strip()
    if body[:1] + body[-1:] in ("()", "[]"):
      body = body[1:-1]
    parts = [p.strip().strip("'\"") for p in body.split(",") if p.strip() != ""]
    return tuple(_parse_value(p, item, where) for p in parts)
  if tp is bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
      return True
    if low in ("0", "false", "no", "off"):
      return False
    raise ConfigError(f"{where}: {text!r} is not a bool; use true or false")
  if tp is int:
    try:
      return int(text)
    except ValueError:
      try:
        as_float = float(text)
      except ValueError:
        as_float = None
      if as_float is not None and as_float.is_integer():
        return int(as_float)
      raise ConfigError(f"{where}: {text!r} is not an int") from None
  if tp is float:
    try:
      return float(text)
    except ValueError:
      raise ConfigError(f"{where}: {text!r} is not a float") from None
  if tp is str:
    return text
  raise ConfigError(f"{where}: fields of type {tp} cannot be set from the command line")


def _hints(cls):
  return typing.get_type_hints(cls)


def _dataclass_of(tp):
  """The dataclass inside ``tp`` (unwrapping Optional), or None."""
  if typing.get_origin(tp) is typing.Union:
    inner = [a for a in typing.get_args(tp) if a is not type(None)]
    tp = inner[0] if len(inner) == 1 else None
  return tp if dataclasses.is_dataclass(tp) else None


def set_field(cfg, dotted: str, text: str, _prefix: str = ""):
  """Returns a copy of ``cfg`` with the field at ``dotted`` parsed from ``text``."""
  head, _, rest = dotted.partition(".")
  hints = _hints(type(cfg))
  where = _prefix + head
  if head not in hints:
    valid = ", ".join(f.name for f in dataclasses.fields(cfg))
    raise ConfigError(f"unknown config field {where!r}; valid fields here: {valid}")
  tp = hints[head]
  if rest:
    sub_cls = _dataclass_of(tp)
    if sub_cls is None:
      raise ConfigError(f"{where!r} is a {_type_name(tp)}, not a section; "
                        f"use --set={where}=VALUE")
    current = getattr(cfg, head)
    if current is None:
      # An unset optional model section starts from the main model's shape.
      current = cfg.model if sub_cls is ModelConfig and hasattr(cfg, "model") else sub_cls()
    new_sub = set_field(current, rest, text, where + ".")
    return dataclasses.replace(cfg, **{head: new_sub})
  if _dataclass_of(tp) is not None:
    raise ConfigError(f"{where!r} is a section; set one of its fields, e.g. "
                      f"--set={where}.{dataclasses.fields(_dataclass_of(tp))[0].name}=VALUE")
  return dataclasses.replace(cfg, **{head: _parse_value(text, tp, where)})


def apply_overrides(cfg, overrides) -> ExperimentConfig:
  """Applies ``["a.b=1", ...]`` overrides in order."""
  for item in overrides:
    if "=" not in item:
      raise ConfigError(f"--set={item!r} needs the form FIELD=VALUE, e.g. --set=ppo.kl.coef=0.05")
    key, _, value = item.partition("=")
    cfg = set_field(cfg, key.strip(), value.strip())
  return cfg


def to_dict(cfg) -> dict:
  return dataclasses.asdict(cfg)


def to_json(cfg) -> str:
  return json.dumps(to_dict(cfg), indent=2, sort_keys=True)


def from_dict(cls, data: dict):
  """Inverse of :func:`to_dict` (used to read a saved config back)."""
  hints = _hints(cls)
  kwargs = {}
  for f in dataclasses.fields(cls):
    if f.name not in data:
      continue
    value = data[f.name]
    sub = _dataclass_of(hints[f.name])
    if sub is not None and value is not None:
      value = from_dict(sub, value)
    elif typing.get_origin(hints[f.name]) is tuple and value is not None:
      value = tuple(value)
    kwargs[f.name] = value
  return cls(**kwargs)


def diff(a, b, prefix: str = "") -> list[tuple[str, object, object]]:
  """Fields that differ between two configs of the same class, as (dotted, a, b)."""
  out = []
  for f in dataclasses.fields(a):
    va, vb = getattr(a, f.name), getattr(b, f.name)
    if dataclasses.is_dataclass(va) and dataclasses.is_dataclass(vb):
      out.extend(diff(va, vb, prefix + f.name + "."))
    elif va != vb:
      out.append((prefix + f.name, va, vb))
  return out


def _from_json(tp, value, where: str, path: str):
  """``value`` (parsed JSON) as type ``tp``, checked; errors name the file and dotted key."""
  def bad(expected):
    raise ConfigError(f"{path}: {where} is {json.dumps(value)[:60]}, not {expected}; fix the "
                      f"file (python -m jaxrlhf.main --print_config writes a valid one)")
  origin, args = typing.get_origin(tp), typing.get_args(tp)
  if origin is typing.Union:  # Optional[X]
    if value is None:
      return None
    return _from_json([a for a in args if a is not type(None)][0], value, where, path)
  cls = _dataclass_of(tp)
  if cls is not None:
    if not isinstance(value, dict):
      bad("a JSON object (a config section)")
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in value if k not in hints]
    if unknown:
      raise ConfigError(f"{path}: unknown config field {where + '.' if where else ''}"
                        f"{unknown[0]}; valid fields here: {', '.join(names)}")
    return cls(**{k: _from_json(hints[k], v, f"{where}.{k}" if where else k, path)
                  for k, v in value.items()})
  if origin is Literal:
    if value not in args:
      bad(_type_name(tp))
    return value
  if origin is tuple:
    if not isinstance(value, list):
      bad(_type_name(tp) + " (a JSON list)")
    return tuple(_from_json(args[0], v, f"{where}[{i}]", path) for i, v in enumerate(value))
  if tp is bool:
    if not isinstance(value, bool):
      bad("true or false")
    return value
  if tp is int:
    if isinstance(value, bool) or not (isinstance(value, int) or
                                       (isinstance(value, float) and value.is_integer())):
      bad("an int")
    return int(value)
  if tp is float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      bad("a number")
    return float(value)
  if tp is str:
    if not isinstance(value, str):
      bad("a string")
    return value
  bad(_type_name(tp))


def load_config_file(path: str) -> ExperimentConfig:
  """``--config=run.json``: a config written by ``--print_config`` (or saved with a run) read
  back and checked field by field; missing fields keep their defaults."""
  try:
    with open(path) as f:
      text = f.read()
  except OSError as e:
    raise ConfigError(f"--config={path}: cannot be read ({e.strerror}); give the path of a JSON "
                      f"file written by --print_config") from None
  try:
    data = json.loads(text)
  except json.JSONDecodeError as e:
    raise ConfigError(f"--config={path}:{e.lineno}: not valid JSON ({e.msg}); write the file "
                      f"with python -m jaxrlhf.main --experiment=NAME --print_config > {path}") from None
  return _from_json(ExperimentConfig, data, "", path)
