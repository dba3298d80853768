"""A tiny, deterministic SFT-style training loop with checkpoints, run as a subprocess by
tests/test_checkpoint.py so that it can be killed (SIGKILL) or stopped (SIGTERM) for real.

State: step, a typed RNG key (used every step for a random token drop), TINY-model params, an
AdamW state (with a warm-up schedule, so the optimizer's step count matters) and a running
loss average.  Data: batch ``p`` is a pure function of the data position ``p``, kept in the
checkpoint's JSON ``extra``.  Each step's loss goes to ``--log`` (one JSON line per event), the
final state to ``--out`` (.npz).

Fault injection for the tests: ``--hang_after_save=N`` waits until checkpoint N is complete,
logs it and hangs; ``--hang_in_commit=N`` hangs inside orbax's commit of checkpoint N (all
data written, not yet renamed into place); ``--wait_for_signal_at=N`` idles after step N until
a stop signal arrives.
"""

import os

if __name__ == "__main__":
  # Only as the tests' subprocess: importing this module (test_resume does) must not change
  # the device count of the test process itself.
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=4").strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

jax.config.update("jax_threefry_partitionable", True)

from jaxrlhf import model as M  # noqa: E402
from jaxrlhf.checkpoint import Checkpointer, checkpoint_dir  # noqa: E402
from jaxrlhf.config import (CheckpointConfig, ExperimentConfig,  # noqa: E402
                            MeshConfig, ModelConfig, SFTConfig, to_dict)
from jaxrlhf.mesh import batch_sharding, make_mesh, replicated  # noqa: E402
from jaxrlhf.preemption import PreemptionHandler  # noqa: E402

MODEL = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                    mlp_dim=64, max_seq_len=32)
BATCH, LENGTH = 8, 12
T0 = time.time()


def parse():
  p = argparse.ArgumentParser()
  p.add_argument("--workdir", required=True)
  p.add_argument("--steps", type=int, default=8)
  p.add_argument("--every", type=int, default=4)
  p.add_argument("--resume", default="latest")
  p.add_argument("--log", required=True)
  p.add_argument("--out", default="")
  p.add_argument("--hang_after_save", type=int, default=-1)
  p.add_argument("--hang_in_commit", type=int, default=-1)
  p.add_argument("--wait_for_signal_at", type=int, default=-1)
  return p.parse_args()


def log(path, **event):
  with open(path, "a") as f:
    f.write(json.dumps({**event, "t": round(time.time() - T0, 3)}) + "\n")
    f.flush()
    os.fsync(f.fileno())


def batch_at(position: int, mesh):
  """Left-padded random tokens; a pure function of the data position."""
  rng = np.random.default_rng([1234, position])
  tokens = rng.integers(1, MODEL.vocab_size, size=(BATCH, LENGTH)).astype(np.int32)
  mask = np.arange(LENGTH)[None, :] >= rng.integers(0, 5, size=(BATCH, 1))
  s = batch_sharding(mesh, 2, tokens.shape)
  return jax.device_put(np.where(mask, tokens, 0), s), jax.device_put(mask, s)


def optimizer():
  sched = optax.warmup_cosine_decay_schedule(0.0, 3e-3, warmup_steps=3, decay_steps=20)
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.01))


def init_state(key):
  k_params, k_run = jax.random.split(key)
  params = M.init_params(MODEL, k_params)
  return {"step": jnp.zeros((), jnp.int32), "key": k_run, "params": params,
          "opt": optimizer().init(params), "loss_ema": jnp.zeros((), jnp.float32)}


def state_shardings(mesh):
  """Params on their logical-axis shardings, optimizer moments alongside, the rest replicated."""
  abstract = jax.eval_shape(init_state, jax.random.key(0))
  params = M.param_shardings(MODEL, mesh)
  opt = optax.tree_map_params(optimizer(), lambda _, s: s, abstract["opt"], params,
                              transform_non_params=lambda _: replicated(mesh))
  shardings = {"step": replicated(mesh), "key": replicated(mesh), "params": params, "opt": opt,
               "loss_ema": replicated(mesh)}
  return abstract, shardings


