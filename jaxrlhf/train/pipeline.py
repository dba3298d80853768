"""Runs an experiment's stages in order (e.g. SFT -> RM -> PPO): each stage starts from the
roles earlier stages produced, and the run ends with a summary table."""

from __future__ import annotations

import dataclasses
import json
import os
import time

import jax

from jaxrlhf.config import ExperimentConfig, to_json
from jaxrlhf.data import DataSource
from jaxrlhf.mesh import make_mesh
from jaxrlhf.model import hf
from jaxrlhf.metrics import MetricsWriter
from jaxrlhf.train.loop import TrainingError, run_stage


def stage_class(name: str):
  from jaxrlhf.train import dpo, grpo, ppo, rm, sft
  return {"sft": sft.SFTStage, "rm": rm.RMStage, "ppo": ppo.PPOStage, "grpo": grpo.GRPOStage,
          "dpo": dpo.DPOStage}[name]


def run(cfg: ExperimentConfig, workdir: str, resume: str = "latest", profile_steps=None) -> int:
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    f.write(to_json(cfg))
  mesh = make_mesh(cfg.mesh)
  cfg = resolve_models(cfg, dict(mesh.shape)["tp"])
  data = DataSource(cfg.data, cfg.seed)
  print(f"{cfg.name}: stages {' -> '.join(cfg.stages)} on mesh {dict(mesh.shape)} "
        f"({jax.device_count()} {jax.default_backend()} devices); outputs in {workdir}")
  writer = MetricsWriter(workdir, cfg.logging,
                         {s: getattr(cfg, s).steps for s in cfg.stages})
  roles: dict = {}
  summary: dict = {}
  key = jax.random.key(cfg.seed)
  try:
    for i, name in enumerate(cfg.stages):
      stage = stage_class(name)(cfg, mesh, data)
      t0 = time.perf_counter()
      state, frozen = stage.init(jax.random.fold_in(key, i), roles)
      if name in ("sft", "dpo", "ppo", "grpo"):
        before = stage.evaluate(state, frozen)
        summary[f"{name}/start"] = before
      state, last, stopped = run_stage(stage, state, frozen, writer=writer)
      final = {k: v for k, v in last.items() if k.startswith("eval/")} or stage.evaluate(
          state, frozen)
      summary[name] = {**final, "time_s": time.perf_counter() - t0,
                       **({"kl/mean": last["kl/mean"]} if "kl/mean" in last else {})}
      roles.update(stage.outputs(state, frozen))
      if stopped:
        break
  except TrainingError as e:
    print(f"error: {e}")
    return 1
  finally:
    writer.close()
  print_summary(cfg, summary)
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  return 0


def resolve_models(cfg: ExperimentConfig, tp: int) -> ExperimentConfig:
  """Reads the architecture of every role that names a Hugging Face directory."""
  changes = {}
  for field in ("model", "reward_model", "value_model", "guard_model"):
    m = getattr(cfg, field)
    if m is not None and m.hf_path:
      changes[field] = hf.resolve_hf_config(m, tp)
  return dataclasses.replace(cfg, **changes) if changes else cfg


def print_summary(cfg: ExperimentConfig, summary: dict) -> None:
  rows = []
  for name in cfg.stages:
    if name not in summary:
      continue
    s = summary[name]
    start = summary.get(f"{name}/start", {})
    if "eval/accuracy" in s:
      rows.append((f"{name}: held-out exact match", start.get("eval/accuracy"),
                   s["eval/accuracy"]))
    if "eval/pair_accuracy" in s:
      rows.append((f"{name}: held-out pair accuracy", start.get("eval/pair_accuracy"),
                   s["eval/pair_accuracy"]))
    if "kl/mean" in s:
      rows.append((f"{name}: KL to reference (last step)", None, s["kl/mean"]))
    rows.append((f"{name}: wall time (s)", None, s["time_s"]))
  fmt = lambda v: "" if v is None else f"{v:.3f}"
  width = max(len(r[0]) for r in rows)
  print(f"\n{'summary':<{width}}  {'start':>8}  {'end':>8}")
  for label, a, b in rows:
    print(f"{label:<{width}}  {fmt(a):>8}  {fmt(b):>8}")
