"""Checkpoints and resume: bit-identical round trips, retention, resharding, real kills.

The subprocess tests run tests/ckpt_worker.py (a tiny deterministic training loop) and kill it
with SIGKILL / stop it with SIGTERM for real.  They share a persistent compilation cache so
only the first worker compiles.
"""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrlhf import checkpoint as C
from jaxrlhf import model as M
from jaxrlhf.config import CheckpointConfig, ConfigError, ExperimentConfig, LoggingConfig, to_dict
from jaxrlhf.mesh import replicated
from helpers import TINY, mesh, read_events, wait_for_event

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CFG = ExperimentConfig(name="ckpt_test", model=TINY)


@flax.struct.dataclass
class _TrainState:
  """Shaped like the trainer's state: a dataclass pytree of arrays and dicts."""

  step: jax.Array
  rng: jax.Array
  params: dict
  opt_state: dict
  extras: dict


def _sharded_state(m, seed=0):
  """A trainer-like state on mesh ``m``: TINY params and an AdamW state (random values, so
  every moment is distinct), a typed key, KL controller and running reward statistics.
  Filled on the host and placed with ``device_put``: nothing to compile."""
  tx = optax.adamw(1e-3)
  abstract = jax.eval_shape(lambda k: (lambda p: (p, tx.init(p)))(M.init_params(TINY, k)),
                            jax.random.key(0))
  rng = np.random.default_rng(seed)
  params, opt = jax.tree.map(lambda a: rng.standard_normal(a.shape).astype(a.dtype), abstract)
  shard = M.param_shardings(TINY, m)
  opt_shard = optax.tree_map_params(tx, lambda _, s: s, abstract[1], shard,
                                    transform_non_params=lambda _: replicated(m))
  params, opt = jax.device_put((params, opt), (shard, opt_shard))
  return _TrainState(step=jnp.int32(7), rng=jax.random.key(seed + 11), params={"policy": params},
                     opt_state={"policy": opt},
                     extras={"kl/coef": jnp.float32(0.05), "reward/mean": jnp.float32(0.25),
                             "reward/var": jnp.float32(1.5), "reward/count": jnp.int32(96)})


def _params(m=None, seed=0):
  """Random TINY params (numpy; on ``m``'s parameter shardings when given)."""
  rng = np.random.default_rng(seed)
  params = jax.tree.map(lambda a: rng.standard_normal(a.shape).astype(a.dtype),
                        M.abstract_params(TINY))
  return params if m is None else jax.device_put(params, M.param_shardings(TINY, m))


def _abstract(state, shardings=None):
  """ShapeDtypeStructs of ``state`` with the given shardings (default: the state's own)."""
  if shardings is None:
    shardings = jax.tree.map(lambda x: x.sharding, state)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      state, shardings)


def _host(tree):
  def one(x):
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    return np.asarray(jax.device_get(x))
  return jax.tree.map(one, tree)


def _assert_bit_identical(a, b):
  ta, tb = jax.tree.structure(a), jax.tree.structure(b)
  assert ta == tb, (ta, tb)
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype and x.shape == y.shape, jax.tree_util.keystr(path)
    assert x.tobytes() == y.tobytes(), jax.tree_util.keystr(path)


def _small_state(v):
  return {"w": jnp.full((4,), v, jnp.float32)}


# ------------------------------------------------------------------------ in-process tests


