"""Hugging Face interop: golden logits of Llama / Qwen2 / Mistral checkpoints made by
transformers (tests/assets/make_hf_assets.py), sharded loading, export round trips, errors."""

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
from jaxrlhf import registry
from jaxrlhf.config import ModelConfig, apply_overrides
from jaxrlhf.mesh import FROZEN_PARAM_RULES, PARAM_RULES
from jaxrlhf.model import hf
from jaxrlhf.model.transformer import rope, rope_frequencies

ASSETS = os.path.join(os.path.dirname(__file__), "assets", "hf")
GOLDEN = np.load(os.path.join(ASSETS, "golden.npz"))
TOKENS, MASK, POSITIONS = GOLDEN["tokens"], GOLDEN["mask"], GOLDEN["positions"]
HAS_TORCH = importlib.util.find_spec("torch") is not None
# Logits are O(1-5); float32 agreement with PyTorch is ~1e-5.
ATOL = 1e-4


def _asset(name):
  return os.path.join(ASSETS, name)


def _outputs(params, cfg, head="lm"):
  h, _ = M.forward(params, jnp.asarray(TOKENS), jnp.asarray(POSITIONS), jnp.asarray(MASK), cfg=cfg)
  out = M.scalar_head(params, h) if head == "scalar" else M.lm_logits(params, h, cfg)
  return np.asarray(out)


def _assert_golden(out, name):
  want = GOLDEN[f"{name}/logits"]
  out = out[..., :want.shape[-1]] if want.ndim == 3 else out  # drop padded vocabulary columns
  np.testing.assert_allclose(out[MASK], want[MASK], atol=ATOL, rtol=0)


def _assert_same_params(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ------------------------------------------------------------------------- golden parity


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral", "llama31"])
def test_golden_logits_match_transformers(name):
  cfg = hf.config_from_hf(_asset(name))
  params = hf.load_hf(_asset(name), cfg, mesh())
  assert params["embed"].dtype == jnp.float32  # mistral is stored in bfloat16
  _assert_golden(_outputs(params, cfg), name)


def test_llama3_rope_scaling_is_read_and_matters():
  cfg = hf.config_from_hf(_asset("llama31"))
  assert (cfg.rope_scaling, cfg.rope_factor, cfg.rope_original_max_len) == ("llama3", 8.0, 8)
  assert cfg.rope_theta == 500000.0
  params = hf.load_hf(_asset("llama31"), cfg, mesh())
  # The same weights with the scaling ignored are far from transformers' logits: the golden
  # test above can tell.
  plain = _outputs(params, dataclasses.replace(cfg, rope_scaling="none"))
  assert np.abs(plain[MASK] - GOLDEN["llama31/logits"][MASK]).max() > 100 * ATOL


def test_linear_rope_scaling_is_position_interpolation():
  """Linear scaling by f at position p is the unscaled rotation at position p / f."""
  base = ModelConfig(head_dim=16, rope_theta=10000.0)
  x = jax.random.normal(jax.random.key(0), (1, 4, 2, 16))
  pos = jnp.array([[0, 3, 6, 9]])
  scaled = rope(x, pos, rope_frequencies(
      dataclasses.replace(base, rope_scaling="linear", rope_factor=3.0)))
  np.testing.assert_allclose(scaled, rope(x, pos / 3.0, rope_frequencies(base)), atol=1e-5)


def test_config_mapping_of_each_family():
  llama, qwen2, mistral = (hf.config_from_hf(_asset(n)) for n in ("llama", "qwen2", "mistral"))
  assert (llama.n_heads, llama.n_kv_heads, llama.head_dim, llama.qkv_bias,
          llama.tie_embeddings) == (4, 2, 16, False, False)
  assert qwen2.qkv_bias and qwen2.tie_embeddings and qwen2.vocab_size == 99
  assert mistral.rope_theta == 1e6 and mistral.max_seq_len == 32  # capped at sliding window
  assert "unembed" not in hf.load_hf(_asset("qwen2"), qwen2, mesh())


def test_reward_model_score_head_matches_transformers():
  cfg = hf.config_from_hf(_asset("llama_rm"))
  params = hf.load_hf(_asset("llama_rm"), cfg, mesh(), head="scalar")
  _assert_golden(_outputs(params, cfg, "scalar"), "llama_rm")


def test_causal_lm_loads_as_scalar_role_with_a_new_head_in_bfloat16():
  cfg = hf.config_from_hf(_asset("llama"))
  lm = hf.load_hf(_asset("llama"), cfg, mesh())
  rm = hf.load_hf(_asset("llama"), cfg, mesh(), head="scalar", dtype="bfloat16")
  assert rm["embed"].dtype == jnp.bfloat16 and "unembed" not in rm
  np.testing.assert_array_equal(np.asarray(rm["score"]["w"], np.float32), 0)
  assert float(rm["score"]["b"]) == 0
  np.testing.assert_array_equal(np.asarray(rm["layers"]["wq"]),
                                np.asarray(lm["layers"]["wq"].astype(jnp.bfloat16)))


# ---------------------------------------------------------------------------- sharding


@pytest.mark.parametrize("name,rules", [("qwen2", FROZEN_PARAM_RULES), ("llama", PARAM_RULES)])
def test_sharded_load_gives_the_unsharded_logits(name, rules):
  """(dp=2, tp=4): heads and the vocabulary split over tp; with the frozen-role rules d_model
  is split over dp too, so every device reads a block of rows and columns.  Qwen2's vocabulary
  of 99 is padded to 100 for tp=4."""
  m = mesh(dp=2, tp=4)
  cfg = hf.config_from_hf(_asset(name), tp=4)
  params = hf.load_hf(_asset(name), cfg, m, rules=rules)
  want_shardings = M.param_shardings(cfg, m, rules=rules)
  for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(want_shardings)):
    assert x.sharding == s
  wq = params["layers"]["wq"]
  assert wq.addressable_shards[0].data.shape == (
      (2, 32, 1, 16) if rules is FROZEN_PARAM_RULES else (2, 64, 1, 16))
  if name == "qwen2":
    assert (cfg.vocab_size, cfg.unpadded_vocab_size) == (100, 99)
    assert params["embed"].addressable_shards[0].data.shape == (25, 32)
    np.testing.assert_array_equal(np.asarray(params["embed"][99:]), 0)
  with jax.set_mesh(m):
    out = jax.jit(lambda p: _outputs_traced(p, cfg))(params)
  out = np.asarray(out)
  _assert_golden(out, name)
  ref = _outputs(hf.load_hf(_asset(name), cfg, mesh()), cfg)
  np.testing.assert_allclose(out, ref, atol=1e-5)


