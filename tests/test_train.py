"""Training programs: each step equals its single-device result on a (dp=2, tp=2) mesh, and
short runs really learn."""

import dataclasses

import jax
import numpy as np
import pytest

from helpers import mesh
from jaxrlhf.config import (DataConfig, DPOConfig, ExperimentConfig, GRPOConfig, ModelConfig,
                            OptimizerConfig, PPOConfig, RMConfig, RewardConfig, RolloutConfig,
                            SFTConfig)
from jaxrlhf.data import DataSource
from jaxrlhf.train.common import put_batch
from jaxrlhf.train.program import samples_due
from jaxrlhf.train.spec import build_stage

MODEL = ModelConfig(vocab_size=48, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                    mlp_dim=64, max_seq_len=16)
DATA = DataConfig(task="addition", digits=1, max_prompt_len=5, max_response_len=3, eval_size=8)
# A large Adam epsilon keeps updates proportional to gradients, so float noise in a gradient
# that is zero in exact arithmetic (e.g. the reward bias under a pairwise loss) stays noise.
OPT = OptimizerConfig(lr=1e-3, warmup_steps=0, schedule="constant", eps=1e-3)


def config(**changes) -> ExperimentConfig:
  base = ExperimentConfig(
      model=MODEL, data=DATA, rollout=RolloutConfig(max_new_tokens=3),
      sft=SFTConfig(steps=2, batch_size=8, optim=OPT, eval_every=0),
      rm=RMConfig(steps=2, batch_size=8, optim=OPT, eval_every=0),
      dpo=DPOConfig(steps=2, batch_size=8, optim=OPT, eval_every=0),
      ppo=PPOConfig(steps=2, batch_size=8, optim=OPT, value_optim=OPT, eval_every=0,
                    num_minibatches=2, reward=RewardConfig(sources=("model", "rule:exact_match"),
                                                           weights=(1.0, 1.0))),
      grpo=GRPOConfig(steps=2, batch_size=4, num_samples=4, optim=OPT, eval_every=0))
  return dataclasses.replace(base, **changes)


def run_steps(cfg, name, m, steps=1, roles=None, key=None, samples=None):
  """``steps`` steps of stage ``name``; ``samples``: a list that gets the rollout sample rows
  (``logging.samples_every``), each with its ``step``."""
  stage = build_stage(name, cfg, m, DataSource(cfg.data, cfg.seed))
  state, frozen = stage.init(jax.random.key(0) if key is None else key, roles or {})
  out = []
  fn = None
  for step in range(steps):
    host_batch = stage.batch(step)
    rows = []
    if samples is not None and samples_due(cfg.logging, step + 1):
      host_batch["host"] = dataclasses.replace(host_batch["host"], samples=rows)
    batch = put_batch(m, host_batch)
    with jax.set_mesh(m):
      fn = fn or stage.make_step_fn(state, frozen, batch)
      state, metrics = fn(state, frozen, batch)
    out.append({k: float(v) for k, v in jax.device_get(metrics).items()})
    if samples is not None:
      samples += [{**r, "step": step + 1} for r in rows]
  return stage, state, frozen, out


def test_dpo_reference_cache_is_the_runs_and_computes_each_pair_once(monkeypatch):
  """``dpo.reference=cache``: the run's feeder adds each pair's reference log-probs, equal to
  the reference's forward pass on the step's batch, and runs that pass only for pairs it has
  not seen (the stage itself keeps nothing)."""
  cfg = config()
  cfg = dataclasses.replace(cfg, dpo=dataclasses.replace(cfg.dpo, loss="ipo", reference="cache"))
  m = mesh()
  stage = build_stage("dpo", cfg, m, DataSource(cfg.data, cfg.seed))
  state, frozen = stage.init(jax.random.key(0), {})
  feeder = stage.feeder(frozen)
  calls = []
  ref = stage.reference_logps
  monkeypatch.setattr(stage, "reference_logps", lambda *a: calls.append(1) or ref(*a))
  got = feeder.batch(0)
  with jax.set_mesh(m):
    want = jax.device_get(ref(frozen["reference"], put_batch(m, stage.batch(0))))
  np.testing.assert_allclose(got["ref_chosen"], want[0], rtol=1e-6)
  np.testing.assert_allclose(got["ref_rejected"], want[1], rtol=1e-6)
  assert len(calls) == 1
  again = feeder.batch(0)  # the same pairs: read from the cache
  assert len(calls) == 1 and (again["ref_chosen"] == got["ref_chosen"]).all()
  assert "ref_chosen" not in stage.batch(0) and not hasattr(stage, "_cache")


@pytest.mark.parametrize("name", ["ppo", "grpo"])
def test_the_rl_step_reads_its_statics_and_nothing_of_the_stage(name):
  """The RL step's phases are given a frozen StepStatics, not the stage: with every attribute
  of the stage gone (data, tokenizer, configs, evaluation...), the step still traces and runs,
  and equals the step of an intact stage; the record cannot be changed."""
  from jaxrlhf.train import program
  cfg = config()
  m = mesh()
  stage = build_stage(name, cfg, m, DataSource(cfg.data, cfg.seed))
  state, frozen = stage.init(jax.random.key(0), {})
  batch = put_batch(m, stage.batch(0))
  with jax.set_mesh(m):
    _, want = jax.jit(stage.step)(state, frozen, batch)
  statics = stage.statics
  with pytest.raises(dataclasses.FrozenInstanceError):
    statics.n = 3
  with pytest.raises(TypeError):
    statics.precision["policy"] = None
  step = program.step_fn(stage, stage.phases())
  for attr in list(vars(stage)):
    if attr != "statics":
      setattr(stage, attr, None)
  with jax.set_mesh(m):
    _, got = jax.jit(step)(state, frozen, batch)
  assert jax.device_get(got) == jax.device_get(want)