def test_round_trip_is_bit_identical_and_async_save_survives_donation(tmp_path):
  m = mesh(dp=2, tp=4)
  state = _sharded_state(m)
  expected = _host(state)
  abstract = _abstract(state)
  extra = {"data_position": 17, "stage": "ppo", "policy_version": np.int64(3)}
  frozen = {"reference": {"stage": "sft", "role": "policy", "id": "abc"}}
  ckpt = C.Checkpointer(str(tmp_path / "ckpt"), CheckpointConfig(every_steps=7, async_save=True),
                        to_dict(CFG), frozen=frozen)
  assert ckpt.maybe_save(7, state, extra=extra)
  # The training step that follows donates the state while the save is still being written.
  step = jax.jit(lambda s: jax.tree.map(
      lambda x: x + 1 if jnp.issubdtype(x.dtype, jnp.floating) else x, s), donate_argnums=0)
  embed = state.params["policy"]["embed"]
  state = step(state)
  jax.block_until_ready(state)
  assert embed.is_deleted()  # the buffers the save was given are gone
  ckpt.wait()
  restored, got_extra = ckpt.restore(abstract)
  _assert_bit_identical(_host(restored), expected)
  assert got_extra == {"data_position": 17, "stage": "ppo", "policy_version": 3}
  assert isinstance(restored, _TrainState)
  assert jnp.issubdtype(restored.rng.dtype, jax.dtypes.prng_key)
  assert type(restored.opt_state["policy"][0]).__name__ == "ScaleByAdamState"
  for r, a in zip(jax.tree.leaves(restored), jax.tree.leaves(abstract)):
    assert r.sharding == a.sharding
  assert ckpt.saved_config() == json.loads(json.dumps(to_dict(CFG)))
  assert ckpt.saved_frozen() == frozen
  ckpt.close()


def test_cadence_keep_last_k_plus_best(tmp_path):
  now = [0.0]
  cfg = CheckpointConfig(every_steps=2, every_seconds=100.0, keep=2, best_metric="eval/acc",
                         best_mode="max", async_save=False)
  ckpt = C.Checkpointer(str(tmp_path / "a"), cfg, to_dict(CFG), clock=lambda: now[0])
  acc = {2: 0.1, 4: 0.9, 6: 0.3, 8: 0.2, 10: 0.4}
  saved = []
  for step in range(1, 11):
    now[0] += 1.0
    metrics = {"eval/acc": acc[step]} if step in acc else None
    if ckpt.maybe_save(step, _small_state(step), extra={"p": step}, metrics=metrics):
      saved.append(step)
  assert saved == [2, 4, 6, 8, 10]
  # The last two, plus step 4, the best accuracy even though it is old.
  assert ckpt.all_steps() == [4, 8, 10]
  assert ckpt.best_step() == 4
  # every_seconds: step 11 is not a multiple of 2, but 100 s have passed since step 10.
  assert not ckpt.maybe_save(11, _small_state(11), extra={})
  now[0] += 100.0
  assert ckpt.maybe_save(11, _small_state(11), extra={})
  # A forced save of an already-saved step is a no-op, not an error (final save at a cadence
  # step).
  assert not ckpt.maybe_save(11, _small_state(11), extra={}, force=True)
  ckpt.close()

  low = CheckpointConfig(every_steps=1, keep=1, best_metric="loss", best_mode="min",
                         async_save=False)
  ckpt = C.Checkpointer(str(tmp_path / "b"), low, to_dict(CFG))
  for step, loss in enumerate([3.0, 1.0, 2.0, 4.0], start=1):
    ckpt.maybe_save(step, _small_state(step), extra={}, metrics={"loss": np.float32(loss)})
  assert ckpt.all_steps() == [2, 4] and ckpt.best_step() == 2
  ckpt.close()

  off = C.Checkpointer(str(tmp_path / "c"), CheckpointConfig(enabled=False, every_steps=1),
                       to_dict(CFG))
  assert not off.maybe_save(1, _small_state(1), extra={}, force=True)
  assert off.all_steps() == [] and off.latest_step() is None
  off.close()