def test_each_device_block_is_read_once_and_only_its_slice(monkeypatch):
  """On (dp=2, tp=4) with d_model over dp, every read is a quarter of the heads / vocabulary
  and half of d_model, one layer at a time; the dp replicas of a block are not read again."""
  reads = []
  slice_of = hf.reading._Checkpoint.slice

  def recording(self, name):
    s = slice_of(self, name)

    class Recorder:
      def __getitem__(self, index):
        out = s[index]
        reads.append((name, out.shape))
        return out
    return Recorder()

  monkeypatch.setattr(hf.reading._Checkpoint, "slice", recording)
  cfg = hf.config_from_hf(_asset("llama"), tp=4)
  hf.load_hf(_asset("llama"), cfg, mesh(dp=2, tp=4), rules=FROZEN_PARAM_RULES)
  shapes = {}
  for name, shape in reads:
    shapes.setdefault(name, []).append(shape)
  assert shapes["model.layers.1.self_attn.q_proj.weight"] == [(16, 32)] * 8  # 4 tp x 2 dp
  assert shapes["model.embed_tokens.weight"] == [(25, 32)] * 8
  assert shapes["lm_head.weight"] == [(25, 32)] * 8
  # Replicated over tp: two distinct halves, each read once and copied to its 4 devices.
  assert shapes["model.norm.weight"] == [(32,)] * 2


def _outputs_traced(params, cfg):
  h, _ = M.forward(params, jnp.asarray(TOKENS), jnp.asarray(POSITIONS), jnp.asarray(MASK),
                   cfg=cfg)
  return M.lm_logits(params, h, cfg)


# ------------------------------------------------------------------------------ export


@pytest.mark.parametrize("name,head,tp", [("llama", "lm", 1), ("qwen2", "lm", 4),
                                          ("mistral", "lm", 1), ("llama_rm", "scalar", 1),
                                          ("llama31", "lm", 1)])
