"""The planner: memory, FLOPs, time and dollars of an experiment on a cluster, from a laptop.

``python -m jaxrlhf.main --experiment=NAME --plan --devices=N --accelerator=h100`` builds every
stage's train state and batch as ``jax.ShapeDtypeStruct``s with their shardings on a mesh of
N *simulated* CPU devices, lowers and compiles the programs the trainer runs (an RL step's
generation, scoring and update phases, and the one-program step), and reads the answer off
XLA.  Nothing is allocated.  ``--plan_search`` finds the smallest device count and mesh on
which the experiment fits; ``python -m jaxrlhf.plan --compare`` plans the four 70B
experiments next to the seed analysis's figures.

Where each figure comes from (details and caveats in docs/plan.md):

* **Memory per device** is XLA's memory analysis of the compiled program: arguments + outputs +
  temporaries - donated (aliased) bytes.  The CPU compiler multiplies bf16 in f32 and hoists
  f32 copies of whole stacked weights and residuals out of the layer loops; a GPU does not, so
  we subtract the copies' share of the peak (:func:`jaxrlhf.plan_hlo.cpu_upcast_bytes`) and
  report the raw CPU figure beside it.  A phase program also counts what stays resident while
  it runs without being its argument (the rest of the train state, frozen models, rollouts).
* **FLOPs and HBM bytes** are analytic (:func:`jaxrlhf.perf.decoder_flops` and the formulas
  in :func:`workload`): XLA's cost analysis counts a loop body once, and every program here
  loops (scanned layers, the decoding loop, minibatches).  XLA's raw figures are kept as
  ``xla_flops`` / ``xla_bytes_accessed``.
* **Collective traffic** is read from the compiled HLO with loops multiplied out
  (:func:`jaxrlhf.plan_hlo.collective_traffic`), split into traffic inside an 8-device node
  (NVLink) and across nodes (the network, :data:`NODES`).
* **Time** per program is a roofline: the slowest of compute, HBM and collectives, assuming
  they overlap perfectly -- a lower bound.  Phases run one after another, so an RL step's
  time is the sum of its phases' times; the decoding loop is assumed to run all
  ``max_new_tokens`` steps.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys
import time
from typing import Optional

from jaxrlhf import hardware
from jaxrlhf.config import ConfigError, ExperimentConfig, MeshConfig, ModelConfig

GB = 1e9

# Node topology, which the accelerator table does not hold: devices per node sharing the
# fast interconnect, and each device's share of the network between nodes (bytes/s, one
# direction).  NVIDIA HGX/DGX H100, H200 and B200 nodes have 8 GPUs on NVSwitch and one
# 400 Gb/s ConnectX-7 InfiniBand NIC per GPU = 50 GB/s per GPU per direction (NVIDIA DGX H100
# and DGX B200 user guides, "networking").  A TPU v5p slice connects every chip by ICI (the
# 3D torus), so a whole slice counts as one node.
NODES: dict[str, tuple[int, float]] = {
    "h100": (8, 50 * GB), "h200": (8, 50 * GB), "b200": (8, 50 * GB),
    "tpu-v5p": (8960, 600 * GB),
}

# A program fits when its peak is at most this share of the device's memory: the rest is
# for the runtime, the CUDA context and fragmentation (run GPUs with
# XLA_PYTHON_CLIENT_MEM_FRACTION=.95 so JAX may use it).
USABLE_FRACTION = 0.9

# What a real run costs over the roofline estimate: runs reaching 60% / 40% of the roofline.
SLOWDOWN = (1.7, 2.5)

# The seed analysis's build-vs-API bands, US dollars of alignment training per month.
BANDS = ((50_000, "under $50k/month: use API fine-tuning services (Together AI, Fireworks, "
                  "Anyscale)"),
         (200_000, "$50k-200k/month: reserved H100 clusters running DPO"),
         (math.inf, "above $200k/month: a dedicated alignment cluster with PPO capability"))

# The seed's figures for 70B (models in memory, minimum GPUs, memory per GPU, H100-hours per
# run); see /work/shared/seeds and docs/plan.md.
SEED_70B = {
    "sft70b": ("1", "4-8", "35-45 GB", "400-700"),
    "dpo70b": ("2", "8-16", "50-70 GB", "800-1,400"),
    "grpo70b": ("3", ">=PPO", "-", "-"),
    "ppo70b": ("4-6", "32-64", "100-140 GB", "2,500-3,500"),
}

SEARCH_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def band(usd_per_month: float) -> str:
  """Where a monthly alignment spend falls in the seed's build-vs-API bands."""
  for limit, text in BANDS:
    if usd_per_month < limit:
      return text
  return BANDS[-1][1]