def test_restore_into_a_different_mesh_gives_same_values_and_logits(tmp_path):
  m_old, m_new = mesh(dp=2, tp=4), mesh(dp=4, tp=2)
  state = _sharded_state(m_old)
  ckpt = C.Checkpointer(str(tmp_path / "ckpt"), CheckpointConfig(async_save=True), to_dict(CFG))
  assert ckpt.save_now(7, state)
  ckpt.wait()

  new_param_sh = M.param_shardings(TINY, m_new)
  opt_sh = optax.tree_map_params(optax.adamw(1e-3), lambda _, s: s, state.opt_state["policy"],
                                 new_param_sh, transform_non_params=lambda _: replicated(m_new))
  new_sh = jax.tree.map(lambda _: replicated(m_new), state).replace(
      params={"policy": new_param_sh}, opt_state={"policy": opt_sh})
  restored, _ = ckpt.restore(_abstract(state, new_sh))
  ckpt.close()

  _assert_bit_identical(_host(restored), _host(state))
  wq = restored.params["policy"]["layers"]["wq"]
  assert wq.sharding.mesh.shape == m_new.shape and wq.sharding == new_param_sh["layers"]["wq"]
  assert restored.opt_state["policy"][0].mu["layers"]["wq"].sharding == wq.sharding

  tokens = jax.random.randint(jax.random.key(1), (4, 10), 1, TINY.vocab_size)
  mask = jnp.ones_like(tokens, bool)

  @jax.jit
  def logits(p):
    h, _ = M.forward(p, tokens, M.positions_from_mask(mask), mask, cfg=TINY)
    return M.lm_logits(p, h, TINY)

  with jax.set_mesh(m_new):
    original_on_new = jax.device_put(state.params["policy"], new_param_sh)
    got = np.asarray(logits(restored.params["policy"]))
    want = np.asarray(logits(original_on_new))
  np.testing.assert_array_equal(got, want)
  # On the old mesh the same parameters give the same logits up to reduction order (tp=4 vs 2).
  with jax.set_mesh(m_old):
    np.testing.assert_allclose(got, np.asarray(logits(state.params["policy"])), rtol=1e-4,
                               atol=1e-4)


def test_a_checkpoint_with_the_old_dict_extras_restores_into_typed_extras(tmp_path, capsys):
  """Checkpoints written before the typed extras kept them as a dict with "skips/consecutive"
  and "skips/total" keys: such a checkpoint resumes, every value as saved, and no false note
  about converted dtypes (the typed key is saved as uint32)."""
  from jaxrlhf.algorithms import init_kl_controller
  from jaxrlhf.train.types import Carried, Extras, Skips, TrainState
  carry = Carried(prompt=jnp.arange(6, dtype=jnp.int32).reshape(2, 3),
                  prompt_mask=jnp.ones((2, 3), bool), answer=jnp.full((2, 2), 7, jnp.int32),
                  answer_mask=jnp.zeros((2, 2), bool), count=jnp.int32(1))
  extras = Extras(skips=Skips(consecutive=jnp.int32(2), total=jnp.int32(5)),
                  kl=init_kl_controller(0.05), carry=carry)
  state = TrainState(step=jnp.int32(3), rng=jax.random.key(4), params={"policy": _params()},
                     opt_state={}, extras=extras)
  old = state.replace(extras={"kl": extras.kl, "carry": carry,
                              "skips/consecutive": extras.skips.consecutive,
                              "skips/total": extras.skips.total})
  state = jax.device_put(state, replicated(mesh()))
  with C.Checkpointer(str(tmp_path / "ck"), CheckpointConfig(async_save=False),
                      to_dict(CFG)) as ck:
    ck.maybe_save(3, jax.device_put(old, replicated(mesh())), extra={}, force=True)
  with C.Checkpointer(str(tmp_path / "ck"), CheckpointConfig(async_save=False),
                      to_dict(CFG)) as ck:  # a new process's view: nothing saved through it
    restored, _ = ck.restore(_abstract(state))
  assert isinstance(restored.extras, Extras) and isinstance(restored.extras.carry, Carried)
  _assert_bit_identical(_host(restored), _host(state))
  assert "restored in" not in capsys.readouterr().out


def test_restore_into_a_different_model_is_a_clear_error(tmp_path):
  ckpt = C.Checkpointer(str(tmp_path / "ckpt"), CheckpointConfig(async_save=False), to_dict(CFG))
  ckpt.maybe_save(3, {"params": _params()}, extra={}, force=True)
  bigger = dataclasses.replace(TINY, d_model=48)
  with pytest.raises(ConfigError, match=r"(?s)ckpt/3 does not fit.*--resume=none"):
    ckpt.restore({"params": M.abstract_params(bigger)})
  with pytest.raises(TypeError, match=r"extra\.batch: ndarray is not JSON"):
    ckpt.maybe_save(4, _small_state(4), extra={"batch": np.zeros(3)}, force=True)
  ckpt.close()


