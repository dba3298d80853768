"""The sampler's log-probs against the trainer's on the real model (docs/rollout.md).

    python -m benchmarks.logprob_parity [--dtype=bfloat16] [--prompts=4] [--samples=2]

SmolLM2-135M-Instruct (``jaxrlhf prepare-model smollm2-135m-instruct``) samples ``--samples``
responses of 48 tokens to each of the first ``--prompts`` GSM8K questions at temperature 1
(``generate``); the trainer's teacher-forced ``token_logprobs`` then scores the same sequences.
Printed for each ``model.residual_dtype``: the mean and largest |difference| per response token
(what ``rollout/logprob_mismatch`` reports), the trainer against itself on half the rows and
with 16 padding columns, and the time of a bf16 train step (the gradient of the log-probs over
8 x 160 tokens) and of the generation, min of 3, measured in this one process.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
  ap.add_argument("--prompts", type=int, default=4)
  ap.add_argument("--samples", type=int, default=2)
  ap.add_argument("--new-tokens", type=int, default=48)
  args = ap.parse_args(argv)

  from experiments.smol import _model_dir, _shared
  from jaxrlhf.config import KernelsConfig, MeshConfig, RolloutConfig
  from jaxrlhf.data.tokenizers import HFTokenizer
  from jaxrlhf.mesh import make_mesh
  from jaxrlhf.model import hf
  from jaxrlhf.model.scoring import token_logprobs
  from jaxrlhf.rollout import generate

  folder = _model_dir()
  if not folder:
    sys.exit("benchmarks.logprob_parity: prepare the model first: jaxrlhf prepare-model "
             "smollm2-135m-instruct")
  data = _shared("gsm8k", "train.jsonl")
  try:
    with open(data, encoding="utf-8") as f:
      questions = [json.loads(line)["question"] for _, line in zip(range(args.prompts), f)]
  except OSError:
    sys.exit(f"benchmarks.logprob_parity: no GSM8K at {data!r}: put gsm8k/train.jsonl in "
             f"../shared/data beside this checkout")
  base = hf.config_from_hf(folder)
  params = hf.load_hf(folder, dataclasses.replace(base, compute_dtype=args.dtype),
                      make_mesh(MeshConfig(), jax.devices()[:1]))
  tok = HFTokenizer(folder)
  enc = [tok.encode(q)[:64] for q in questions]
  p = max(map(len, enc))
  toks = np.full((len(enc), p), tok.pad_id, np.int32)
  mask = np.zeros((len(enc), p), bool)
  for i, e in enumerate(enc):  # left-padded, as the trainer batches prompts
    toks[i, p - len(e):], mask[i, p - len(e):] = e, True
  toks, mask = jnp.asarray(toks), jnp.asarray(mask)
  kernels = KernelsConfig()
  rollout = RolloutConfig(max_new_tokens=args.new_tokens, temperature=1.0)
  rng = np.random.default_rng(0)
  step_toks = jnp.asarray(rng.integers(0, base.vocab_size, (8, 160)), jnp.int32)
  step_mask = jnp.ones((8, 160), bool)

  def best(fn, *a):
    times = []
    for _ in range(3):
      t = time.perf_counter()
      jax.block_until_ready(fn(*a))
      times.append(time.perf_counter() - t)
    return min(times)

  print(f"SmolLM2-135M-Instruct, {args.dtype} compute, {len(enc)} GSM8K prompts x "
        f"{args.samples} samples x {args.new_tokens} tokens")
  for residual in ("float32", "compute"):
    cfg = dataclasses.replace(base, compute_dtype=args.dtype, residual_dtype=residual)
    gen = jax.jit(functools.partial(generate, cfg=cfg, rollout=rollout, eos_id=-1,
                                    num_samples=args.samples, kernels=kernels))
    score = jax.jit(lambda w, t, m, cfg=cfg: token_logprobs(w, t, m, cfg=cfg, start=p,
                                                            kernels=kernels)[0])
    r = gen(params, toks, mask, jax.random.key(1))
    want = np.asarray(score(params, r.tokens_BT, r.mask_BT))
    rm = np.asarray(r.response_mask_BN)
    gap = np.abs(np.asarray(r.behaviour_logp_BN) - want)[rm]
    half = r.tokens_BT.shape[0] // 2
    rows = np.abs(np.asarray(score(params, r.tokens_BT[:half], r.mask_BT[:half])) - want[:half])
    pad = lambda x: jnp.pad(x, ((0, 0), (0, 16)))
    cols = np.abs(np.asarray(score(params, pad(r.tokens_BT), pad(r.mask_BT)))[:, :args.new_tokens]
                  - want)
    loss = lambda w, cfg=cfg: token_logprobs(w, step_toks, step_mask, cfg=cfg, start=32,
                                             kernels=kernels)[0].sum()
    grad = jax.jit(jax.grad(loss))
    jax.block_until_ready(grad(params))
    t_step = best(grad, params)
    t_gen = best(lambda: gen(params, toks, mask, jax.random.key(2)).tokens)
    print(f"  residual_dtype={residual:8s} sampler vs trainer: mean {gap.mean():.3g}, max "
          f"{gap.max():.3g} ({gap.size} tokens); trainer vs itself: {half} rows "
          f"{rows[rm[:half]].mean():.3g}, +16 columns {cols[rm].mean():.3g}; train step "
          f"{t_step:.2f} s, generation {t_gen:.2f} s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
