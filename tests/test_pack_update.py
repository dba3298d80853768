"""Packed forwards after generation (rollout.pack, issue 25): the reference, reward, values and
the update's forward and backward run on packed rows, several sequences per row, and give the
same step as the rollout's own rows, for any minibatching, gradient accumulation and
algorithm; each distinct row count is compiled once; what cannot be packed is refused."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import mesh
from jaxrlhf import model as M
from jaxrlhf.config import ConfigError, validate
from jaxrlhf.data.packing import Packer
from jaxrlhf.train import packed as PK
from test_length_buckets import MODEL, _same, config, run_steps


class _Stage:
  """What the packed forwards read of a stage: its mesh, kernels and model configs."""

  def __init__(self, cfg=MODEL):
    from jaxrlhf.config import KernelsConfig
    self.mesh, self.cfg, self.model = mesh(), type("C", (), {"kernels": KernelsConfig()})(), cfg

  def model_cfg(self, role):
    return self.model


def _ragged(rng, b, p, n):
  """Tokens ``[b, p + n]`` and their mask: each row a left-padded prompt of 1..p real tokens
  and a response of 1..n."""
  mask = np.zeros((b, p + n), bool)
  for i in range(b):
    mask[i, p - rng.integers(1, p + 1):p + rng.integers(1, n + 1)] = True
  return jnp.asarray(np.where(mask, rng.integers(3, MODEL.vocab_size, mask.shape), 0)), mask


def _layout(mask, order=None, groups=1, row_len=None):
  mask = np.asarray(mask, bool)
  order = np.arange(mask.shape[0]) if order is None else order
  return PK.layout(mask, order, Packer(row_len=row_len or mask.shape[1], groups=groups))


def test_layout_places_each_real_token_once_and_maps_it_back():
  """Every real token of every row (an episode row's hole included) sits in exactly one slot,
  in order, one segment per sequence; slot_BT points each back; micro-batch groups hold only
  their own sequences and index locally."""
  rng = np.random.default_rng(0)
  b, t = 8, 12
  mask = np.zeros((b, t), bool)
  for i in range(b):
    p = rng.integers(1, 5)
    mask[i, 4 - p:4 + rng.integers(0, 9)] = True
  mask[3, 7] = False  # a hole (an episode's padding between turns)
  order = rng.permutation(b)
  got = _layout(mask, order, groups=2)
  src, seg, slot = got["src_RL"], got["segment_ids_RL"], got["slot_BT"]
  rows = src.shape[0] // 2
  per = b // 2
  for g in range(2):
    for j in range(per):
      i = order[g * per + j]
      cols = np.flatnonzero(mask[i])
      s = slot[g * per + j, cols]
      r, l = s // t, s % t
      assert np.all(r < rows)  # local rows of the group
      np.testing.assert_array_equal(src[g * rows + r, l], j * t + cols)
      assert np.all(np.diff(s) == 1)  # contiguous, in order
      assert len(set(seg[g * rows + r, l])) == 1 and seg[g * rows + r[0], l[0]] >= 1
  assert (src >= 0).sum() == mask.sum()  # nothing twice, nothing lost
  np.testing.assert_array_equal(seg > 0, src >= 0)


def test_packed_forwards_equal_the_rollout_rows():
  """Log-probs, entropies, per-token and pooled scores of a packed layout, gathered back,
  equal the unpacked forward's at every real position (start=P and start=1)."""
  stage = _Stage()
  params = M.init_params(MODEL, jax.random.key(1), head="lm+scalar")
  b, p = 6, 5
  tokens, mask = _ragged(np.random.default_rng(2), b, p, 10)
  mask_j = jnp.asarray(mask)
  rows = PK.PackedRows(**{k: jnp.asarray(v) for k, v in _layout(mask).items()})
  assert rows.src_RL.shape[0] < b  # several sequences per row
  # Jitted, as the step runs them (and op by op would be slow).
  logprobs = jax.jit(lambda packed, start: PK.token_logprobs(
      stage, params, tokens, mask_j, packed, role="policy", start=start), static_argnums=1)
  scores = jax.jit(lambda packed: PK.token_scores(stage, params, tokens, mask_j, packed,
                                                  role="value"))
  for start in (p, 1):
    want, got = logprobs(None, start), logprobs(rows, start)
    # Predicted positions: the token and the one before it real.
    real = mask[:, start:] & mask[:, start - 1:-1]
    for w, g in zip(want, got):
      np.testing.assert_allclose(np.asarray(g)[real], np.asarray(w)[real], rtol=2e-5,
                                 atol=2e-5)
  want, got = scores(None), scores(rows)
  np.testing.assert_allclose(np.asarray(got)[mask], np.asarray(want)[mask], rtol=2e-5,
                             atol=2e-5)
  for pool in ("last", "mean"):
    stage = _Stage(dataclasses.replace(MODEL, score_pool=pool))
    pooled = jax.jit(lambda packed: PK.sequence_scores(stage, params, tokens, mask_j, packed,
                                                       role="reward", start=p))
    want, got = pooled(None), pooled(rows)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_packed_gradients_equal_the_rollout_rows():
  """The gradient of a masked log-prob loss through the packed layout equals the unpacked
  one (the gather back scatters the cotangents to the right slots)."""
  stage = _Stage()
  params = M.init_params(MODEL, jax.random.key(3))
  rng = np.random.default_rng(4)
  b, p, n = 8, 5, 10
  tokens, mask = _ragged(rng, b, p, n)
  weights = jnp.asarray(rng.normal(size=(b, n)).astype(np.float32))
  resp = jnp.asarray(mask[:, p:])
  rows = PK.PackedRows(**{k: jnp.asarray(v) for k, v in _layout(mask).items()})

  def loss(params, packed):
    lp, ent = PK.token_logprobs(stage, params, tokens, jnp.asarray(mask), packed,
                                role="policy", start=p)
    return jnp.sum(jnp.where(resp, weights * lp + 0.1 * ent, 0.0))

  want = jax.jit(jax.grad(loss))(params, None)
  got = jax.jit(jax.grad(loss))(params, rows)
  jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5), got, want)


