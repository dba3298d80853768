"""Resume through the real training pipeline: PPO and GRPO runs stopped for real (SIGKILL,
SIGTERM) continue bit-identically; finished stages are skipped; ``--resume=none`` starts over;
the non-finite stop keeps the last good state.

Each run is tests/resume_worker.py in a subprocess (``pipeline.run`` on a tiny config, 2 CPU
devices).  The workers share a persistent compilation cache, so only the first of each kind
compiles.  States are compared by restoring the checkpoints in this process (onto a mesh of
this process's devices, as any resume would).
"""

import os
import shutil
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import mesh, read_events, wait_for_event
from jaxrlhf import checkpoint as C
from jaxrlhf.config import to_dict
from jaxrlhf.data import DataSource
from jaxrlhf.metrics import read_jsonl
from jaxrlhf.train.spec import build_stage

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import resume_worker  # noqa: E402

# Metrics that measure the machine rather than the computation.
VOLATILE = ("time/", "memory/", "perf/", "throughput/")


@pytest.fixture(scope="module")
def jit_cache(tmp_path_factory):
  return str(tmp_path_factory.mktemp("jit_cache"))


class Worker:
  """tests/resume_worker.py in a subprocess; stdout to a file, events to a JSON-lines log."""

  def __init__(self, workdir, cache, algo, *flags, name="run"):
    self.workdir = workdir
    self.log = os.path.join(workdir, f"{name}.events")
    self.out_path = os.path.join(workdir, f"{name}.out")
    self._out = open(self.out_path, "w")
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_COMPILATION_CACHE_DIR": cache,
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    env.pop("XLA_FLAGS", None)  # the worker sets its own device count
    self.proc = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "resume_worker.py"), f"--workdir={workdir}",
         f"--algo={algo}", f"--log={self.log}", *flags],
        stdout=self._out, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env)

  def output(self):
    with open(self.out_path) as f:
      return f.read()

  def events(self):
    return read_events(self.log)

  def wait_for(self, event, timeout=300):
    return wait_for_event(self.proc, self.log, event, timeout,
                          lambda: "output:\n" + self.output()[-4000:])

  def finish(self, expect_rc=0, timeout=300):
    try:
      self.proc.wait(timeout=timeout)
    finally:
      self._out.close()
    assert self.proc.returncode == expect_rc, self.output()[-4000:]
    return self.output()

  def kill(self):
    self.proc.send_signal(signal.SIGKILL)
    self.proc.wait(timeout=30)
    self._out.close()


def _cfg(algo, *overrides):
  args = resume_worker.argparse.Namespace(algo=algo, steps=8, every=4, set=list(overrides))
  return resume_worker.build(args)


def _state(workdir, cfg, name, step):
  """Checkpoint ``step`` of stage ``name`` restored here, as flat numpy leaves."""
  m = mesh(dp=2)
  stage = build_stage(name, cfg, m, DataSource(cfg.data, cfg.seed))
  abstract, _ = stage.abstract_init()
  with C.Checkpointer(C.checkpoint_dir(workdir, name), cfg.checkpoint, to_dict(cfg)) as ck:
    state, extra = ck.restore(abstract, step)
  out = {}
  for path, x in jax.tree_util.tree_leaves_with_path(state):
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    out[jax.tree_util.keystr(path)] = np.asarray(jax.device_get(x))
  return out, extra


def _assert_same_state(a, b):
  assert sorted(a) == sorted(b)
  # What must survive: step, RNG key, params and optimizer moments, KL controller, reward stats.
  assert any("mu" in k for k in a) and any(".rng" in k for k in a)
  for k in a:
    assert np.array_equal(a[k], b[k]), k


def _metrics(workdir, stage, steps):
  """The logged metrics of ``steps`` (later records win, as the report reads them), without
  the ones that measure the machine."""
  by_step = {}
  for rec in read_jsonl(os.path.join(workdir, "metrics.jsonl")):
    if rec["stage"] == stage and rec["step"] in steps:
      by_step.setdefault(rec["step"], {}).update(
          {k: v for k, v in rec.items() if k != "wall_time" and not k.startswith(VOLATILE)})
  return by_step


def _steps(workdir, stage):
  with C.Checkpointer(C.checkpoint_dir(workdir, stage), _cfg("sft").checkpoint, {}) as ck:
    return ck.all_steps()