def train_step(state, tokens, mask):
  key, sub = jax.random.split(state["key"])
  keep = jax.random.bernoulli(sub, 0.9, mask.shape) & mask

  def loss_fn(params):
    h, _ = M.forward(params, tokens, M.positions_from_mask(mask), mask, cfg=MODEL)
    logp = jax.nn.log_softmax(M.lm_logits(params, h[:, :-1], MODEL))
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    w = keep[:, 1:].astype(jnp.float32)
    return jnp.sum(nll * w) / jnp.maximum(jnp.sum(w), 1.0)

  loss, grads = jax.value_and_grad(loss_fn)(state["params"])
  updates, opt = optimizer().update(grads, state["opt"], state["params"])
  new = {"step": state["step"] + 1, "key": key,
         "params": optax.apply_updates(state["params"], updates), "opt": opt,
         "loss_ema": 0.9 * state["loss_ema"] + 0.1 * loss}
  return new, loss


def hang_in_commit_of(step: int, log_path: str):
  """Makes orbax's commit of checkpoint ``step`` hang: data written, folder not renamed."""
  from orbax.checkpoint._src.path import atomicity
  original = atomicity.AtomicRenameTemporaryPath.finalize

  async def finalize(self, *args, **kwargs):
    if os.path.basename(str(self._final_path)) == str(step):
      log(log_path, event="committing", step=step, tmp=str(self.get()))
      await asyncio.sleep(3600)
    return await original(self, *args, **kwargs)

  atomicity.AtomicRenameTemporaryPath.finalize = finalize


def flat(tree) -> dict:
  out = {}
  for path, x in jax.tree_util.tree_leaves_with_path(tree):
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    out[jax.tree_util.keystr(path)] = np.asarray(jax.device_get(x))
  return out


def main():
  args = parse()
  if args.hang_in_commit >= 0:
    hang_in_commit_of(args.hang_in_commit, args.log)
  cfg = ExperimentConfig(name="ckpt_worker", model=MODEL, mesh=MeshConfig(dp=2, tp=2),
                         sft=SFTConfig(steps=args.steps, batch_size=BATCH),
                         checkpoint=CheckpointConfig(every_steps=args.every, keep=3))
  mesh = make_mesh(cfg.mesh)
  abstract, shardings = state_shardings(mesh)
  abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          abstract, shardings)
  step_fn = jax.jit(train_step, out_shardings=(shardings, replicated(mesh)), donate_argnums=0)
  ckpt = Checkpointer(checkpoint_dir(args.workdir, "sft"), cfg.checkpoint, to_dict(cfg))

  start, position = 0, 0
  point = ckpt.resume(abstract, args.resume, cfg)
  if point is None:
    state = jax.jit(init_state, out_shardings=shardings)(jax.random.key(cfg.seed))
  else:
    state, start, position = point.state, point.step, point.extra["data_position"]
  log(args.log, event="start", step=start)

  with PreemptionHandler() as stop:
    for step in range(start + 1, cfg.sft.steps + 1):
      state, loss = step_fn(state, *batch_at(position, mesh))
      position += 1
      log(args.log, event="step", step=step, loss=float(loss))
      extra = {"data_position": position, "stage": "sft"}
      ckpt.maybe_save(step, state, extra=extra)
      if step == args.hang_in_commit:
        ckpt.wait()  # never returns: the commit hangs until the test kills us
      if step == args.hang_after_save:
        ckpt.wait()
        log(args.log, event="saved", step=step)
        time.sleep(3600)
      if step == args.wait_for_signal_at:
        log(args.log, event="waiting", step=step)
        while not stop.should_stop():
          time.sleep(0.02)
      if stop.should_stop():
        ckpt.save_now(step, state, extra)
        ckpt.close()
        print(stop.message(step, ckpt.directory), flush=True)
        log(args.log, event="stopped", step=step)
        return 0
  ckpt.save_now(cfg.sft.steps, state, {"data_position": position, "stage": "sft"})
  ckpt.close()
  if args.out:
    np.savez(args.out, **flat(state))
  log(args.log, event="done", step=cfg.sft.steps)
  return 0


if __name__ == "__main__":
  sys.exit(main())