def test_check_resume_config_breaking_and_harmless():
  saved = to_dict(CFG)
  changed = dataclasses.replace(
      CFG, logging=LoggingConfig(every_steps=10), checkpoint=CheckpointConfig(every_steps=5),
      sft=dataclasses.replace(CFG.sft, steps=900), mesh=dataclasses.replace(CFG.mesh, tp=2),
      model=dataclasses.replace(TINY, remat="full"))
  harmless = {c[0] for c in C.check_resume_config(saved, changed)}
  assert harmless == {"logging.every_steps", "checkpoint.every_steps", "sft.steps", "mesh.tp",
                      "model.remat", "reward_model.remat", "value_model.remat",
                      "guard_model.remat"}
  # An unset role model means "same as model": setting it to that same shape is no change.
  assert C.check_resume_config(saved, dataclasses.replace(CFG, reward_model=TINY)) == []

  wider = dataclasses.replace(CFG, model=dataclasses.replace(TINY, d_model=64))
  with pytest.raises(ConfigError) as e:
    C.check_resume_config(saved, wider, "runs/x/ppo/checkpoints/40")
  msg = str(e.value)
  assert "runs/x/ppo/checkpoints/40" in msg and "model.d_model: 32 -> 64" in msg
  assert "reward_model.d_model" in msg and "--workdir" in msg and "--resume=none" in msg
  for field, cfg in [
      ("ppo.batch_size", dataclasses.replace(CFG, ppo=dataclasses.replace(CFG.ppo, batch_size=7))),
      ("stages", dataclasses.replace(CFG, stages=("sft", "ppo"))),
      ("value_model.n_layers",
       dataclasses.replace(CFG, value_model=dataclasses.replace(TINY, n_layers=1))),
      ("model.param_dtype",
       dataclasses.replace(CFG, model=dataclasses.replace(TINY, param_dtype="bfloat16")))]:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
      C.check_resume_config(saved, cfg)


def test_resume_policy():
  assert C.parse_resume("none") == "none" and C.parse_resume("LATEST") == "latest"
  assert C.parse_resume("200") == 200 and C.parse_resume(5) == 5
  with pytest.raises(ConfigError, match="use none, latest or a step number"):
    C.parse_resume("lastest")
  assert C.resolve_resume("latest", []) is None
  assert C.resolve_resume("latest", [4, 8]) == 8 and C.resolve_resume("4", [4, 8]) == 4
  assert C.resolve_resume("none", [4, 8]) is None
  with pytest.raises(ConfigError, match=r"--resume=6: .*runs/a.*available steps: 4, 8"):
    C.resolve_resume("6", [8, 4], "runs/a")


def test_resume_moves_abandoned_and_replaced_checkpoints_aside(tmp_path, capsys):
  d = str(tmp_path / "sft" / "checkpoints")
  cfg = CheckpointConfig(every_steps=1, keep=5, async_save=False)
  ckpt = C.Checkpointer(d, cfg, to_dict(CFG))
  for step in (1, 2, 3):
    ckpt.maybe_save(step, _small_state(step), extra={"p": step})
  abstract = jax.eval_shape(lambda: _small_state(0))

  louder = dataclasses.replace(CFG, logging=LoggingConfig(every_steps=5))
  point = ckpt.resume(abstract, "latest", louder)
  assert point.step == 3 and point.extra == {"p": 3} and point.state["w"][0] == 3
  assert point.changes == [("logging.every_steps", 1, 5)]
  assert "logging.every_steps: 1 -> 5" in capsys.readouterr().out

  point = ckpt.resume(abstract, "1", CFG)
  assert point.step == 1 and ckpt.all_steps() == [1]
  # Continuing from step 1 can save step 2 again; the abandoned 2 and 3 are kept aside.
  assert ckpt.maybe_save(2, _small_state(20), extra={})
  aside = [p for p in os.listdir(tmp_path / "sft") if p.startswith("checkpoints.abandoned-")]
  assert len(aside) == 1 and sorted(os.listdir(tmp_path / "sft" / aside[0])) == ["2", "3"]

  assert ckpt.resume(abstract, "none", CFG) is None
  assert ckpt.all_steps() == []
  assert any(p.startswith("checkpoints.replaced-") for p in os.listdir(tmp_path / "sft"))
  assert ckpt.maybe_save(1, _small_state(1), extra={})
  ckpt.close()