@pytest.mark.parametrize("algo,kw", [
    ("grpo", {}),
    ("grpo", {"grad_accum": 2, "loss_agg": "seq_mean_token_mean"}),
    ("ppo", {}),
])
def test_packed_steps_equal_the_rollout_rows_and_compile_per_row_count(algo, kw):
  """Three steps with packing equal three without: GRPO (group advantages, KL in the loss;
  with gradient accumulation and per-sequence aggregation too) and PPO (values, GAE, two
  epochs of two shuffled minibatches).  Metrics and parameters to float rounding; the
  packed rows are fewer than the rollout's."""
  base = config(algo, **{k: v for k, v in kw.items() if k != "grad_accum"})
  if kw.get("grad_accum"):
    section = getattr(base, algo)
    base = dataclasses.replace(base, **{algo: dataclasses.replace(
        section, optim=dataclasses.replace(section.optim, grad_accum=kw["grad_accum"]))})
  packed = dataclasses.replace(base, rollout=dataclasses.replace(base.rollout, pack=True))
  full = run_steps(base, mesh(), algo)
  got = run_steps(packed, mesh(), algo)
  _same(full, got, rtol=5e-5, atol=2e-6)
  rows = 16 if algo == "grpo" else 8
  section = getattr(base, algo)
  per_mb = rows // section.num_minibatches
  for m in got[2]:
    assert 1 <= m["pack/rows"] < rows and 0.5 < m["pack/useful_fraction"] <= 1
    # Per minibatch, fewer rows than its sequences; the same real tokens in every epoch's rows.
    assert 1 <= m["pack/update_rows"] < per_mb and 0 < m["pack/update_useful_fraction"] <= 1
    update_slots = section.ppo_epochs * section.num_minibatches * m["pack/update_rows"]
    assert m["pack/update_useful_fraction"] * update_slots == pytest.approx(
        section.ppo_epochs * m["pack/useful_fraction"] * m["pack/rows"])
  distinct = {(m["pack/rows"], m["pack/update_rows"]) for m in got[2]}
  assert got[0].jitted["after_host"]._cache_size() == len(distinct)


def test_packed_refill_and_buckets_on_dp2_equal_the_rollout_rows_on_one_device():
  """Refill's short groups, cut to their bucket and packed into rows of that width, on a
  dp=2 x tp=2 mesh, equal the rollout's own rows on one device."""
  base = config(buckets=4, refill=True)
  packed = dataclasses.replace(base, rollout=dataclasses.replace(base.rollout, pack=True))
  full = run_steps(base, mesh(), steps=2)
  got = run_steps(packed, mesh(dp=2, tp=2), steps=2)
  assert all(m["pack/rows"] % 2 == 0 for m in got[2])  # rows split over dp
  _same(full, got, rtol=2e-4, atol=2e-5)


def test_packing_with_dynamic_sampling_is_refused_with_the_fix():
  from jaxrlhf.pools import common
  base = config("grpo", dynamic_sampling=True)
  cfg = dataclasses.replace(base, rollout=dataclasses.replace(base.rollout, pack=True))
  with pytest.raises(ConfigError, match="rollout.pack=true with grpo.dynamic_sampling"):
    validate(cfg)
  ppo = config("ppo")
  ppo = dataclasses.replace(ppo, rollout=dataclasses.replace(ppo.rollout, pack=True))
  common.check_config(dataclasses.replace(ppo, stages=("ppo",)))  # the pools take it
  bad = dataclasses.replace(ppo, rollout=dataclasses.replace(ppo.rollout, pack_buckets=0))
  with pytest.raises(ConfigError, match="rollout.pack_buckets"):
    validate(bad)
  from jaxrlhf.config import KernelsConfig
  bad = dataclasses.replace(ppo, kernels=KernelsConfig(attention="cudnn"))
  with pytest.raises(ConfigError, match="rollout.pack=true with kernels.attention=cudnn"):
    validate(bad)


