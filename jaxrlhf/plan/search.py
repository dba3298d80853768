"""Mesh search: the smallest device count and mesh on which an experiment fits."""

from __future__ import annotations

import dataclasses
from typing import Optional

from jaxrlhf.config import ExperimentConfig, MeshConfig
from jaxrlhf.train.preflight import gb, state_bytes
from jaxrlhf.plan.cluster import USABLE_FRACTION, node_of
from jaxrlhf.plan.build import Plan, build_plan


SEARCH_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def candidate_meshes(cfg: ExperimentConfig, n: int, node_size: int) -> list[MeshConfig]:
  """Meshes for ``n`` devices, most memory-frugal first: tensor parallelism inside a node
  (as wide as the heads allow), the rest on fsdp so trainable states shard over every
  device; then narrower tp."""
  out = []
  for tp in (8, 4, 2, 1):
    if tp > n or tp > node_size or n % tp or cfg.model.n_kv_heads % tp:
      continue
    out.append(MeshConfig(dp=1, fsdp=n // tp, tp=tp))
  return out


def decode_layouts(cfg: ExperimentConfig, mesh_cfg: MeshConfig) -> tuple[str, ...]:
  """The decode layouts worth trying on a mesh, fastest first: the tensor-parallel copy (one
  gather per step), then the training layout (no copy: less memory, a gather per token).
  With fsdp=1, or no stage that generates, they are the same."""
  # Lazy, like every jax-side import of the planner: it sets up simulated devices first.
  from jaxrlhf.train import spec
  generates = any(spec.get(s).generates for s in cfg.stages)
  if not generates or mesh_cfg.fsdp == 1:
    return (cfg.rollout.decode_layout,)
  return ("tp", "train")


def find_smallest(cfg: ExperimentConfig, acc, counts=SEARCH_COUNTS, per_count: int = 2,
           log=print) -> tuple[Optional[Plan], list]:
  """The smallest device count (and mesh) whose programs fit ``acc``; compiles only the
  programs that run.  Returns ``(plan or None, tried)`` with one row per candidate."""
  usable = acc.memory_bytes * USABLE_FRACTION
  total = state_bytes(cfg)
  tried = []
  for n in counts:
    if total / n > usable:
      tried.append((n, None, total / n, "states alone exceed memory"))
      continue
    for mesh_cfg in candidate_meshes(cfg, n, node_of(acc.name)[0])[:per_count]:
      for layout in decode_layouts(cfg, mesh_cfg):
        c = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout,
                                                                 decode_layout=layout))
        plan = build_plan(c, n, acc, full=False, mesh_cfg=mesh_cfg)
        peak = max(s.peak.peak_bytes_per_device for s in plan.stages)
        tried.append((n, mesh_cfg, peak, "fits" if plan.fits else "too big"))
        log(f"  {n:>4} devices, tp={mesh_cfg.tp} fsdp={mesh_cfg.fsdp} dp={mesh_cfg.dp}"
            + (f", decode layout {layout}" if len(decode_layouts(cfg, mesh_cfg)) > 1 else "")
            + f": peak {gb(peak)} GB/device -> {'fits' if plan.fits else 'too big'} "
            f"({plan.plan_seconds:.0f}s)")
        if plan.fits:
          return plan, tried
  return None, tried
