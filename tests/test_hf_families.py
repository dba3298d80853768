"""Qwen3 / Gemma 2 / Gemma 3: golden logits and greedy decodes of checkpoints made by
transformers' own classes (tests/assets/make_family_assets.py), sharded loading, export round
trips, and the errors for what is not supported.  No torch needed (one test uses it if there)."""

import dataclasses
import importlib.util
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import mesh
from jaxrlhf import model as M
from jaxrlhf.config import KernelsConfig, ModelConfig, RolloutConfig
from jaxrlhf.model import hf
from jaxrlhf.rollout import generate, generate_uncached

ASSETS = os.path.join(os.path.dirname(__file__), "assets", "hf_families")
GOLDEN = np.load(os.path.join(ASSETS, "golden.npz"))
TOKENS, MASK, POSITIONS = GOLDEN["tokens"], GOLDEN["mask"], GOLDEN["positions"]
NAMES = ("qwen3", "qwen3_tied", "gemma2", "gemma3")
HAS_TORCH = importlib.util.find_spec("torch") is not None
# float32 against PyTorch's float32: the worst position is ~5e-6 off (logits up to ~4).
ATOL = 1e-5


def _asset(name):
  return os.path.join(ASSETS, name)


def _logits(params, cfg):
  h, _ = M.forward(params, jnp.asarray(TOKENS), jnp.asarray(POSITIONS), jnp.asarray(MASK),
                   cfg=cfg)
  return np.asarray(M.lm_logits(params, h, cfg))


def _max_diff(out, name):
  want = GOLDEN[f"{name}/logits"]
  return float(np.abs(out[..., :want.shape[-1]][MASK] - want[MASK]).max())


# ---------------------------------------------------------------------------- mapping


def test_config_mapping_of_each_family():
  q3, q3t, g2, g3 = (hf.config_from_hf(_asset(n)) for n in NAMES)
  assert (q3.qk_norm, q3.qkv_bias, q3.tie_embeddings, q3.head_dim, q3.rope_theta) == (
      True, False, False, 24, 1e6)
  assert q3t.tie_embeddings and (q3t.rope_scaling, q3t.rope_factor) == ("linear", 2.0)
  assert not (q3.post_norms or q3.norm_offset or q3.sliding_window or q3.embed_scale)
  assert (g2.norm_offset, g2.post_norms, g2.mlp_activation, g2.embed_scale, g2.qk_norm) == (
      1.0, True, "gelu_tanh", True, False)
  assert (g2.query_pre_attn_scalar, g2.attn_softcap, g2.final_softcap) == (32.0, 3.0, 4.0)
  assert (g2.sliding_window, g2.layer_types) == (4, ("sliding", "full", "sliding"))
  assert g2.tie_embeddings and g2.rope_local_theta == 0
  assert (g3.qk_norm, g3.sliding_window, g3.attn_softcap, g3.final_softcap) == (True, 5, 0, 0)
  assert g3.layer_types == ("sliding", "sliding", "full", "sliding")
  assert (g3.rope_theta, g3.rope_scaling, g3.rope_factor, g3.rope_local_theta) == (
      1e6, "linear", 4.0, 1e4)
  assert not g3.tie_embeddings
  # Every role's parameter count matches the checkpoint's tensors.
  for name, cfg in zip(NAMES, (q3, q3t, g2, g3)):
    params = hf.load_hf(_asset(name), cfg, mesh())
    assert sum(x.size for x in jax.tree.leaves(params)) == cfg.num_params()


# ---------------------------------------------------------------------- golden parity


@pytest.mark.parametrize("name", NAMES)
def test_golden_logits_match_transformers(name):
  """Loaded onto a (dp=2, tp=4) mesh into the parameters' shardings; the vocabulary of 99
  (qwen3_tied) is padded to 100 for tp=4."""
  m = mesh(dp=2, tp=4)
  cfg = hf.config_from_hf(_asset(name), tp=4)
  params = hf.load_hf(_asset(name), cfg, m)
  for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(M.param_shardings(cfg, m))):
    assert x.sharding == s
  with jax.set_mesh(m):
    out = np.asarray(jax.jit(lambda p: _logits_traced(p, cfg))(params))
  assert _max_diff(out, name) < ATOL


