"""The sharded transformer: the same numbers on every mesh, sharded init, 70B abstract shapes."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import TINY, mesh, ragged_batch
from jaxrlhf import model as M
from jaxrlhf import registry
from jaxrlhf.config import ConfigError, MeshConfig, validate
from jaxrlhf.mesh import (PARAM_RULES, assert_sharded, batch_sharding, make_mesh,
                          resolve_mesh_shape, tree_shardings)
from kernels.logprob import logprob_entropy


def _loss_and_outputs(params, tokens, mask, cfg):
  h, _ = M.forward(params, tokens, M.positions_from_mask(mask), mask, cfg=cfg)
  logp, _ = logprob_entropy(h[:, :-1], M.unembedding(params, cfg), tokens[:, 1:], block_v=16)
  valid = mask[:, 1:] & mask[:, :-1]
  return -jnp.sum(jnp.where(valid, logp, 0.0)) / jnp.sum(valid), h


def _run(m, params, tokens, mask, cfg):
  with jax.set_mesh(m):
    shardings = tree_shardings(m, M.param_axes(cfg), params, PARAM_RULES)
    params = jax.device_put(params, shardings)
    tokens = jax.device_put(tokens, batch_sharding(m, 2, tokens.shape))
    mask = jax.device_put(mask, batch_sharding(m, 2, mask.shape))
    fn = jax.jit(jax.value_and_grad(lambda p, t, k: _loss_and_outputs(p, t, k, cfg), has_aux=True))
    (loss, h), grads = fn(params, tokens, mask)
  return jax.device_get((loss, h, grads))


@pytest.mark.parametrize("shape", [dict(dp=8), dict(dp=2, tp=4), dict(dp=2, fsdp=2, tp=2)])
def test_forward_and_grads_equal_single_device(shape):
  cfg = dataclasses.replace(TINY, n_kv_heads=4)
  params = M.init_params(cfg, jax.random.key(0))
  tokens, mask = ragged_batch(jax.random.key(1), 8, 12, cfg.vocab_size)
  ref = _run(mesh(), params, tokens, mask, cfg)
  got = _run(mesh(**shape), params, tokens, mask, cfg)
  np.testing.assert_allclose(got[0], ref[0], rtol=1e-5)
  np.testing.assert_allclose(np.where(mask[..., None], got[1], 0),
                             np.where(mask[..., None], ref[1], 0), atol=2e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-6, rtol=2e-4), got[2], ref[2])


def _prefill_then_decode(params, tokens, pos, mask, cfg, prefill=6):
  """Hidden states of ``prefill`` tokens written into a KV cache at once, then the rest one
  token per step."""
  cache = M.init_cache(cfg, tokens.shape[0], 16)
  h1, cache = M.forward(params, tokens[:, :prefill], pos[:, :prefill], mask[:, :prefill],
                        cfg=cfg, cache=cache)
  outs = [h1]
  for t in range(prefill, tokens.shape[1]):
    h, cache = M.forward(params, tokens[:, t:t + 1], pos[:, t:t + 1], mask[:, t:t + 1], cfg=cfg,
                         cache=cache)
    outs.append(h)
  return jnp.concatenate(outs, 1)


def test_kv_cache_matches_full_forward_on_ragged_prompts():
  params = M.init_params(TINY, jax.random.key(0))
  tokens, mask = ragged_batch(jax.random.key(2), 4, 10, TINY.vocab_size)
  pos = M.positions_from_mask(mask)
  full, _ = M.forward(params, tokens, pos, mask, cfg=TINY)
  cached = _prefill_then_decode(params, tokens, pos, mask, TINY)
  np.testing.assert_allclose(np.where(mask[..., None], cached, 0),
                             np.where(mask[..., None], full, 0), atol=1e-5)


def test_layer_options_do_not_change_the_function():
  params = M.init_params(TINY, jax.random.key(0))
  tokens, mask = ragged_batch(jax.random.key(3), 2, 8, TINY.vocab_size)
  pos = M.positions_from_mask(mask)
  ref, _ = M.forward(params, tokens, pos, mask, cfg=TINY)
  for change in (dict(scan_layers=False), dict(remat="full"), dict(remat="dots")):
    cfg = dataclasses.replace(TINY, **change)
    got = jax.grad(lambda p: jnp.sum(M.forward(p, tokens, pos, mask, cfg=cfg)[0] ** 2))(params)
    want = jax.grad(lambda p: jnp.sum(M.forward(p, tokens, pos, mask, cfg=TINY)[0] ** 2))(params)
    np.testing.assert_allclose(M.forward(params, tokens, pos, mask, cfg=cfg)[0], ref, atol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4), got, want)


def test_scalar_head_and_tied_embeddings():
  cfg = dataclasses.replace(TINY, tie_embeddings=True)
  p = M.init_params(cfg, jax.random.key(0), head="lm")
  assert "unembed" not in p
  np.testing.assert_array_equal(M.unembedding(p, cfg), p["embed"].T)
  s = M.init_params(TINY, jax.random.key(0), head="scalar")
  tokens, mask = ragged_batch(jax.random.key(4), 3, 6, TINY.vocab_size)
  h, _ = M.forward(s, tokens, M.positions_from_mask(mask), mask, cfg=TINY)
  assert M.scalar_head(s, h).shape == (3, 6)
  assert set(jax.tree.leaves(M.param_axes(TINY, "scalar")["score"], is_leaf=lambda x: isinstance(x, tuple))) == {("embed",), ()}


def test_sharded_init_places_params_directly():
  m = mesh(dp=2, fsdp=2, tp=2)
  cfg = dataclasses.replace(TINY, n_kv_heads=4)
  params = M.init_sharded(cfg, jax.random.key(0), m)
  wq = params["layers"]["wq"]
  assert wq.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tp", None)
  # Each device holds 1/4 of wq (fsdp x tp); no device holds the whole thing.
  assert wq.addressable_shards[0].data.size == wq.size // 4
  np.testing.assert_allclose(jax.device_get(params["embed"]),
                             M.init_params(cfg, jax.random.key(0))["embed"], rtol=1e-6)


@pytest.mark.parametrize("name", ["sft70b", "ppo70b"])
def test_70b_abstract_params_are_sharded_on_64_devices(name):
  cfg = registry.get(name)
  # Shapes only: an abstract 64-device mesh, nothing allocated.
  abstract_mesh = jax.sharding.AbstractMesh((8, 1, 8), ("dp", "fsdp", "tp"))
  abstract = M.abstract_params(cfg.model)
  shardings = tree_shardings(abstract_mesh, M.param_axes(cfg.model), abstract, PARAM_RULES)
  assert_sharded(abstract, shardings)  # everything of 4 MiB or more
  total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract))
  assert total == cfg.model.num_params() and 70e9 < total < 71e9
  # Per-device bytes: every big tensor split 8 ways over tp.
  per_device = sum(int(np.prod(x.shape)) * 2 // np.prod([abstract_mesh.shape[a] for a in
                   _axes(s.spec)]) for x, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings)))
  assert per_device < 141e9 / 7


def _axes(spec):
  out = []
  for entry in spec:
    if entry is None:
      continue
    out.extend(entry if isinstance(entry, tuple) else (entry,))
  return out


def test_replicated_large_param_is_caught():
  """A rules table that leaves a large parameter whole on a mesh whose fsdp / tp axes could
  split it is caught; on a mesh of dp alone (data parallelism) the trained weights are whole
  on every device by design, and the check lets them be."""
  cfg = dataclasses.replace(TINY, vocab_size=4096, d_model=512)
  abstract = M.abstract_params(cfg)
  missing_embed = {**PARAM_RULES, "embed": None, "vocab": None}
  shardings = tree_shardings(mesh(dp=2, fsdp=4), M.param_axes(cfg), abstract, missing_embed)
  with pytest.raises(AssertionError, match=r"fully replicated: \['embed'\]"):
    assert_sharded(abstract, shardings, min_bytes=1 << 20)
  data_parallel = tree_shardings(mesh(dp=8), M.param_axes(cfg), abstract, PARAM_RULES)
  assert_sharded(abstract, data_parallel, min_bytes=1 << 20)


def test_mesh_shape_errors_say_what_fits():
  assert resolve_mesh_shape(MeshConfig(dp=-1, tp=4), 8) == {"dp": 2, "fsdp": 1, "tp": 4}
  with pytest.raises(ConfigError, match="does not divide the 8 devices"):
    resolve_mesh_shape(MeshConfig(dp=-1, tp=3), 8)
  with pytest.raises(ConfigError, match="needs 4 devices but 8 are present"):
    make_mesh(MeshConfig(dp=2, tp=2))


# Every family variant at once (Gemma 3's layout with Gemma 2's soft-capping): sliding and
# full layers in one scanned stack, a window (3) shorter than the rows, a local rotary base.
FAMILY = dataclasses.replace(
    TINY, qk_norm=True, norm_offset=1.0, post_norms=True, mlp_activation="gelu_tanh",
    embed_scale=True, query_pre_attn_scalar=24.0, attn_softcap=3.0, final_softcap=5.0,
    sliding_window=3, layer_types=("sliding", "full"), rope_local_theta=100.0, init_std=0.3)


def _family_params(cfg, key=0):
  params = M.init_params(cfg, jax.random.key(key))
  # Norm deltas away from their init (0 with norm_offset=1), so each one matters.
  return jax.tree_util.tree_map_with_path(
      lambda path, x: x + 0.3 * jax.random.normal(jax.random.key(7), x.shape)
      if "norm" in jax.tree_util.keystr(path) else x, params)


def test_family_kv_cache_matches_full_forward_past_the_window():
  params = _family_params(FAMILY)
  assert set(params["layers"]) >= {"q_norm", "k_norm", "post_attn_norm", "post_mlp_norm"}
  tokens, mask = ragged_batch(jax.random.key(2), 4, 10, FAMILY.vocab_size, min_len=5)
  pos = M.positions_from_mask(mask)
  full, _ = M.forward(params, tokens, pos, mask, cfg=FAMILY)
  cached = _prefill_then_decode(params, tokens, pos, mask, FAMILY)
  np.testing.assert_allclose(np.where(mask[..., None], cached, 0),
                             np.where(mask[..., None], full, 0), atol=1e-5)
  # The window is what makes the last tokens differ from full attention.
  wide, _ = M.forward(params, tokens, pos, mask, cfg=dataclasses.replace(FAMILY,
                                                                          sliding_window=64))
  assert np.abs(np.asarray(wide - full)[:, -1]).max() > 1e-2


def test_family_layer_options_do_not_change_the_function():
  """Unrolled layers see the layer kinds as Python values, scanned ones as traced: the same
  function, with and without remat, values and gradients."""
  params = _family_params(FAMILY)
  tokens, mask = ragged_batch(jax.random.key(3), 2, 8, FAMILY.vocab_size)
  pos = M.positions_from_mask(mask)
  loss = lambda p, cfg: jnp.sum(M.lm_logits(p, M.forward(p, tokens, pos, mask, cfg=cfg)[0],
                                            cfg) ** 2)
  ref, want = jax.value_and_grad(loss)(params, FAMILY)
  for change in (dict(scan_layers=False), dict(remat="full")):
    got, grads = jax.value_and_grad(loss)(params, dataclasses.replace(FAMILY, **change))
    np.testing.assert_allclose(got, ref, rtol=1e-5)
    # Gradients reach ~40 here: float32 rounding in another order is ~1e-5 of that.
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4), grads,
                 want)
  assert FAMILY.num_params() == sum(x.size for x in jax.tree.leaves(params))


@pytest.mark.parametrize("change,match", [
    (dict(layer_types=("sliding",)), r"model.layer_types has 1 entries for model.n_layers=2"),
    (dict(layer_types=("sliding", "local")), r"model.layer_types has \['local'\]: each entry "
                                             r"is 'full' or 'sliding'"),
    (dict(sliding_window=0), r"'sliding' layers but model.sliding_window=0"),
    (dict(attn_softcap=-1.0), r"model.attn_softcap=-1.0: must be a number >= 0"),
])
def test_family_settings_that_cannot_work_are_named(change, match):
  cfg = dataclasses.replace(FAMILY, **change)
  with pytest.raises(ValueError, match=match):
    M.init_params(cfg, jax.random.key(0))
  exp = dataclasses.replace(registry.get(registry.names()[0]), model=cfg)
  with pytest.raises(ConfigError, match=match):
    validate(exp, required=False)
