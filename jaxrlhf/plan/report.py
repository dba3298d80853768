"""The plan as text (the console report) and as plan.json (its schema is in docs/plan.md)."""

from __future__ import annotations

import dataclasses
import json
import math
import os

from jaxrlhf.train.preflight import gb
from jaxrlhf.plan.cluster import node_of
from jaxrlhf.plan.cost import SLOWDOWN, band
from jaxrlhf.plan.build import Plan


def fmt_size(x: float) -> str:
  """Bytes with a unit that keeps 2-3 significant digits: 37G, 1.5G, 210M, 12K."""
  if x is None or (isinstance(x, float) and math.isnan(x)):
    return "-"
  for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
    if abs(x) >= scale:
      v = x / scale
      return f"{v:.1f}{unit}" if v < 100 else f"{v:.0f}{unit}"
  return f"{x:.0f}B"


def fmt_bytes(x: float) -> str:
  return fmt_size(x) + "B"


def fmt_secs(x: float) -> str:
  if x is None or math.isnan(x):
    return "-"
  if x < 1e-3:
    return f"{x * 1e6:.0f}us"
  return f"{x * 1e3:.0f}ms" if x < 1 else f"{x:.1f}s"


# Why a plan compiled by XLA:CPU has no overlapped time.
NO_SCHEDULE = ("XLA:CPU compiled it: its collectives are synchronous, so its program holds no "
               "schedule of the target's asynchronous ones (pip install -e '.[aot]' compiles "
               "for the target)")
# Which step time the cost figures use.
COST_TIME = ("est_step_seconds: the roofline, compute, HBM and collectives overlapping "
             "perfectly (a lower bound); overlapped_step_seconds (as scheduled) and "
             "unoverlapped_step_seconds (added) lie above it")


def overlap_text(s) -> str:
  """One line on a stage's step with its collectives overlapped as scheduled, and not."""
  serial = f"{fmt_secs(s.unoverlapped_step_seconds)} with nothing overlapped"
  if s.overlapped_step_seconds is None:
    return f"overlap: not estimated ({NO_SCHEDULE}); {serial}"
  hidden = s.unoverlapped_step_seconds - s.overlapped_step_seconds
  return (f"overlap: {fmt_secs(s.overlapped_step_seconds)} as the compiler scheduled it "
          f"({fmt_secs(hidden)} of collectives hidden behind computation between their start "
          f"and done), {serial}; the roofline and the cost assume perfect overlap")


def to_json(plan: Plan) -> dict:
  """The plan.json document (schema in docs/plan.md)."""
  acc = plan.accelerator
  what, size, fix = plan.largest_consumer()
  main = plan.final_stage
  progs = []
  for s in plan.stages:
    for p in s.programs:
      d = dataclasses.asdict(p)
      d["largest_temporaries"] = [[b, t] for b, t in p.largest_temporaries]
      d["fits"] = p.peak_bytes_per_device <= plan.usable_bytes
      progs.append(d)
  usd_month = plan.usd_per_run * plan.runs_per_month
  return {
      "experiment": plan.experiment, "devices": plan.devices, "accelerator": acc.name,
      "compiler": plan.compiler,
      "mesh": plan.mesh, "fits": plan.fits, "est_step_seconds": main.est_step_seconds,
      "overlapped_step_seconds": main.overlapped_step_seconds,
      "unoverlapped_step_seconds": main.unoverlapped_step_seconds,
      **({"overlap_absent": NO_SCHEDULE} if main.overlapped_step_seconds is None else {}),
      "est_usd_per_step": plan.usd_per_step, "programs": progs,
      "memory": {"device_bytes": acc.memory_bytes, "usable_bytes": plan.usable_bytes,
                 "peak_bytes_per_device": max(s.peak.peak_bytes_per_device
                                              for s in plan.stages),
                 "largest_consumer": what, "largest_consumer_bytes": size,
                 "suggestion": fix},
      "stages": [{"stage": s.stage, "steps": s.steps, "may_end_early": s.may_end_early,
                  "mode": s.mode,
                  "est_step_seconds": s.est_step_seconds,
                  "overlapped_step_seconds": s.overlapped_step_seconds,
                  "unoverlapped_step_seconds": s.unoverlapped_step_seconds,
                  "tokens_per_s": s.tokens_per_step / s.est_step_seconds
                  if s.est_step_seconds > 0 else math.nan,
                  "models_in_memory": s.models_in_memory, "consumers": s.consumers,
                  **({"decode": s.decode} if s.decode is not None else {})}
                 for s in plan.stages],
      "cost": {"usd_per_hour_per_device": acc.usd_per_hour, "gpu_hours_per_run": plan.gpu_hours,
               "usd_per_run": plan.usd_per_run, "runs_per_month": plan.runs_per_month,
               "usd_per_month": usd_month, "band": band(usd_month), "step_time": COST_TIME},
      "plan_seconds": plan.plan_seconds,
  }