@pytest.mark.slow
def test_packed_episode_step_equals_the_rollout_rows(tmp_path):
  """A multi-turn PPO step (actions and observations in one row, per-turn rewards, values
  over the actions) packed equals the step on the episode's own rows."""
  from jaxrlhf.config import PPOConfig, RewardConfig as RC
  from jaxrlhf.data import DataSource
  from jaxrlhf.train.common import put_batch
  from jaxrlhf.train.spec import build_stage
  from test_episodes import ECHO, OPT as EOPT, _cfg
  base = _cfg(tmp_path, ECHO, "Echo")
  base = dataclasses.replace(base, ppo=PPOConfig(
      steps=2, batch_size=8, optim=EOPT, value_optim=EOPT, eval_every=0, num_minibatches=2,
      reward=RC(sources=("env",))))
  out = []
  for pack in (False, True):
    cfg = dataclasses.replace(base, rollout=dataclasses.replace(base.rollout, pack=pack))
    m = mesh()
    stage = build_stage("ppo", cfg, m, DataSource(cfg.data, cfg.seed))
    state, frozen = stage.init(jax.random.key(0), {})
    batch = put_batch(m, stage.batch(0))
    with jax.set_mesh(m):
      state, metrics = stage.make_step_fn(state, frozen, batch)(state, frozen, batch)
    out.append(({k: float(v) for k, v in jax.device_get(metrics).items()},
                jax.device_get(state.params)))
  (m1, p1), (m2, p2) = out
  assert m1["env/turns_mean"] > 1 and m2["pack/rows"] < 8
  for k in m1:
    if not k.startswith(("time/", "memory/", "perf/", "throughput/")):
      np.testing.assert_allclose(m2[k], m1[k], rtol=5e-5, atol=2e-6, err_msg=k)
  jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=5e-5, atol=2e-6), p1, p2)


def test_perf_flops_count_the_shapes_a_packed_or_bucketed_step_ran():
  """perf/flops_per_step (and so perf/mfu) counts the phases after generation at the width and
  packed rows a step reported, generation as before; a step without them keeps the full count."""
  from jaxrlhf.data import DataSource
  from jaxrlhf.hardware import ACCELERATORS
  from jaxrlhf.train.spec import build_stage
  from jaxrlhf.train.work import step_utilisation, step_work
  base = config("ppo", buckets=4)
  cfg = dataclasses.replace(base, rollout=dataclasses.replace(base.rollout, pack=True))
  stage = build_stage("ppo", cfg, mesh(), DataSource(cfg.data, cfg.seed))
  acc = next(iter(ACCELERATORS.values()))
  work = step_work(stage, acc, tp=1, n_devices=1, n_processes=1)
  full = work.flops
  # 8 rollout rows (4 prompts x 2) packed into 4 rows at width 8 of 16; 2 minibatches of 2.
  step = {"time/step_s": 1.0, "rollout/update_width": 8.0, "pack/rows": 4.0,
          "pack/update_rows": 2.0}
  shaped = work.of_step(step).flops
  assert shaped["generate"] == full["generate"]
  assert {"reference", "values", "update"} <= full.keys()
  for phase in full.keys() - {"generate"}:
    # Half the rows, 13 of 21 slots each (the head over every slot of a packed row).
    assert 0.2 * full[phase] < shaped[phase] < 0.45 * full[phase], phase
  got = step_utilisation(work, step)
  assert got["perf/flops_per_step"] == pytest.approx(sum(shaped.values()))
  assert step_utilisation(work, {"time/step_s": 1.0})["perf/flops_per_step"] == pytest.approx(
      sum(full.values()))


def test_perf_flops_of_a_packed_sft_step_count_its_rows():
  """data.pack: perf/flops_per_step counts the packed rows a step reported, not the padded
  batch."""
  from jaxrlhf.config import DataConfig, ExperimentConfig, SFTConfig
  from jaxrlhf.data import DataSource
  from jaxrlhf.hardware import ACCELERATORS
  from jaxrlhf.train.spec import build_stage
  from jaxrlhf.train.work import step_work
  from test_length_buckets import OPT
  cfg = ExperimentConfig(model=MODEL, data=DataConfig(task="addition", digits=1,
                                                      max_prompt_len=5, max_response_len=3,
                                                      eval_size=8, pack=True),
                         stages=("sft",), sft=SFTConfig(steps=1, batch_size=8, optim=OPT))
  stage = build_stage("sft", cfg, mesh(), DataSource(cfg.data, cfg.seed))
  work = step_work(stage, next(iter(ACCELERATORS.values())), tp=1, n_devices=1, n_processes=1)
  packed = work.of_step({"pack/rows": 2.0}).flops["update"]
  assert packed == pytest.approx(work.flops["update"] / 4)  # 2 rows of 8 slots, not 8
  assert work.of_step({}).flops is work.flops
