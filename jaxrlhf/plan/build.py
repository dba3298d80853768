"""A whole plan: every stage of an experiment on one mesh of one cluster, and what to do
when it does not fit."""

from __future__ import annotations

import dataclasses
import re
import time
from typing import Optional

from jaxrlhf import hardware, targets
from jaxrlhf.config import ConfigError, ExperimentConfig, MeshConfig
from jaxrlhf.plan.cluster import USABLE_FRACTION
from jaxrlhf.plan.programs import StagePlan, plan_stage


@dataclasses.dataclass
class Plan:
  experiment: str
  devices: int
  accelerator: hardware.Accelerator
  mesh: dict
  stages: list[StagePlan]
  runs_per_month: float
  cfg: ExperimentConfig
  plan_seconds: float = 0.0
  # Whose compiler the memory and collectives come from: "cpu" (simulated CPU devices) or the
  # target platform ("gpu", "tpu": compile-only devices of the accelerator).
  compiler: str = "cpu"

  @property
  def usable_bytes(self) -> float:
    return self.accelerator.memory_bytes * USABLE_FRACTION

  @property
  def fits(self) -> bool:
    return all(s.peak.peak_bytes_per_device <= self.usable_bytes for s in self.stages)

  @property
  def final_stage(self) -> StagePlan:
    """The stage the top-level step figures describe: the experiment's last."""
    return self.stages[-1]

  @property
  def usd_per_step(self) -> float:
    return self.final_stage.est_step_seconds * self.devices * self.accelerator.usd_per_hour / 3600

  @property
  def gpu_hours(self) -> float:
    return sum(s.steps * s.est_step_seconds for s in self.stages) * self.devices / 3600

  @property
  def usd_per_run(self) -> float:
    return self.gpu_hours * self.accelerator.usd_per_hour

  def largest_consumer(self) -> tuple[str, int, str]:
    """What takes the most memory per device on the program with the highest peak:
    ``(what, bytes, suggestion)``."""
    stage = max(self.stages, key=lambda s: s.peak.peak_bytes_per_device)
    p = stage.peak
    items = dict(stage.consumers) if p.name.endswith("/step") else {}
    if not items:
      items = {"arguments": p.argument_bytes, "resident state": p.resident_bytes}
    temp = p.temp_bytes - p.cpu_upcast_bytes + p.output_bytes - p.alias_bytes
    what_temp = "temporaries of " + p.name
    if p.largest_temporaries:
      what_temp += " (largest: " + describe_buffer(p.largest_temporaries[0][1],
                                                    self.cfg) + ")"
    items[what_temp] = temp
    what, size = max(items.items(), key=lambda kv: kv[1])
    return what, size, suggestion(what, stage.stage)


def describe_buffer(desc: str, cfg: Optional[ExperimentConfig]) -> str:
  """Names a temporary from its shape: layer-stacked hidden states are the inputs each layer
  saves for the backward pass; a 5-D layer-stacked bf16 array is a KV cache."""
  m = re.match(r"(\w+)\[([\d,]*)\]", desc)
  if not m or cfg is None:
    return desc
  dims = [int(d) for d in m.group(2).split(",") if d]
  models = [cfg.model] + [x for x in (cfg.reward_model, cfg.value_model) if x is not None]
  for mc in models:
    if len(dims) == 4 and dims[0] == mc.n_layers and dims[-1] == mc.d_model:
      return f"{desc}: each layer's input saved for the backward pass"
    if len(dims) == 5 and dims[0] == mc.n_layers and dims[-1] == mc.head_dim:
      return f"{desc}: KV cache"
  return desc


def suggestion(what: str, stage: str) -> str:
  if "saved for the backward" in what:
    return (f"raise {stage}.optim.grad_accum (micro-batches), or add devices to the data axes")
  if "KV cache" in what:
    return "lower the batch or rollout.max_new_tokens, or add devices"
  if "optimizer" in what or "parameters" in what:
    return "add devices (raise fsdp) so the states shard further"
  return "add devices, or lower the batch"


def build_plan(cfg: ExperimentConfig, n_devices: int, acc, *, full: bool = True,
               mesh_cfg: Optional[MeshConfig] = None) -> Plan:
  import jax
  from jaxrlhf.mesh import make_mesh, resolve_mesh_shape
  from jaxrlhf.model.hf import resolve_models
  mesh_cfg = mesh_cfg or cfg.mesh
  sizes = resolve_mesh_shape(mesh_cfg, n_devices)
  cfg = dataclasses.replace(cfg, mesh=MeshConfig(**sizes))
  cfg = resolve_models(cfg, sizes["tp"])
  if cfg.kernels.decode == "auto":
    # The accelerator's decode loop, on either compiler: "auto" would give a CPU-simulated
    # plan the CPU's unrolled loop, and with it a second copy of the policy's layers.
    cfg = dataclasses.replace(cfg, kernels=dataclasses.replace(cfg.kernels, decode="scanned"))
  compiler = compiler_of(cfg, acc)
  if compiler == "cpu":
    mesh = make_mesh(cfg.mesh, jax.devices("cpu")[:n_devices])
  else:
    mesh = targets.mesh(acc.name, cfg.mesh, n_devices)
  t0 = time.perf_counter()
  stages = [plan_stage(cfg, s, mesh, acc, full=full) for s in cfg.stages]
  return Plan(cfg.name, n_devices, acc, sizes, stages, cfg.plan.runs_per_month, cfg,
              time.perf_counter() - t0, compiler)


def compiler_of(cfg: ExperimentConfig, acc) -> str:
  """``"cpu"``, or the target platform (``"gpu"``, ``"tpu"``) whose own compiler the plan
  reads: ``plan.compiler=target`` insists (a ConfigError naming the install when the plugin
  is missing), ``auto`` takes the target where its plugin is installed."""
  want = cfg.plan.compiler
  if want == "cpu" or acc.name not in targets.NAMES:
    if want == "target":
      raise ConfigError(f"plan.compiler=target: no compile-only devices for {acc.name}; "
                        f"choose one of {', '.join(targets.NAMES)}")
    return "cpu"
  why = targets.missing(acc.name)
  if why:
    if want == "target":
      raise ConfigError(f"plan.compiler=target: {why}")
    return "cpu"
  return targets.platform_of(acc.name)
