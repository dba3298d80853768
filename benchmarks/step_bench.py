"""Step benchmark: seconds per step of every algorithm at the tiny CPU config, and the same RL
step run as separately-jitted phases with host round trips, in the same run.

Prints figures (and writes JSON with ``--out``); it is not a timed test.  For PPO and GRPO the
one-program step (the default) is compared with the phased step (``logging.phase_timing``:
generate, reference, reward, values and update as five programs, each waited for), their
steps alternating so that both see the same load on shared cores, and the ratio phased /
one-program is printed: above 1 means the single program is faster.

    python benchmarks/step_bench.py                  # all five algorithms, 10 steps each
    python benchmarks/step_bench.py --algos=ppo,grpo --steps=20 --out=steps.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import jax

from jaxrlhf import registry
from jaxrlhf.data import DataSource
from jaxrlhf.mesh import make_mesh
from jaxrlhf.train.common import metrics_to_host, put_batch
from jaxrlhf.train.spec import build_stage


class Timed:
  """One algorithm's stage, state and step function, stepped and timed one step at a time (so
  two modes can alternate and see the same load on shared cores)."""

  def __init__(self, cfg, name: str):
    self.mesh = make_mesh(cfg.mesh)
    self.stage = build_stage(name, cfg, self.mesh, DataSource(cfg.data, cfg.seed))
    self.state, self.frozen = self.stage.init(jax.random.key(0), {})
    self.fn, self.step, self.first = None, 0, None
    self.times, self.tokens = [], []

  def run(self):
    batch = put_batch(self.mesh, self.stage.batch(self.step))
    with jax.set_mesh(self.mesh):
      t0 = time.perf_counter()
      self.fn = self.fn or self.stage.make_step_fn(self.state, self.frozen, batch)
      self.state, metrics = self.fn(self.state, self.frozen, batch)
      metrics = metrics_to_host(metrics)
      dt = time.perf_counter() - t0
    if self.step == 0:
      self.first = dt
    else:
      self.times.append(dt)
      self.tokens.append(metrics.get("rollout/tokens", 0.0))
    self.step += 1

  def result(self) -> dict:
    """Steady seconds per step (median after the first, compiling, step) and tokens/s."""
    med = statistics.median(self.times)
    out = {"first_step_s": self.first, "median_step_s": med, "min_step_s": min(self.times),
           "max_step_s": max(self.times)}
    if any(self.tokens):
      out["generated_tokens_per_s"] = statistics.median(self.tokens) / med
    return out


def time_modes(cfgs: dict, name: str, steps: int) -> dict:
  """``mode -> figures`` for the configs in ``cfgs``, their steps alternating."""
  runs = {mode: Timed(cfg, name) for mode, cfg in cfgs.items()}
  for _ in range(steps + 1):
    for r in runs.values():
      r.run()
  return {mode: r.result() for mode, r in runs.items()}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--experiment", default="tiny_ppo")
  parser.add_argument("--algos", default="sft,rm,dpo,ppo,grpo")
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--out", default="")
  args = parser.parse_args()
  base = registry.get(args.experiment)
  results = {}
  print(f"{'algorithm':10s} {'mode':12s} {'first (s)':>10s} {'median (s)':>11s} "
        f"{'min':>7s} {'max':>7s} {'gen tok/s':>10s}")
  for name in args.algos.split(","):
    modes = [("one-program", False)] + ([("phased", True)] if name in ("ppo", "grpo") else [])
    cfgs = {mode: dataclasses.replace(base, logging=dataclasses.replace(base.logging,
                                                                        phase_timing=phased))
            for mode, phased in modes}
    for mode, r in time_modes(cfgs, name, args.steps).items():
      results[f"{name}/{mode}"] = r
      print(f"{name:10s} {mode:12s} {r['first_step_s']:10.2f} {r['median_step_s']:11.4f} "
            f"{r['min_step_s']:7.4f} {r['max_step_s']:7.4f} "
            f"{r.get('generated_tokens_per_s', float('nan')):10.0f}", flush=True)
    if len(modes) > 1:
      ratio = results[f"{name}/phased"]["median_step_s"] / results[f"{name}/one-program"][
          "median_step_s"]
      results[f"{name}/phased_over_one_program"] = ratio
      print(f"{name:10s} phased / one-program step time: {ratio:.2f}x")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(results, f, indent=2)


if __name__ == "__main__":
  main()