def test_stage_results_chain_and_frozen_references(tmp_path):
  wd = str(tmp_path)
  m_old, m_new = mesh(dp=2, tp=4), mesh(dp=4, tp=2)
  params = _params(m_old, seed=3)
  assert not C.stage_result_exists(wd, "sft")
  with pytest.raises(ConfigError, match=r"stage 'sft' has no result in .*sft/final"):
    C.load_stage_result(wd, "sft", {"policy": M.abstract_params(TINY)})
  info = C.save_stage_result(wd, "sft", {"policy": params}, {"eval/acc": np.float32(0.75)})
  assert C.stage_result_exists(wd, "sft") and info["metrics"] == {"eval/acc": 0.75}

  abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          M.abstract_params(TINY), M.param_shardings(TINY, m_new))
  loaded = C.load_stage_result(wd, "sft", {"policy": abstract})["policy"]
  _assert_bit_identical(_host(loaded), _host(params))
  assert loaded["embed"].sharding == abstract["embed"].sharding

  ref = C.frozen_source(wd, "sft", "policy")
  assert ref == {"stage": "sft", "role": "policy", "id": info["id"]}
  _assert_bit_identical(_host(C.load_frozen(wd, ref, abstract)), _host(params))
  with pytest.raises(ConfigError, match="has roles \\['policy'\\], not 'value'"):
    C.frozen_source(wd, "sft", "value")
  # Rerunning the stage rewrites its result: a checkpoint that froze the old one must not
  # silently pick up the new parameters.
  C.save_stage_result(wd, "sft", {"policy": params}, {})
  with pytest.raises(ConfigError, match="rewritten after this checkpoint"):
    C.load_frozen(wd, ref, abstract)


def test_second_signal_exits_at_once(tmp_path):
  # After the first signal the child's main thread does not poll the flag again (it could as
  # well be inside a long XLA call): the second signal alone must end it, at once.
  script = textwrap.dedent("""
      import signal, sys, time
      from jaxrlhf.preemption import PreemptionHandler
      with PreemptionHandler() as stop:
        print("ready", flush=True)
        while not stop.requested:
          time.sleep(0.01)
        print("flag", stop.signal_name, flush=True)
        time.sleep(30)
      print("finished", flush=True)
  """)
  p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
  assert p.stdout.readline().strip() == "ready"
  p.send_signal(signal.SIGTERM)
  assert p.stdout.readline().strip() == "flag SIGTERM"
  t0 = time.time()
  p.send_signal(signal.SIGINT)
  assert p.wait(timeout=10) == 128 + signal.SIGINT
  assert time.time() - t0 < 5


# ------------------------------------------------------------------------ subprocess tests


@pytest.fixture(scope="module")
def jit_cache(tmp_path_factory):
  return str(tmp_path_factory.mktemp("jit_cache"))


class Worker:
  """tests/ckpt_worker.py in a subprocess, with its JSON-lines log."""

  def __init__(self, workdir, cache, *flags, name="run"):
    self.log = os.path.join(workdir, f"{name}.log")
    self.err = open(os.path.join(workdir, f"{name}.stderr"), "w")
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_COMPILATION_CACHE_DIR": cache,
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    env.pop("XLA_FLAGS", None)  # the worker sets its own device count
    self.proc = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "ckpt_worker.py"), "--workdir", workdir,
         "--log", self.log, *flags], stdout=subprocess.PIPE, stderr=self.err, text=True,
        cwd=ROOT, env=env)

  def events(self):
    return read_events(self.log)

  def wait_for(self, event, timeout=240):
    return wait_for_event(self.proc, self.log, event, timeout,
                          lambda: "stderr tail:\n" + open(self.err.name).read()[-3000:])

  def finish(self, timeout=240):
    try:
      out, _ = self.proc.communicate(timeout=timeout)
    finally:
      self.err.close()
    assert self.proc.returncode == 0, open(self.err.name).read()[-3000:]
    return out

  def kill(self):
    self.proc.send_signal(signal.SIGKILL)
    self.proc.wait(timeout=30)
    self.err.close()

  def losses(self):
    return {e["step"]: e["loss"] for e in self.events() if e["event"] == "step"}


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, jit_cache):
  """8 steps without interruption: the reference every resumed run must match bit for bit."""
  wd = str(tmp_path_factory.mktemp("straight"))
  w = Worker(wd, jit_cache, "--steps=8", "--every=4", f"--out={wd}/final.npz")
  w.finish()
  return w.losses(), dict(np.load(f"{wd}/final.npz"))


