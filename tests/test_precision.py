"""Mixed precision (jaxrlhf.train.precision): float32 masters keep the updates bfloat16 weights
lose, move exactly as an all-float32 run, round to the copy the model reads, and resume bit for
bit; stochastic rounding moves the expected number of weights; micro-batch gradients sum in
float32."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import mesh
from jaxrlhf.checkpoint import Checkpointer
from jaxrlhf.config import (CheckpointConfig, ConfigError, LoraConfig, ModelConfig,
                            RewardConfig, validate)
from jaxrlhf.data import DataSource
from jaxrlhf.train.common import accumulate_grads, put_batch
from jaxrlhf.train.precision import Precision, stochastic_round
from jaxrlhf.train.spec import build_stage
from test_train import MODEL, OPT, config

# bfloat16 weights computing in bfloat16 (the 70B experiments' dtypes), and the all-float32
# weights a master-weight run must match (computing in bfloat16 alike).
BF16 = dataclasses.replace(MODEL, param_dtype="bfloat16", compute_dtype="bfloat16")
F32 = dataclasses.replace(MODEL, compute_dtype="bfloat16")
# Adam moves every weight by about lr per step: 1e-6 is far below a bfloat16 weight's
# resolution (2^-8 of its magnitude: ~1e-4 at the init's 0.02, 4e-3 at a norm's 1.0).
SMALL_LR = 1e-6


def _cfg(model, precision="fp32", lr=SMALL_LR, **optim):
  base = config(model=model)
  opt = dataclasses.replace(OPT, lr=lr, precision=precision, **optim)
  # Partial credit, so that GRPO's groups differ in reward from the first step.
  grpo = dataclasses.replace(base.grpo, reward=RewardConfig(sources=("rule:token_accuracy",)))
  return dataclasses.replace(base, **{
      s: dataclasses.replace(getattr(base, s) if s != "grpo" else grpo, optim=opt)
      for s in ("sft", "dpo", "grpo")})


def _stage(cfg, name):
  m = mesh()
  return build_stage(name, cfg, m, DataSource(cfg.data, cfg.seed)), m


def _steps(stage, m, state, frozen, steps, start=0):
  out, fn = [], None
  for step in range(start, start + steps):
    batch = put_batch(m, stage.batch(step))
    with jax.set_mesh(m):
      fn = fn or stage.make_step_fn(state, frozen, batch)
      state, metrics = fn(state, frozen, batch)
    out.append({k: float(v) for k, v in jax.device_get(metrics).items()})
  return state, out


def _run(cfg, name, steps=1, roles=None):
  stage, m = _stage(cfg, name)
  state, frozen = stage.init(jax.random.key(0), roles or {})
  start = jax.device_get(state.params)
  state, out = _steps(stage, m, state, frozen, steps)
  return stage, start, state, frozen, out


def _leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def _changed_fraction(a, b):
  la, lb = _leaves(a), _leaves(b)
  return sum(int(np.sum(x != y)) for x, y in zip(la, lb)) / sum(x.size for x in la)


def _dtypes(tree):
  return {str(x.dtype) for x in jax.tree.leaves(tree)}


def test_pure_bf16_loses_small_updates_that_fp32_masters_keep():
  _, start, state, _, _ = _run(_cfg(BF16, "pure_bf16"), "sft")
  assert _dtypes(state.params["policy"]) == {"bfloat16"}
  lost = _changed_fraction(start["policy"], state.params["policy"])
  assert lost < 0.01, f"pure_bf16 moved {lost:.1%} of the weights at lr {SMALL_LR}"

  stage, start, state, frozen, _ = _run(_cfg(BF16, "fp32"), "sft")
  master = state.params["policy"]
  assert _dtypes(master) == {"float32"} and _dtypes(state.opt_state["policy"]) <= {
      "float32", "int32"}
  kept = _changed_fraction(start["policy"], master)
  assert kept > 0.5, f"fp32 masters moved only {kept:.1%} of the weights"
  # The copy generation reads (the rollout's, an evaluation's) is the master rounded.
  view = stage.view(state.params, frozen, "policy", decode=True)
  assert _dtypes(view) == {"bfloat16"}
  for v, w in zip(_leaves(view), _leaves(master)):
    np.testing.assert_array_equal(v, w.astype(jnp.bfloat16))
  # What the stage hands on (and an export writes) is in the model's param_dtype.
  assert _dtypes(stage.outputs(state, frozen)["policy"]) == {"bfloat16"}


@pytest.mark.parametrize("name", ["sft", "dpo", "grpo"])
def test_fp32_masters_move_exactly_as_an_all_fp32_run(name):
  """bfloat16 weights with float32 masters against float32 weights, both computing in
  bfloat16 from the same (bfloat16-representable) start: the same program, bit for bit."""
  stage, _ = _stage(_cfg(BF16, lr=1e-3), name)
  state, frozen = stage.init(jax.random.key(0), {})
  roles = {"policy": jax.device_get(stage.outputs(state, frozen)["policy"])}
  _, _, mixed, _, m1 = _run(_cfg(BF16, lr=1e-3), name, steps=2, roles=roles)
  _, _, full, _, m2 = _run(_cfg(F32, lr=1e-3), name, steps=2, roles=roles)
  assert _dtypes(full.params["policy"]) == _dtypes(mixed.params["policy"]) == {"float32"}
  for a, b in zip(_leaves(mixed.params), _leaves(full.params)):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(_leaves(mixed.opt_state), _leaves(full.opt_state)):
    np.testing.assert_array_equal(a, b)
  assert _changed_fraction(roles["policy"], mixed.params["policy"]) > 0.5
  for k in m1[-1]:
    if not k.startswith(("time/", "memory/")):
      assert m1[-1][k] == m2[-1][k] or np.isnan(m1[-1][k]) and np.isnan(m2[-1][k]), k


def test_stochastic_rounding_moves_the_expected_number_of_weights():
  """Each weight moves to its neighbour with probability (remainder / gap): over 200k weights
  the count stays within a few standard deviations of the sum of those probabilities."""
  n = 200_000
  k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
  w = (0.02 * jax.random.normal(k1, (n,))).astype(jnp.bfloat16)
  # Updates of 1e-3 of each weight: 1/8 to 1/4 of its gap (2^-8 to 2^-7 of it), which round
  # to nearest keeps and stochastic rounding moves about as often.
  u = 1e-3 * w.astype(jnp.float32) * jax.random.normal(k2, (n,))
  x = np.asarray(w.astype(jnp.float32) + u, np.float32)
  out = np.asarray(stochastic_round(jnp.asarray(x), k3)).astype(np.float32)
  bits = x.view(np.uint32)
  low = (bits & 0xFFFF).astype(np.float64) / 65536.0  # P(the magnitude rounds up)
  toward_zero = (bits & 0xFFFF0000).view(np.float32)
  away = ((bits & 0xFFFF0000) + 0x10000).view(np.float32)  # the next magnitude up
  w32 = np.asarray(w.astype(jnp.float32))
  # x's two neighbours; w is one of them unless u spans a whole gap (small w): then it moves.
  p_move = np.where(toward_zero == w32, low, np.where(away == w32, 1.0 - low, 1.0))
  moved = int(np.sum(out != w32))
  mean, sd = p_move.sum(), np.sqrt(np.sum(p_move * (1 - p_move)))
  assert abs(moved - mean) < 5 * sd, (moved, mean, sd)
  assert 0.05 * n < moved < 0.5 * n
  # Every result is one of the two neighbours of x, and the rounding is unbiased.
  assert np.all((out == toward_zero) | (out == away))
  assert abs(np.mean(out - x)) < 5 * np.std(out - x) / np.sqrt(n)
  # Round to nearest moves none of them: |u| stays below half the gap for nearly all.
  assert np.mean(np.asarray(jnp.asarray(x).astype(jnp.bfloat16)).astype(np.float32) != w32) < \
      0.05
  # Deterministic in the key; infinities and NaNs pass through.
  again = np.asarray(stochastic_round(jnp.asarray(x), k3)).astype(np.float32)
  np.testing.assert_array_equal(out, again)
  special = stochastic_round(jnp.asarray([np.inf, -np.inf, np.nan], jnp.float32), k3)
  assert np.isposinf(special[0]) and np.isneginf(special[1]) and np.isnan(special[2])


def test_bf16_sr_keeps_bf16_weights_and_moves_them_where_pure_bf16_does_not():
  _, start, pure, _, _ = _run(_cfg(BF16, "pure_bf16"), "sft", steps=2)
  _, start, sr, _, _ = _run(_cfg(BF16, "bf16_sr"), "sft", steps=2)
  assert _dtypes(sr.params["policy"]) == {"bfloat16"}
  assert _dtypes(jax.tree.leaves(sr.opt_state["policy"])[1:]) <= {"float32", "int32"}
  moved_sr = _changed_fraction(start["policy"], sr.params["policy"])
  moved_pure = _changed_fraction(start["policy"], pure.params["policy"])
  assert moved_sr > 3 * max(moved_pure, 1e-3), (moved_sr, moved_pure)
  # bfloat16 moments only when asked.
  _, _, half, _, _ = _run(_cfg(BF16, "bf16_sr", moment_dtype="bfloat16"), "sft")
  mu = jax.tree.leaves(half.opt_state["policy"])
  assert "bfloat16" in {str(x.dtype) for x in mu}


def test_micro_batch_gradients_of_bf16_weights_sum_in_float32():
  """Eight micro-batches of a bfloat16-weight model sum to the full batch's gradient to
  float32 rounding (summed in bfloat16, or differentiated at the bfloat16 weights, each part
  would be rounded to 8 bits)."""
  k1, k2 = jax.random.split(jax.random.key(0))
  w = (0.05 * jax.random.normal(k1, (32, 16))).astype(jnp.bfloat16)
  x = jax.random.normal(k2, (64, 32))
  prec = Precision.of(OPT, dataclasses.replace(MODEL, param_dtype="bfloat16"))
  assert prec.mode == "fp32" and prec.master == "float32"
  bf16_sr = Precision.of(dataclasses.replace(OPT, precision="bf16_sr"),
                         dataclasses.replace(MODEL, param_dtype="bfloat16"))

  def loss(p, batch):
    y = batch["x"] @ p["w"].astype(jnp.float32)
    return jnp.sum(jnp.tanh(y) ** 2) / 64, {}

  p = bf16_sr.differentiable({"w": w})
  _, full, _ = accumulate_grads(loss, p, {"x": x}, 1)
  _, micro, _ = accumulate_grads(loss, p, {"x": x}, 8)
  assert micro["w"].dtype == jnp.float32
  np.testing.assert_allclose(micro["w"], full["w"], rtol=2e-5, atol=1e-8)
  rounded = full["w"].astype(jnp.bfloat16).astype(jnp.float32)
  assert float(jnp.max(jnp.abs(micro["w"] - full["w"]))) < float(
      jnp.max(jnp.abs(rounded - full["w"]))) / 50


def _resume_matches(cfg, tmp_path):
  stage, m = _stage(cfg, "sft")
  state, frozen = stage.init(jax.random.key(0), {})
  straight, _ = _steps(stage, m, state, frozen, 3)
  state, frozen = stage.init(jax.random.key(0), {})
  state, _ = _steps(stage, m, state, frozen, 2)
  with Checkpointer(str(tmp_path / "ck"), CheckpointConfig(every_steps=1), {}) as ck:
    ck.save_now(2, state)
    ck.wait()
    restored, _ = ck.restore(stage.abstract_init()[0])
  resumed, _ = _steps(stage, m, restored, frozen, 1, start=2)
  for a, b in zip(_leaves((straight.params, straight.opt_state)),
                  _leaves((resumed.params, resumed.opt_state))):
    np.testing.assert_array_equal(a, b)
  return straight


@pytest.mark.parametrize("precision", ["fp32", "bf16_sr"])
def test_resume_is_bit_identical(precision, tmp_path):
  straight = _resume_matches(_cfg(BF16, precision, lr=1e-4), tmp_path)
  want = {"fp32": "float32", "bf16_sr": "bfloat16"}[precision]
  assert _dtypes(straight.params["policy"]) == {want}


def test_a_pure_bf16_checkpoint_restores_into_fp32_masters(tmp_path, capsys):
  """A checkpoint of bfloat16 weights and moments (this setting's pure_bf16, and every run
  before it existed) resumes under fp32: upcast exactly, then trained on float32 masters."""
  stage, m = _stage(_cfg(BF16, "pure_bf16", lr=1e-4), "sft")
  state, frozen = stage.init(jax.random.key(0), {})
  state, _ = _steps(stage, m, state, frozen, 1)
  with Checkpointer(str(tmp_path / "ck"), CheckpointConfig(every_steps=1), {}) as ck:
    ck.save_now(1, state)
    ck.wait()
    new, m = _stage(_cfg(BF16, "fp32", lr=1e-4), "sft")
    restored, _ = ck.restore(new.abstract_init()[0])
  assert "are restored in float32" in capsys.readouterr().out
  assert _dtypes(restored.params["policy"]) == {"float32"}
  for a, b in zip(_leaves(restored.params), _leaves(state.params)):
    np.testing.assert_array_equal(a, b.astype(np.float32))
  _steps(new, m, restored, frozen, 1, start=1)


def test_lora_adapters_train_in_fp32_over_a_bf16_base():
  cfg = _cfg(BF16, lr=1e-3)
  cfg = dataclasses.replace(cfg, sft=dataclasses.replace(cfg.sft, lora=LoraConfig(rank=2)))
  stage, _, state, frozen, _ = _run(cfg, "sft")
  assert _dtypes(state.params["policy"]) == {"float32"}
  assert _dtypes(frozen[stage.base_keys["policy"]]) == {"bfloat16"}
  assert _dtypes(stage.outputs(state, frozen)["policy"]) == {"bfloat16"}


def test_bf16_sr_on_a_float16_model_is_refused_in_one_line():
  cfg = _cfg(dataclasses.replace(MODEL, param_dtype="float16"), "bf16_sr")
  cfg = dataclasses.replace(cfg, stages=("sft",))
  with pytest.raises(ConfigError, match=r"sft\.optim\.precision='bf16_sr': rounds updates to "
                     r"bfloat16 but the model's param_dtype is float16; use precision=fp32"):
    validate(cfg)


def test_float32_models_ignore_the_setting():
  for mode in ("fp32", "bf16_sr", "pure_bf16"):
    p = Precision.of(dataclasses.replace(OPT, precision=mode), ModelConfig())
    assert (p.master, p.moments, p.storage) == ("float32",) * 3