def _logits_traced(params, cfg):
  h, _ = M.forward(params, jnp.asarray(TOKENS), jnp.asarray(POSITIONS), jnp.asarray(MASK),
                   cfg=cfg)
  return M.lm_logits(params, h, cfg)


@pytest.mark.parametrize("name,changes", [
    ("qwen3", dict(qk_norm=False)),
    ("gemma2", dict(attn_softcap=0.0)),
    ("gemma2", dict(final_softcap=0.0)),
    ("gemma2", dict(sliding_window=0, layer_types=())),
    ("gemma2", dict(norm_offset=0.0)),
    ("gemma2", dict(embed_scale=False)),
    ("gemma2", dict(query_pre_attn_scalar=0.0)),
    ("gemma2", dict(mlp_activation="silu")),
    ("gemma3", dict(rope_local_theta=0.0)),
    ("gemma3", dict(layer_types=("sliding",) * 4)),
])
def test_each_family_feature_shows_in_the_golden_logits(name, changes):
  """With any one feature switched off, the same weights are far from transformers' logits:
  the golden test above can tell each one."""
  cfg = hf.config_from_hf(_asset(name))
  params = hf.load_hf(_asset(name), cfg, mesh())
  assert _max_diff(_logits(params, cfg), name) < ATOL
  assert _max_diff(_logits(params, dataclasses.replace(cfg, **changes)), name) > 100 * ATOL


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_bfloat16_with_remat_stays_near_the_float32_goldens(name):
  """The templates' training setting (bfloat16 weights and compute, full remat): one bf16
  rounding of the logits and the activations (observed: mean |diff| 0.012, max 0.1 on logits
  up to ~4), and the same top token everywhere."""
  base = ModelConfig(param_dtype="bfloat16", compute_dtype="bfloat16", remat="full")
  cfg = hf.config_from_hf(_asset(name), base)
  params = hf.load_hf(_asset(name), cfg, mesh())
  out = _logits(params, cfg)
  want = GOLDEN[f"{name}/logits"]
  diff = np.abs(out[MASK] - want[MASK])
  assert diff.mean() < 0.03 and diff.max() < 0.3, (diff.mean(), diff.max())
  assert (out[MASK].argmax(-1) == want[MASK].argmax(-1)).mean() >= 0.95


@pytest.mark.parametrize("name", ["qwen3", "gemma2", "gemma3"])
def test_greedy_decode_matches_transformers_generate(name):
  """Prompt of 5 + 10 greedy tokens: past Gemma's sliding windows (4, 5), so the KV-cache
  decode has to drop the oldest slots exactly as transformers' cache does."""
  cfg = hf.config_from_hf(_asset(name))
  params = hf.load_hf(_asset(name), cfg, mesh())
  want = GOLDEN[f"{name}/greedy"]
  p = 5
  prompt = jnp.asarray(want[:, :p])
  rollout = RolloutConfig(max_new_tokens=want.shape[1] - p, temperature=0.0)
  out = generate(params, prompt, jnp.ones_like(prompt, bool), jax.random.key(0), cfg=cfg,
                 rollout=rollout, eos_id=-1)
  np.testing.assert_array_equal(np.asarray(out.tokens_BT), want)
  if name == "gemma2":  # the recompute-everything reference agrees too
    ref = generate_uncached(params, prompt, jnp.ones_like(prompt, bool), jax.random.key(0),
                            cfg=cfg, rollout=rollout, eos_id=-1)
    np.testing.assert_array_equal(np.asarray(ref.tokens_BT), want)
    np.testing.assert_allclose(np.asarray(ref.behaviour_logp_BN), np.asarray(out.behaviour_logp_BN), atol=1e-5)


@pytest.mark.parametrize("impl", ["xla", "pallas_interpret"])
def test_teacher_forced_logprobs_apply_the_final_softcap(impl):
  """The training path's blockwise log-probs (and the Pallas kernels') are those of
  transformers' soft-capped logits."""
  cfg = hf.config_from_hf(_asset("gemma2"))
  params = hf.load_hf(_asset("gemma2"), cfg, mesh())
  kernels = KernelsConfig(logprob=impl, attention=impl)
  logp, _ = M.token_logprobs(params, jnp.asarray(TOKENS), jnp.asarray(MASK), cfg=cfg,
                             kernels=kernels)
  want = jax.nn.log_softmax(GOLDEN["gemma2/logits"][:, :-1], axis=-1)
  want = np.take_along_axis(np.asarray(want), TOKENS[:, 1:, None], axis=-1)[..., 0]
  ok = MASK[:, 1:] & MASK[:, :-1]  # predicted from a real token (pad rows are unspecified)
  np.testing.assert_allclose(np.asarray(logp)[ok], want[ok], atol=ATOL)