@pytest.fixture(scope="module")
def straight(tmp_path_factory, jit_cache):
  """8 steps of PPO, and SFT then 8 steps of GRPO, without interruption: the references every
  resumed run must match bit for bit.  Started together: each compiles (mostly one core) and
  fills the shared cache for the runs that follow."""
  dirs = {a: str(tmp_path_factory.mktemp(f"{a}_straight")) for a in ("ppo", "grpo")}
  workers = [Worker(wd, jit_cache, a) for a, wd in dirs.items()]
  for w in workers:
    w.finish()
  return dirs


@pytest.fixture(scope="module")
def ppo_straight(straight):
  return straight["ppo"]


@pytest.fixture(scope="module")
def grpo_straight(straight):
  return straight["grpo"]


def test_ppo_killed_after_checkpoint_resumes_bit_identically(tmp_path, jit_cache, ppo_straight):
  wd = str(tmp_path)
  first = Worker(wd, jit_cache, "ppo", "--hang_after_save=4", name="first")
  first.wait_for("saved")
  first.kill()
  second = Worker(wd, jit_cache, "ppo", name="second")
  out = second.finish()
  assert "ppo: continuing after step 4 of 8" in out

  cfg = _cfg("ppo")
  got, extra = _state(wd, cfg, "ppo", 8)
  want, _ = _state(ppo_straight, cfg, "ppo", 8)
  _assert_same_state(got, want)
  assert extra["data_position"] == 8 and extra["stage"] == "ppo"
  assert any("'value'" in k for k in got) and any(".extras.kl." in k for k in got)
  steps = range(5, 9)
  resumed, straight = _metrics(wd, "ppo", steps), _metrics(ppo_straight, "ppo", steps)
  assert sorted(resumed) == list(steps) and resumed == straight
  assert "reward/mean" in resumed[5] and "kl/mean" in resumed[5]


def test_grpo_after_sft_sigterm_then_sigkill_then_resume(tmp_path, jit_cache, grpo_straight):
  wd = str(tmp_path)
  # SIGTERM during GRPO step 2: the step finishes, a checkpoint is written, exit 0.
  first = Worker(wd, jit_cache, "grpo", "--wait_for_signal_at=2", "--every=100", name="first")
  first.wait_for("waiting")
  first.proc.send_signal(signal.SIGTERM)
  out = first.finish()
  assert "stopped by SIGTERM after step 2; checkpoint saved" in out
  assert _steps(wd, "grpo") == [2] and C.stage_result_exists(wd, "sft")

  # Resume from it, then SIGKILL once checkpoint 4 is complete.
  second = Worker(wd, jit_cache, "grpo", "--hang_after_save=4", name="second")
  second.wait_for("saved")
  second.kill()
  out = second.output()
  assert "sft: finished earlier" in out and "grpo: continuing after step 2 of 8" in out

  third = Worker(wd, jit_cache, "grpo", name="third")
  out = third.finish()
  assert "sft: finished earlier" in out and "grpo: continuing after step 4 of 8" in out
  cfg = _cfg("grpo")
  got, _ = _state(wd, cfg, "grpo", 8)
  want, _ = _state(grpo_straight, cfg, "grpo", 8)
  _assert_same_state(got, want)
  steps = range(3, 9)
  resumed, straight = _metrics(wd, "grpo", steps), _metrics(grpo_straight, "grpo", steps)
  assert sorted(resumed) == list(steps) and resumed == straight

  # The frozen reference is recorded by reference to the SFT result, not copied.
  with C.Checkpointer(C.checkpoint_dir(wd, "grpo"), cfg.checkpoint, {}) as ck:
    frozen = ck.saved_frozen(8)
  sft_id = C.stage_result_info(wd, "sft")["id"]
  assert frozen == {"reference": {"stage": "sft", "role": "policy", "id": sft_id, "head": "lm"}}

  # A rerun of the finished pipeline trains nothing.
  lines = len(read_jsonl(os.path.join(wd, "metrics.jsonl")))
  out = Worker(wd, jit_cache, "grpo", name="fourth").finish()
  assert "sft: finished earlier" in out and "grpo: finished earlier" in out
  assert len(read_jsonl(os.path.join(wd, "metrics.jsonl"))) == lines


