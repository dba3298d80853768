"""Runs the real training pipeline (``jaxrlhf.train.pipeline.run``) on a tiny config in a
subprocess, so tests/test_resume.py can kill it (SIGKILL) or stop it (SIGTERM) for real.

``--algo=ppo``: PPO alone; ``--algo=grpo``: SFT (2 steps) then GRPO; ``--algo=sft``: SFT
alone.  Every stage trains ``--steps`` steps (SFT in the GRPO chain: 2) with a checkpoint every
``--every`` steps on a 2-device ``dp=2`` mesh; ``--set`` overrides any config field.

Fault injection (in ``--stage``, default the last stage): ``--hang_after_save=N`` waits until
checkpoint N is complete on disk, logs ``saved`` and hangs; ``--wait_for_signal_at=N`` logs
``waiting`` after step N (at its checkpoint call) and idles until a stop signal arrives.
Events go to ``--log`` as JSON lines.
"""

import os

if __name__ == "__main__":
  # Only as the tests' subprocess: importing this module (test_resume does) must not change
  # the device count of the test process itself.
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=2").strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402

jax.config.update("jax_threefry_partitionable", True)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from jaxrlhf import checkpoint, preemption  # noqa: E402
from jaxrlhf.config import (CheckpointConfig, LoggingConfig, MeshConfig,  # noqa: E402
                            apply_overrides)
from jaxrlhf.train import pipeline  # noqa: E402
from test_train import config as tiny_config  # noqa: E402

STAGES = {"ppo": ("ppo",), "grpo": ("sft", "grpo"), "sft": ("sft",)}


def build(args):
  cfg = tiny_config()
  steps = {s: args.steps for s in STAGES[args.algo]}
  if args.algo == "grpo":
    steps["sft"] = 2
  cfg = dataclasses.replace(
      cfg, name=f"resume_{args.algo}", stages=STAGES[args.algo], mesh=MeshConfig(dp=2),
      checkpoint=CheckpointConfig(every_steps=args.every, keep=3),
      logging=LoggingConfig(console_every_s=0.0),
      **{s: dataclasses.replace(getattr(cfg, s), steps=n, eval_every=0)
         for s, n in steps.items()})
  return apply_overrides(cfg, args.set)


def log(path, **event):
  with open(path, "a") as f:
    f.write(json.dumps(event) + "\n")
    f.flush()
    os.fsync(f.fileno())


def install_hooks(args, stage):
  """Wraps the loop's per-step checkpoint seam with the faults: ``Checkpointer.due`` (asked
  once a step) for the wait, ``Checkpointer.save_now`` (each save the loop starts) for the
  hang."""
  handlers = []
  enter = preemption.PreemptionHandler.__enter__

  def remember(self):
    handlers.append(self)
    return enter(self)

  preemption.PreemptionHandler.__enter__ = remember
  due, save_now = checkpoint.Checkpointer.due, checkpoint.Checkpointer.save_now

  def ours(self):
    return self.directory.rstrip("/").split("/")[-2] == stage

  def hooked_due(self, step, *, force=False):
    answer = due(self, step, force=force)
    if not force and ours(self) and step == args.wait_for_signal_at:
      log(args.log, event="waiting", step=step)
      while not handlers[-1].requested:
        time.sleep(0.02)
    return answer

  def hooked_save_now(self, step, state, extra=None, metrics=None):
    started = save_now(self, step, state, extra, metrics)
    if ours(self) and step == args.hang_after_save and started:
      self.wait()
      log(args.log, event="saved", step=step)
      time.sleep(3600)
    return started

  checkpoint.Checkpointer.due = hooked_due
  checkpoint.Checkpointer.save_now = hooked_save_now


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--workdir", required=True)
  p.add_argument("--algo", choices=sorted(STAGES), required=True)
  p.add_argument("--steps", type=int, default=8)
  p.add_argument("--every", type=int, default=4)
  p.add_argument("--resume", default="latest")
  p.add_argument("--set", action="append", default=[])
  p.add_argument("--log", required=True)
  p.add_argument("--stage", default="")
  p.add_argument("--hang_after_save", type=int, default=-1)
  p.add_argument("--wait_for_signal_at", type=int, default=-1)
  args = p.parse_args()
  cfg = build(args)
  install_hooks(args, args.stage or cfg.stages[-1])
  rc = pipeline.run(cfg, args.workdir, resume=args.resume)
  log(args.log, event="exit", rc=rc)
  return rc


if __name__ == "__main__":
  sys.exit(main())
