"""Group-shared prompts against today's per-row cache (issue 42's group workload): prompt 512,
G = 16 samples, response 64, on the suite's 4-layer policy (benchmarks/suite.py).

    python -m benchmarks.prefix_bench [--groups=2] [--repeats=5] [--refill]

Each arm generates the same rollouts (no EOS: every response is 64 tokens) with
``rollout.prefix_sharing`` off and on, alternated in one process; the decode time is the whole
generation's minus a prefill-only generation's (``max_new_tokens=1``), medians over the
repeats.  KV memory per group: the cache buffers each arm allocates (the prompt's slots once
per group, or once per sample).  ``--refill``: both arms run the in-flight refill loop
(``generate_refill``, a queue of ``groups`` prompts): dense, its cache of ``P + N - 1`` slots
a row; shared, per-row positions with the prompts in their group slots (docs/rollout.md)."""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from jaxrlhf import model as M
from jaxrlhf.config import KernelsConfig, ModelConfig, RolloutConfig
from jaxrlhf.rollout import generate, generate_refill

POLICY = ModelConfig(vocab_size=512, d_model=256, n_layers=4, n_heads=4, n_kv_heads=4,
                     head_dim=64, mlp_dim=1024, max_seq_len=640, tie_embeddings=False)


def kv_bytes(cfg: ModelConfig, groups: int, n: int, prompt: int, new: int, shared: bool,
             refill: bool = False) -> int:
  """Bytes of the decode cache (keys and values, all layers) of ``groups`` prompts x ``n``
  (the refill loop's shared arm: a page of ``new`` slots a row)."""
  per_slot = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4  # float32 k and v
  own = new if refill else new - 1
  slots = groups * prompt + groups * n * own if shared else groups * n * (prompt + new - 1)
  return slots * per_slot


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--groups", type=int, default=2)
  ap.add_argument("--samples", type=int, default=16)
  ap.add_argument("--prompt", type=int, default=512)
  ap.add_argument("--new", type=int, default=64)
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--refill", action="store_true", help="run the refill loop in both arms")
  a = ap.parse_args(argv)
  cfg = POLICY
  params = M.init_params(cfg, jax.random.key(0))
  prompts = jax.random.randint(jax.random.key(1), (a.groups, a.prompt), 3, cfg.vocab_size)
  mask = jnp.ones_like(prompts, bool)

  def run(shared: bool, new: int) -> float:
    ro = RolloutConfig(max_new_tokens=new, prefix_sharing=shared, refill=a.refill)
    t = time.perf_counter()
    if a.refill:
      out = generate_refill(params, prompts, mask, jax.random.key(2), cfg=cfg, rollout=ro,
                            eos_id=-1, num_samples=a.samples, num_groups=a.groups,
                            kernels=KernelsConfig())
    else:
      out = generate(params, prompts, mask, jax.random.key(2), cfg=cfg, rollout=ro, eos_id=-1,
                     num_samples=a.samples, kernels=KernelsConfig())
    jax.block_until_ready(out)
    return time.perf_counter() - t

  arms = {"dense": False, "shared": True}
  for shared in arms.values():  # compile both lengths first
    run(shared, a.new), run(shared, 1)
  times = {k: [] for k in arms}
  for _ in range(a.repeats):
    for name, shared in arms.items():
      times[name].append(run(shared, a.new) - run(shared, 1))
  med = {k: statistics.median(v) for k, v in times.items()}
  kv = {k: kv_bytes(cfg, a.groups, a.samples, a.prompt, a.new, s, a.refill)
        for k, s in arms.items()}
  tokens = a.groups * a.samples * (a.new - 1)
  print(f"group workload: {a.groups} prompts of {a.prompt} x {a.samples} samples, "
        f"{a.new} new tokens, {cfg.n_layers}-layer d{cfg.d_model} policy"
        + (", refill loop" if a.refill else ""))
  for k in arms:
    print(f"  {k:<7} decode {med[k]:6.3f} s ({tokens / med[k]:7.0f} tokens/s)   "
          f"KV per group {kv[k] / a.groups / 2**20:6.1f} MiB")
  print(f"  shared vs dense: decode {med['dense'] / med['shared']:.2f}x faster, "
        f"KV per group {kv['dense'] / kv['shared']:.2f}x smaller")
  return {"decode_s": med, "kv_bytes": kv, "tokens": tokens}


if __name__ == "__main__":
  main()