def test_export_round_trip_is_identical(tmp_path, name, head, tp):
  cfg = hf.config_from_hf(_asset(name), tp=tp)
  params = hf.load_hf(_asset(name), cfg, mesh(), head)
  out = hf.export_hf(params, cfg, str(tmp_path / "out"), head=head, max_shard_size="64KB")
  back_cfg = hf.config_from_hf(out, tp=tp)
  assert dataclasses.replace(back_cfg, hf_path="") == dataclasses.replace(cfg, hf_path="")
  back = hf.load_hf(out, back_cfg, mesh(), head)
  _assert_same_params(back, params)
  config = json.load(open(os.path.join(out, "config.json")))
  source = json.load(open(os.path.join(_asset(name), "config.json")))
  assert config["architectures"] == source["architectures"]
  assert config["vocab_size"] == source["vocab_size"]  # padded rows dropped (qwen2: 99)
  assert config["eos_token_id"] == source["eos_token_id"]
  assert os.path.exists(os.path.join(out, hf.INDEX_FILE))  # 64KB shards
  if name == "llama":  # the tokenizer travels with the model
    from transformers import AutoTokenizer
    text = "Hello, RLHF!"
    assert (AutoTokenizer.from_pretrained(out)(text)["input_ids"] ==
            AutoTokenizer.from_pretrained(_asset(name))(text)["input_ids"])


def test_export_without_a_source_config_and_a_score_bias(tmp_path):
  """A model with no HF origin (e.g. trained from scratch) exports as Llama; a value head's
  bias survives the round trip through config.json."""
  cfg = dataclasses.replace(hf.config_from_hf(_asset("llama")), hf_path="")
  params = hf.load_hf(_asset("llama"), cfg, mesh(), head="scalar")
  params["score"] = {"w": params["embed"][3], "b": jnp.asarray(0.25, jnp.float32)}
  hf.export_hf(params, cfg, str(tmp_path / "rm"), head="scalar", max_shard_size="64KB")
  # Exporting again into the same folder replaces the earlier shards and index.
  out = hf.export_hf(params, cfg, str(tmp_path / "rm"), head="scalar", dtype="bfloat16")
  assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
  back_cfg = hf.config_from_hf(out)
  assert dataclasses.replace(back_cfg, hf_path="") == cfg
  back = hf.load_hf(out, back_cfg, mesh(), head="scalar")
  _assert_same_params(back, jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(x.dtype),
                                         params))


@pytest.mark.skipif(not HAS_TORCH, reason="needs PyTorch (transformers' models)")
@pytest.mark.parametrize("name,tp", [("llama", 1), ("qwen2", 4), ("llama_rm", 1),
                                     ("llama31", 1)])
def test_transformers_loads_the_export(tmp_path, name, tp):
  import torch
  import transformers

  head = "scalar" if name == "llama_rm" else "lm"
  cfg = hf.config_from_hf(_asset(name), tp=tp)
  params = hf.load_hf(_asset(name), cfg, mesh(), head)
  if head == "scalar":
    params["score"]["b"] = jnp.asarray(0.5, jnp.float32)
  out = hf.export_hf(params, cfg, str(tmp_path / name), head=head)
  cls = (transformers.AutoModelForSequenceClassification if head == "scalar" else
         transformers.AutoModelForCausalLM)
  model = cls.from_pretrained(out, attn_implementation="eager").eval()
  args = dict(attention_mask=torch.from_numpy(MASK).long(),
              position_ids=torch.from_numpy(POSITIONS).long())
  with torch.no_grad():
    if head == "scalar":
      h = model.model(torch.from_numpy(TOKENS).long(), **args).last_hidden_state
      got = model.score(h)[..., 0].numpy()  # HF has no score bias: ours is kept aside
      assert model.config.jaxrlhf_score_bias == 0.5
    else:
      got = model(torch.from_numpy(TOKENS).long(), **args).logits.numpy()
  _assert_golden(got, name)


# ------------------------------------------------------------------------------ errors


