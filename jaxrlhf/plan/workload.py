"""The analytic work of each program of a stage: model FLOPs (the trainer's own MFU count,
the algorithm spec's) and HBM bytes per device (weights, KV cache, optimizer states)."""

from __future__ import annotations

import dataclasses

from jaxrlhf.config import ModelConfig
from jaxrlhf.train.preflight import dtype_bytes, param_bytes


@dataclasses.dataclass(frozen=True)
class Work:
  """Global FLOPs and per-device HBM bytes of one program (analytic), and the tokens it
  produces or trains on."""

  flops: float
  hbm_bytes: float
  tokens: float = 0.0


def tp_share(m: ModelConfig, tp: int) -> int:
  """How far ``tp`` splits a model's heads (the mesh rules replicate what it can't divide)."""
  return tp if m.n_kv_heads % tp == 0 and m.n_heads % tp == 0 else 1


def train_bytes(m: ModelConfig, head: str, sizes: dict, passes: int, precision=None) -> float:
  """HBM bytes per device of ``passes`` forward+backward passes and one AdamW update: each
  pass reads the device's tensor-parallel slice of every weight (fsdp gathers it, in
  ``param_dtype``) once forward, once backward and once more to recompute with
  ``remat=full``; the update reads and writes the device's shard of the master weights and
  both moments (in ``precision``'s dtypes: jaxrlhf.train.precision) and reads its float32
  gradients."""
  master = precision.master if precision else m.param_dtype
  moments = precision.moments if precision else m.param_dtype
  w = param_bytes(m, head)
  tp = tp_share(m, sizes["tp"])
  reads = 3 if m.remat == "full" else 2
  shard = m.num_params(head) / (tp * sizes["fsdp"])
  update = shard * (2 * dtype_bytes(master) + 4 * dtype_bytes(moments) + 4)
  return passes * reads * w / tp + update


def workload(stage, sizes: dict) -> dict[str, Work]:
  """Analytic work of each program of ``stage`` on a mesh of ``sizes`` (dp, fsdp, tp).

  FLOPs are :func:`jaxrlhf.train.work.step_flops` (the trainer's own MFU count: matmuls of
  each phase, elementwise work left out).  HBM bytes per device count weights, the KV cache
  and optimizer states -- what bounds decoding and the update; activations are left out (the
  programs that move many are compute-bound).
  """
  from jaxrlhf.train.work import generation_bytes, step_flops
  cfg, scfg = stage.cfg, stage.scfg
  tp, n = sizes["tp"], sizes["dp"] * sizes["fsdp"] * sizes["tp"]
  flops = step_flops(stage)
  if not stage.spec.generates:
    role = next(iter(stage.trainable))
    m, head = cfg.role_model(role), stage.trainable[role]
    rows = scfg.batch_size * stage.spec.rows_per_example
    hbm = train_bytes(m, head, sizes, scfg.optim.grad_accum, stage.precision[role])
    if "reference" in flops:  # DPO computing reference log-probs in the step
      hbm += param_bytes(m, head) / tp_share(m, tp)
    return {"step": Work(sum(flops.values()), hbm, rows * (stage.P + stage.R))}
  pol = cfg.role_model("policy")
  rows = scfg.batch_size * stage.n
  frozen = stage.frozen()
  # Prefill reads the weights once more than the decode steps generation_bytes counts.
  gen_bytes = (generation_bytes(stage, tp_share(pol, tp), n) / n
               + param_bytes(pol, "lm") / tp_share(pol, tp))
  out = {"generate": Work(flops["generate"], gen_bytes, rows * stage.N)}
  forward = lambda r, h: param_bytes(cfg.role_model(r), h) / tp_share(cfg.role_model(r), tp)
  if "reference" in flops:
    out["reference"] = Work(flops["reference"], forward("reference", "lm"))
  out["reward"] = Work(flops.get("reward", 0.0),
                       sum(forward(r, "scalar") for r in ("reward", "guard") if r in frozen))
  passes = scfg.ppo_epochs * scfg.num_minibatches * scfg.optim.grad_accum
  upd_bytes = sum(train_bytes(cfg.role_model(r), h, sizes, passes, stage.precision[r])
                  for r, h in stage.trainable.items())
  if "values" in flops:
    out["values"] = Work(flops["values"], forward("value", "scalar"))
  out["update"] = Work(flops["update"], upd_bytes, rows * stage.N)
  return out
