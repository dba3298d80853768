"""Compile-and-read: one stage's programs lowered on abstract arrays, XLA's memory analysis,
the collectives read from the HLO, and a roofline time for each."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Optional

from jaxrlhf.config import ExperimentConfig
from jaxrlhf.train.preflight import dtype_bytes, tree_bytes
from jaxrlhf.plan.cluster import node_of
from jaxrlhf.plan.workload import Work, workload


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
  # Compute/HBM and collectives added, nothing overlapped: max(t_compute, t_memory) + t_comm.
  t_unoverlapped: float = math.nan
  # Read from the target compiler's schedule (None when compiled by XLA:CPU, which schedules
  # no asynchronous collectives for the target): t_unoverlapped less the collective time hidden
  # behind the computation scheduled between each asynchronous collective's start and done.
  t_overlapped: Optional[float] = None
  t_hidden: Optional[float] = None
  hlo_ops_seconds: Optional[float] = None  # the schedule's own roofline of its non-collectives
  async_collectives: Optional[int] = None  # in the compiled program (loop bodies once)
  sync_collectives: Optional[int] = None
  compile_seconds: float = 0.0
  largest_temporaries: list = dataclasses.field(default_factory=list)

  @property
  def cpu_peak_bytes(self) -> int:
    return self.peak_bytes_per_device + self.cpu_upcast_bytes


def compile_program(fn, *args):
  t0 = time.perf_counter()
  compiled = fn.lower(*args).compile()
  return compiled, time.perf_counter() - t0


def abstract_outputs(fn, compiled, *args):
  """The outputs of a jitted ``fn`` as ShapeDtypeStructs with the compiled shardings."""
  import jax
  shapes = jax.eval_shape(fn, *args)
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                      shapes, compiled.output_shardings)


def read_program(name: str, compiled, *, runs: bool, held: int, n_devices: int,
                 node_size: int, unknown_trip: int, half_f32_traffic: bool,
                 compile_seconds: float, cpu: bool = True,
                 modules: Optional[dict] = None) -> ProgramPlan:
  """Memory, raw cost and collective traffic of a compiled program.  ``held``: bytes per
  device resident while it runs (0 for a program that takes everything as arguments);
  what of it is not an argument of the compiled program counts towards its peak (jit drops
  unused arguments, so the compiled argument size is the measure).  ``cpu``: compiled by
  XLA:CPU, whose float32 copies of 16-bit arrays (and collectives) are taken out; a target's
  own compile (``cpu=False``) is read as it is, and its parsed HLO is kept in ``modules``
  (by program name) for :func:`overlap`."""
  from jaxrlhf.plan import hlo as plan_hlo
  mem = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else {}
  cost = cost or {}
  module = plan_hlo.parse_hlo(compiled.as_text())
  if modules is not None and not cpu:
    modules[name] = module
  upcast = plan_hlo.cpu_upcast_bytes(module) if cpu else 0
  half_f32_traffic = half_f32_traffic and cpu
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
  p.t_unoverlapped = max(p.t_compute, p.t_memory) + p.t_comm


def overlap(p: ProgramPlan, module, acc, node_bw: float, n_devices: int, node_size: int,
            unknown_trip: int) -> None:
  """Fills in how much of the program's collective time the target's schedule hides (in
  place; after :func:`roofline`).  The schedule (:func:`jaxrlhf.plan.hlo.schedule`) gives
  where computation lies between each asynchronous collective's start and done; its
  instructions' roofline is scaled so that they add up to the plan's own analytic
  ``max(t_compute, t_memory)``, so that the hidden time is in the plan's units."""
  from jaxrlhf.plan import hlo as plan_hlo
  if module is None or math.isnan(p.t_unoverlapped):
    return
  rates = plan_hlo.Rates(acc.peak_flops, acc.hbm_bandwidth, acc.interconnect_bandwidth / 2,
                         node_bw)
  args = (module, n_devices, node_size, rates, unknown_trip)
  raw = plan_hlo.schedule(*args)
  work = max(p.t_compute, p.t_memory)
  sched = plan_hlo.schedule(*args, ops_scale=work / raw.ops_seconds) if raw.ops_seconds else raw
  p.hlo_ops_seconds = raw.ops_seconds
  p.async_collectives, p.sync_collectives = sched.async_collectives, sched.sync_collectives
  p.t_hidden = min(sched.hidden_seconds, work, p.t_comm)
  p.t_overlapped = p.t_unoverlapped - p.t_hidden


def _sum_or_none(xs) -> Optional[float]:
  xs = list(xs)
  return None if not xs or any(x is None for x in xs) else sum(xs)