def test_resume_none_starts_over(tmp_path, jit_cache, ppo_straight):
  wd = str(tmp_path / "run")
  shutil.copytree(ppo_straight, wd)
  out = Worker(wd, jit_cache, "ppo", "--resume=none", name="again").finish()
  assert "continuing" not in out and "finished earlier" not in out
  moved = sorted(os.listdir(os.path.join(wd, "ppo")))
  assert moved[:2] == ["checkpoints", "checkpoints.replaced-" + moved[1].split("-", 1)[1]]
  assert any(n.startswith("final.replaced-") for n in moved)
  cfg = _cfg("ppo")
  _assert_same_state(_state(wd, cfg, "ppo", 8)[0], _state(ppo_straight, cfg, "ppo", 8)[0])
  records = [r for r in read_jsonl(os.path.join(wd, "metrics.jsonl"))
             if r["stage"] == "ppo" and "loss" in r]  # training records, not the final eval
  assert [r["step"] for r in records] == list(range(1, 9))  # the new run's only
  old = [n for n in os.listdir(wd) if n.startswith("metrics.jsonl.replaced-")]
  assert len(old) == 1  # the replaced run's metrics, moved aside with its checkpoints
  assert [r["step"] for r in read_jsonl(os.path.join(wd, old[0]))
          if r["stage"] == "ppo" and "loss" in r] == list(range(1, 9))


def test_nonfinite_stop_checkpoints_the_last_good_state(tmp_path, jit_cache):
  wd = str(tmp_path)
  # A huge learning rate: step 1 is finite but leaves parameters near 1e30, so every later
  # loss overflows and is skipped; the second skip in a row stops the run.
  flags = ["--set=sft.optim.lr=1e30", "--set=sft.optim.max_consecutive_skips=2"]
  out = Worker(wd, jit_cache, "sft", "--every=1", "--steps=6", *flags).finish(expect_rc=1)
  assert "2 consecutive steps had a non-finite loss" in out
  assert "parameters were left at the last good state and checkpointed as step 3" in out
  assert _steps(wd, "sft") == [1, 2, 3]
  cfg = _cfg("sft", *[f.split("=", 1)[1] for f in flags])
  last, _ = _state(wd, cfg, "sft", 3)
  good, _ = _state(wd, cfg, "sft", 1)
  for k in good:
    if ".params" in k or ".opt_state" in k:
      assert np.all(np.isfinite(last[k])), k
      assert np.array_equal(last[k], good[k]), k
  assert int(last[".extras.skips.total"]) == 2


# tp=2, not the workers' dp=2: the frozen base is sharded over the data axes (as fsdp), and
# XLA's in-process CPU collectives can deadlock on two devices waiting on different
# collectives (seen in CI on this test, and with fsdp=2 before: benchmarks/NOTES.md).
LORA_SETS = ("--set=sft.lora.rank=4", "--set=grpo.lora.rank=4",
             "--set=grpo.lora.base_dtype=bfloat16", "--set=mesh.dp=1", "--set=mesh.tp=2")


def _killed_and_resumed_grpo(tmp_path, jit_cache, sets):
  """SFT then 8 GRPO steps with ``sets``, straight and killed after checkpoint 4 then resumed;
  asserts the resumed run continued there and ends in the same state as the straight one.
  Returns ``(straight_dir, resumed_dir, cfg, resumed state)``."""
  straight_dir, wd = str(tmp_path / "straight"), str(tmp_path / "resumed")
  os.makedirs(straight_dir)
  os.makedirs(wd)
  straight = Worker(straight_dir, jit_cache, "grpo", *sets, name="straight")
  first = Worker(wd, jit_cache, "grpo", *sets, "--hang_after_save=4", name="first")
  straight.finish()
  first.wait_for("saved")
  first.kill()
  out = Worker(wd, jit_cache, "grpo", *sets, name="second").finish()
  assert "grpo: continuing after step 4 of 8" in out
  cfg = _cfg("grpo", *(s.removeprefix("--set=") for s in sets))
  got, _ = _state(wd, cfg, "grpo", 8)
  want, _ = _state(straight_dir, cfg, "grpo", 8)
  _assert_same_state(got, want)
  return straight_dir, wd, cfg, got


def test_lora_grpo_killed_after_checkpoint_resumes_bit_identically(tmp_path, jit_cache):
  """SFT then GRPO, both with adapters: the checkpoints hold the adapters and their
  optimizer state (the frozen base is rebuilt from SFT's merged result, which the manifest
  names), and the resumed run ends bit for bit where an uninterrupted one does."""
  straight_dir, wd, cfg, got = _killed_and_resumed_grpo(tmp_path, jit_cache, LORA_SETS)
  # Only adapters are trained and checkpointed: no base projection in the state.
  assert any("'lora'" in k for k in got) and not any("'embed'" in k for k in got)
  frozen = C.Checkpointer(C.checkpoint_dir(wd, "grpo"), cfg.checkpoint, {}).saved_frozen(8)
  assert frozen["reference"]["stage"] == "sft"
  steps = range(5, 9)
  assert _metrics(wd, "grpo", steps) == _metrics(straight_dir, "grpo", steps)