def node_of(accelerator: str) -> tuple[int, float]:
  return NODES.get(accelerator, (8, 50 * GB))


# ---------------------------------------------------------------------- simulated devices


def simulate_devices(n: int) -> None:
  """Makes jax start with at least ``n`` CPU devices (and only the CPU backend).  Must run
  before jax initialises its backends; afterwards it checks there are enough."""
  # Quieten the SPMD partitioner's C++ warnings (read when jax loads, so set it first).
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  import jax
  from jax._src import xla_bridge
  if not xla_bridge.backends_are_initialized():
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", max(n, 1))
  have = len(jax.devices("cpu"))
  if have < n:
    raise ConfigError(
        f"planning for {n} devices needs {n} simulated CPU devices but jax already started "
        f"with {have}; run the planner in a fresh process (python -m jaxrlhf.main --plan ...)")


def enable_compile_cache() -> None:
  """The trainer's persistent XLA cache (:func:`jaxrlhf.perf.enable_compilation_cache`,
  ``JAXRLHF_COMPILATION_CACHE``): re-planning the same programs loads them instead of
  compiling.  Imported here, not at the top: planning sets up simulated devices first."""
  from jaxrlhf.perf import enable_compilation_cache
  enable_compilation_cache()


# --------------------------------------------------------------------------- tree bytes


def leaf_bytes(x) -> int:
  """Bytes one device holds of an abstract array (its shard under its sharding)."""
  import jax
  import numpy as np
  shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else (
      x.shape)
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    itemsize = 8
  else:
    itemsize = np.dtype(x.dtype).itemsize
  return int(math.prod(shape)) * itemsize


def tree_bytes(tree) -> int:
  import jax
  return sum(leaf_bytes(x) for x in jax.tree.leaves(tree))


def dtype_bytes(name: str) -> int:
  return {"float32": 4, "bfloat16": 2, "float16": 2}[name]


# ----------------------------------------------------------------------------- workload


@dataclasses.dataclass(frozen=True)
class Work:
  """Global FLOPs and per-device HBM bytes of one program (analytic), and the tokens it
  produces or trains on."""

  flops: float
  hbm_bytes: float
  tokens: float = 0.0


def _param_bytes(m: ModelConfig, head: str) -> float:
  return m.num_params(head) * dtype_bytes(m.param_dtype)


def _tp_share(m: ModelConfig, tp: int) -> int:
  """How far ``tp`` splits a model's heads (the mesh rules replicate what it can't divide)."""
  return tp if m.n_kv_heads % tp == 0 and m.n_heads % tp == 0 else 1


def _train_bytes(m: ModelConfig, head: str, sizes: dict, passes: int) -> float:
  """HBM bytes per device of ``passes`` forward+backward passes and one AdamW update: each
  pass reads the device's tensor-parallel slice of every weight (fsdp gathers it) once
  forward, once backward and once more to recompute with ``remat=full``; the update reads
  and writes the device's shard of params and both moments and reads its gradients."""
  w = _param_bytes(m, head)
  tp = _tp_share(m, sizes["tp"])
  reads = 3 if m.remat == "full" else 2
  shard = w / (tp * sizes["fsdp"])
  return passes * reads * w / tp + 7 * shard


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
  if stage.name not in ("ppo", "grpo"):
    role = next(iter(stage.trainable))
    m, head = cfg.role_model(role), stage.trainable[role]
    rows = scfg.batch_size * (1 if stage.name == "sft" else 2)
    hbm = _train_bytes(m, head, sizes, scfg.optim.grad_accum)
    if "reference" in flops:  # DPO computing reference log-probs in the step
      hbm += _param_bytes(m, head) / _tp_share(m, tp)
    return {"step": Work(sum(flops.values()), hbm, rows * (stage.P + stage.R))}
  pol = cfg.role_model("policy")
  rows = scfg.batch_size * stage.n
  frozen = stage.frozen()
  # Prefill reads the weights once more than the decode steps generation_bytes counts.
  gen_bytes = (generation_bytes(stage, _tp_share(pol, tp), n) / n
               + _param_bytes(pol, "lm") / _tp_share(pol, tp))
  out = {"generate": Work(flops["generate"], gen_bytes, rows * stage.N)}
  forward = lambda r, h: _param_bytes(cfg.role_model(r), h) / _tp_share(cfg.role_model(r), tp)
  if "reference" in flops:
    out["reference"] = Work(flops["reference"], forward("reference", "lm"))
  out["reward"] = Work(flops.get("reward", 0.0),
                       sum(forward(r, "scalar") for r in ("reward", "guard") if r in frozen))
  passes = scfg.ppo_epochs * scfg.num_minibatches * stage.opt_accum()
  upd_bytes = sum(_train_bytes(cfg.role_model(r), h, sizes, passes)
                  for r, h in stage.trainable.items())
  if "values" in flops:
    out["values"] = Work(flops["values"], forward("value", "scalar"))
  out["update"] = Work(flops["update"], upd_bytes, rows * stage.N)
  return out