# ------------------------------------------------------------------------------ export


@pytest.mark.parametrize("name,tp", [("qwen3", 1), ("qwen3_tied", 4), ("gemma2", 1),
                                     ("gemma3", 1)])
def test_export_round_trip_is_identical(tmp_path, name, tp):
  """Export -> the same tensor names and config fields transformers wrote (read back by
  ``AutoConfig``, no torch) -> the same ModelConfig and bit-identical parameters; without a
  source config the family is chosen from the ModelConfig alone."""
  import transformers
  from safetensors import safe_open

  cfg = hf.config_from_hf(_asset(name), tp=tp)
  params = hf.load_hf(_asset(name), cfg, mesh())
  for source in (None, ""):
    out = hf.export_hf(params, cfg, str(tmp_path / f"out{source}"), source=source,
                       max_shard_size="64KB")
    back_cfg = hf.config_from_hf(out, tp=tp)
    assert dataclasses.replace(back_cfg, hf_path="") == dataclasses.replace(cfg, hf_path="")
    back = hf.load_hf(out, back_cfg, mesh())
    for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    mine, theirs = (transformers.AutoConfig.from_pretrained(d) for d in (out, _asset(name)))
    assert type(mine) is type(theirs)
    for field in ("architectures", "vocab_size", "hidden_size", "head_dim", "layer_types",
                  "sliding_window", "rope_parameters", "tie_word_embeddings",
                  "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                  "hidden_activation", "hidden_act", "rms_norm_eps"):
      assert getattr(mine, field, None) == getattr(theirs, field, None), field
    assert _tensor_names(out) == _tensor_names(_asset(name)) - {"lm_head.weight"} or (
        _tensor_names(out) == _tensor_names(_asset(name)))


@pytest.mark.parametrize("name,arch", [("gemma3", "Gemma3TextForSequenceClassification"),
                                       ("qwen3", "Qwen3ForSequenceClassification")])
def test_a_reward_model_from_a_family_checkpoint_exports_as_its_classifier(tmp_path, name, arch):
  """A causal LM starts a reward model with a new scalar head; it exports as the family's
  sequence classifier (Gemma 3's is a Text class), which AutoConfig and load_hf read back."""
  import transformers

  cfg = hf.config_from_hf(_asset(name))
  params = hf.load_hf(_asset(name), cfg, mesh(), head="scalar")
  params["score"]["w"] = params["embed"][5]
  out = hf.export_hf(params, cfg, str(tmp_path / "rm"), head="scalar")
  assert transformers.AutoConfig.from_pretrained(out).architectures == [arch]
  back = hf.load_hf(out, hf.config_from_hf(out), mesh(), head="scalar")
  np.testing.assert_array_equal(np.asarray(back["score"]["w"]), np.asarray(params["embed"][5]))
  if HAS_TORCH:
    import torch
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        out, attn_implementation="eager").eval()
    assert type(model).__name__ == arch
    with torch.no_grad():
      h = model.model(torch.from_numpy(TOKENS).long(),
                      attention_mask=torch.from_numpy(MASK).long(),
                      position_ids=torch.from_numpy(POSITIONS).long()).last_hidden_state
      got = model.score(h)[..., 0].numpy()
    hs, _ = M.forward(back, jnp.asarray(TOKENS), jnp.asarray(POSITIONS), jnp.asarray(MASK),
                      cfg=cfg)
    np.testing.assert_allclose(np.asarray(M.scalar_head(back, hs))[MASK], got[MASK], atol=ATOL)


def _tensor_names(path):
  from safetensors import safe_open
  names = set()
  for f in os.listdir(path):
    if f.endswith(".safetensors"):
      with safe_open(os.path.join(path, f), framework="np") as st:
        names |= set(st.keys())
  return names