def _copy(name, tmp_path, edit=None, config=None):
  """A copy of an asset with its tensors edited (``edit(dict) -> dict``) and/or its
  config.json updated."""
  from safetensors.numpy import load_file, save_file

  dst = tmp_path / name
  shutil.copytree(_asset(name), dst)
  if edit is not None:
    tensors = edit(load_file(str(dst / "model.safetensors")))
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
  if config is not None:
    data = json.load(open(dst / "config.json"))
    data.update(config)
    json.dump(data, open(dst / "config.json", "w"))
  return str(dst)


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps(
      {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
  with pytest.raises(hf.HFError, match=r"GPT2LMHeadModel is not supported; supported: "
                     r"LlamaForCausalLM, .*Qwen2ForCausalLM.*MistralForCausalLM"):
    hf.config_from_hf(str(tmp_path))


def test_unsupported_rope_scaling_is_refused(tmp_path):
  path = _copy("llama", tmp_path, config={"rope_parameters": {
      "rope_type": "yarn", "rope_theta": 500000.0, "factor": 8.0,
      "original_max_position_embeddings": 32}})
  with pytest.raises(hf.HFError, match="rope_type 'yarn'.*supported: default, linear, llama3"):
    hf.config_from_hf(path)


def test_missing_and_unexpected_tensors_are_listed(tmp_path):
  def edit(t):
    del t["model.layers.0.mlp.up_proj.weight"], t["model.layers.1.mlp.up_proj.weight"]
    t["model.layers.0.self_attn.o_proj.bias"] = np.zeros(64, np.float32)
    return t

  path = _copy("llama", tmp_path, edit)
  with pytest.raises(hf.HFError) as e:
    hf.load_hf(path, hf.config_from_hf(path), mesh())
  msg = str(e.value)
  assert "missing tensors (2): model.layers.{0,1}.mlp.up_proj.weight" in msg
  assert "unexpected tensors (1): model.layers.0.self_attn.o_proj.bias" in msg


def test_shape_mismatches_name_the_tensor_and_both_shapes():
  cfg = hf.config_from_hf(_asset("llama"))
  with pytest.raises(hf.HFError, match=r"model.layers.0.mlp.gate_proj.weight: checkpoint "
                     r"\(128, 64\) vs model \(96, 64\) \[mlp_dim=96, d_model=64\]"):
    hf.load_hf(_asset("llama"), dataclasses.replace(cfg, mlp_dim=96), mesh())
  # A vocabulary padded by hand, without saying so: the error says how to pad.
  with pytest.raises(hf.HFError, match=r"model.embed_tokens.weight: checkpoint \(100, 64\) vs "
                     r"model \(104, 64\).*unpadded_vocab_size"):
    hf.load_hf(_asset("llama"), dataclasses.replace(cfg, vocab_size=104), mesh())


def test_config_mismatch_that_shapes_cannot_see():
  # 8 heads of 8 has the same tensor shapes as 4 heads of 16, but a different function.
  cfg = dataclasses.replace(hf.config_from_hf(_asset("llama")), n_heads=8, n_kv_heads=4,
                            head_dim=8)
  with pytest.raises(hf.HFError, match=r"model.n_heads=8 but the checkpoint has 4"):
    hf.load_hf(_asset("llama"), cfg, mesh())


def test_directory_errors(tmp_path):
  with pytest.raises(hf.HFError, match="is not a directory"):
    hf.config_from_hf(str(tmp_path / "nope"))
  path = _copy("llama", tmp_path)
  cfg = hf.config_from_hf(path)
  os.remove(os.path.join(path, "model.safetensors"))
  with pytest.raises(hf.HFError, match="no safetensors weights"):
    hf.load_hf(path, cfg, mesh())
  sharded = tmp_path / "q"
  shutil.copytree(_asset("qwen2"), sharded)
  os.remove(sharded / "model-00002-of-00004.safetensors")
  with pytest.raises(hf.HFError, match="names shard files that are not in .*00002-of-00004"):
    hf.load_hf(str(sharded), hf.config_from_hf(str(sharded)), mesh())


# ------------------------------------------------------------------------- experiments


def test_experiment_templates_take_the_model_from_the_command_line():
  for name in ("ppo_jsonl", "grpo_jsonl", "dpo_jsonl"):
    cfg = apply_overrides(registry.get(name), [f"model.hf_path={_asset('qwen2')}",
                                               "mesh.tp=4"])
    model = hf.resolve_hf_config(cfg.model, tp=cfg.mesh.tp)
    assert (model.d_model, model.vocab_size, model.unpadded_vocab_size) == (64, 100, 99)
    assert model.param_dtype == cfg.model.param_dtype  # training fields kept
