"""Pinned behaviour: short fixed-seed runs of every algorithm and step variant, whose metrics are
committed in ``tests/assets/golden_metrics.json`` and compared value for value by
``tests/test_golden.py``.

A refactor of the training layer must leave every figure here unchanged.  Regenerate the file
only on purpose (a deliberate change of behaviour, named in the commit with what it moves):

    python tests/golden.py --write            # all cases, rewrites the file
    python tests/golden.py --check --exact    # compares bit for bit (same machine as --write)

The cases go through the public entry (``pipeline.run`` on a config, reading back
``metrics.jsonl``) and, for the disaggregated pools, ``run_actor`` / ``run_critic`` over a
loopback redis-server; timing, memory and utilisation fields are left out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ASSET = os.path.join(HERE, "assets", "golden_metrics.json")

if __name__ == "__main__":
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  sys.path.insert(0, HERE)
  sys.path.insert(0, os.path.dirname(HERE))

from jaxrlhf import rewards as RW  # noqa: E402
from jaxrlhf.config import (CheckpointConfig, DPOConfig, KLConfig, LoggingConfig,  # noqa: E402
                            MeshConfig, RewardConfig)


# Fields that measure the machine rather than the computation.
VOLATILE = ("time/", "memory/", "perf/", "throughput/")


def _base(**changes):
  from test_train import config
  cfg = config(seed=3)
  cfg = dataclasses.replace(
      cfg, mesh=MeshConfig(dp=-1, fsdp=1, tp=2),
      checkpoint=CheckpointConfig(enabled=False),
      logging=LoggingConfig(console=False, sinks=("jsonl",)))
  return dataclasses.replace(cfg, **changes)


def _rl(cfg, name, **changes):
  return dataclasses.replace(cfg, **{name: dataclasses.replace(getattr(cfg, name), **changes)})


@RW.register_host_reward("golden_digits", needs_answer=False)
def _golden_digits(responses, answers):
  """A host reward for the split-step case: the fraction of digit characters."""
  del answers
  return [sum(c.isdigit() for c in r) / max(len(r), 1) for r in responses]


def cases() -> dict:
  """name -> ExperimentConfig (or ("pools", config)); each runs in seconds on a CPU."""
  b = _base()
  out = {}
  # SFT -> RM -> PPO, the default pipeline's shape: model + rule reward, two minibatches, two
  # epochs, evaluation every step.
  c = _base(stages=("sft", "rm", "ppo"))
  c = _rl(c, "ppo", steps=3, ppo_epochs=2, num_minibatches=2, eval_every=1)
  c = dataclasses.replace(c, sft=dataclasses.replace(c.sft, steps=3, eval_every=3),
                          rm=dataclasses.replace(c.rm, steps=3, eval_every=3))
  out["sft_rm_ppo"] = c
  # PPO variants: loss-side KL (k3, adaptive), seq-mean aggregation, running normalisation with
  # a clip, missing-EOS mask, the guard, shared backbone; timed phases.
  c = _base(stages=("ppo",))
  c = _rl(c, "ppo", steps=3, shared_backbone=True, loss_agg="seq_mean_token_mean",
          entropy_coef=0.01, dual_clip=3.0,
          kl=KLConfig(coef=0.05, estimator="k3", placement="loss", adaptive=True, target=0.1,
                      horizon=100),
          reward=RewardConfig(sources=("model", "rule:exact_match"), weights=(0.5, 1.0),
                              normalize="running", clip=3.0, missing_eos="mask", guard=True,
                              guard_action="penalty", guard_threshold=0.4))
  c = dataclasses.replace(c, logging=dataclasses.replace(c.logging, phase_timing=True))
  out["ppo_variants_timed"] = c
  # GRPO from SFT (rule reward, k3 in the loss).
  c = _base(stages=("sft", "grpo"))
  c = _rl(c, "grpo", steps=3, eval_every=3)
  c = dataclasses.replace(c, sft=dataclasses.replace(c.sft, steps=2))
  out["sft_grpo"] = c
  # GRPO split around a host reward (two programs), RLOO, KL in the reward, two minibatches.
  c = _base(stages=("grpo",))
  c = _rl(c, "grpo", steps=3, advantage="rloo", num_minibatches=2,
          kl=KLConfig(coef=0.05, placement="reward"),
          reward=RewardConfig(sources=("rule:exact_match", "host:golden_digits"),
                              weights=(1.0, 0.5), normalize="batch"))
  out["grpo_host_reward"] = c
  # GRPO, every phase its own timed program, Dr.GRPO aggregation.
  c = _base(stages=("grpo",))
  c = _rl(c, "grpo", steps=2, advantage="drgrpo", loss_agg="seq_mean_token_sum_norm")
  c = dataclasses.replace(c, logging=dataclasses.replace(c.logging, phase_timing=True))
  out["grpo_timed"] = c
  # DPO: reference in the step (sigmoid) and cached (IPO) from SFT.
  c = _base(stages=("sft", "dpo"))
  c = dataclasses.replace(c, dpo=dataclasses.replace(c.dpo, steps=3, eval_every=3))
  out["sft_dpo"] = c
  c = _base(stages=("dpo",))
  c = dataclasses.replace(c, dpo=DPOConfig(steps=3, batch_size=8, optim=b.dpo.optim,
                                           eval_every=0, loss="ipo", reference="cache"))
  out["dpo_ipo_cache"] = c
  # The disaggregated pools in sync mode.
  from test_pools import pools_config
  out["pools_sync"] = ("pools", dataclasses.replace(pools_config(steps=3, mode="sync"), seed=3))
  # GRPO in the pools: no value model in the critic, a host reward scored there.
  from test_pools import grpo_pools_config
  out["pools_grpo_sync"] = ("pools", dataclasses.replace(grpo_pools_config(steps=3, mode="sync"),
                                                         seed=3))
  return out


def _clean(metrics: dict) -> dict:
  return {k: v for k, v in sorted(metrics.items()) if not k.startswith(VOLATILE)}


def run_case(name: str, cfg, workdir: str) -> list:
  """``[[stage, step, {metric: value}], ...]`` in the order written."""
  if isinstance(cfg, tuple):
    return _run_pools(cfg[1], workdir)
  from jaxrlhf.train import pipeline
  code = pipeline.run(cfg, workdir, resume="none")
  assert code == 0, f"{name}: exit status {code}"
  rows = []
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      r = json.loads(line)
      metrics = {k: v for k, v in r.items() if k not in ("stage", "step", "wall_time")}
      rows.append([r["stage"], r["step"], _clean(metrics)])
  return rows


def _run_pools(cfg, workdir: str) -> list:
  from redis_helpers import RedisServer
  from test_pools import run_pools
  server = RedisServer(workdir).start()
  try:
    _, _, recs, _ = run_pools(cfg, server.url, workdir)
  finally:
    server.stop()
  rows = []
  for pool in ("actor", "critic"):
    for step in sorted(recs[pool].by_step):
      rows.append([pool, step, _clean(recs[pool].by_step[step])])
  return rows


def compare(name: str, got: list, want: list, *, exact: bool) -> list[str]:
  """Differences between two runs of a case, as readable lines (empty when they agree)."""
  problems = []
  if [r[:2] for r in got] != [r[:2] for r in want]:
    return [f"{name}: records {[r[:2] for r in got]} != {[r[:2] for r in want]}"]
  for (stage, step, g), (_, _, w) in zip(got, want):
    if sorted(g) != sorted(w):
      extra, missing = sorted(set(g) - set(w)), sorted(set(w) - set(g))
      problems.append(f"{name} {stage} step {step}: new keys {extra}, missing keys {missing}")
    for k in sorted(set(g) & set(w)):
      a, b = g[k], w[k]
      if exact:
        same = a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b))
      else:
        # Another CPU's codegen rounds differently; a few steps keep the drift tiny.
        same = math.isclose(a, b, rel_tol=2e-3, abs_tol=2e-4) or (
            isinstance(a, float) and math.isnan(a) and math.isnan(b))
      if not same:
        problems.append(f"{name} {stage} step {step} {k}: {a!r} != {b!r}")
  return problems


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--write", action="store_true", help="rewrite the committed file")
  p.add_argument("--check", action="store_true", help="compare with the committed file")
  p.add_argument("--exact", action="store_true", help="with --check: bit for bit")
  p.add_argument("--cases", default="", help="comma-separated subset")
  args = p.parse_args()
  all_cases = cases()
  names = [n for n in args.cases.split(",") if n] or list(all_cases)
  results = {}
  for name in names:
    with tempfile.TemporaryDirectory() as d:
      results[name] = run_case(name, all_cases[name], d)
    print(f"{name}: {len(results[name])} records")
  if args.write:
    old = {}
    if os.path.exists(ASSET) and args.cases:
      with open(ASSET) as f:
        old = json.load(f)
    with open(ASSET, "w") as f:
      json.dump({**old, **results}, f, indent=1, sort_keys=True)
    print(f"wrote {ASSET}")
  if args.check:
    with open(ASSET) as f:
      want = json.load(f)
    problems = [p for n in names for p in compare(n, results[n], want[n], exact=args.exact)]
    print("\n".join(problems) or f"all {len(names)} cases agree"
          + (" bit for bit" if args.exact else ""))
    return 1 if problems else 0
  return 0


if __name__ == "__main__":
  sys.exit(main())
