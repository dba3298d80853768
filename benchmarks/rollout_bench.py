"""Rollout benchmark: prefill and decode throughput of :func:`jaxrlhf.rollout.generate`.

Prints figures (and writes JSON with ``--out``); it is not a timed test.

* Prefill tokens/s (compute-bound) and decode tokens/s (memory-bound) for one model config
  and batch; decode is timed as a whole ``generate`` call minus the prefill-only program.
* ``--recompute`` (default on CPU): the recompute-everything decoder
  (:func:`jaxrlhf.rollout.generate_uncached`) at the same settings in the same run, and the
  cached decoder's speed-up over it.
* ``--bandwidth`` (default on GPU/TPU): decode's achieved memory bandwidth -- bytes per step
  = parameters + the whole KV cache, which every step reads since shapes are static -- against
  the bandwidth of a plain device copy measured in the same run.

    python benchmarks/rollout_bench.py                       # CPU preset
    python benchmarks/rollout_bench.py --preset=gpu-1b --out=rollout.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.config import ModelConfig, RolloutConfig
from jaxrlhf.model import forward, init_cache, init_params, lm_logits, positions_from_mask
from jaxrlhf.rollout import generate, generate_uncached
from kernels._backend import platform_of

# name -> (model, batch, prompt_len, new_tokens)
PRESETS = {
    # Small enough that the recompute-everything baseline finishes in about a minute on 2 cores.
    "cpu": (ModelConfig(vocab_size=512, d_model=128, n_layers=2, n_heads=4, n_kv_heads=4,
                        head_dim=32, mlp_dim=512, max_seq_len=512), 8, 32, 256),
    # Llama-3.2-1B shaped, bf16: decode is clearly memory-bound on one GPU.
    "gpu-1b": (ModelConfig(vocab_size=128256, d_model=2048, n_layers=16, n_heads=32,
                           n_kv_heads=8, head_dim=64, mlp_dim=8192, max_seq_len=4096,
                           tie_embeddings=True, param_dtype="bfloat16",
                           compute_dtype="bfloat16"), 64, 256, 256),
    # Llama-3-8B shaped, bf16.
    "gpu-8b": (ModelConfig(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32,
                           n_kv_heads=8, head_dim=128, mlp_dim=14336, max_seq_len=4096,
                           param_dtype="bfloat16", compute_dtype="bfloat16"), 64, 256, 256),
}


def _time(fn, *args, repeats: int) -> float:
  """Median wall time of ``fn(*args)`` in seconds, after one compiling call."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def _nbytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def copy_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
  """Bytes/s of an on-device elementwise copy (``nbytes`` read + ``nbytes`` written)."""
  x = jnp.zeros((nbytes // 4,), jnp.float32)
  # "+ 1" so XLA cannot alias the output to the input and skip the copy.
  t = _time(jax.jit(lambda a: a + 1.0), x, repeats=repeats)
  return 2 * nbytes / t


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  backend = platform_of(jax.devices()[0])  # the device the benchmark runs on
  parser.add_argument("--preset", choices=sorted(PRESETS),
                      default="cpu" if backend == "cpu" else "gpu-1b")
  parser.add_argument("--batch", type=int, help="prompts (default: the preset's)")
  parser.add_argument("--prompt_len", type=int)
  parser.add_argument("--new_tokens", type=int)
  parser.add_argument("--num_samples", type=int, default=1)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--recompute", choices=("auto", "on", "off"), default="auto",
                      help="time the recompute-everything decoder too (auto: on CPU only)")
  parser.add_argument("--bandwidth", choices=("auto", "on", "off"), default="auto",
                      help="measure copy bandwidth and decode's share of it (auto: not on CPU)")
  parser.add_argument("--copy_mib", type=int, default=1024)
  parser.add_argument("--out", default="", help="write the figures as JSON here")
  args = parser.parse_args(argv)

  cfg, batch, p, n_new = PRESETS[args.preset]
  batch, p = args.batch or batch, args.prompt_len or p
  n_new = args.new_tokens or n_new
  cfg = dataclasses.replace(cfg, max_seq_len=max(cfg.max_seq_len, p + n_new))
  rows = batch * args.num_samples
  rollout = RolloutConfig(max_new_tokens=n_new, temperature=1.0)
  params = jax.jit(lambda k: init_params(cfg, k))(jax.random.key(0))
  # Left-padded prompts of varying length; eos_id=-1 so every row decodes all n_new tokens.
  lens = np.random.default_rng(0).integers(p // 2, p + 1, size=batch)
  mask = jnp.asarray(np.arange(p)[None] >= (p - lens)[:, None])
  tokens = jnp.where(mask, jax.random.randint(jax.random.key(1), (batch, p), 1, cfg.vocab_size),
                     0)
  key = jax.random.key(2)
  gen_kw = dict(cfg=cfg, rollout=rollout, eos_id=-1, num_samples=args.num_samples)

  @jax.jit
  def prefill(params, tokens, mask):
    h, cache = forward(params, tokens, positions_from_mask(mask), mask, cfg=cfg,
                       cache=init_cache(cfg, batch, p))
    return lm_logits(params, h[:, -1:], cfg), cache

  t_prefill = _time(prefill, params, tokens, mask, repeats=args.repeats)
  t_gen = _time(lambda *a: generate(*a, **gen_kw), params, tokens, mask, key,
                repeats=args.repeats)
  steps = n_new - 1  # decode forwards; token 0 comes from the prefill logits
  # Decode time is generate's less the prefill's, timed apart: on a contended machine the
  # prefill's timing can reach generate's, and the difference is noise, not decode (the
  # GPU script's smoke mode read 2.8e6 of the copy bandwidth that way).  Below a tenth of
  # generate's time it is reported as unmeasured (None) rather than as a figure.
  t_decode = t_gen - t_prefill if t_gen - t_prefill > 0.1 * t_gen else None
  res = {
      "backend": backend, "device": jax.devices()[0].device_kind, "preset": args.preset,
      "model": dataclasses.asdict(cfg), "batch": batch, "num_samples": args.num_samples,
      "prompt_len": p, "new_tokens": n_new,
      "prefill_s": t_prefill, "prefill_tokens_per_s": batch * p / t_prefill,
      "generate_s": t_gen, "generate_tokens_per_s": rows * n_new / t_gen,
      "decode_step_ms": t_decode and 1e3 * t_decode / steps,
      "decode_tokens_per_s": t_decode and rows * steps / t_decode,
  }

  if args.recompute == "on" or (args.recompute == "auto" and backend == "cpu"):
    t_unc = _time(lambda *a: generate_uncached(*a, **gen_kw), params, tokens, mask, key,
                  repeats=1)
    res.update(recompute_s=t_unc, recompute_tokens_per_s=rows * n_new / t_unc,
               cached_speedup=t_unc / t_gen)

  if args.bandwidth == "on" or (args.bandwidth == "auto" and backend != "cpu"):
    param_bytes = _nbytes(params)
    itemsize = jnp.dtype(cfg.compute_dtype).itemsize
    kv_bytes = 2 * cfg.n_layers * rows * (p + n_new - 1) * cfg.n_kv_heads * cfg.head_dim * itemsize
    copy_bw = copy_bandwidth(args.copy_mib << 20)
    achieved = t_decode and (param_bytes + kv_bytes) / (t_decode / steps)
    res.update(param_bytes=param_bytes, kv_cache_bytes=kv_bytes,
               bytes_per_decode_step=param_bytes + kv_bytes, copy_bandwidth_GBps=copy_bw / 1e9,
               decode_bandwidth_GBps=achieved and achieved / 1e9,
               decode_bandwidth_fraction=achieved and achieved / copy_bw)

  width = max(len(k) for k in res)
  for k, v in res.items():
    if k != "model":
      print(f"{k:<{width}}  {v:.4g}" if isinstance(v, float) else f"{k:<{width}}  {v}")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(res, f, indent=2)
    print(f"wrote {args.out}")
  return res


if __name__ == "__main__":
  main()
