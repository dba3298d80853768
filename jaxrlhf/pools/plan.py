"""Sizing a disaggregated RL run (PPO, GRPO...): each pool on its own device count and accelerator, and the
pipeline's step time and cost.

``python -m jaxrlhf.main --experiment=ppo70b --plan --role=all --devices=32 --accelerator=h100
--critic_devices=8 --critic_accelerator=h100``

Each pool's phases are timed by the planner's analytic roofline (:func:`jaxrlhf.plan.workload`
on the pool's own mesh: the slower of compute and HBM traffic per device; collectives and
memory are not modelled here — ``--plan`` of the colocated stage compiles the programs and
checks memory).  The actor runs generation, reference log-probs and the policy update; the
critic reward (+ guard), and for PPO value scoring and the value update (GRPO's critic
trains nothing).  A step then takes:

* sync: actor generation + reference, then critic scoring, then the two updates side by side
  (the critic publishes advantages before its own update): ``gen + ref + score +
  max(policy update, value update)``;
* async (one step off): the two pools run concurrently, so the slower pool bounds the step:
  ``max(actor, critic)``.

Cost per step is the step time times both pools' hourly prices.  These are lower bounds, like
every roofline figure of the planner.
"""

from __future__ import annotations

import dataclasses
import math

from jaxrlhf import hardware
from jaxrlhf.plan.cluster import node_of
from jaxrlhf.plan.workload import Work, train_bytes, workload
from jaxrlhf.config import ConfigError, ExperimentConfig
from jaxrlhf.perf import decoder_flops

ACTOR_PHASES = ("generate", "reference", "update_policy")
CRITIC_PHASES = ("reward", "values", "update_value")


@dataclasses.dataclass(frozen=True)
class PoolPlan:
  role: str
  devices: int
  accelerator: hardware.Accelerator
  mesh: dict  # dp, fsdp, tp
  phases: dict  # phase -> seconds (roofline)

  @property
  def seconds(self) -> float:
    return sum(self.phases.values())

  @property
  def usd_per_hour(self) -> float:
    return self.devices * self.accelerator.usd_per_hour


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
  experiment: str
  mode: str
  actor: PoolPlan
  critic: PoolPlan
  steps: int
  stage: str = "ppo"

  @property
  def step_seconds(self) -> float:
    a, c = self.actor.phases, self.critic.phases
    if self.mode == "async":
      return max(self.actor.seconds, self.critic.seconds)
    return (a["generate"] + a.get("reference", 0.0) + c["reward"] + c.get("values", 0.0)
            + max(a["update_policy"], c.get("update_value", 0.0)))

  @property
  def bound(self) -> str:
    return "actor" if self.actor.seconds >= self.critic.seconds else "critic"

  @property
  def usd_per_hour(self) -> float:
    return self.actor.usd_per_hour + self.critic.usd_per_hour

  @property
  def usd_per_step(self) -> float:
    return self.step_seconds * self.usd_per_hour / 3600

  @property
  def steps_per_minute(self) -> float:
    return 60.0 / self.step_seconds


def pool_mesh(n: int, accelerator: str) -> dict:
  """Tensor parallelism inside a node (up to its size), data parallelism across."""
  node = node_of(accelerator)[0]
  tp = math.gcd(n, min(node, 8))
  return {"dp": n // tp, "fsdp": 1, "tp": tp}


def _seconds(work: Work, n: int, acc) -> float:
  return max(work.flops / n / acc.peak_flops, work.hbm_bytes / acc.hbm_bandwidth)


def plan_pool(stage, role: str, n: int, acc, mesh: dict = None) -> PoolPlan:
  """Roofline seconds of ``role``'s phases of the RL ``stage`` on ``n`` devices of ``acc``."""
  mesh = mesh or pool_mesh(n, acc.name)
  cfg, scfg = stage.cfg, stage.scfg
  work = workload(stage, mesh)
  rows, T = scfg.batch_size * stage.n, stage.P + stage.N
  passes = scfg.ppo_epochs * scfg.num_minibatches * scfg.optim.grad_accum
  if role == "actor":
    m = cfg.role_model("policy")
    upd = Work(scfg.ppo_epochs * decoder_flops(m, rows, T, head_positions=stage.N,
                                                 train=True),
                 train_bytes(m, "lm", mesh, passes, stage.precision["policy"]))
    phases = {"generate": work["generate"], "update_policy": upd}
    if "reference" in work:
      phases["reference"] = work["reference"]
  else:
    phases = {"reward": work.get("reward", Work(0.0, 0.0))}
    if "value" in stage.trainable:
      m = cfg.role_model("value")
      upd = Work(scfg.ppo_epochs * decoder_flops(m, rows, T, head="scalar", train=True),
                 train_bytes(m, "scalar", mesh, passes, stage.precision["value"]))
      phases.update({"values": work["values"], "update_value": upd})
  return PoolPlan(role=role, devices=n, accelerator=acc, mesh=mesh,
                  phases={k: _seconds(w, n, acc) for k, w in phases.items()})


def plan_pools(cfg: ExperimentConfig, actor_devices: int, actor_accelerator: str,
               critic_devices: int, critic_accelerator: str) -> PipelinePlan:
  from jaxrlhf.pools import common as C
  C.check_config(cfg)
  for what, n in (("--devices", actor_devices), ("--critic_devices", critic_devices)):
    if n < 1:
      raise ConfigError(f"{what}={n}: each pool needs at least one device")
  # Construction allocates nothing; the mesh is not used by the analytic figures.
  stage = C.build_stage(cfg, None)
  accs = {r: hardware.get_accelerator(a) for r, a in (("actor", actor_accelerator),
                                                      ("critic", critic_accelerator))}
  return PipelinePlan(experiment=cfg.name, mode=cfg.pools.mode, steps=stage.steps,
                      stage=stage.name,
                      actor=plan_pool(stage, "actor", actor_devices, accs["actor"]),
                      critic=plan_pool(stage, "critic", critic_devices, accs["critic"]))


def format_pipeline(p: PipelinePlan) -> str:
  lines = [f"{p.experiment}: disaggregated {p.stage.upper()}, mode {p.mode} (roofline lower "
           "bounds)"]
  for pool in (p.actor, p.critic):
    m = pool.mesh
    phases = ", ".join(f"{k} {v:.3g}s" for k, v in pool.phases.items())
    lines.append(f"  {pool.role:6s} {pool.devices:4d} x {pool.accelerator.name} "
                 f"(tp={m['tp']} dp={m['dp']}): {pool.seconds:.3g}s/step ({phases}); "
                 f"${pool.usd_per_hour:,.0f}/h")
  lines.append(f"  step {p.step_seconds:.3g}s = {p.steps_per_minute:.3g} steps/min "
               f"(slower pool: {p.bound}); ${p.usd_per_hour:,.0f}/h, ${p.usd_per_step:.3g}/step, "
               f"${p.usd_per_step * p.steps:,.0f} for {p.steps} steps")
  return "\n".join(lines)