# ------------------------------------------------------------------------------ programs


@dataclasses.dataclass
class ProgramPlan:
  """One compiled program: memory per device (bytes), work, traffic and estimated time."""

  name: str
  runs: bool  # runs in the configured mode (else compiled only to attribute time)
  argument_bytes: int
  output_bytes: int
  temp_bytes: int
  alias_bytes: int
  cpu_upcast_bytes: int  # f32 copies the CPU compiler adds (subtracted from the peak)
  resident_bytes: int  # held on the device while it runs, not its argument (phases)
  peak_bytes_per_device: int
  flops: float = math.nan  # per device, analytic
  bytes_accessed: float = math.nan  # HBM bytes per device, analytic
  xla_flops: float = math.nan  # XLA cost analysis (loop bodies counted once)
  xla_bytes_accessed: float = math.nan
  comm_intra_bytes: float = 0.0
  comm_inter_bytes: float = 0.0
  t_compute: float = math.nan
  t_memory: float = math.nan
  t_comm: float = math.nan
  est_seconds: float = math.nan
  bound: str = ""
  compile_seconds: float = 0.0
  largest_temporaries: list = dataclasses.field(default_factory=list)

  @property
  def cpu_peak_bytes(self) -> int:
    return self.peak_bytes_per_device + self.cpu_upcast_bytes


def _compile(fn, *args):
  t0 = time.perf_counter()
  compiled = fn.lower(*args).compile()
  return compiled, time.perf_counter() - t0


def _abstract_outputs(fn, compiled, *args):
  """The outputs of a jitted ``fn`` as ShapeDtypeStructs with the compiled shardings."""
  import jax
  shapes = jax.eval_shape(fn, *args)
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                      shapes, compiled.output_shardings)


def read_program(name: str, compiled, *, runs: bool, held: int, n_devices: int,
                 node_size: int, unknown_trip: int, half_f32_traffic: bool,
                 compile_seconds: float) -> ProgramPlan:
  """Memory, raw cost and collective traffic of a compiled program.  ``held``: bytes per
  device resident while it runs (0 for a program that takes everything as arguments);
  what of it is not an argument of the compiled program counts towards its peak (jit drops
  unused arguments, so the compiled argument size is the measure)."""
  from jaxrlhf import plan_hlo
  mem = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else {}
  cost = cost or {}
  module = plan_hlo.parse_hlo(compiled.as_text())
  upcast = plan_hlo.cpu_upcast_bytes(module)
  traffic = plan_hlo.collective_traffic(module, n_devices, node_size, unknown_trip,
                                        f32_scale=0.5 if half_f32_traffic else 1.0)
  arg, out = int(mem.argument_size_in_bytes), int(mem.output_size_in_bytes)
  temp, alias = int(mem.temp_size_in_bytes), int(mem.alias_size_in_bytes)
  upcast = min(upcast, temp)
  resident = max(held - arg, 0)
  peak = arg + out + temp - alias - upcast + resident
  return ProgramPlan(
      name=name, runs=runs, argument_bytes=arg, output_bytes=out, temp_bytes=temp,
      alias_bytes=alias, cpu_upcast_bytes=upcast, resident_bytes=resident,
      peak_bytes_per_device=peak, xla_flops=float(cost.get("flops", math.nan)),
      xla_bytes_accessed=float(cost.get("bytes accessed", math.nan)),
      comm_intra_bytes=traffic.intra_bytes, comm_inter_bytes=traffic.inter_bytes,
      compile_seconds=compile_seconds,
      largest_temporaries=plan_hlo.largest_live(module, skip_upcasts=True, top=3))


def roofline(p: ProgramPlan, work: Optional[Work], n_devices: int, acc, node_bw: float):
  """Fills in the program's FLOPs, HBM bytes and time estimate (in place)."""
  if work is None:
    return
  p.flops = work.flops / n_devices
  p.bytes_accessed = work.hbm_bytes
  p.t_compute = p.flops / acc.peak_flops
  p.t_memory = p.bytes_accessed / acc.hbm_bandwidth
  p.t_comm = p.comm_intra_bytes / (acc.interconnect_bandwidth / 2) + p.comm_inter_bytes / node_bw
  times = {"compute": p.t_compute, "memory": p.t_memory, "collectives": p.t_comm}
  p.bound = max(times, key=times.get)
  p.est_seconds = times[p.bound]


