"""Packed batches (data.pack): the first-fit layout, and the SFT, reward-model and DPO
objectives on packed rows equal to the padded ones, values and gradients, on random layouts."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import mesh
from jaxrlhf import model as M
from jaxrlhf.algorithms import bradley_terry_loss
from jaxrlhf.config import (ConfigError, DataConfig, DPOConfig, ExperimentConfig, KernelsConfig,
                            ModelConfig, OptimizerConfig, RMConfig, SFTConfig)
from jaxrlhf.config.experiment import validate
from jaxrlhf.data import DataSource
from jaxrlhf.data.packing import Packer, first_fit
from jaxrlhf.train import spec
from jaxrlhf.train.common import put_batch
from jaxrlhf.train.spec import build_stage

MODEL = ModelConfig(vocab_size=48, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                    mlp_dim=64, max_seq_len=32)
OPT = OptimizerConfig(lr=1e-3, warmup_steps=0, schedule="constant", eps=1e-3)
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _text(rng, lo, hi):
  return "".join(rng.choice(list(LETTERS), size=int(rng.integers(lo, hi + 1))))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  """SFT rows and preference pairs of spread lengths (prompt 0..10 characters after BOS,
  responses 0..10 before EOS), so every batch packs differently."""
  d = tmp_path_factory.mktemp("packing")
  rng = np.random.default_rng(0)
  with open(d / "sft.jsonl", "w") as f:
    for _ in range(64):
      f.write(json.dumps({"prompt": _text(rng, 0, 10), "response": _text(rng, 0, 10)}) + "\n")
  with open(d / "pairs.jsonl", "w") as f:
    for _ in range(64):
      f.write(json.dumps({"prompt": _text(rng, 0, 10), "chosen": _text(rng, 0, 10),
                          "rejected": _text(rng, 1, 10)}) + "\n")
  return str(d / "sft.jsonl"), str(d / "pairs.jsonl")


def config(files, pack, stage="sft", grad_accum=1, **data):
  sft, pairs = files
  opt = dataclasses.replace(OPT, grad_accum=grad_accum)
  return ExperimentConfig(
      model=MODEL, stages=(stage,),
      data=DataConfig(task="jsonl", sft_path=sft, pairs_path=pairs, max_prompt_len=12,
                      max_response_len=12, eval_size=4, pack=pack, **data),
      sft=SFTConfig(steps=2, batch_size=16, optim=opt, eval_every=0),
      rm=RMConfig(steps=2, batch_size=8, optim=opt, eval_every=0),
      dpo=DPOConfig(steps=2, batch_size=8, optim=opt, eval_every=0))


def stages(files, name, **kw):
  """The padded and the packed stage of ``name``, and parameters for both."""
  out = []
  for pack in (False, True):
    cfg = config(files, pack, name, **kw)
    out.append(build_stage(name, cfg, mesh(), DataSource(cfg.data, cfg.seed)))
  state, frozen = out[0].init(jax.random.key(0), {})
  return out[0], out[1], state, frozen


def assert_trees_close(a, b, rtol, atol):
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol,
                               err_msg=jax.tree_util.keystr(path))


# ------------------------------------------------------------------------------- layout


def test_first_fit_packs_every_sequence_whole_within_its_group():
  rng = np.random.default_rng(3)
  n, length = 24, 20
  lens = rng.integers(1, length + 1, n)
  tokens = rng.integers(3, 40, (n, length)).astype(np.int32)
  start = rng.integers(0, length - lens + 1)
  mask = (np.arange(length)[None] >= start[:, None]) & (
      np.arange(length)[None] < (start + lens)[:, None])
  loss = mask & (rng.random((n, length)) < 0.5)
  packer = Packer(row_len=32, groups=2, row_multiple=2, buckets=3)
  b = packer.pack(tokens, mask, loss)
  rows = b["tokens"].shape[0]
  assert rows in packer.bucket_rows(n) and rows % 2 == 0
  assert len(packer.bucket_rows(n)) <= 3 and max(packer.bucket_rows(n)) == packer.max_rows(n)
  np.testing.assert_array_equal(b["sequence_lengths"], lens)
  assert b["mask"].sum() == lens.sum()
  np.testing.assert_array_equal(b["mask"], b["segment_ids"] > 0)
  per_group = rows // 2
  for i in range(n):
    where = np.argwhere(b["sequence_ids"] == i)
    row = where[0, 0]
    assert (where[:, 0] == row).all(), "a sequence spans rows"
    assert row // per_group == i // (n // 2), "a sequence left its micro-batch's rows"
    cols = where[:, 1]
    np.testing.assert_array_equal(cols, np.arange(cols[0], cols[0] + lens[i]))
    np.testing.assert_array_equal(b["tokens"][row, cols], tokens[i][mask[i]])
    np.testing.assert_array_equal(b["loss_mask"][row, cols], loss[i][mask[i]])
    assert len(set(b["segment_ids"][row, cols])) == 1
  # First-fit decreasing never needs more rows than the sequences' total over the row length,
  # rounded up, plus one for each size class it cannot combine: here it is near the bound.
  assert len(first_fit(lens, 32)) <= n
  assert sum(len(r) for r in first_fit(lens, 32)) == n
  with pytest.raises(ValueError, match="raise data.pack_length"):
    Packer(row_len=8).pack(tokens, mask, loss)


def test_positions_restart_at_each_segment():
  seg = jnp.asarray([[1, 1, 1, 2, 2, 3, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
  np.testing.assert_array_equal(M.positions_from_segments(seg),
                                [[0, 1, 2, 0, 1, 0, 0, 1], [0, 1, 2, 3, 4, 5, 6, 7]])


# ------------------------------------------------------------------- packed == padded


@pytest.mark.parametrize("attention", ["xla", "pallas_interpret"])
def test_packed_sft_loss_and_gradients_equal_padded(files, attention):
  kernels = KernelsConfig(attention=attention)
  padded, packed, state, _ = stages(files, "sft")
  params = state.params["policy"]
  for stage in (padded, packed):
    stage.cfg = dataclasses.replace(stage.cfg, kernels=kernels)
  a, b = padded.batch(0), packed.batch(0)
  assert b["tokens"].shape[0] < a["tokens"].shape[0]  # fewer rows than sequences
  assert b["segment_ids"].max() > 1  # several sequences share a row
  got = []
  for stage, batch in ((padded, a), (packed, b)):
    loss_fn, mb = stage.objective(jax.tree.map(jnp.asarray, batch))
    (loss, metrics), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params, mb)
    got.append((loss, metrics["tokens"], grads))
  np.testing.assert_allclose(got[1][0], got[0][0], rtol=1e-5)
  assert float(got[1][1]) == float(got[0][1])  # the same target tokens
  assert_trees_close(got[1][2], got[0][2], rtol=2e-4, atol=2e-6)


@pytest.mark.parametrize("pool", ["last", "mean"])
def test_packed_reward_scores_and_gradients_equal_padded(files, pool):
  padded, packed, state, _ = stages(files, "rm")
  for stage in (padded, packed):
    stage.cfg = dataclasses.replace(stage.cfg, model=dataclasses.replace(MODEL, score_pool=pool))
  padded, packed = (build_stage("rm", s.cfg, s.mesh, s.data) for s in (padded, packed))
  params = state.params["reward"]
  # A head that is not zero, so the scores (and their gradients) depend on every token.
  params = {**params, "score": {"w": jax.random.normal(jax.random.key(1), (MODEL.d_model,)),
                                "b": params["score"]["b"]}}
  a, b = (jax.tree.map(jnp.asarray, s.batch(0)) for s in (padded, packed))
  assert b["segment_ids"].max() > 1

  def objective(stage, batch):
    def f(p):
      c, r = stage.pair_scores(p, batch)
      return bradley_terry_loss(c, r)[0], (c, r)
    return jax.jit(jax.value_and_grad(f, has_aux=True))(params)

  (la, sa), ga = objective(padded, a)
  (lb, sb), gb = objective(packed, b)
  for x, y in zip(sb, sa):
    np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(lb, la, rtol=1e-5)
  assert_trees_close(gb, ga, rtol=2e-4, atol=2e-6)


@pytest.mark.parametrize("loss", ["sigmoid", "simpo"])
def test_packed_dpo_logps_and_gradients_equal_padded(files, loss):
  padded, packed, state, frozen = stages(files, "dpo")
  for stage in (padded, packed):
    stage.scfg = dataclasses.replace(stage.scfg, loss=loss)
  params = state.params["policy"]
  a, b = (jax.tree.map(jnp.asarray, s.batch(1)) for s in (padded, packed))
  ref = frozen.get("reference", params)

  def objective(stage, batch):
    rc, rr = stage.seq_logps(ref, batch)
    def f(p):
      pc, pr = stage.seq_logps(p, batch)
      return stage.pref_loss(pc, pr, rc, rr, batch)[0], (pc, pr)
    return jax.jit(jax.value_and_grad(f, has_aux=True))(params)

  (la, sa), ga = objective(padded, a)
  (lb, sb), gb = objective(packed, b)
  for x, y in zip(sb, sa):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(lb, la, rtol=1e-5, atol=1e-6)
  assert_trees_close(gb, ga, rtol=2e-4, atol=2e-6)


def _run(cfg, name, m):
  stage = build_stage(name, cfg, m, DataSource(cfg.data, cfg.seed))
  state, frozen = stage.init(jax.random.key(0), {})
  batch = put_batch(m, stage.batch(1))
  with jax.set_mesh(m):
    _, metrics = stage.make_step_fn(state, frozen, batch)(state, frozen, batch)
  return {k: float(v) for k, v in jax.device_get(metrics).items()}


def test_packed_dpo_step_with_micro_batches_on_a_mesh_matches_padded(files):
  """A whole DPO step (reference log-probs of the whole batch, then the update) on a dp=2
  mesh with two micro-batches, each packed into its own rows: the same loss, metrics and
  gradient norm as the padded step, and the packing's own metrics."""
  m = mesh(dp=2)
  a, b = (_run(config(files, pack, "dpo", grad_accum=2), "dpo", m) for pack in (False, True))
  for k in a:
    if k == "pref_accuracy":
      # At policy = reference every margin is 0 up to rounding, and this counts margins > 0:
      # the sign of the two layouts' rounding, not a figure of the step (the margins and the
      # loss are compared).
      continue
    np.testing.assert_allclose(b[k], a[k], rtol=2e-4, atol=2e-5, err_msg=k)
  assert 0 < b["pack/useful_fraction"] <= 1 and b["pack/rows"] % 4 == 0
  assert "pack/rows" not in a


# ------------------------------------------------------------------------------ settings


def test_bad_pack_settings_name_the_field_and_the_fix(files):
  with pytest.raises(ConfigError, match=r"data.pack_length=10: .* set data.pack_length=24"):
    validate(config(files, True, pack_length=10))
  with pytest.raises(ConfigError, match=r"data.pack_buckets=0: must be >= 1"):
    validate(config(files, True, pack_buckets=0))
  with pytest.raises(ConfigError, match=r"data.pack=true, but none of the stages \(grpo\) packs"
                                        r".*sft, rm, dpo.*set data.pack=false"):
    spec.check_packing(dataclasses.replace(config(files, True), stages=("grpo",)))
  spec.check_packing(config(files, True))  # SFT packs: accepted
