"""Entry point: ``python -m jaxrlhf.main --experiment=NAME|path/to/exp.py [--set=a.b=v ...]``
(or ``--config=run.json``, a config ``--print_config`` wrote).

Flags -> experiment config -> train (default), or ``--plan`` (size the run for a cluster).

The error boundary (:func:`main`): a user's mistake (a setting, a data file, a model or adapter
folder, an experiment file, a host reward or environment under ``errors=raise``: every
``ConfigError``, ``HFError`` and ``EnvError``) prints one ``error:`` line naming the file or
field and the fix, and exits with status 2.  Any other exception is a bug in jaxrlhf and keeps
its traceback, for the bug report.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Optional

from absl import app, flags

from jaxrlhf import registry
from jaxrlhf.cli import guarded, say_error
from jaxrlhf.config import (STAGE_NAMES, ConfigError, ExperimentConfig, apply_overrides,
                            load_config_file, to_json, validate)
from jaxrlhf.metrics import SinkError

DEFAULT_EXPERIMENT = "tiny_ppo"

_EXPERIMENT = flags.DEFINE_string(
    "experiment", DEFAULT_EXPERIMENT,
    "Experiment to run (experiments/NAME.py), or your own file path/to/my_experiment.py that "
    "registers one. One of: " + ", ".join(registry.names()))
_CONFIG = flags.DEFINE_string(
    "config", None, "Read the whole config from a JSON file (what --print_config writes, or a "
    "run's saved config); --set and the other flags apply on top. Replaces --experiment.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Output folder (default: runs/EXPERIMENT).")
_STEPS = flags.DEFINE_integer("steps", None, "Cap the steps of every stage (smoke runs).")
_SET = flags.DEFINE_multi_string(
    "set", [], "Override a config field by dotted name, e.g. --set=ppo.kl.coef=0.05 "
    "(repeatable). See --print_config for every field.")
_PRINT_CONFIG = flags.DEFINE_bool("print_config", False, "Print the resolved config and exit.")
_LIST = flags.DEFINE_bool("list", False, "List the experiments and exit.")
_RESUME = flags.DEFINE_string("resume", "latest", "none | latest | STEP: where to resume from.")
_PLAN = flags.DEFINE_bool("plan", False, "Compile the experiment's programs for a cluster and "
                          "report memory, FLOPs, time and cost; allocates nothing.")
_PLAN_SEARCH = flags.DEFINE_bool("plan_search", False,
                                 "Find the smallest device count and mesh on which it fits.")
_DEVICES = flags.DEFINE_integer("devices", None, "Device count to plan for (--plan).")
_ACCELERATOR = flags.DEFINE_string("accelerator", None,
                                   "Accelerator to plan for: h100, h200, b200, tpu-v5p.")
_MESH = flags.DEFINE_string("mesh", None, "Mesh override, e.g. dp=2,fsdp=4,tp=8.")
_PROFILE = flags.DEFINE_string("profile_steps", None,
                               "A:B captures a jax.profiler trace of steps A..B into WORKDIR.")
_COORD = flags.DEFINE_string("coordinator_address", None,
                             "Multi-process: host:port of process 0 (enables jax.distributed).")
_NPROC = flags.DEFINE_integer("num_processes", None, "Multi-process: number of processes.")
_PID = flags.DEFINE_integer("process_id", None, "Multi-process: this process's id.")
_ROLE = flags.DEFINE_string(
    "role", None, "Disaggregated RL, the experiment's last stage (PPO, GRPO; docs/pools.md): "
    "actor | critic (one pool, talking to the "
    "other through Redis) | all (both pools and, if none is configured, a loopback Redis).")
_REDIS_URL = flags.DEFINE_string(
    "redis_url", "", "Redis for --role: redis://HOST:PORT/DB (default $JAXRLHF_REDIS_URL, else "
    "127.0.0.1:6379); the password comes from $JAXRLHF_REDIS_PASSWORD.")
_CRITIC_DEVICES = flags.DEFINE_integer(
    "critic_devices", None, "--plan --role=all: the critic pool's device count (default "
    "--devices); --devices is the actor's.")
_CRITIC_ACCELERATOR = flags.DEFINE_string(
    "critic_accelerator", None, "--plan --role=all: the critic pool's accelerator (default "
    "--accelerator).")
_POOL_EVENTS = flags.DEFINE_string("pool_events", "",
                                   "--role: append what the pool did (JSON lines) to this file.")


# Flags that set one config field each: flag -> (dotted field, how the value is written).
FLAG_FIELDS = {
    "devices": ("plan.devices", str),
    "accelerator": ("plan.accelerator", str),
    "coordinator_address": ("distributed.coordinator_address", str),
    "num_processes": ("distributed.num_processes", str),
    "process_id": ("distributed.process_id", str),
}


def flag_overrides(values: dict) -> list[str]:
  """``--set``-style overrides for the flags given (``values``: flag name -> value or None):
  each :data:`FLAG_FIELDS` flag sets its field, ``--mesh=dp=2,tp=8`` the mesh axes, and a
  coordinator address turns multi-process start-up on."""
  out = []
  mesh = values.get("mesh")
  if mesh:
    for part in mesh.split(","):
      if "=" not in part:
        raise ConfigError(f"--mesh={mesh!r}: use AXIS=SIZE pairs, e.g. --mesh=dp=2,fsdp=4,tp=8")
      out.append("mesh." + part.strip())
  if values.get("coordinator_address"):
    out.append("distributed.enabled=true")
  for flag, (field, text) in FLAG_FIELDS.items():
    if values.get(flag) not in (None, ""):
      out.append(f"{field}={text(values[flag])}")
  return out


def resolve_config(experiment: str, overrides, flag_values: Optional[dict] = None,
                   steps=None, required: bool = True, config_file=None) -> ExperimentConfig:
  """The experiment's config (a registered name, a user's .py file, or ``config_file``: JSON
  from --print_config) with ``--set`` overrides, then the flags' fields
  (:func:`flag_overrides`), and ``--steps`` capping every stage, checked (config.validate;
  ``required=False`` lets a template's config print without your model and data); raises
  ConfigError."""
  cfg = (load_config_file(config_file) if config_file
         else registry.resolve(experiment or DEFAULT_EXPERIMENT))
  cfg = apply_overrides(cfg, list(overrides) + flag_overrides(flag_values or {}))
  if steps is not None:
    if steps <= 0:
      raise ConfigError(f"--steps={steps}: must be positive")
    for stage in STAGE_NAMES:
      sub = getattr(cfg, stage)
      cfg = dataclasses.replace(cfg, **{stage: dataclasses.replace(sub, steps=min(sub.steps, steps))})
  return validate(resolve_models(cfg), required)


def resolve_models(cfg: ExperimentConfig) -> ExperimentConfig:
  """``cfg`` with the architecture of every role that sets ``hf_path`` read from its checkpoint
  (:func:`jaxrlhf.model.hf.resolve_models`), so the checks, ``--plan`` and ``--print_config``
  see the real model rather than a template's placeholder shape."""
  roles = (cfg.model, cfg.reward_model, cfg.value_model, cfg.guard_model)
  if not any(m is not None and m.hf_path for m in roles):
    return cfg  # no transformers import for the built-in models
  from jaxrlhf.model.hf import configs
  return configs.resolve_models(cfg)


def _run(argv) -> int:
  if len(argv) > 1:
    raise ConfigError(f"unexpected arguments {argv[1:]}; flags look like --experiment=NAME")
  if _LIST.value:
    for name in registry.names():
      print(f"{name:12s} {registry.get(name).description}")
    return 0
  if _CONFIG.value and flags.FLAGS["experiment"].present:
    raise ConfigError(f"--config={_CONFIG.value} holds the whole experiment; drop "
                      f"--experiment={_EXPERIMENT.value} (change fields with --set)")
  flag_values = {name: flags.FLAGS[name].value for name in (*FLAG_FIELDS, "mesh")}
  cfg = resolve_config(_EXPERIMENT.value, _SET.value, flag_values, _STEPS.value,
                       required=not _PRINT_CONFIG.value, config_file=_CONFIG.value)
  if cfg.pools.redis_url or _REDIS_URL.value:
    # Before anything prints or saves the config: no credentials in a Redis URL.
    from jaxrlhf.pools.store import check_url
    check_url(_REDIS_URL.value or cfg.pools.redis_url)
  if _PRINT_CONFIG.value:
    print(to_json(cfg))
    return 0
  workdir = _WORKDIR.value or os.path.join("runs", cfg.name)

  if _ROLE.value:
    from jaxrlhf.pools.run import ROLES
    if _ROLE.value not in ROLES:
      raise ConfigError(f"--role={_ROLE.value!r}: use one of {', '.join(ROLES)}")
  if _PLAN.value and _ROLE.value:
    from jaxrlhf.pools import plan as pools_plan
    print(pools_plan.format_pipeline(pools_plan.plan_pools(
        cfg, cfg.plan.devices, cfg.plan.accelerator, _CRITIC_DEVICES.value or cfg.plan.devices,
        _CRITIC_ACCELERATOR.value or cfg.plan.accelerator)))
    return 0
  if _PLAN.value or _PLAN_SEARCH.value:
    # Lazy: planning sets up simulated devices before jax starts its backends.
    from jaxrlhf.plan import cli as plan_cli
    return plan_cli.main(cfg, workdir, search=_PLAN_SEARCH.value)

  if _ROLE.value == "all":
    from jaxrlhf.pools import run as pools_run
    return pools_run.run_all(cfg, workdir, sys.argv, _REDIS_URL.value, resume=_RESUME.value)
  from jaxrlhf import distributed
  if distributed.wanted(cfg.distributed):
    distributed.initialize(cfg.distributed)
  if _ROLE.value:
    from jaxrlhf.pools import run as pools_run
    return pools_run.run_role(cfg, workdir, _ROLE.value, _REDIS_URL.value, _POOL_EVENTS.value,
                              resume=_RESUME.value)
  from jaxrlhf.train import pipeline
  return pipeline.run(cfg, workdir, resume=_RESUME.value, profile_steps=_PROFILE.value)


def main(argv) -> None:
  def run() -> int:
    try:
      return _run(argv)
    except SinkError as e:  # logging.sink_errors=stop
      say_error(str(e))
      return 1
    except KeyboardInterrupt:
      # Ctrl-C outside training (set-up, planning): during training the loop catches it,
      # stops at a step boundary and checkpoints.
      print("interrupted outside a training step (set-up or planning); nothing new was saved",
            file=sys.stderr)
      return 130

  # The file system refusing (full disk, read-only or missing folder, a file where a folder
  # goes) is the cause and the path in one line, not a traceback through the writers.
  sys.exit(guarded(run, os_hint="check the --workdir folder (free space, permissions, path)"))


def entry():
  if any(a in ("--help", "-h", "--helpshort", "--helpfull") for a in sys.argv[1:]):
    # absl's own --help exits with status 1; asking for help is not an error.
    print(__doc__)
    print(flags.FLAGS.main_module_help())
    sys.exit(0)
  try:
    flags.FLAGS(sys.argv)  # a trial parse, so a bad flag is one error line and status 2
  except flags.Error as e:
    print(f"error: {e} (python -m jaxrlhf.main --help lists the flags)", file=sys.stderr)
    sys.exit(2)
  flags.FLAGS.unparse_flags()  # app.run parses again; repeated flags (--set) must not double
  app.run(main)


if __name__ == "__main__":
  entry()