def _sum_work(works) -> Work:
  works = [w for w in works if w is not None]
  return Work(sum(w.flops for w in works), sum(w.hbm_bytes for w in works),
              max((w.tokens for w in works), default=0.0))


# --------------------------------------------------------------------------------- stages


@dataclasses.dataclass
class StagePlan:
  stage: str
  steps: int
  mode: str  # "one program" or the phased programs' names
  programs: list[ProgramPlan]
  est_step_seconds: float
  tokens_per_step: float
  consumers: dict[str, int]  # resident bytes per device by what they are
  models_in_memory: list[str]
  # Why ``steps`` is a budget the stage may end before (e.g. "sft.stop_accuracy=0.8"), or "".
  may_end_early: str = ""

  @property
  def peak(self) -> ProgramPlan:
    running = [p for p in self.programs if p.runs] or self.programs
    return max(running, key=lambda p: p.peak_bytes_per_device)


def _consumers(state, frozen, batch) -> dict[str, int]:
  out = {}
  for role, p in state.params.items():
    out[f"{role} parameters"] = tree_bytes(p)
    out[f"{role} optimizer state"] = tree_bytes(state.opt_state.get(role, {}))
  for role, p in frozen.items():
    out[f"{role} parameters (frozen)"] = tree_bytes(p)
  out["batch"] = tree_bytes(batch)
  return out


def plan_stage(cfg: ExperimentConfig, name: str, mesh, acc, *, full: bool = True) -> StagePlan:
  """Compiles one stage's programs on abstract arrays.  ``full=False`` compiles only the
  programs that run (enough for memory; used by the search)."""
  import jax
  from jaxrlhf.data import DataSource
  from jaxrlhf.train.pipeline import stage_class
  n = mesh.size
  sizes = dict(mesh.shape)
  node_size, node_bw = node_of(acc.name)
  stage = stage_class(name)(cfg, mesh, DataSource(cfg.data, cfg.seed))
  state, frozen = stage.abstract_init()
  batch = stage.abstract_batch()
  work = workload(stage, sizes)
  sixteen_bit = any(dtype_bytes(cfg.role_model(r).compute_dtype) == 2
                    for r in (*stage.trainable, *stage.frozen()))
  rl = name in ("ppo", "grpo")
  unknown_trip = max(stage.N - 1, 1) if rl else 1
  read = lambda label, c, secs, runs, held=0: read_program(
      f"{name}/{label}", c, runs=runs, held=held, n_devices=n, node_size=node_size,
      unknown_trip=unknown_trip, half_f32_traffic=sixteen_bit, compile_seconds=secs)
  programs: list[ProgramPlan] = []
  with jax.set_mesh(mesh):
    step_fn = stage.make_step_fn(state, frozen, batch)
    one_program = hasattr(step_fn, "lower")
    if one_program:
      compiled, secs = _compile(step_fn, state, frozen, batch)
      step = read("step", compiled, secs, runs=True)
      programs.append(step)
      mode = "one program per step"
    if rl and (full or not one_program):
      programs += _plan_phases(stage, state, frozen, batch, read, one_program, step_fn)
      if not one_program:
        mode = "phases: " + ", ".join(p.name.split("/")[1] for p in programs if p.runs)
  # Time: each phase by its roofline; an RL step runs its phases one after another.
  label = lambda p: p.name.split("/")[1]
  for p in programs:
    roofline(p, work.get(label(p)), n, acc, node_bw)
    if label(p) == "rest":
      roofline(p, _sum_work(w for k, w in work.items() if k != "generate"), n, acc, node_bw)
  if rl and one_program:
    step = programs[0]
    roofline(step, _sum_work(work.values()), n, acc, node_bw)
    phases = [p for p in programs if label(p) in work]
    if phases:
      step.est_seconds, step.bound = sum(p.est_seconds for p in phases), "sum of phases"
    step_seconds = step.est_seconds
  elif rl:
    step_seconds = sum(p.est_seconds for p in programs if p.runs)
  else:
    step_seconds = programs[0].est_seconds
  tokens = work["generate" if rl else "step"].tokens
  models = [f"{r} ({cfg.role_model(r).num_params(h) / 1e9:.3g}B, trained)"
            for r, h in stage.trainable.items()]
  models += [f"{r} ({cfg.role_model(r).num_params(h) / 1e9:.3g}B, frozen)"
             for r, h in stage.frozen().items()]
  return StagePlan(stage=name, steps=stage.steps, mode=mode, programs=programs,
                   est_step_seconds=step_seconds, tokens_per_step=tokens,
                   consumers=_consumers(state, frozen, batch),
                   models_in_memory=models,
                   may_end_early=stage.stop_rule())