def sum_work(works) -> Work:
  works = [w for w in works if w is not None]
  return Work(sum(w.flops for w in works), sum(w.hbm_bytes for w in works),
              max((w.tokens for w in works), default=0.0))


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
  # An RL stage's decode layout (rollout.decode_layout): see :func:`decode_plan`.
  decode: Optional[dict] = None
  # The step with compute/HBM and collectives added (nothing overlapped), and as the target
  # compiler's schedule overlaps them (None when XLA:CPU compiled it): ProgramPlan's fields.
  unoverlapped_step_seconds: float = math.nan
  overlapped_step_seconds: Optional[float] = None

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


def decode_plan(stage, state, frozen, mesh, acc) -> dict:
  """What the decode layout costs and saves, per device: the policy copy it holds while
  generating, the bytes the once-per-step reshard gathers and their time at the link the
  fsdp groups use (NVLink inside a node, the network across nodes)."""
  import jax
  layout = "tp" if stage.decode_shardings is not None else "train"
  policy = state.params["policy"]
  if "policy" in stage.lora:  # what generation reads: the adapters over the frozen base
    base = frozen[stage.base_keys["policy"]]
    policy = {**base, "layers": {**base["layers"], "lora": policy["layers"]["lora"]}}
  else:  # the master's copy in param_dtype (Stage.view(decode=True))
    policy = stage.precision["policy"].view(policy)
  train_bytes = tree_bytes(policy)
  reads = decode_reads(stage, mesh, acc)
  if layout == "train":
    return {"layout": "train" if stage.cfg.rollout.decode_layout == "train" else
            "tp (the training layout: no fsdp)", "copy_bytes": 0.0, "reshard_bytes": 0.0,
            "reshard_seconds": 0.0, "policy_bytes": float(train_bytes), **reads}
  copy = tree_bytes(jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                 policy, stage.decode_shardings))
  sizes = dict(mesh.shape)
  node_size, node_bw = node_of(acc.name)
  crosses = sizes["tp"] * sizes["fsdp"] > node_size  # fsdp groups span nodes (tp is minor)
  bw = node_bw if crosses else acc.interconnect_bandwidth / 2
  gathered = copy - train_bytes
  return {"layout": "tp", "copy_bytes": float(copy), "reshard_bytes": float(gathered),
          "reshard_seconds": gathered / bw, "policy_bytes": float(train_bytes),
          "link": "network" if crosses else acc.interconnect, **reads}


def decode_reads(stage, mesh, acc) -> dict:
  """Bytes one decoded token reads per device (``token_bytes``: weights, the KV cache, its
  prompts' part, and the cache with ``rollout.prefix_sharing``), and the decode loop's time
  at the HBM roofline (``N - 1`` tokens) without and with prefix sharing."""
  from jaxrlhf.plan.workload import tp_share
  from jaxrlhf.train.work import decode_token_bytes
  n = mesh.size
  per = decode_token_bytes(stage, tp_share(stage.model_cfg("policy"), dict(mesh.shape)["tp"]),
                           n)
  per = {k: v / n for k, v in per.items()}
  steps = max(stage.N - 1, 1)
  loop = lambda kv: steps * (per["weights"] + kv) / acc.hbm_bandwidth  # noqa: E731
  return {"token_bytes": per, "decode_hbm_seconds": {"dense": loop(per["kv"]),
                                                      "shared": loop(per["kv_shared"])}}


