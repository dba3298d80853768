"""LoRA against full fine-tuning on the benchmark suite's workloads (benchmarks/suite.py): the
step's device memory from XLA's memory analysis (arguments + temporaries of the compiled
one-program step) and the steady step time, both measured in this one process, full and LoRA
interleaved so load on the machine moves both alike.

    python -m benchmarks.lora_bench                       # ppo, grpo, dpo; rank 8
    python -m benchmarks.lora_bench --workloads=ppo --rank=16 --steps=10

LoRA here: every projection (q, k, v, o, gate, up, down), the settings' default alpha, the
frozen base in the model's float32 (``--base_dtype=bfloat16`` halves it).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from benchmarks import suite


def _with_lora(cfg, name: str, rank: int, base_dtype: str):
  from jaxrlhf.config import LoraConfig
  lora = LoraConfig(rank=rank, base_dtype=base_dtype)
  return dataclasses.replace(cfg, **{name: dataclasses.replace(getattr(cfg, name), lora=lora)})


def measure(name: str, rank: int, steps: int, base_dtype: str = "") -> dict:
  import jax
  from jaxrlhf.train.common import put_batch
  from jaxrlhf.train.preflight import tree_bytes
  out = {}
  runs = {}
  for mode in ("full", "lora"):
    cfg = suite.workload_config(name)
    if mode == "lora":
      cfg = _with_lora(cfg, name, rank, base_dtype)
    cfg, mesh, stage, state, frozen, _ = suite.build(name, cfg=cfg)
    batch = put_batch(mesh, stage.batch(0))
    with jax.set_mesh(mesh):
      compiled = stage.make_step_fn(state, frozen, batch).lower(state, frozen, batch).compile()
    mem = compiled.memory_analysis()
    trained = sum(x.size for x in jax.tree.leaves(state.params))
    out[mode] = {"args_bytes": mem.argument_size_in_bytes, "temp_bytes": mem.temp_size_in_bytes,
                 "state_bytes": tree_bytes(state), "frozen_bytes": tree_bytes(frozen),
                 "trained_params": trained, "times": []}
    runs[mode] = [stage, mesh, None, state, frozen]
  # Warm-up (the first call compiles), then interleaved timed steps.
  for mode in runs:
    stage, mesh, fn, state, frozen = runs[mode]
    fn, state, _ = suite._step(stage, mesh, fn, state, frozen, 0)
    runs[mode][2:4] = [fn, state]
  for step in range(1, steps + 1):
    for mode in runs:
      stage, mesh, fn, state, frozen = runs[mode]
      t = time.perf_counter()
      fn, state, _ = suite._step(stage, mesh, fn, state, frozen, step)
      out[mode]["times"].append(time.perf_counter() - t)
      runs[mode][3] = state
  for mode in out:
    out[mode]["step_s"] = statistics.median(out[mode].pop("times"))
  return out


def report(name: str, r: dict, rank: int) -> str:
  mib = lambda b: f"{b / 2**20:.1f} MiB"
  f, lo = r["full"], r["lora"]
  dev = lambda x: x["args_bytes"] + x["temp_bytes"]
  lines = [f"{name} (rank {rank}): trained parameters {f['trained_params']:,} -> "
           f"{lo['trained_params']:,}",
           f"  arguments {mib(f['args_bytes'])} -> {mib(lo['args_bytes'])}; temporaries "
           f"{mib(f['temp_bytes'])} -> {mib(lo['temp_bytes'])}; together {mib(dev(f))} -> "
           f"{mib(dev(lo))} ({dev(f) / dev(lo):.2f}x less)",
           f"  state {mib(f['state_bytes'])} -> {mib(lo['state_bytes'])}; frozen "
           f"{mib(f['frozen_bytes'])} -> {mib(lo['frozen_bytes'])}",
           f"  step {f['step_s'] * 1e3:.0f} ms -> {lo['step_s'] * 1e3:.0f} ms "
           f"({f['step_s'] / lo['step_s']:.2f}x, median, interleaved)"]
  return "\n".join(lines)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--workloads", default="ppo,grpo,dpo")
  p.add_argument("--rank", type=int, default=8)
  p.add_argument("--steps", type=int, default=5)
  p.add_argument("--base_dtype", default="", choices=("", "float32", "bfloat16"))
  args = p.parse_args(argv)
  results = {}
  for name in args.workloads.split(","):
    results[name] = measure(name, args.rank, args.steps, args.base_dtype)
    print(report(name, results[name], args.rank), flush=True)
  return results


if __name__ == "__main__":
  main()