@pytest.mark.skipif(not HAS_TORCH, reason="needs PyTorch (transformers' models)")
@pytest.mark.parametrize("name", NAMES)
def test_transformers_loads_the_export(tmp_path, name):
  import torch
  import transformers

  cfg = hf.config_from_hf(_asset(name), tp=4)
  params = hf.load_hf(_asset(name), cfg, mesh())
  out = hf.export_hf(params, cfg, str(tmp_path / name), source="")
  model = transformers.AutoModelForCausalLM.from_pretrained(
      out, attn_implementation="eager").eval()
  with torch.no_grad():
    got = model(torch.from_numpy(TOKENS).long(), attention_mask=torch.from_numpy(MASK).long(),
                position_ids=torch.from_numpy(POSITIONS).long()).logits.numpy()
  assert _max_diff(got, name) < ATOL


def test_export_refuses_a_config_no_family_holds(tmp_path):
  cfg = hf.config_from_hf(_asset("gemma2"))
  params = hf.load_hf(_asset("gemma2"), cfg, mesh())
  with pytest.raises(hf.HFError, match="gemma2 architecture and cannot be written as the "
                                       "source's qwen3 model"):
    hf.export_hf(params, cfg, str(tmp_path / "a"), source=_asset("qwen3"))
  half = dataclasses.replace(cfg, post_norms=False, hf_path="")
  with pytest.raises(hf.HFError, match="exist only in Gemma 2 / 3.*model.post_norms=False"):
    hf.export_hf(params, half, str(tmp_path / "b"))
  with pytest.raises(hf.HFError, match="no supported family has both"):
    hf.family_of(ModelConfig(qk_norm=True, qkv_bias=True))


# ------------------------------------------------------------------------------ errors


def _copy(name, tmp_path, config):
  dst = tmp_path / name
  shutil.copytree(_asset(name), dst)
  data = json.load(open(dst / "config.json"))
  data.update(config)
  json.dump(data, open(dst / "config.json", "w"))
  return str(dst)


@pytest.mark.parametrize("name,config,match", [
    ("gemma3", {"rope_parameters": {
        "full_attention": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 8.0,
                           "original_max_position_embeddings": 32},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     r"config.json: rope_parameters.full_attention rope_type 'yarn' .*supported: default, "
     r"linear, llama3"),
    ("gemma3", {"rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}},
     r"rope_parameters.sliding_attention rope_type 'linear' is not supported; supported: "
     r"default"),
    ("qwen3", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 2.0}},
     r"rope_parameters rope_type 'dynamic' .*supported: default, linear, llama3"),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
     r"use_sliding_window=true is not supported for qwen3"),
    ("qwen3", {"attention_bias": True}, r"attention_bias / mlp_bias are not supported"),
    ("gemma2", {"hidden_activation": "gelu"},
     r"hidden_activation='gelu' is not supported for gemma2; supported: gelu_pytorch_tanh"),
    ("gemma3", {"use_bidirectional_attention": True},
     r"use_bidirectional_attention=true is not supported"),
    ("gemma2", {"architectures": ["Gemma2ForTokenClassification"]},
     r"Gemma2ForTokenClassification is not supported; supported: .*Qwen3ForCausalLM.*"
     r"Gemma2ForCausalLM.*Gemma3ForCausalLM, Gemma3TextForSequenceClassification"),
])
def test_unsupported_settings_name_the_field(tmp_path, name, config, match):
  with pytest.raises(hf.HFError, match=match):
    hf.config_from_hf(_copy(name, tmp_path, config))


def test_multimodal_gemma3_is_refused_with_the_supported_list(tmp_path):
  path = _copy("gemma3", tmp_path, {"model_type": "gemma3",
                                    "architectures": ["Gemma3ForConditionalGeneration"]})
  with pytest.raises(hf.HFError, match="Gemma3ForConditionalGeneration is not supported; "
                                       "supported: .*Gemma3ForCausalLM"):
    hf.config_from_hf(path)


def test_a_config_that_does_not_match_the_checkpoint_is_named(tmp_path):
  cfg = dataclasses.replace(hf.config_from_hf(_asset("gemma2")), attn_softcap=50.0)
  with pytest.raises(hf.HFError, match=r"model.attn_softcap=50.0 but the checkpoint has 3.0"):
    hf.load_hf(_asset("gemma2"), cfg, mesh())


# The end-to-end runs (GRPO on Qwen3, DPO on Gemma 3, from a copy of the asset as a Hub
# folder, trained on the command line, exported and read back by transformers) are
# tests/test_byo_e2e.py's, on the users' own data and reward as issue 23 states them.