def _decode_lines(plan: Plan, s) -> list[str]:
  """A stage plan's lines on its decode layout, and on generation bound by collectives."""
  acc, lines = plan.accelerator, []
  if s.decode is not None:
    d = s.decode
    if d["layout"] == "tp":
      lines.append(f"decode layout: tp (rollout.decode_layout): the policy is resharded once per "
                   f"step, {fmt_bytes(d['reshard_bytes'])} gathered per device over "
                   f"{d['link']} ({fmt_secs(d['reshard_seconds'])}, inside generate), into a "
                   f"{fmt_bytes(d['copy_bytes'])} copy per device that lives while it "
                   f"generates; --set=rollout.decode_layout=train decodes in the training "
                   f"layout instead (no copy, its fsdp shards gathered for every token)")
    else:
      lines.append(f"decode layout: {d['layout']}")
    if "token_bytes" in d:
      t, sec = d["token_bytes"], d["decode_hbm_seconds"]
      on = plan.cfg.rollout.prefix_sharing
      lines.append(
          f"decode reads per token and device: weights {fmt_bytes(t['weights'])} + KV "
          f"{fmt_bytes(t['kv'])} ({fmt_bytes(t['kv_prompt'])} of it the prompts'); with "
          f"prefix sharing the KV is {fmt_bytes(t['kv_shared'])}. Decode loop at the HBM "
          f"roofline: {fmt_secs(sec['dense'])} dense, {fmt_secs(sec['shared'])} with shared "
          f"prefixes ({sec['dense'] / sec['shared']:.2f}x; rollout.prefix_sharing="
          f"{str(on).lower()} here)")
  gen = next((p for p in s.programs if p.name.endswith("/generate")), None)
  if gen is not None and gen.bound == "collectives" and (s.decode or {}).get("layout") == "train":
    # One gather per step instead of one per token: the decode loop's traffic once.
    steps = max(plan.cfg.rollout.max_new_tokens - 1, 1)
    once = (gen.comm_intra_bytes / steps / (acc.interconnect_bandwidth / 2)
            + gen.comm_inter_bytes / steps / node_of(acc.name)[1])
    without = max(gen.t_compute, gen.t_memory) + once
    lines.append(f"note: generation is bound by collectives: the rollout all-gathers the "
                 f"fsdp-sharded policy for every decoded token ({fmt_bytes(gen.comm_inter_bytes)}"
                 f" across nodes per step); gathered once per step it would take about "
                 f"{fmt_secs(without)} ({fmt_secs(s.est_step_seconds - gen.est_seconds + without)} "
                 f"per step)")
  return lines