ENV_SETS = ("--set=model.vocab_size=51", "--set=model.max_seq_len=64", "--set=data.task=guess",
            "--set=data.tokenizer=char_tools", "--set=data.max_prompt_len=12",
            "--set=data.max_response_len=48", "--set=rollout.max_new_tokens=40",
            "--set=env.name=guess", "--set=env.max_turns=4", "--set=env.max_turn_tokens=4",
            "--set=grpo.reward.sources=env", "--set=mesh.dp=1", "--set=mesh.tp=2")


def test_multi_turn_grpo_killed_mid_run_resumes_bit_identically(tmp_path, jit_cache):
  """SFT then GRPO against the guessing game (episodes of several turns, host environment
  steps between jitted decode segments): killed after a checkpoint, the resumed run ends bit
  for bit where an uninterrupted one does (the episodes depend on the state's key and the
  data position only)."""
  straight_dir, wd, _, _ = _killed_and_resumed_grpo(tmp_path, jit_cache, ENV_SETS)
  steps = range(5, 9)
  resumed, unbroken = _metrics(wd, "grpo", steps), _metrics(straight_dir, "grpo", steps)
  assert resumed == unbroken
  assert all(m["env/turns_mean"] > 1 for m in unbroken.values())


# Refill with carry-over: stops on the digits end rows at ragged lengths, so groups finish at
# different loop steps and started groups are left over (checked at the kill point below).
CARRY_SETS = ("--set=rollout.refill=true", "--set=rollout.refill_leftover=carry",
              "--set=rollout.max_new_tokens=6",
              "--set=rollout.stop_token_ids=3,4,5,6,7,8,9,10,11,12")


@pytest.mark.parametrize("leftover", ["carry", pytest.param("continue", marks=pytest.mark.slow),
                                      pytest.param("continue_keep", marks=pytest.mark.slow)])
def test_grpo_with_refill_carry_over_resumes_bit_identically(tmp_path, jit_cache, leftover):
  """The prompts carried over from step 4 are in checkpoint 4 (with ``continue``, their
  partial responses too, and with ``continue_kv=keep`` their keys and values): killed there
  and resumed, the run trains them in step 5 and ends bit for bit where an uninterrupted one
  does."""
  mode = leftover.split("_")[0]
  sets = tuple(s.replace("=carry", f"={mode}") for s in CARRY_SETS)
  if leftover == "continue_keep":
    sets += ("--set=rollout.continue_kv=keep",)
  straight_dir, wd, cfg, got = _killed_and_resumed_grpo(tmp_path, jit_cache, sets)
  at_kill, _ = _state(wd, cfg, "grpo", 4)
  count = int(at_kill[".extras.carry.count"])
  assert count > 0  # the checkpoint really carries prompts over
  assert np.any(at_kill[".extras.carry.prompt_mask"][:count])
  if mode == "continue":  # and the responses begun
    rmask = next(v for k, v in at_kill.items() if k.startswith(".extras.carry.partial")
                 and "rmask" in k)
    assert rmask.any()
  if leftover == "continue_keep":  # and their pages
    kv_len = next(v for k, v in at_kill.items() if k.startswith(".extras.carry.partial")
                  and "kv_len" in k)
    assert kv_len.any()
  steps = range(4, 9)
  unbroken = _metrics(straight_dir, "grpo", steps)
  assert unbroken[4]["rollout/carried_out"] == count
  assert unbroken[5]["rollout/carried_in"] == count
  steps = range(5, 9)
  resumed = _metrics(wd, "grpo", steps)
  assert resumed == {s: unbroken[s] for s in steps}
  assert all(m["rollout/dropped"] == 0 for m in resumed.values())


@pytest.mark.parametrize("name", ["sft", "grpo"])
def test_a_resume_builds_the_frozen_roles_alone(name):
  """What a restore starts from: every frozen role (a LoRA role's base too: SFT's own
  ``policy.base``, GRPO's reference) exactly as a fresh start builds it, and no train state
  (the checkpoint's is restored into the abstract one)."""
  import dataclasses
  from jaxrlhf.config import LoraConfig
  from test_train import config
  cfg = config()
  cfg = dataclasses.replace(cfg, **{name: dataclasses.replace(
      getattr(cfg, name), lora=LoraConfig(rank=4, alpha=8.0))})
  stage = build_stage(name, cfg, mesh(), DataSource(cfg.data, cfg.seed))
  _, full = stage.init(jax.random.key(3), {})
  state, frozen = stage.init(jax.random.key(3), {}, frozen_only=True)
  assert state is None and sorted(frozen) == sorted(full)
  assert ("policy.base" if name == "sft" else "reference") in frozen
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(frozen), jax.device_get(full))
