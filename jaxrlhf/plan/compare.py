"""The four 70B experiments planned next to the seed analysis's figures."""

from __future__ import annotations

import dataclasses
import json
import os

from jaxrlhf import hardware
from jaxrlhf.train.preflight import GB
from jaxrlhf.plan.cluster import enable_compile_cache, simulate_devices
from jaxrlhf.plan.build import build_plan
from jaxrlhf.plan.report import fmt_secs, write_json
from jaxrlhf.plan.search import SEARCH_COUNTS, find_smallest


# The seed's figures for 70B (models in memory, minimum GPUs, memory per GPU, H100-hours per
# run); see /work/shared/seeds and docs/plan.md.
SEED_70B = {
    "sft70b": ("1", "4-8", "35-45 GB", "400-700"),
    "dpo70b": ("2", "8-16", "50-70 GB", "800-1,400"),
    "grpo70b": ("3", ">=PPO", "-", "-"),
    "ppo70b": ("4-6", "32-64", "100-140 GB", "2,500-3,500"),
}


def compare(accelerator: str = "h100", workdir: str = "runs/compare70b", search: bool = True,
            names=("sft70b", "dpo70b", "grpo70b", "ppo70b")) -> list[dict]:
  """Plans the 70B experiments on their configured clusters (and, with ``search``, finds the
  smallest cluster for each) and prints them next to the seed analysis's figures."""
  from jaxrlhf import registry
  acc = hardware.get_accelerator(accelerator)
  cfgs = [dataclasses.replace(registry.get(n), plan=dataclasses.replace(
      registry.get(n).plan, accelerator=acc.name)) for n in names]
  simulate_devices(max([c.plan.devices for c in cfgs] + list(SEARCH_COUNTS if search else [])))
  enable_compile_cache()
  rows = []
  for cfg in cfgs:
    print(f"planning {cfg.name} on {cfg.plan.devices} x {acc.name} ...", flush=True)
    p = build_plan(cfg, cfg.plan.devices, acc)
    write_json(p, os.path.join(workdir, cfg.name))
    smallest = None
    if search:
      found, _ = find_smallest(cfg, acc, log=lambda line: print(line, flush=True))
      smallest = (found.devices, found.mesh) if found is not None else None
    seed = SEED_70B.get(cfg.name, ("-",) * 4)
    rows.append({
        "experiment": cfg.name, "models_in_memory": len(p.final_stage.models_in_memory),
        "models": p.final_stage.models_in_memory, "devices": p.devices, "mesh": p.mesh,
        "peak_bytes_per_device": max(s.peak.peak_bytes_per_device for s in p.stages),
        "fits": p.fits, "min_devices": smallest[0] if smallest else None,
        "min_mesh": smallest[1] if smallest else None, "searched": search,
        "est_step_seconds": p.final_stage.est_step_seconds, "gpu_hours_per_run": p.gpu_hours,
        "compiler": p.compiler,
        "overlapped_step_seconds": p.final_stage.overlapped_step_seconds,
        "unoverlapped_step_seconds": p.final_stage.unoverlapped_step_seconds,
        "usd_per_run": p.usd_per_run, "steps": p.final_stage.steps,
        "seed": dict(zip(("models_in_memory", "min_gpus", "memory_per_gpu", "gpu_hours"),
                         seed))})
  print(format_compare(rows, acc))
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "compare.json"), "w") as f:
    json.dump(rows, f, indent=2, default=float)
  print(f"wrote {os.path.join(workdir, 'compare.json')} and each plan.json under {workdir}")
  return rows


def _min_text(row: dict) -> str:
  if row["min_devices"]:
    m = row["min_mesh"]
    return f"{row['min_devices']} ({m['tp']}x{m['fsdp']}x{m['dp']})"
  return "-" if not row.get("searched") else f">{max(SEARCH_COUNTS)}"


def format_compare(rows: list[dict], acc) -> str:
  head = (f"{'':<8} {'models':>6} {'seed':>5} | {'min (tpxfsdpxdp)':>16} {'seed':>6} | "
          f"{'GB/dev @N':>10} {'fits':>4} {'seed':>10} | {'step':>7} {'dev-hours':>9} "
          f"{'seed':>11}")
  compiler = rows[0].get("compiler", "cpu") if rows else "cpu"
  where = ("on simulated CPU devices" if compiler == "cpu" else
           f"by XLA:{compiler.upper()} on compile-only devices")
  lines = [f"\nours (compiled {where}) vs the seed analysis, {acc.name}:", head]
  for r in rows:
    s = r["seed"]
    mem = f"{r['peak_bytes_per_device'] / GB:.0f} @{r['devices']}"
    lines.append(
        f"{r['experiment']:<8} {r['models_in_memory']:>6} {s['models_in_memory']:>5} | "
        f"{_min_text(r):>16} "
        f"{s['min_gpus']:>6} | {mem:>10} {'yes' if r['fits'] else 'NO':>4} "
        f"{s['memory_per_gpu']:>10} | {fmt_secs(r['est_step_seconds']):>7} "
        f"{r['gpu_hours_per_run']:>9,.0f} {s['gpu_hours']:>11}")
  lines.append("dev-hours: the experiment's configured steps at the roofline step time (a lower "
               "bound); why the figures differ: docs/plan.md")
  lines += [f"{r['experiment']}: step {fmt_secs(r['unoverlapped_step_seconds'])} with nothing "
            f"overlapped" + (f", {fmt_secs(r['overlapped_step_seconds'])} as XLA:"
                             f"{compiler.upper()} scheduled the overlap"
                             if r.get("overlapped_step_seconds") is not None else "")
            for r in rows if "unoverlapped_step_seconds" in r]
  return "\n".join(lines)