def format_plan(plan: Plan) -> str:
  acc = plan.accelerator
  mesh = " x ".join(f"{k}={v}" for k, v in plan.mesh.items())
  where = ("on simulated CPU devices (XLA:CPU; pip install -e '.[aot]' compiles for the "
           "target itself)" if plan.compiler == "cpu" else
           f"by XLA:{plan.compiler.upper()} for {acc.name} itself, on compile-only devices")
  memory = ("temp and peak without the CPU compiler's f32 copies; 'cpu' keeps them"
            if plan.compiler == "cpu" else "as the target's compiler laid the program out")
  lines = [f"{plan.experiment}: {plan.devices} x {acc.name} ({gb(acc.memory_bytes)} GB, "
           f"{gb(plan.usable_bytes)} GB usable), mesh {mesh}; compiled in "
           f"{plan.plan_seconds:.0f}s {where}",
           f"per device: args/temp/out/peak from XLA's memory analysis ({memory}), FLOP and "
           "HBM bytes analytic, NVLink/net = collective bytes inside/across nodes; est = "
           "roofline time"]
  head = (f"{'program':<16} {'runs':<4} {'args':>6} {'temp':>6} {'out':>6} {'peak':>6} "
          f"{'cpu':>6} {'fits':<4} {'FLOP':>6} {'HBM':>6} {'NVLink':>6} {'net':>6} "
          f"{'est':>7}  bound")
  for s in plan.stages:
    budget = (f"{s.steps} steps at most ({s.may_end_early} may end it sooner)"
              if s.may_end_early else f"{s.steps} steps")
    lines.append(f"\n{s.stage}: {budget}, {s.mode}; in memory: "
                 + ", ".join(s.models_in_memory))
    lines.append(head)
    for p in s.programs:
      fits = "yes" if p.peak_bytes_per_device <= plan.usable_bytes else "NO"
      lines.append(
          f"{p.name:<16} {'yes' if p.runs else '-':<4} {fmt_size(p.argument_bytes):>6} "
          f"{fmt_size(p.temp_bytes - p.cpu_upcast_bytes):>6} "
          f"{fmt_size(p.output_bytes - p.alias_bytes):>6} {fmt_size(p.peak_bytes_per_device):>6} "
          f"{fmt_size(p.cpu_peak_bytes):>6} {fits:<4} {fmt_size(p.flops):>6} "
          f"{fmt_size(p.bytes_accessed):>6} {fmt_size(p.comm_intra_bytes):>6} "
          f"{fmt_size(p.comm_inter_bytes):>6} {fmt_secs(p.est_seconds):>7}  {p.bound}")
    tps = s.tokens_per_step / s.est_step_seconds if s.est_step_seconds > 0 else math.nan
    lines.append(f"step: {fmt_secs(s.est_step_seconds)} (roofline, a lower bound), "
                 f"{tps:,.0f} tokens/s")
    lines.append(overlap_text(s))
    lines += _decode_lines(plan, s)
  what, size, fix = plan.largest_consumer()
  peak = max(s.peak.peak_bytes_per_device for s in plan.stages)
  if plan.fits:
    lines.append(f"\nfits: peak {fmt_bytes(peak)}/device of {fmt_bytes(plan.usable_bytes)} usable; "
                 f"largest consumer: {what} ({fmt_bytes(size)})")
    if peak > 0.9 * plan.usable_bytes:
      top = max((s.peak for s in plan.stages), key=lambda p: p.peak_bytes_per_device)
      lines.append(
          "note: the peak is within 10% of the limit"
          + (f", after subtracting an estimate of the f32 copies only XLA's CPU compiler makes "
             f"({fmt_bytes(top.cpu_upcast_bytes)})" if top.cpu_upcast_bytes else "")
          + f"; leave headroom: {fix}")
  else:
    lines.append(f"\nDOES NOT FIT: peak {fmt_bytes(peak)}/device > {fmt_bytes(plan.usable_bytes)} "
                 f"usable on {acc.name}; largest consumer: {what} ({fmt_bytes(size)}); {fix}; "
                 f"or try --plan_search")
  usd_month = plan.usd_per_run * plan.runs_per_month
  # Roofline step times are a lower bound; well-tuned runs reach 40-60% of them (docs/plan.md).
  real = band(usd_month * SLOWDOWN[1])
  lines.append(
      f"{'cost' if plan.fits else 'cost if it fit (it does not, above)'} at "
      f"${acc.usd_per_hour:.2f}/device-hour and roofline step times (a lower bound; at 40-60% "
      f"of the roofline a run costs {SLOWDOWN[0]:g}-{SLOWDOWN[1]:g}x): "
      f"${plan.usd_per_step:.3g}/step; per run "
      f"({' + '.join(f'{s.steps} {s.stage}' for s in plan.stages)} steps"
      f"{', at most: a stage may end early' if any(s.may_end_early for s in plan.stages) else ''}"
      f"): {fmt_amount(plan.gpu_hours)} {acc.name}-hours, ${fmt_amount(plan.usd_per_run)}; "
      f"{plan.runs_per_month:g} run(s)/month: ${fmt_amount(usd_month)} -> {band(usd_month)}"
      + (f" (at {SLOWDOWN[1]:g}x: {real})" if real != band(usd_month) else ""))
  return "\n".join(lines)


def fmt_amount(x: float) -> str:
  """Hours or dollars: whole numbers with separators, small ones with 3 significant digits
  (a tiny run's cost is not $0)."""
  return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def write_json(plan: Plan, workdir: str) -> str:
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, "plan.json")
  with open(path, "w") as f:
    json.dump(to_json(plan), f, indent=2, default=float)
  return path