def plan_stage(cfg: ExperimentConfig, name: str, mesh, acc, *, full: bool = True) -> StagePlan:
  """Compiles one stage's programs on abstract arrays.  ``full=False`` compiles only the
  programs that run (enough for memory; used by the search)."""
  import jax
  from jaxrlhf.data import DataSource
  from jaxrlhf.train.spec import build_stage
  n = mesh.size
  sizes = dict(mesh.shape)
  node_size, node_bw = node_of(acc.name)
  stage = build_stage(name, cfg, mesh, DataSource(cfg.data, cfg.seed))
  state, frozen = stage.abstract_init()
  batch = stage.abstract_batch()
  work = workload(stage, sizes)
  sixteen_bit = any(dtype_bytes(cfg.role_model(r).compute_dtype) == 2
                    for r in (*stage.trainable, *stage.frozen()))
  rl = stage.spec.generates
  unknown_trip = max(stage.N - 1, 1) if rl else 1
  on_cpu = mesh.devices.flat[0].platform == "cpu"
  modules: dict = {}  # the target's compiled HLO by program, for the overlap
  read = lambda label, c, secs, runs, held=0: read_program(
      f"{name}/{label}", c, runs=runs, held=held, n_devices=n, node_size=node_size,
      unknown_trip=unknown_trip, half_f32_traffic=sixteen_bit, compile_seconds=secs,
      cpu=on_cpu, modules=modules)
  programs: list[ProgramPlan] = []
  with jax.set_mesh(mesh):
    if getattr(stage, "episodes", None) is not None:
      # Multi-turn episodes run on the host between jitted pieces; their decoding is planned
      # as one single-turn generation over the rollout.max_new_tokens slots the turns share,
      # cut from the rest of the step as the episodes are.
      from jaxrlhf.train import program
      step_fn = program.PhasedProgram(stage, stage.phases(), state,
                                      timed=cfg.logging.phase_timing, host_fn=stage.host_scores)
    else:
      step_fn = stage.make_step_fn(state, frozen, batch)
    from jaxrlhf.train import program
    steps = program.parts(step_fn)
    one_program = [p.name for p in steps] == ["step"]
    if one_program:
      compiled, secs = compile_program(step_fn, state, frozen, batch)
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
    if label(p) == "score_and_update":  # everything after generation
      roofline(p, sum_work(w for k, w in work.items() if k != "generate"), n, acc, node_bw)
  if rl and one_program:
    roofline(programs[0], sum_work(work.values()), n, acc, node_bw)
  for p in programs:
    overlap(p, modules.pop(p.name, None), acc, node_bw, n, node_size, unknown_trip)
  # An RL step runs its phases one after another: the step's times are their sums.
  phases = [p for p in programs if label(p) in work] if rl and one_program else []
  timed = phases or ([p for p in programs if p.runs] if rl else programs[:1])
  step_seconds = sum(p.est_seconds for p in timed)
  unoverlapped = sum(p.t_unoverlapped for p in timed)
  overlapped = _sum_or_none(p.t_overlapped for p in timed)
  if phases:
    step = programs[0]
    step.est_seconds, step.bound = step_seconds, "sum of phases"
    step.t_unoverlapped, step.t_overlapped = unoverlapped, overlapped
    step.t_hidden = _sum_or_none(p.t_hidden for p in phases)
  tokens = work["generate" if rl else "step"].tokens
  models = _models_in_memory(stage, state)
  return StagePlan(stage=name, steps=stage.steps, mode=mode, programs=programs,
                   est_step_seconds=step_seconds, tokens_per_step=tokens,
                   unoverlapped_step_seconds=unoverlapped,
                   overlapped_step_seconds=overlapped,
                   consumers=_consumers(state, frozen, batch),
                   models_in_memory=models,
                   may_end_early=stage.stop_rule(),
                   decode=decode_plan(stage, state, frozen, mesh, acc) if rl else None)


def _models_in_memory(stage, state) -> list[str]:
  """One line per model the stage holds: trained (full, or LoRA adapters on which base) or
  frozen, with its size."""
  import jax
  cfg, models = stage.cfg, []
  for r, h in stage.trainable.items():
    if r in stage.lora:
      n = sum(x.size for x in jax.tree.leaves(state.params[r]))
      bk = stage.base_keys[r]
      on = f"on the {bk}'s weights" if bk in stage.frozen() else (
          f"on its frozen {cfg.role_model(r).num_params(h) / 1e9:.3g}B base")
      models.append(f"{r} (LoRA rank {stage.lora[r].rank}: {n / 1e6:.3g}M trained {on})")
    else:
      models.append(f"{r} ({cfg.role_model(r).num_params(h) / 1e9:.3g}B, trained)")
  return models + [f"{r} ({cfg.role_model(r).num_params(h) / 1e9:.3g}B, frozen)"
                   for r, h in stage.frozen().items()]


def _plan_phases(stage, state, frozen, batch, read, one_program: bool, step_fn):
  """The RL step's phased programs (train/program.py) as the trainer jits them -- around a
  host reward, or one per timing group -- chained on abstract carries."""
  import jax
  import jax.numpy as jnp
  from jaxrlhf.train import program
  from jaxrlhf.train.types import StepCarry
  phased = program.parts(step_fn) if not one_program else program.PhasedProgram(
      stage, stage.phases(), state, timed=True).programs()
  held = tree_bytes(state) + tree_bytes(frozen) + tree_bytes(batch)
  out = []
  carry = StepCarry(state=state)
  batch = {k: v for k, v in batch.items() if k != "host"}
  for part in phased:
    if part.host_scores and carry.host_score_B is None:
      rows = carry.rollout.tokens_BT.shape[0]
      carry = carry.replace(host_score_B=jax.ShapeDtypeStruct(
          (rows,), jnp.float32, sharding=carry.rollout.lengths_B.sharding))
    # The rollout so far also stays on the device between programs.
    rollout_bytes = tree_bytes((carry.rollout, carry.scored, carry.shaped))
    compiled, secs = compile_program(part.fn, frozen, batch, carry)
    out.append(read(part.name, compiled, secs, runs=not one_program,
                    held=held + rollout_bytes))
    carry = abstract_outputs(part.fn, compiled, frozen, batch, carry)
  return out