def _plan_phases(stage, state, frozen, batch, read, one_program: bool, step_fn):
  """The RL phases as the trainer's PhasedStep jits them, chained on abstract rollouts."""
  import jax
  import jax.numpy as jnp
  from jaxrlhf.train.rl import PhasedStep
  phased = step_fn if not one_program else PhasedStep(stage, state, frozen, batch)
  timed = phased.timed or one_program
  held = tree_bytes(state) + tree_bytes(frozen) + tree_bytes(batch)
  rollout_bytes = 0  # the rollout so far also stays on the device between phases
  out = []

  def add(label, fn, args, runs):
    compiled, secs = _compile(fn, *args)
    out.append(read(label, compiled, secs, runs=runs, held=held + rollout_bytes))
    return compiled

  c = add("generate", phased.gen, (state, batch), not one_program)
  _, ro = _abstract_outputs(phased.gen, c, state, batch)
  rollout_bytes = tree_bytes(ro)
  host = None
  if stage.host_sources:
    rows = ro["tokens"].shape[0]
    host = jax.ShapeDtypeStruct((rows,), jnp.float32, sharding=ro["lengths"].sharding)
  if not timed:
    add("rest", phased.rest, (state, frozen, batch, ro, host), True)
    return out
  runs = not one_program
  c = add("reference", phased.ref, (frozen, ro), runs)
  ro = {**ro, **_abstract_outputs(phased.ref, c, frozen, ro)}
  rollout_bytes = tree_bytes(ro)
  c = add("reward", phased.rew, (frozen, batch, ro, host), runs)
  scored, _ = _abstract_outputs(phased.rew, c, frozen, batch, ro, host)
  ro = {**ro, **scored}
  rollout_bytes = tree_bytes(ro)
  if stage.uses_value:
    c = add("values", phased.val, (state, ro), runs)
    ro = {**ro, **_abstract_outputs(phased.val, c, state, ro)}
    rollout_bytes = tree_bytes(ro)
  add("update", phased.upd, (state, frozen, batch, ro), runs)
  return out


# ----------------------------------------------------------------------------- the plan


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
  from jaxrlhf.train.pipeline import resolve_models
  mesh_cfg = mesh_cfg or cfg.mesh
  devices = jax.devices("cpu")[:n_devices]
  sizes = resolve_mesh_shape(mesh_cfg, n_devices)
  cfg = dataclasses.replace(cfg, mesh=MeshConfig(**sizes))
  cfg = resolve_models(cfg, sizes["tp"])
  mesh = make_mesh(cfg.mesh, devices)
  t0 = time.perf_counter()
  stages = [plan_stage(cfg, s, mesh, acc, full=full) for s in cfg.stages]
  return Plan(cfg.name, n_devices, acc, sizes, stages, cfg.plan.runs_per_month, cfg,
              time.perf_counter() - t0)


# -------------------------------------------------------------------------------- output


def _gb(x: float) -> str:
  return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x / GB:.1f}"


def _size(x: float) -> str:
  """Bytes with a unit that keeps 2-3 significant digits: 37G, 1.5G, 210M, 12K."""
  if x is None or (isinstance(x, float) and math.isnan(x)):
    return "-"
  for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
    if abs(x) >= scale:
      v = x / scale
      return f"{v:.1f}{unit}" if v < 100 else f"{v:.0f}{unit}"
  return f"{x:.0f}B"


def _bytes(x: float) -> str:
  return _size(x) + "B"


def _secs(x: float) -> str:
  if x is None or math.isnan(x):
    return "-"
  if x < 1e-3:
    return f"{x * 1e6:.0f}us"
  return f"{x * 1e3:.0f}ms" if x < 1 else f"{x:.1f}s"


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
      "mesh": plan.mesh, "fits": plan.fits, "est_step_seconds": main.est_step_seconds,
      "est_usd_per_step": plan.usd_per_step, "programs": progs,
      "memory": {"device_bytes": acc.memory_bytes, "usable_bytes": plan.usable_bytes,
                 "peak_bytes_per_device": max(s.peak.peak_bytes_per_device
                                              for s in plan.stages),
                 "largest_consumer": what, "largest_consumer_bytes": size,
                 "suggestion": fix},
      "stages": [{"stage": s.stage, "steps": s.steps, "may_end_early": s.may_end_early,
                  "mode": s.mode,
                  "est_step_seconds": s.est_step_seconds,
                  "tokens_per_s": s.tokens_per_step / s.est_step_seconds
                  if s.est_step_seconds > 0 else math.nan,
                  "models_in_memory": s.models_in_memory, "consumers": s.consumers}
                 for s in plan.stages],
      "cost": {"usd_per_hour_per_device": acc.usd_per_hour, "gpu_hours_per_run": plan.gpu_hours,
               "usd_per_run": plan.usd_per_run, "runs_per_month": plan.runs_per_month,
               "usd_per_month": usd_month, "band": band(usd_month)},
      "plan_seconds": plan.plan_seconds,
  }