def _assert_same_final(path, reference):
  got = dict(np.load(path))
  assert sorted(got) == sorted(reference)
  assert any("opt" in k and "mu" in k for k in got) and "['key']" in got
  for k in reference:
    assert np.array_equal(got[k], reference[k]), k


def test_sigkill_after_checkpoint_then_resume_is_bit_identical(tmp_path, jit_cache, straight_run):
  ref_losses, ref_final = straight_run
  wd = str(tmp_path)
  first = Worker(wd, jit_cache, "--steps=8", "--every=4", "--hang_after_save=4", name="first")
  first.wait_for("saved")
  first.kill()
  assert sorted(first.losses()) == [1, 2, 3, 4]

  second = Worker(wd, jit_cache, "--steps=8", "--every=4", f"--out={wd}/final.npz",
                  name="second")
  second.finish()
  assert second.wait_for("start")["step"] == 4
  resumed = second.losses()
  assert sorted(resumed) == [5, 6, 7, 8]
  assert resumed == {s: ref_losses[s] for s in (5, 6, 7, 8)}
  _assert_same_final(f"{wd}/final.npz", ref_final)


def test_kill_while_writing_leaves_previous_checkpoint(tmp_path, jit_cache, straight_run):
  ref_losses, ref_final = straight_run
  wd = str(tmp_path)
  ckdir = C.checkpoint_dir(wd, "sft")
  first = Worker(wd, jit_cache, "--steps=8", "--every=2", "--hang_in_commit=4", name="first")
  partial = first.wait_for("committing")["tmp"]
  # Everything of step 4 is on disk except the commit: the state's arrays are there.
  assert os.path.basename(partial).startswith("4.") and os.path.isdir(f"{partial}/state")
  first.kill()
  assert sorted(os.listdir(ckdir)) == ["2", os.path.basename(partial)]

  ckpt = C.Checkpointer(ckdir, CheckpointConfig(), to_dict(CFG))
  assert ckpt.all_steps() == [2] and ckpt.latest_step() == 2
  assert ckpt.saved_config()["name"] == "ckpt_worker"
  ckpt.close()

  second = Worker(wd, jit_cache, "--steps=8", "--every=2", f"--out={wd}/final.npz",
                  name="second")
  second.finish()
  assert second.wait_for("start")["step"] == 2
  assert second.losses() == {s: ref_losses[s] for s in range(3, 9)}
  _assert_same_final(f"{wd}/final.npz", ref_final)
  # The resumed run cleared the partial step away and wrote step 4 properly (keep=3).
  assert sorted(os.listdir(ckdir), key=int) == ["4", "6", "8"]


def test_sigterm_checkpoints_exits_zero_and_resumes(tmp_path, jit_cache, straight_run):
  ref_losses, ref_final = straight_run
  wd = str(tmp_path)
  # every=100: the only checkpoint is the one the signal causes.
  first = Worker(wd, jit_cache, "--steps=8", "--every=100", "--wait_for_signal_at=3",
                 name="first")
  first.wait_for("waiting")
  first.proc.send_signal(signal.SIGTERM)
  out = first.finish(timeout=120)
  assert "stopped by SIGTERM after step 3; checkpoint saved" in out
  assert first.wait_for("stopped")["step"] == 3
  assert sorted(os.listdir(C.checkpoint_dir(wd, "sft"))) == ["3"]

  second = Worker(wd, jit_cache, "--steps=8", "--every=100", f"--out={wd}/final.npz",
                  name="second")
  second.finish()
  assert second.wait_for("start")["step"] == 3
  assert second.losses() == {s: ref_losses[s] for s in range(4, 9)}
  _assert_same_final(f"{wd}/final.npz", ref_final)


