"""Group-shared prompts against today's per-row cache (issue 42's group workload): prompt 512,
G = 16 samples, response 64, on the suite's 4-layer policy (benchmarks/suite.py).

    python -m benchmarks.prefix_bench [--groups=2] [--repeats=5] [--refill]
    python -m benchmarks.prefix_bench --longtail [--groups=4] [--kv-pages=96]

Each arm generates the same rollouts (no EOS: every response is 64 tokens) with
``rollout.prefix_sharing`` off and on, alternated in one process; the decode time is the whole
generation's minus a prefill-only generation's (``max_new_tokens=1``), medians over the
repeats.  KV memory per group: the cache buffers each arm allocates (the prompt's slots once
per group, or once per sample).  ``--refill``: both arms run the in-flight refill loop
(``generate_refill``, a queue of ``groups`` prompts): dense, its cache of ``P + N - 1`` slots
a row; shared, per-row positions with the prompts in their group slots (docs/rollout.md).

``--longtail``: the responses end as the long-tail workload's do (benchmarks/lengths.py: a
Pareto tail of index 1 from ``N / 16`` tokens, median ``N / 8``, about 6% running to ``N``;
each sample draws its own), both arms in the refill loop, and the shared arm on a pool by
live tokens (``rollout.kv_page_size=16``, ``rollout.kv_pages``): a row's pages come as its
tokens need them and return when it ends.  KV per group is then the prompt plus the pool's
share, against the dense arm's whole buffer."""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from benchmarks.lengths import length_params, pareto_lengths
from jaxrlhf import model as M
from jaxrlhf.config import KernelsConfig, ModelConfig, RolloutConfig
from jaxrlhf.rollout import generate, generate_refill

POLICY = ModelConfig(vocab_size=512, d_model=256, n_layers=4, n_heads=4, n_kv_heads=4,
                     head_dim=64, mlp_dim=1024, max_seq_len=640, tie_embeddings=False)


def slot_bytes(cfg: ModelConfig) -> int:
  """One cache slot's keys and values, every layer, in float32."""
  return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4


def kv_bytes(cfg: ModelConfig, groups: int, n: int, prompt: int, new: int, shared: bool,
             refill: bool = False) -> int:
  """Bytes of the decode cache (keys and values, all layers) of ``groups`` prompts x ``n``
  (the refill loop's shared arm: a page of ``new`` slots a row)."""
  own = new if refill else new - 1
  slots = groups * prompt + groups * n * own if shared else groups * n * (prompt + new - 1)
  return slots * slot_bytes(cfg)


EOS, START = 1, 2  # (--longtail) the length model's EOS, and the token every prompt ends in
PAGE = 16  # (--longtail) the shared arm's page


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--groups", type=int, default=2)
  ap.add_argument("--samples", type=int, default=16)
  ap.add_argument("--prompt", type=int, default=512)
  ap.add_argument("--new", type=int, default=64)
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--refill", action="store_true", help="run the refill loop in both arms")
  ap.add_argument("--longtail", action="store_true",
                  help="long-tailed response lengths; the shared arm on a pool by live tokens")
  ap.add_argument("--kv-pages", type=int, default=0,
                  help="(--longtail) the shared arm's pool, in pages of 16 slots (default: "
                       "one group's worst case, the least the loop takes)")
  a = ap.parse_args(argv)
  refill = a.refill or a.longtail
  cfg = POLICY
  prompts = jax.random.randint(jax.random.key(1), (a.groups, a.prompt), 3, cfg.vocab_size)
  eos, pages = -1, 0
  if a.longtail:
    params, _ = length_params(cfg, jax.random.key(0), eos_id=EOS, max_len=a.new,
                              reserved=(0,),
                              start={START: pareto_lengths(a.new, max(1, a.new // 16))})
    prompts = prompts.at[:, -1].set(START)
    eos, pages = EOS, a.kv_pages or a.samples * -(-a.new // PAGE)
  else:
    params = M.init_params(cfg, jax.random.key(0))
  mask = jnp.ones_like(prompts, bool)

  def rollout(shared: bool, new: int) -> RolloutConfig:
    paged = {"kv_page_size": PAGE, "kv_pages": pages} if shared and a.longtail else {}
    return RolloutConfig(max_new_tokens=new, prefix_sharing=shared, refill=refill, **paged)

  def run(shared: bool, new: int):
    ro = rollout(shared, new)
    t = time.perf_counter()
    if refill:
      out = generate_refill(params, prompts, mask, jax.random.key(2), cfg=cfg, rollout=ro,
                            eos_id=eos, num_samples=a.samples, num_groups=a.groups,
                            kernels=KernelsConfig())
    else:
      out = generate(params, prompts, mask, jax.random.key(2), cfg=cfg, rollout=ro,
                     eos_id=eos, num_samples=a.samples, kernels=KernelsConfig())
    jax.block_until_ready(out)
    return time.perf_counter() - t, out

  arms = {"dense": False, "shared": True}
  outs = {}
  for name, shared in arms.items():  # compile both lengths first
    outs[name] = run(shared, a.new)[1]
    run(shared, 1)
  times = {k: [] for k in arms}
  for _ in range(a.repeats):
    for name, shared in arms.items():
      times[name].append(run(shared, a.new)[0] - run(shared, 1)[0])
  med = {k: statistics.median(v) for k, v in times.items()}
  if a.longtail:
    kv = {"dense": kv_bytes(cfg, a.groups, a.samples, a.prompt, a.new, False, True),
          "shared": (a.groups * a.prompt + pages * PAGE) * slot_bytes(cfg)}
  else:
    kv = {k: kv_bytes(cfg, a.groups, a.samples, a.prompt, a.new, s, refill)
          for k, s in arms.items()}
  rollout_of = lambda out: out[0] if refill else out  # noqa: E731
  # Tokens the decode loop sampled: each response's but its first (the prefill's).
  tokens = {k: int(jnp.sum(rollout_of(o).response_mask_BN)) - a.groups * a.samples
            for k, o in outs.items()}
  same = bool(jnp.all(rollout_of(outs["dense"]).tokens_BT == rollout_of(outs["shared"]).tokens_BT))
  print(f"group workload: {a.groups} prompts of {a.prompt} x {a.samples} samples, "
        f"{'up to ' if a.longtail else ''}{a.new} new tokens, {cfg.n_layers}-layer "
        f"d{cfg.d_model} policy" + (", refill loop" if refill else "")
        + (f", long-tailed lengths (mean {tokens['dense'] / (a.groups * a.samples) + 1:.1f})"
           if a.longtail else ""))
  for k in arms:
    print(f"  {k:<7} decode {med[k]:6.3f} s ({tokens[k] / med[k]:7.0f} tokens/s)   "
          f"KV per group {kv[k] / a.groups / 2**20:6.1f} MiB")
  if a.longtail:
    st = outs["shared"][1].stats
    print(f"  shared pool: {pages} pages of {PAGE} slots, at most {int(st['kv_peak'])} in use, "
          f"{int(st['kv_preempted'])} groups put back; same tokens as dense: {same}")
  print(f"  shared vs dense: decode {med['dense'] / med['shared']:.2f}x faster, "
        f"KV per group {kv['dense'] / kv['shared']:.2f}x smaller")
  return {"decode_s": med, "kv_bytes": kv, "tokens": tokens, "same_tokens": same}


if __name__ == "__main__":
  main()
