"""The frozen, typed sections of a run's configuration other than the stages: the model, mesh,
rollout, optimizer, KL, rewards, data, checkpoints, logging, kernels, planning and pools; and
:class:`ConfigError`, the one error a bad setting raises."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal


class ConfigError(ValueError):
  """A user-facing error: a bad setting, or a user's file or code that cannot be used (the
  message names the field or file and the fix).  ``jaxrlhf.main`` prints it as one ``error:``
  line and exits with status 2; any other exception is a bug and keeps its traceback."""


def one_line(e: BaseException, limit: int = 200) -> str:
  """``Type: message`` of a third-party library's exception on one line, at most ``limit``
  characters of the message (for a ConfigError that wraps it)."""
  text = " ".join(str(e).split())
  return f"{type(e).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A Llama-family decoder (RMSNorm, RoPE, GQA, SwiGLU), with the Qwen3 / Gemma variants
  below (off by default)."""

  # Token ids the model embeds and predicts.  With hf_path: the checkpoint's, padded up to a
  # multiple of mesh.tp (unpadded_vocab_size below).
  vocab_size: int = 512
  # Width of the residual stream (the hidden size).
  d_model: int = 128
  # Decoder layers.
  n_layers: int = 2
  # Attention query heads per layer.
  n_heads: int = 4
  # Key/value heads per layer (grouped-query attention): n_heads must be a multiple of it;
  # equal to n_heads is plain multi-head attention.
  n_kv_heads: int = 4
  # Features per attention head (need not be d_model / n_heads).
  head_dim: int = 32
  # Hidden width of the gated MLP (a checkpoint's intermediate_size).
  mlp_dim: int = 512
  # The longest prompt + generated response a generation may hold (checked before decoding;
  # rotary positions need no table).  With hf_path: the checkpoint's max_position_embeddings.
  max_seq_len: int = 256
  # The base of the rotary embedding's frequencies.
  rope_theta: float = 10000.0
  # Rotary frequency scaling of long-context checkpoints: "none"; "linear" (every frequency
  # divided by rope_factor); "llama3" (Llama 3.1+: wavelengths longer than
  # rope_original_max_len / rope_low_freq_factor divided by rope_factor, those shorter than
  # rope_original_max_len / rope_high_freq_factor kept, a smooth ramp between).
  rope_scaling: Literal["none", "linear", "llama3"] = "none"
  # The factor rope_scaling divides the scaled frequencies by (the context extension).
  rope_factor: float = 1.0
  # llama3 scaling: wavelengths longer than rope_original_max_len / this are fully scaled.
  rope_low_freq_factor: float = 1.0
  # llama3 scaling: wavelengths shorter than rope_original_max_len / this are kept as they are.
  rope_high_freq_factor: float = 4.0
  # llama3 scaling: the context length the model was pretrained at (a checkpoint's
  # original_max_position_embeddings).
  rope_original_max_len: int = 8192
  # Epsilon added to the mean square inside every RMSNorm.
  norm_eps: float = 1e-5
  # The LM head reads the token embedding (transposed) instead of an output matrix of its own.
  tie_embeddings: bool = False
  # Qwen2-style biases on the q/k/v projections.
  qkv_bias: bool = False
  # How the weights are stored for reading: the frozen roles, generation and each stage's
  # result use it; a trained role's own copy follows STAGE.optim.precision (docs/training.md).
  param_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
  # The activations' and matmuls' dtype: each weight is cast to it where it is used (logits and
  # log-probs are float32 whatever it is).
  compute_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
  # The residual stream's and every matmul output's dtype with a 16-bit compute_dtype:
  # "float32" rounds to compute_dtype only where a matmul reads its operands (and the KV
  # cache), so a decode step and the full forward round the same values and the sampler's
  # log-probs match the trainer's bit for bit on CPU (docs/rollout.md); "compute" rounds every
  # activation: half the saved activations and tp all-reduce bytes, what the 70B experiments
  # use, and a ~0.03 sampler/trainer log-prob mismatch per token on a real model.
  residual_dtype: Literal["float32", "compute"] = "float32"
  # What the backward pass keeps: "none" keeps everything, "full" recomputes each layer,
  # "dots" keeps matmul outputs only, "dots_no_batch" keeps weight-only matmuls.
  remat: Literal["none", "full", "dots", "dots_no_batch"] = "none"
  # Run the layers as one lax.scan (one layer compiled: faster compiles); false unrolls them.
  scan_layers: bool = True
  # Standard deviation of the random normal init of the weight matrices (a model that is not
  # loaded from hf_path).
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
  # Architecture variants of other families (Qwen3, Gemma 2 / 3; docs/hf.md).  Every one is
  # off by default, and off it leaves the Llama computation exactly as it is.
  # Qwen3 / Gemma 3: an RMSNorm over head_dim on q and k (one weight, shared by the heads),
  # before the rotary embedding.
  qk_norm: bool = False
  # Gemma: every RMSNorm scales by (norm_offset + w), so a stored weight is a delta from 1.
  norm_offset: float = 0.0
  # Gemma 2 / 3: RMSNorms on the attention and MLP outputs too, before each residual add.
  post_norms: bool = False
  # The gated MLP's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, tanh approximation).
  mlp_activation: Literal["silu", "gelu_tanh"] = "silu"
  # Gemma: token embeddings multiplied by sqrt(d_model) (rounded to the parameter dtype).
  embed_scale: bool = False
  # Attention logits scaled by query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5.  0: off.
  query_pre_attn_scalar: float = 0.0
  # Gemma 2: logits soft-capped as cap * tanh(x / cap), in attention and at the LM head.  0: off.
  attn_softcap: float = 0.0
  # Gemma 2: the LM head's logits soft-capped the same way, with this cap.  0: off.
  final_softcap: float = 0.0
  # Sliding-window attention: a query sees the last sliding_window slots (itself included), on
  # the layers that layer_types marks "sliding" (all layers when layer_types is empty).  0: off.
  sliding_window: int = 0
  # Per layer, "full" or "sliding" attention (Gemma's interleaving).  Empty: every layer alike.
  layer_types: tuple[str, ...] = ()
  # Gemma 3: the rotary base of the sliding layers, which use no rope scaling.  0: rope_theta
  # (and its scaling) on every layer.
  rope_local_theta: float = 0.0

  @property
  def group_size(self) -> int:
    return self.n_heads // self.n_kv_heads

  def num_params(self, head: str = "lm") -> int:
    d, f, v, l = self.d_model, self.mlp_dim, self.vocab_size, self.n_layers
    attn = d * self.head_dim * (self.n_heads * 2 + self.n_kv_heads * 2)
    if self.qkv_bias:
      attn += self.head_dim * (self.n_heads + 2 * self.n_kv_heads)
    if self.qk_norm:
      attn += 2 * self.head_dim
    per_layer = attn + 3 * d * f + (4 if self.post_norms else 2) * d
    total = v * d + l * per_layer + d
    if head == "lm" and not self.tie_embeddings:
      total += d * v
    if head == "scalar":
      total += d + 1
    return total

  def architecture_problems(self, prefix: str = "model") -> list[str]:
    """What is inconsistent among the family fields above, one message per problem."""
    out = []
    if self.layer_types:
      bad = sorted(set(self.layer_types) - {"full", "sliding"})
      if bad:
        out.append(f"{prefix}.layer_types has {bad}: each entry is 'full' or 'sliding'")
      if len(self.layer_types) != self.n_layers:
        out.append(f"{prefix}.layer_types has {len(self.layer_types)} entries for "
                   f"{prefix}.n_layers={self.n_layers}: give one per layer (or none)")
      if "sliding" in self.layer_types and self.sliding_window < 1:
        out.append(f"{prefix}.layer_types has 'sliding' layers but {prefix}.sliding_window="
                   f"{self.sliding_window}: set the window (in tokens)")
    if self.sliding_window < 0:
      out.append(f"{prefix}.sliding_window={self.sliding_window}: must be >= 0 (0 is off)")
    for n in ("query_pre_attn_scalar", "attn_softcap", "final_softcap", "rope_local_theta"):
      v = getattr(self, n)
      if not (math.isfinite(v) and v >= 0):
        out.append(f"{prefix}.{n}={v!r}: must be a number >= 0 (0 is off)")
    return out


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Device mesh ``dp x fsdp x tp``; -1 on one axis means "all remaining devices"."""

  # Data-parallel axis: the batch is split over it; trained weights are replicated on it (frozen
  # roles are sharded over it too).
  dp: int = -1
  # Fully sharded data-parallel axis: the batch is split over it, and the weights and optimizer
  # state are sharded over d_model (ZeRO-3 style).
  fsdp: int = 1
  # Tensor-parallel axis: heads, MLP hidden units and the vocabulary are split over it (Megatron
  # style); keep it within a host.
  tp: int = 1


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
  """Multi-process (multi-host) start-up; used only when asked for (see BUILD.md)."""

  # Join a multi-process run through jax.distributed (also done when coordinator_address is
  # set, or all three JAX_* variables below are); alone, for clusters JAX detects (SLURM, TPU).
  enabled: bool = False
  # host:port of process 0; empty: $JAX_COORDINATOR_ADDRESS, else JAX's own detection.
  coordinator_address: str = ""
  # Processes in the run; 0: $JAX_NUM_PROCESSES, else JAX's own detection.
  num_processes: int = 0
  # This process's id, 0 to num_processes - 1; -1: $JAX_PROCESS_ID, else JAX's own detection.
  process_id: int = -1
  # CPU collectives for multi-process CPU runs (tests, laptops): "gloo" or "none".
  cpu_collectives: Literal["gloo", "none"] = "gloo"


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  """Generation: sampling settings and lengths."""

  # Response slots generated per prompt, by the RL rollouts and the evaluations: a response
  # ends at EOS, a stop id or this many tokens (with env.name: the whole episode's budget).
  max_new_tokens: int = 16
  # Sampling temperature of the rollouts and sampled evaluations; 0: greedy (top_k and top_p
  # ignored).  Evaluations' greedy answers always use 0.
  temperature: float = 1.0
  # Sample among the k most likely tokens only.  0: off.
  top_k: int = 0
  # Nucleus sampling: the smallest set of most likely tokens (after top_k) whose probability
  # reaches top_p.  1.0: off.
  top_p: float = 1.0
  # Extra token ids that end a sequence besides the tokenizer's EOS.
  stop_token_ids: tuple[int, ...] = ()
  # The policy's layout while the RL step generates: "tp" reshards it once per step into
  # tensor-parallel weights, whole on every tp group (one all-gather over fsdp, a copy of
  # params/tp per device that lives only during generation); "train" decodes in the training
  # layout (fsdp shards all-gathered again for every token).  The same with fsdp=1.
  decode_layout: Literal["tp", "train"] = "tp"
  # Per-response sampling keys: token j of response r (r = prompt index x num_samples +
  # sample) draws with fold_in(fold_in(key, r), j), so a response does not depend on the row
  # or loop step it ran in.  Off: every row draws from fold_in(key, step) (the default's draws).
  row_keys: bool = False
  # Group-shared prompts (docs/rollout.md, "Shared prefixes"): the num_samples responses of
  # a prompt read its keys/values from one copy, written once, with their queries batched
  # against it (one prompt read per group and decoded token, not num_samples), and keep only
  # their own response slots apart.  The same tokens; log-probs to float rounding (one
  # softmax over both parts, summed in another order).  Plain generation (RL steps, sampled
  # evaluations), refill (every refill_leftover mode: each group's prompt in its own slot,
  # rewritten when the group is refilled) and multi-turn episodes (an example's first
  # observation once per group; the rows' pages hold the rest).
  prefix_sharing: bool = False
  # Paged KV cache for multi-turn episodes (env.name) and in-flight refill (refill;
  # docs/rollout.md, "Paged KV cache"): 0 keeps one contiguous cache of max_prompt_len +
  # max_new_tokens slots a row, written in lock step (a row idle while others decode leaves
  # holes).  k > 0: pages of k slots from a shared pool, each row writing its own tokens at
  # its own position (no holes, every column of a row its own) and holding only the pages
  # they fill.  Same tokens up to float rounding.
  kv_page_size: int = 0
  # The pool's pages with kv_page_size > 0: 0 holds every row's whole buffer, reserved up
  # front and read as it lies (per-row positions at lock step's memory, no gather); k > 0
  # hands pages out as tokens need them, so k below that bounds the KV memory by the tokens
  # really held.  Episodes (env/kv_fill: real tokens per slot of the pages in use): running
  # out stops the run with an error naming this setting.  Refill (rollout/kv_peak_frac,
  # rollout/kv_waits, rollout/kv_preempted): a row's pages return to the pool when it ends,
  # and a queued prompt starts when kv_admit says the pool has room for it; a smaller pool
  # runs fewer groups at once (the same responses, another batch).  At least one group's
  # worst case (n x (prompt + max_new_tokens)).  With refill_leftover=continue a carried
  # response's pages are taken again at the step's start (continue_kv=recompute; not with
  # keep); a carried group the pool cannot hold then starts later from its prompt.
  kv_pages: int = 0
  # How refill admits a queued prompt into a pool handed out by live tokens (kv_pages > 0;
  # docs/rollout.md, "A refill pool by live tokens"): "live" once the pool holds its prompt
  # and a page for each of its and the running rows; when a running row finds no page, the
  # youngest running group is put back (its pages freed) and restarts from its prompt later,
  # decoding the same tokens again (rollout/kv_preempted).  "worst" once the pool covers its
  # group's worst case (n x (prompt + max_new_tokens)) beside every running row's: nothing is
  # ever put back or decoded twice, but fewer groups run at once.
  kv_admit: Literal["live", "worst"] = "live"
  # In-flight refill (RL steps, docs/rollout.md): the step's rows are batch_size groups of
  # num_samples slots; a group whose rows have all stopped takes the next prompt of the step's
  # queue inside the decode loop, and decoding stops once batch_size groups have completed.
  # The batch is those groups (the first to finish: short responses are favoured; the rest
  # is dropped and counted, docs/training.md).  Always draws with per-response keys.
  refill: bool = False
  # Prompts queued per step with refill, per trained prompt (ceil(batch_size x this)).
  refill_queue: float = 2.0
  # What refill does with the groups started but not trained (still decoding at the stop, or
  # finished past the quota): "drop" them (counted in rollout/dropped; the batch favours
  # short responses), or "carry" their prompts (tokens, answers; kept in the checkpointed
  # state) to the front of the next step's queue, where they restart from scratch under the
  # current policy and are trained first (the next step's loop runs until every carried
  # group has finished).  Every started prompt is then trained within two steps, at the
  # price of the discarded partial decodes (docs/rollout.md, "Carry-over"); or "continue":
  # carry their partial responses too (tokens and the log-probs of the policy that sampled
  # them, in the checkpointed state), which the next step prefills after their prompts under
  # the new weights and decodes on from where they stopped (partial rollouts: no decode is
  # thrown away; a response spans at most two policies, docs/rollout.md, "Partial
  # rollouts").  GRPO with device rewards only (no host: reward sources).
  refill_leftover: Literal["drop", "carry", "continue"] = "drop"
  # With refill_leftover=continue, what the next step does with a carried response's tokens
  # (docs/rollout.md, "Partial rollouts"): "recompute" prefills them again after their
  # prompts under the new weights (the continuation is sampled from the current policy given
  # its context: the sampler's log-probs stay the trainer's); "keep" keeps their keys and
  # values from the step that wrote them (in the checkpointed state, replicated on every
  # device: rows x (max_prompt_len + max_new_tokens) slots of KV) and decodes on with no
  # forward over them: the first tokens after the carry are sampled against the old
  # policy's keys and values, which the per-token off-policy corrections (TIS/MIS) see as
  # any other sampler mismatch.
  continue_kv: Literal["recompute", "keep"] = "recompute"
  # Length buckets for the phases after generation (RL steps, docs/rollout.md): 0 (off) runs
  # the reference, reward, values and update on all max_new_tokens response slots; k > 0 cuts
  # the rollout after the batch's longest response, rounded up to one of k widths
  # (ceil(max_new_tokens / k) x 1..k), each compiled once: the same losses and gradients up
  # to float rounding, cheaper when every response of a step is short (refill's batches).
  length_buckets: int = 0
  # Prompt buckets (RL steps and the evaluations' generation, docs/rollout.md): 0 (off) pads
  # every batch's prompts to data.max_prompt_len; k > 0 pads them to the batch's longest
  # prompt rounded up to one of k widths (ceil(max_prompt_len / k) x 1..k), each compiled
  # once: the same step up to float rounding, and generation, the forwards and the update
  # run on fewer prompt columns when the prompts are short of the limit.
  prompt_buckets: int = 0
  # Packing for the phases after generation (RL steps, docs/rollout.md, "Packed forwards"):
  # the reference, reward, values and the update's forward and backward run on packed rows,
  # each sequence's real tokens placed first-fit into rows of max_prompt_len +
  # max_new_tokens slots (of the length bucket's width with length_buckets), several
  # sequences per row, attention and positions per sequence; every result is gathered back
  # to the rollout's rows, so KL, advantages and losses are unchanged (the same step up to
  # float rounding).  Cheaper when most responses are shorter than the limit.
  pack: bool = False
  # Distinct packed row counts per layout (each compiled once): the rows come in multiples
  # of ceil(sequences / pack_buckets).
  pack_buckets: int = 8


  def refill_pages(self, prompt_len: int, rows: int, n: int) -> tuple[int, int, int]:
    """The refill loop's paged pool when it runs on per-row positions: ``(page_size, pages,
    group_pages)``.  A row's own slots are its prompt (unless shared, prefix_sharing) and
    max_new_tokens, in pages of kv_page_size slots (0: one page of them all); the pool is
    kv_pages pages (0: every row's whole buffer); a group of ``n`` rows (prompts of
    ``prompt_len``) may come to hold ``group_pages`` of them at most."""
    own = self.max_new_tokens + (0 if self.prefix_sharing else prompt_len)
    ps = self.kv_page_size or own
    per_row = -(-own // ps)
    pages = (self.kv_pages if self.kv_page_size else 0) or rows * per_row
    return ps, pages, n * per_row

@dataclasses.dataclass(frozen=True)
class EnvConfig:
  """Multi-turn rollouts against an environment (docs/environments.md): the
  policy's actions alternate with the environment's observations inside one KV cache."""

  # "" (off: one prompt, one response), a built-in ("calculator", "guess"), or the user's class:
  # "path/to/file.py:Class" or "package.module:Class".
  name: str = ""
  # The most actions per episode; the episode ends (truncated) at the limit.
  max_turns: int = 4
  # The most tokens in one action; an action that reaches it ends there (the environment still
  # reads it).
  max_turn_tokens: int = 16
  # Strings that end an action besides EOS (added to the environment's own ``stop_strings``).
  stop_strings: tuple[str, ...] = ()
  # "text": observations are tokenised as they are and appended; "chat": each observation is a
  # message of ``observation_role`` rendered by the tokenizer's chat template (append-only).
  format: Literal["text", "chat"] = "text"
  # The role of each observation's message in format "chat".
  observation_role: str = "user"
  # An episode cut short by max_turns or by the token budget (rollout.max_new_tokens, which
  # holds actions and observations): "truncate" keeps the rewards it earned, "penalize" sets
  # its return to limit_penalty.
  on_limit: Literal["truncate", "penalize"] = "truncate"
  # The return of a cut episode under on_limit="penalize".
  limit_penalty: float = 0.0
  # Host stepping: 0 steps the rows one after another, N in N threads.  A call still running
  # after timeout_s (any worker count) fails its row and is abandoned on a daemon thread,
  # which never keeps the process from exiting.
  workers: int = 0
  # Seconds one reset or step call may run before its row fails (see errors).
  timeout_s: float = 30.0
  # A reset/step that raises or times out: "mask" ends that episode, drops it from the update
  # and counts it (env/errors, env/timeouts); "raise" stops the run.
  errors: Literal["mask", "raise"] = "mask"
  # An episode whose return reaches this counts as solved (evaluation's success rate).
  success_reward: float = 1.0


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """optax AdamW with warm-up + decay, global-norm clipping, gradient accumulation."""

  # The peak learning rate, reached at the end of warm-up.
  lr: float = 1e-3
  # The learning rate after warm-up: "constant" at lr, or a "cosine" or "linear" decay that
  # reaches lr x end_lr_ratio at the stage's last step.  The schedule counts steps: the
  # ppo_epochs x num_minibatches updates of one RL step all run at that step's rate.
  schedule: Literal["constant", "cosine", "linear"] = "cosine"
  # Steps of linear warm-up to lr (see warmup_start).  0: none.
  warmup_steps: int = 10
  # Where warm-up starts: "zero" ramps from 0 at the first update, as optax's linear schedule
  # and transformers' warm-up do (step 1 trains at lr 0; the tiny experiments' documented
  # figures were measured so); "first_step" runs step k at lr * k / warmup_steps, so the first
  # step trains (the templates and the real-model experiments).
  warmup_start: Literal["zero", "first_step"] = "zero"
  # Final learning rate as a fraction of ``lr`` for decaying schedules.
  end_lr_ratio: float = 0.1
  # Adam's decay of the first moment (momentum), in [0, 1).
  b1: float = 0.9
  # Adam's decay of the second moment, in [0, 1).
  b2: float = 0.95
  # Adam's epsilon, added to the root of the second moment.
  eps: float = 1e-8
  # AdamW's decoupled weight decay (scaled by the learning rate), on every trained array.
  weight_decay: float = 0.0
  # Gradients are clipped to this global norm before the update.  0: off.
  grad_clip: float = 1.0
  # Micro-batches per update: the batch (an RL minibatch) is split into this many, their
  # gradients summed in float32, which lowers activation memory; the batch must divide by it.
  grad_accum: int = 1
  # A step whose loss or gradients are not finite is skipped; this many in a row stop the run.
  max_consecutive_skips: int = 5
  # How the trained weights are kept when the model's param_dtype is 16-bit (a float32 model
  # trains in float32 whatever this says; docs/training.md, "Mixed precision"; PRECISIONS):
  # "fp32": float32 master weights and Adam moments in the train state (and checkpoints);
  # the losses read the master (cast to compute_dtype where each weight is used), generation
  # a copy cast to param_dtype once per step; gradients sum in float32.
  # "bf16_sr": the weights stay bfloat16 and each update is rounded stochastically (keyed by
  # the step: deterministic, bit-identical on resume); moments in moment_dtype.
  # "pure_bf16": weights, moments and updates all in param_dtype: an update below ~0.4% of a
  # weight is lost (the behaviour before this setting; warns once).
  precision: Literal["fp32", "bf16_sr", "pure_bf16"] = "fp32"
  # Adam's moments under "fp32" and "bf16_sr": "float32", or "bfloat16" to halve them.
  moment_dtype: Literal["float32", "bfloat16"] = "float32"


# The values of OptimizerConfig.precision.
PRECISIONS = ("fp32", "bf16_sr", "pure_bf16")

# Projections a LoRA adapter may target (``lora.targets``), by their usual short names.
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """Low-rank adapters (docs/lora.md): the stage's trained roles keep their weights
  frozen and train ``W + scale * A @ B`` on the ``targets`` projections, ``scale = alpha /
  rank`` (``alpha / sqrt(rank)`` with ``rslora``).  B starts at zero, so the first step's model
  is the base exactly; the reference is the same base with the adapters off (no second copy).
  ``rank=0``: full fine-tuning."""

  # The adapters' rank.  0: no adapters, the weights themselves train.
  rank: int = 0
  # The numerator of the adapters' scale (alpha / rank; alpha / sqrt(rank) with rslora).
  alpha: float = 16.0
  # The projections that get adapters, among LORA_TARGETS: attention q, k, v, o and the MLP's
  # gate, up, down.
  targets: tuple[str, ...] = LORA_TARGETS
  # Which of the stage's trained roles get adapters (the others train fully); the default,
  # every one: the policy (SFT, DPO, PPO, GRPO), the value model (PPO), the reward model (RM).
  roles: tuple[str, ...] = ("policy", "value", "reward")
  # A's initialisation ("kaiming": PEFT's default, uniform with a = sqrt(5); "gaussian":
  # N(0, 1 / rank)); B is always zero.
  init: Literal["kaiming", "gaussian"] = "kaiming"
  # Rank-stabilised LoRA: the scale is alpha / sqrt(rank) instead of alpha / rank.
  rslora: bool = False
  # Dropout on the adapters' input: only 0 is accepted (it would make one batch's log-probs
  # differ between the rollout, the reference and the update).
  dropout: float = 0.0
  # The frozen base's dtype ("" keeps model.param_dtype; "bfloat16" halves it); the adapters
  # and their optimizer state follow STAGE.optim.precision (float32 under the default "fp32").
  base_dtype: Literal["", "float32", "bfloat16"] = ""
  # A PEFT adapter directory (adapter_config.json + adapter_model.safetensors) to continue
  # from instead of a fresh init; its rank and targets must match the settings above.
  init_from: str = ""

  def scale(self) -> float:
    return self.alpha / (self.rank ** 0.5 if self.rslora else self.rank)


@dataclasses.dataclass(frozen=True)
class KLConfig:
  """KL to the frozen reference.  ``logr = logp_ref - logp`` per token."""

  # The KL coefficient (the starting one with adaptive).  0 with adaptive off: no KL term, and
  # no reference model is loaded.
  coef: float = 0.05
  # The per-token estimate of KL(policy || reference): "k1" -logr (unbiased, can be negative),
  # "k2" logr^2 / 2, "k3" exp(logr) - 1 - logr (unbiased, >= 0).
  estimator: Literal["k1", "k2", "k3"] = "k1"
  # "reward": -coef * kl per token in the reward (PPO).  "loss": coef * mean kl in the loss (GRPO).
  placement: Literal["reward", "loss"] = "reward"
  # Adapt coef after each step towards target (Ziegler et al. 2019; docs/conventions.md).
  adaptive: bool = False
  # adaptive: the KL aimed at, per sequence (summed over its tokens, mean of the batch).
  target: float = 6.0
  # adaptive: how slowly coef moves: each step multiplies it by 1 + e x (sequences in the step) /
  # horizon, e the relative error clipped to [-0.2, 0.2].
  horizon: int = 10000
  # logr is clamped to [-clamp_logr, clamp_logr] before the estimator; the estimate to
  # [-clamp_kl, clamp_kl] after it.
  clamp_logr: float = 20.0
  # The bound of the per-token estimate, after the estimator; a clamp <= 0 is off.
  clamp_kl: float = 10.0


@dataclasses.dataclass(frozen=True)
class RewardConfig:
  """Where rewards come from and how they are normalised."""

  # Weighted sources: "model" (the learned reward model), "rule:NAME" (a jittable rule from
  # jaxrlhf.rewards), "host:NAME" (a host Python function).  Weights align with sources.
  sources: tuple[str, ...] = ("model",)
  # One weight per source, in the same order: the reward is the weighted sum of the sources'
  # scores (a source weighted 0 is off).
  weights: tuple[float, ...] = (1.0,)
  # Reward normalisation before the advantages: "none"; "batch" (z-score over the step's
  # valid rows); "running" (z-score with running statistics kept in the train state).
  normalize: Literal["none", "batch", "running"] = "none"
  # Rewards are clipped to [-clip, clip] after normalisation.  0: off.
  clip: float = 0.0
  # Sequences without EOS within max_new_tokens: "none", "penalty" (add missing_eos_penalty),
  # or "mask" (drop from the update).
  missing_eos: Literal["none", "penalty", "mask"] = "none"
  # Added to the reward of a response without EOS under missing_eos="penalty".
  missing_eos_penalty: float = -1.0
  # Reward-hacking guard: a smaller scalar-head classifier.
  guard: bool = False
  # The guard flags a response whose probability (the sigmoid of its score) is above this, or
  # NaN.
  guard_threshold: float = 0.5
  # A flagged response: "penalty" adds guard_penalty to its reward, "mask" drops it from the
  # update.
  guard_action: Literal["penalty", "mask"] = "penalty"
  # Added to a flagged response's reward under guard_action="penalty".
  guard_penalty: float = -1.0
  # A host reward that raises or returns a non-number for a response: "mask" scores it as
  # unscorable (masked out of the update, counted in reward/host_errors and
  # reward/host_invalid); "raise" stops the run with the function's error.
  host_errors: Literal["mask", "raise"] = "mask"
  # A host reward call still running after this many seconds is abandoned (left on a daemon
  # thread, which never keeps the process from exiting): its responses are masked and counted
  # in reward/host_timeouts, or the run stops under host_errors=raise.  One call scores a
  # whole batch, so allow for the slowest batch (a code-running reward may need minutes).
  # 0: no limit, the function runs on the calling thread (for code that needs the main
  # thread, e.g. one that sets signal.alarm).
  timeout_s: float = 120.0
  # DAPO's overlong shaping: > 0 adds a penalty over the last this many tokens before
  # rollout.max_new_tokens, falling linearly from 0 to -overlong_penalty at the limit; 0: off.
  overlong_buffer: int = 0
  # The overlong penalty at the limit: a response of rollout.max_new_tokens tokens gets
  # -overlong_penalty.
  overlong_penalty: float = 1.0


@dataclasses.dataclass(frozen=True)
class DataConfig:
  # A built-in synthetic task ("addition"; "calculator" and "guess", the data of the built-in
  # environments) or "jsonl" for the user's files below.
  task: str = "addition"
  # The addition task's operand digits, 1 to 6 (the sum is written with one more).
  digits: int = 2
  # Write the sum least-significant digit first ("07+45=" -> "250"): each digit then depends
  # only on two operand digits and the carry already written, which small models learn fast.
  reverse_answer: bool = False
  # Added to the experiment's seed to draw the batches; alone, it picks the examples that
  # data.eval_split holds out.
  seed: int = 0
  # The most examples evaluated per evaluation set.
  eval_size: int = 256
  # Evaluation generates for this many prompts at a time (the last batch padded to it; a set
  # that fits in one batch runs as one batch of its own size), printing progress when there are
  # several batches.
  eval_batch_size: int = 256
  # "char" or "char_tools" (built-ins for synthetic tasks; char_tools adds "<>/") or a local
  # transformers tokenizer directory.
  tokenizer: str = "char"
  # Prompts (PPO, GRPO): rows {"prompt", optional "answer"}, in any data.format.
  prompts_path: str = ""
  # SFT examples: rows {"prompt", "response"} or {"messages": [...]}.
  sft_path: str = ""
  # Preference pairs (RM, DPO, KTO): rows {"prompt", "chosen", "rejected"}.
  pairs_path: str = ""
  # KTO's unpaired examples, JSONL {"prompt", "completion", "label": true|false}; empty: each
  # pair's two sides (chosen desirable, rejected undesirable).
  unpaired_path: str = ""
  # One evaluation file for every stage, used when a kind has no file of its own below;
  # refused when the stages read both kinds (prompts and pairs).
  eval_path: str = ""
  # Prompt slots of a batch, prompts left-padded to it (or to a rollout.prompt_buckets width);
  # a longer prompt follows data.overlong.
  max_prompt_len: int = 16
  # Response slots of the training batches (SFT, RM, DPO, KTO), the end token included, and
  # the longest answer; RL responses are rollout.max_new_tokens long.
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
  # How each row's text is read, after the renames (docs/data.md):
  # "hh": prompts, responses and chosen/rejected written as Anthropic HH-RLHF transcripts
  # ("\n\nHuman: ...\n\nAssistant: ...") are read as chat messages, so whole-conversation pairs
  # share their prompt turns; "": plain text.
  transcripts: Literal["", "hh"] = ""
  # Plain-string prompts and responses as chat: the prompt one user message, each response one
  # assistant message, rendered by data.tokenizer's chat template (an instruct model's format).
  chat: bool = False
  # Each plain prompt written into this text at "{prompt}", e.g. "{prompt}\nPut your final
  # answer within \\boxed{}." (applied before data.chat); empty: the prompt as it is.
  prompt_template: str = ""
  # A regular expression searched in each row's answer (or, without one, its response) whose
  # first group becomes the answer, e.g. GSM8K's "####\s*(\S+)\s*$"; a row it does not match
  # is an error naming the file and line.  Empty: the answer as written.
  answer_pattern: str = ""
  # Evaluation data per kind of file; empty: data.eval_path if set, else split off the training
  # file by data.eval_split, else the first data.eval_size training examples (said on the
  # console: they are not held out).
  # SFT, PPO and GRPO evaluate greedy answers on prompts with an "answer"; RM and DPO
  # evaluate preference pairs.
  prompts_eval_path: str = ""
  # Held-out preference pairs (RM, DPO, KTO), rows as in data.pairs_path.
  pairs_eval_path: str = ""
  # > 0: this fraction of each training file (chosen by data.seed) is held out for evaluation
  # and never trained on (at most data.eval_size examples of it are evaluated).
  eval_split: float = 0.0
  # Packing (the SFT, reward-model and DPO batches; docs/data.md): each step's sequences are
  # placed first-fit into rows of data.pack_length tokens (0: max_prompt_len +
  # max_response_len), several per row, each attending only to itself with its positions
  # restarting; the row count is rounded up to one of data.pack_buckets sizes (one compiled
  # program each).  Off (the default): one left/right-padded row per sequence, as before.
  pack: bool = False
  # Slots of a packed row; 0: max_prompt_len + max_response_len (the shortest allowed).
  pack_length: int = 0
  # Row counts are rounded up to a multiple of ceil(examples / pack_buckets): at most this
  # many compiled step programs.
  pack_buckets: int = 8


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  # Write step checkpoints; false: none at all (stage results are still written).
  enabled: bool = True
  # Save when step % every_steps == 0 (the stage's last step is always saved).  0: off.
  every_steps: int = 50
  # Also save when this many seconds have passed since the last save (process 0's clock
  # decides for every host).  0: off.
  every_seconds: float = 0.0
  # The last this many checkpoints of each stage are kept (at least 1), plus best_metric's best.
  keep: int = 2
  # A metric (e.g. "eval/accuracy") whose best checkpoint is kept besides the last keep;
  # empty: no best-checkpoint tracking.
  best_metric: str = ""
  # Whether the highest ("max") or the lowest ("min") best_metric is best.
  best_mode: Literal["max", "min"] = "max"
  # Write checkpoints on a background thread; the loop waits only for the copy to host.
  async_save: bool = True


Sink = Literal["jsonl", "tensorboard", "wandb", "mlflow"]


# sink -> (the module it needs, the extra that installs it); the others come with jaxrlhf.
SINK_PACKAGES = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
  # Write the metrics every this many steps (and at evaluations and each stage's last step).
  every_steps: int = 1
  # Show each stage's progress line (and samples) on standard output.
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
  # Samples (prompt, response, reward, answer) recorded at each evaluation, and from the RL
  # rollout every ``samples_every`` steps (0: at evaluations only): this many rows each time to
  # WORKDIR/samples.jsonl, the console (the first few, shortened) and the trackers of
  # ``sinks`` (docs/observability.md); 0: no samples.
  samples: int = 8
  # RL stages: steps between the rollout's samples; 0: samples at evaluations only.
  samples_every: int = 0
  # Run the step as separately-timed phases (generation, scoring, update) to see where the
  # time goes; the default one-program step reports total time only.
  phase_timing: bool = False


@dataclasses.dataclass(frozen=True)
class KernelsConfig:
  """Which implementation each hot op uses: "auto" picks by the target platform (Pallas on GPU
  and TPU, XLA on CPU); "pallas_interpret" runs the Pallas kernels in the slow interpreter
  (debugging)."""

  # Log-prob and entropy over the vocabulary: "xla" blockwise, "pallas" fused kernels (Triton
  # on GPU, Mosaic on TPU), "naive" full logits (the reference, for tests and tiny
  # vocabularies).
  logprob: Literal["auto", "xla", "pallas", "pallas_interpret", "naive"] = "auto"
  # Attention: "xla", "pallas" (GPU: our flash and decode kernels; TPU: jax's splash
  # attention, with decode and the cache prefill on XLA), "cudnn" (NVIDIA GPUs, 16-bit
  # compute_dtype; no soft-capping or packed rows).
  attention: Literal["auto", "xla", "pallas", "pallas_interpret", "cudnn"] = "auto"
  # Vocabulary columns per block of the XLA log-prob path (the Pallas kernel has its own).
  logprob_block_v: int = 8192
  # The decode step's layer loop: "unrolled" reads per-layer copies of the weights (cast to
  # compute_dtype once per generation, one more copy of the layers while it runs) and a
  # per-layer KV cache, so no layer's weights or cache are copied out per token (XLA's CPU
  # runtime copies a scanned layer's slice at every step: benchmarks/NOTES.md, change 14);
  # "scanned" scans the stacked weights and cache (XLA:GPU hands a layer's slice to its
  # matmuls as an offset); "auto" unrolled on CPU, scanned elsewhere (and in --plan).
  decode: Literal["auto", "unrolled", "scanned"] = "auto"


@dataclasses.dataclass(frozen=True)
class PlanConfig:
  """Settings for ``--plan``: the cluster a run is sized for."""

  # The accelerator --plan sizes for: "h100", "h200", "b200" or "tpu-v5p" (--accelerator).
  accelerator: str = "h100"
  # The device count --plan sizes for (--devices).
  devices: int = 8
  # Runs a month, for --plan's monthly cost.
  runs_per_month: float = 1.0
  # Which compiler --plan reads memory and collectives from: "target" compiles for the
  # accelerator itself on compile-only devices (XLA:GPU through the CUDA plugin, XLA:TPU
  # through libtpu: pip install -e '.[aot]'); "cpu" on simulated CPU devices; "auto" the
  # target where its plugin is installed, else the CPU.  The plan says which it used.
  compiler: Literal["auto", "target", "cpu"] = "auto"


@dataclasses.dataclass(frozen=True)
class PoolsConfig:
  """Disaggregated RL (``--role=actor|critic|all``, docs/pools.md): an actor pool (generation,
  reference, policy update) and a critic pool (reward, guard, value) exchanging batches
  through Redis streams.  The Redis password comes from ``JAXRLHF_REDIS_PASSWORD`` only, so it
  never lands in a saved config."""

  # "sync": the actor waits for each batch's advantages before generating the next (the
  # colocated step's math); "async": it generates up to max_staleness batches ahead.
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