def format_plan(plan: Plan) -> str:
  acc = plan.accelerator
  mesh = " x ".join(f"{k}={v}" for k, v in plan.mesh.items())
  lines = [f"{plan.experiment}: {plan.devices} x {acc.name} ({_gb(acc.memory_bytes)} GB, "
           f"{_gb(plan.usable_bytes)} GB usable), mesh {mesh}; planned in "
           f"{plan.plan_seconds:.0f}s on simulated devices",
           "per device: args/temp/out/peak from XLA's memory analysis (temp and peak without "
           "the CPU compiler's f32 copies; 'cpu' keeps them), FLOP and HBM bytes analytic, "
           "NVLink/net = collective bytes inside/across nodes; est = roofline time"]
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
          f"{p.name:<16} {'yes' if p.runs else '-':<4} {_size(p.argument_bytes):>6} "
          f"{_size(p.temp_bytes - p.cpu_upcast_bytes):>6} "
          f"{_size(p.output_bytes - p.alias_bytes):>6} {_size(p.peak_bytes_per_device):>6} "
          f"{_size(p.cpu_peak_bytes):>6} {fits:<4} {_size(p.flops):>6} "
          f"{_size(p.bytes_accessed):>6} {_size(p.comm_intra_bytes):>6} "
          f"{_size(p.comm_inter_bytes):>6} {_secs(p.est_seconds):>7}  {p.bound}")
    tps = s.tokens_per_step / s.est_step_seconds if s.est_step_seconds > 0 else math.nan
    lines.append(f"step: {_secs(s.est_step_seconds)} (roofline, a lower bound), "
                 f"{tps:,.0f} tokens/s")
    gen = next((p for p in s.programs if p.name.endswith("/generate")), None)
    if gen is not None and gen.bound == "collectives":
      # One gather per step instead of one per token: the decode loop's traffic once.
      steps = max(plan.cfg.rollout.max_new_tokens - 1, 1)
      once = (gen.comm_intra_bytes / steps / (acc.interconnect_bandwidth / 2)
              + gen.comm_inter_bytes / steps / node_of(acc.name)[1])
      without = max(gen.t_compute, gen.t_memory) + once
      lines.append(f"note: generation is bound by collectives: the rollout all-gathers the "
                   f"fsdp-sharded policy for every decoded token ({_bytes(gen.comm_inter_bytes)}"
                   f" across nodes per step); gathered once per step it would take about "
                   f"{_secs(without)} ({_secs(s.est_step_seconds - gen.est_seconds + without)} "
                   f"per step)")
  what, size, fix = plan.largest_consumer()
  peak = max(s.peak.peak_bytes_per_device for s in plan.stages)
  if plan.fits:
    lines.append(f"\nfits: peak {_bytes(peak)}/device of {_bytes(plan.usable_bytes)} usable; "
                 f"largest consumer: {what} ({_bytes(size)})")
    if peak > 0.9 * plan.usable_bytes:
      top = max((s.peak for s in plan.stages), key=lambda p: p.peak_bytes_per_device)
      lines.append(
          "note: the peak is within 10% of the limit"
          + (f", after subtracting an estimate of the f32 copies only XLA's CPU compiler makes "
             f"({_bytes(top.cpu_upcast_bytes)})" if top.cpu_upcast_bytes else "")
          + f"; leave headroom: {fix}")
  else:
    lines.append(f"\nDOES NOT FIT: peak {_bytes(peak)}/device > {_bytes(plan.usable_bytes)} "
                 f"usable on {acc.name}; largest consumer: {what} ({_bytes(size)}); {fix}; "
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
      f"): {_amount(plan.gpu_hours)} {acc.name}-hours, ${_amount(plan.usd_per_run)}; "
      f"{plan.runs_per_month:g} run(s)/month: ${_amount(usd_month)} -> {band(usd_month)}"
      + (f" (at {SLOWDOWN[1]:g}x: {real})" if real != band(usd_month) else ""))
  return "\n".join(lines)