@pytest.mark.parametrize("name", ["sft", "rm", "dpo", "ppo", "grpo"])
def test_step_on_dp2_tp2_equals_single_device(name):
  cfg = config()
  _, s1, _, m1 = run_steps(cfg, name, mesh())
  _, s2, _, m2 = run_steps(cfg, name, mesh(dp=2, tp=2))
  keys = [k for k in m1[0] if not k.startswith(("time/", "memory/"))]
  for k in keys:
    np.testing.assert_allclose(m2[0][k], m1[0][k], rtol=2e-4, atol=2e-5, err_msg=k)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5),
               jax.device_get(s2.params), jax.device_get(s1.params))


def test_optimizer_moments_are_sharded_like_their_parameters():
  cfg = config()
  m = mesh(fsdp=2, tp=2)
  stage = build_stage("ppo", cfg, m, DataSource(cfg.data, cfg.seed))
  state, _ = stage.init(jax.random.key(0), {})
  abstract, _ = stage.abstract_init()
  for role in ("policy", "value"):
    p_sh = jax.tree.map(lambda x: x.sharding.spec, state.params[role])
    adam = state.opt_state[role][1][0]  # chain(clip, adamw): adamw's ScaleByAdamState
    for moment in (adam.mu, adam.nu):
      assert jax.tree.map(lambda x: x.sharding.spec, moment) == p_sh
    # The abstract state the planner and checkpoint restore use agrees with the real one.
    assert jax.tree.map(lambda x: x.sharding.spec, abstract.opt_state[role]) == jax.tree.map(
        lambda x: x.sharding.spec, state.opt_state[role])
  assert state.params["policy"]["layers"]["w_up"].sharding.spec[1] == "fsdp"


def test_grpo_with_a_host_reward_splits_in_two_programs_and_matches_the_rule():
  """The same exact-match reward as a host Python function (decoded text, two programs around
  the host call) and as a jittable rule (one program) gives the same step."""
  rule = config()
  host = dataclasses.replace(rule, grpo=dataclasses.replace(
      rule.grpo, reward=RewardConfig(sources=("host:exact_match",))))
  stage_r, s_r, _, m_r = run_steps(rule, "grpo", mesh(), steps=2)
  stage_h, s_h, _, m_h = run_steps(host, "grpo", mesh(), steps=2)
  for a, b in zip(m_r, m_h):
    for k in ("reward/mean", "loss", "kl/mean"):
      np.testing.assert_allclose(b[k], a[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert "time/phase/host_reward_s" in b and "time/phase/host_reward_s" not in a
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6),
               jax.device_get(s_h.params), jax.device_get(s_r.params))


def test_value_model_takes_the_reward_models_backbone_with_a_zero_head():
  """The reward head's raw-score scale has nothing to do with normalised returns: the value
  model starts from the reward model's backbone with a fresh (zero) head."""
  cfg = config()
  m = mesh()
  rm_stage = build_stage("rm", cfg, m, DataSource(cfg.data, cfg.seed))
  reward = rm_stage.init(jax.random.key(1), {})[0].params["reward"]
  reward = {**reward, "score": {"w": reward["score"]["w"] + 1.0, "b": reward["score"]["b"] + 2.0}}
  stage = build_stage("ppo", cfg, m, DataSource(cfg.data, cfg.seed))
  state, frozen = stage.init(jax.random.key(0), {"reward": reward})
  value = jax.device_get(state.params["value"])
  assert not np.any(value["score"]["w"]) and float(value["score"]["b"]) == 0.0
  np.testing.assert_array_equal(value["layers"]["w_up"], jax.device_get(reward["layers"]["w_up"]))
  # The frozen reward model keeps its own head.
  assert float(jax.device_get(frozen["reward"]["score"]["b"])) == float(reward["score"]["b"])


def test_the_learning_rate_schedule_counts_steps_not_optimizer_updates():
  """An RL step makes ppo_epochs x num_minibatches updates; warm-up over W *steps* (as the
  published recipes count it) runs every update of step k at lr * k / W, and a GRPO stage
  with two epochs of two minibatches builds its optimizers so."""
  import jax.numpy as jnp
  import optax
  from jaxrlhf.config import OptimizerConfig
  from jaxrlhf.train.common import make_optimizer
  cfg = OptimizerConfig(lr=1e-2, warmup_steps=4, warmup_start="first_step", schedule="constant",
                        grad_clip=0.0, weight_decay=0.0)
  opt = make_optimizer(cfg, 20, updates_per_step=4)
  params = {"w": jnp.zeros(())}
  state = opt.init(params)
  moves = []
  for _ in range(12):  # a constant gradient: Adam moves each update by its learning rate
    updates, state = opt.update({"w": jnp.ones(())}, state, params)
    new = optax.apply_updates(params, updates)
    moves.append(float(params["w"] - new["w"]))
    params = new
  want = [1e-2 * k / 4 for k in (1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)]
  assert moves == pytest.approx(want, rel=1e-3)
  # and the stage passes its updates per step on
  c = config(stages=("grpo",))
  c = dataclasses.replace(c, grpo=dataclasses.replace(c.grpo, steps=20, ppo_epochs=2,
                                                      num_minibatches=2, optim=cfg))
  stage = build_stage("grpo", c, mesh(), DataSource(c.data, c.seed))
  s = stage.opt["policy"].init({"w": jnp.zeros(())})
  for _ in range(4):
    updates, s = stage.opt["policy"].update({"w": jnp.ones(())}, s, {"w": jnp.zeros(())})
    assert float(updates["w"]) == pytest.approx(-1e-2 / 4, rel=1e-3)