def test_checkpoints_hold_the_trainable_state_only_logged_and_pruned(tmp_path, capsys):
  """A PPO stage (frozen reference and reward model, trained policy and value): every save is
  the trainable state's bytes (the frozen roles are referenced by the manifest, never
  written), its size is logged once per save and recorded as ``checkpoint/bytes``, and
  ``keep`` prunes the older ones."""
  from test_train import config
  from jaxrlhf.data import DataSource
  from jaxrlhf.metrics import MetricsWriter
  from jaxrlhf.train.loop import run_stage
  from jaxrlhf.train.pipeline import frozen_manifest
  from jaxrlhf.train.spec import build_stage
  cfg = config(stages=("ppo",))
  cfg = dataclasses.replace(cfg, ppo=dataclasses.replace(cfg.ppo, steps=3),
                            checkpoint=CheckpointConfig(every_steps=1, keep=2),
                            logging=LoggingConfig(console=False, sinks=("jsonl",)))
  wd = str(tmp_path)
  stage = build_stage("ppo", cfg, mesh(), DataSource(cfg.data, cfg.seed))
  state, frozen = stage.init(jax.random.key(0), {})
  trainable, frozen_bytes = C.tree_bytes(state), C.tree_bytes(frozen)
  assert set(frozen) == {"reference", "reward"} and frozen_bytes > 2**17
  ck_dir = C.checkpoint_dir(wd, "ppo")
  writer = MetricsWriter(wd, cfg.logging, {"ppo": 3})
  with C.Checkpointer(ck_dir, cfg.checkpoint, to_dict(cfg),
                      frozen=frozen_manifest(stage, wd, {})) as ck, jax.set_mesh(stage.mesh):
    run_stage(stage, state, frozen, writer=writer, checkpointer=ck)
  writer.close()
  with open(os.path.join(wd, "metrics.jsonl")) as f:
    saved = [json.loads(line).get("checkpoint/bytes") for line in f]
  assert saved == [saved[1]] * 3
  # The second save: the trainable state plus the JSON items (config, manifest, position).
  assert trainable <= saved[1] < trainable + 2**16 < trainable + frozen_bytes
  assert sorted(int(s) for s in os.listdir(ck_dir) if s.isdigit()) == [2, 3]  # keep=2
  with open(os.path.join(ck_dir, "2", "state", "_METADATA")) as f:
    tree = json.load(f)["tree_metadata"]
  keys = [[k["key"] for k in v["key_metadata"]] for v in tree.values()]
  assert {k[1] for k in keys if k[0] == "params"} == {"policy", "value"}
  with open(os.path.join(ck_dir, "2", "frozen", "metadata")) as f:
    assert set(json.load(f)) == {"reference", "reward"}
  out = capsys.readouterr().out.splitlines()
  # The folder is said once; each save is a note on the progress line, not a line of its own.
  assert len([l for l in out if ": checkpoints -> " in l]) == 1
  assert not [l for l in out if ": checkpoint " in l]


def test_closing_before_any_save_waits_for_orbax_s_cleanup_thread(tmp_path, monkeypatch):
  # orbax clears earlier runs' temporary folders in a thread it waits for only at the first
  # save.  A run refused before saving (a weights file cut short) closed its checkpointer
  # with the thread still going, and exiting under it printed a traceback (seen in
  # tests/test_hostile.py on a loaded machine).  A slow clean-up makes the race certain.
  import asyncio
  import threading
  from orbax.checkpoint._src.path import temporary_paths

  async def slow_cleanup(*args, **kwargs):
    await asyncio.sleep(0.5)

  monkeypatch.setattr(temporary_paths, "cleanup_temporary_paths", slow_cleanup)
  ckpt = C.Checkpointer(str(tmp_path / "ckpt"), CheckpointConfig(every_steps=7), to_dict(CFG))
  cleaning = [t for t in threading.enumerate() if "_target_setting_result" in t.name]
  assert cleaning and any(t.is_alive() for t in cleaning)  # the race is set up
  ckpt.close()
  assert not any(t.is_alive() for t in cleaning)