def _amount(x: float) -> str:
  """Hours or dollars: whole numbers with separators, small ones with 3 significant digits
  (a tiny run's cost is not $0)."""
  return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def write_json(plan: Plan, workdir: str) -> str:
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, "plan.json")
  with open(path, "w") as f:
    json.dump(to_json(plan), f, indent=2, default=float)
  return path


# --------------------------------------------------------------------------------- search


def state_bytes(cfg: ExperimentConfig) -> float:
  """Bytes of every stage's parameters and AdamW states in total (the largest stage), before
  any sharding: what the devices must hold between them at least."""
  from jaxrlhf.train.pipeline import stage_class
  from jaxrlhf.data import DataSource
  data = DataSource(cfg.data, cfg.seed)
  best = 0.0
  for name in cfg.stages:
    stage = stage_class(name)(cfg, None, data)
    total = sum(3 * _param_bytes(cfg.role_model(r), h) for r, h in stage.trainable.items())
    total += sum(_param_bytes(cfg.role_model(r), h) for r, h in stage.frozen().items())
    best = max(best, total)
  return best


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
      plan = build_plan(cfg, n, acc, full=False, mesh_cfg=mesh_cfg)
      peak = max(s.peak.peak_bytes_per_device for s in plan.stages)
      tried.append((n, mesh_cfg, peak, "fits" if plan.fits else "too big"))
      log(f"  {n:>4} devices, tp={mesh_cfg.tp} fsdp={mesh_cfg.fsdp} dp={mesh_cfg.dp}: "
          f"peak {_gb(peak)} GB/device -> {'fits' if plan.fits else 'too big'} "
          f"({plan.plan_seconds:.0f}s)")
      if plan.fits:
        return plan, tried
  return None, tried


# ----------------------------------------------------------------------------- entry point


def main(cfg: ExperimentConfig, workdir: str, search: bool = False) -> int:
  """``--plan`` / ``--plan_search`` from jaxrlhf.main.  Returns the exit status."""
  acc = hardware.get_accelerator(cfg.plan.accelerator)
  if acc.measured:
    raise ConfigError("--accelerator=cpu cannot be planned for; choose one of "
                      + ", ".join(repr(k) for k in hardware.ACCELERATORS))
  n = max(SEARCH_COUNTS) if search else cfg.plan.devices
  if n < 1:
    raise ConfigError(f"plan.devices={n}: must be at least 1 (--devices=N)")
  simulate_devices(n)
  enable_compile_cache()
  if search:
    print(f"searching the smallest {acc.name} cluster for {cfg.name} "
          f"(usable {_gb(acc.memory_bytes * USABLE_FRACTION)} GB/device):")
    found, _ = find_smallest(cfg, acc)
    if found is None:
      print(f"error: {cfg.name} does not fit on up to {max(SEARCH_COUNTS)} {acc.name} "
            f"devices with these settings", file=sys.stderr)
      return 1
    mesh_cfg = MeshConfig(**found.mesh)
    print(f"smallest: {found.devices} x {acc.name}, mesh tp={mesh_cfg.tp} "
          f"fsdp={mesh_cfg.fsdp} dp={mesh_cfg.dp}; full plan:\n")
    plan = build_plan(cfg, found.devices, acc, mesh_cfg=mesh_cfg)
  else:
    plan = build_plan(cfg, n, acc)
  print(format_plan(plan))
  print(f"wrote {write_json(plan, workdir)}")
  return 0


# ------------------------------------------------------------------- the wrong-machine guard


def device_capacity(devices) -> tuple[float, str]:
  """Bytes one device can hold, and where the figure comes from: the allocator's limit on
  a GPU/TPU, the accelerator table when the runtime keeps no statistics, and on the CPU the
  host's memory shared by all its (simulated) devices."""
  d = devices[0]
  if d.platform == "cpu":
    total = hardware._host_memory_bytes()
    return total / len(devices), f"host memory {_gb(total)} GB shared by {len(devices)} " \
                                 f"cpu device{'s' if len(devices) > 1 else ''}"
  stats = d.memory_stats() if hasattr(d, "memory_stats") else None
  if stats and stats.get("bytes_limit"):
    return float(stats["bytes_limit"]), f"{d.device_kind} allocator limit"
  acc = hardware.detect_accelerator(d)
  if acc is not None:
    return acc.memory_bytes, f"{acc.name} datasheet"
  return math.inf, "unknown"


def states_per_device(cfg: ExperimentConfig, mesh) -> tuple[float, str]:
  """The largest stage's parameter and AdamW-moment bytes on one device of ``mesh`` (moments
  sharded like their parameters), and which stage that is.  Analytic: no compile, nothing
  allocated."""
  import jax
  from jaxrlhf import model as M
  from jaxrlhf.data import DataSource
  from jaxrlhf.mesh import FROZEN_PARAM_RULES, PARAM_RULES
  from jaxrlhf.train.pipeline import stage_class
  data = DataSource(cfg.data, cfg.seed)
  best, where = 0.0, ""
  for name in cfg.stages:
    stage = stage_class(name)(cfg, mesh, data)
    roles = [(r, h, PARAM_RULES, 3) for r, h in stage.trainable.items()]
    roles += [(r, h, FROZEN_PARAM_RULES, 1) for r, h in stage.frozen().items()]
    total = 0.0
    for role, head, rules, copies in roles:
      m = cfg.role_model(role)
      shardings = M.param_shardings(m, mesh, head, rules, check=False)
      shapes = M.abstract_params(m, head)
      total += copies * sum(leaf_bytes(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s))
                            for x, s in zip(jax.tree.leaves(shapes), jax.tree.leaves(shardings)))
    if total > best:
      best, where = total, name
  return best, where


def preflight(cfg: ExperimentConfig) -> None:
  """Stops a run, before anything is allocated, when the devices present cannot even hold the
  experiment's parameters and optimizer states (a lower bound on what it needs: activations
  come on top).  Takes milliseconds for small models and well under a second at 70B; raises
  ConfigError with what is needed against what is present and the --plan commands."""
  import jax
  from jaxrlhf.mesh import make_mesh, resolve_mesh_shape
  devices = jax.devices()
  n = len(devices)
  capacity, source = device_capacity(devices)
  try:
    resolve_mesh_shape(cfg.mesh, n)
    mesh = make_mesh(cfg.mesh, devices)
    need, stage = states_per_device(cfg, mesh)
    how = f"on mesh {dict(mesh.shape)}"
  except ConfigError:  # the mesh does not fit these devices: assume perfect sharding
    need_total = state_bytes(cfg)
    need, stage, how = need_total / n, cfg.stages[-1], "even if perfectly sharded"
  if need <= capacity:
    return
  mesh_text = ",".join(f"{k}={v}" for k, v in dataclasses.asdict(cfg.mesh).items())
  raise ConfigError(
      f"{cfg.name} cannot run on these devices: its {stage} stage's parameters and optimizer "
      f"states alone need {_gb(need)} GB per device ({n} {devices[0].platform} "
      f"device{'s' if n > 1 else ''} present, {how}), but a device holds "
      f"{_gb(capacity)} GB ({source}); activations come on top. It is sized for "
      f"{cfg.plan.devices} x {cfg.plan.accelerator} (mesh {mesh_text}). Size it without "
      f"allocating anything:\n"
      f"  python -m jaxrlhf.main --experiment={cfg.name} --plan "
      f"--devices={cfg.plan.devices} --accelerator={cfg.plan.accelerator}\n"
      f"  python -m jaxrlhf.main --experiment={cfg.name} --plan_search "
      f"--accelerator={cfg.plan.accelerator}")


# ------------------------------------------------------------------------------ compare


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
  lines = [f"\nours (compiled on simulated devices) vs the seed analysis, {acc.name}:", head]
  for r in rows:
    s = r["seed"]
    mem = f"{r['peak_bytes_per_device'] / GB:.0f} @{r['devices']}"
    lines.append(
        f"{r['experiment']:<8} {r['models_in_memory']:>6} {s['models_in_memory']:>5} | "
        f"{_min_text(r):>16} "
        f"{s['min_gpus']:>6} | {mem:>10} {'yes' if r['fits'] else 'NO':>4} "
        f"{s['memory_per_gpu']:>10} | {_secs(r['est_step_seconds']):>7} "
        f"{r['gpu_hours_per_run']:>9,.0f} {s['gpu_hours']:>11}")
  lines.append("dev-hours: the experiment's configured steps at the roofline step time (a lower "
               "bound); why the figures differ: docs/plan.md")
  return "\n".join(lines)


def _cli(argv=None) -> int:
  import argparse
  ap = argparse.ArgumentParser(prog="python -m jaxrlhf.plan",
                               description="Plan the 70B experiments next to the seed figures.")
  ap.add_argument("--compare", action="store_true", help="plan sft70b, dpo70b, grpo70b, ppo70b")
  ap.add_argument("--accelerator", default="h100", help="h100, h200, b200 or tpu-v5p")
  ap.add_argument("--workdir", default="runs/compare70b")
  ap.add_argument("--no_search", action="store_true",
                  help="skip finding each experiment's smallest cluster (faster)")
  args = ap.parse_args(argv)
  if not args.compare:
    ap.print_help()
    return 0
  try:
    compare(args.accelerator, args.workdir, search=not args.no_search)
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(_cli())
