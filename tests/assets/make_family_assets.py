"""Regenerates the tiny Qwen3 / Gemma 2 / Gemma 3 checkpoints and golden outputs in
tests/assets/hf_families/ (the Llama / Qwen2 / Mistral ones are make_hf_assets.py's).

Needs PyTorch (CPU) and transformers; CI never runs it, the tests only read what it wrote:

    .venv/bin/pip install torch==2.13.0   # a CPU build; not a project dependency
    .venv/bin/python tests/assets/make_family_assets.py

Each model is built at random by transformers' own classes (Qwen3ForCausalLM,
Gemma2ForCausalLM, Gemma3ForCausalLM on a Gemma3TextConfig), its weights re-drawn as in
make_hf_assets.py so that every one shows in the logits, saved with ``save_pretrained`` and run
once in float32 with eager attention on fixed inputs (one row left-padded, explicit positions).
What each asset exercises:

  qwen3        q/k RMSNorm per head, no biases, head_dim 24 (not d_model / n_heads),
               rope_theta 1e6, untied LM head, GQA
  qwen3_tied   tied embeddings, vocabulary 99 (not a multiple of tp=4), linear rope
               scaling, sharded into several files with an index
  gemma2       GeGLU, (1 + w) norms before and after attention and the MLP, embeddings
               scaled by sqrt(d_model), query_pre_attn_scalar 32 (not head_dim), attention
               and final soft-capping small enough to bend the logits, sliding window 4
               (shorter than the 12-token rows) on alternate layers, tied head
  gemma3       q/k norms with (1 + w), layer pattern sliding, sliding, full, sliding with
               window 5, local rope base 1e4 vs global 1e6 with linear scaling x4,
               untied head, no soft-capping

qwen3 and gemma3 also carry a character-level tokenizer (the 100 ids: 4 specials + 96
characters) with a chat template, so a run can start from the folder alone (model and
tokenizer, as from the Hub).

Beside the logits, ``NAME/greedy`` holds transformers' greedy continuation (``generate``,
no padding, KV cache) of the first ``PROMPT`` tokens of every row, so the decode path (with
the sliding window past its length) is checked against transformers' own.  At the end the
script loads every asset with jaxrlhf, exports it with ``export_hf`` and checks that
transformers reloads the export to the same logits (printed; a failure raises).

The golden file ``golden.npz`` holds ``tokens``, ``mask``, ``positions`` and, per asset,
``NAME/logits`` (float32 ``[B, T, V]``) and ``NAME/greedy`` (int32 ``[B, PROMPT + NEW]``).
"""

import json
import os
import shutil
import sys
import tempfile

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from make_hf_assets import B, T, inputs, redraw  # the same rows, the same weight redraw

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_families")
PROMPT, NEW = 5, 10
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]  # ids 0, 1, 2, 3: Gemma's pad/eos/bos order
CHARS = [chr(c) for c in range(32, 127)] + ["\n"]
CHAT_TEMPLATE = ("{% for m in messages %}<bos>{{ m['role'] }}\n{{ m['content'] }}<eos>\n"
                 "{% endfor %}{% if add_generation_prompt %}<bos>assistant\n{% endif %}")
WITH_TOKENIZER = ("qwen3", "gemma3")

COMMON = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
              pad_token_id=0, bos_token_id=2, eos_token_id=1)

ASSETS = {
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
              dict(COMMON, vocab_size=100, head_dim=24, tie_word_embeddings=False,
                   rope_parameters=dict(rope_type="default", rope_theta=1000000.0)), None),
    "qwen3_tied": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
                   dict(COMMON, vocab_size=99, head_dim=16, tie_word_embeddings=True,
                        rope_parameters=dict(rope_type="linear", rope_theta=10000.0,
                                             factor=2.0)), "40KB"),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM,
               dict(COMMON, vocab_size=100, head_dim=16, num_hidden_layers=3,
                    query_pre_attn_scalar=32, sliding_window=4, attn_logit_softcapping=3.0,
                    final_logit_softcapping=4.0, tie_word_embeddings=True,
                    rope_parameters=dict(rope_type="default", rope_theta=10000.0)), None),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
               dict(COMMON, vocab_size=100, head_dim=16, num_hidden_layers=4,
                    query_pre_attn_scalar=24, sliding_window=5, tie_word_embeddings=False,
                    layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                 "sliding_attention"],
                    rope_parameters={
                        "full_attention": dict(rope_type="linear", rope_theta=1000000.0,
                                               factor=4.0),
                        "sliding_attention": dict(rope_type="default", rope_theta=10000.0)}),
               None),
}


def char_tokenizer() -> transformers.PreTrainedTokenizerFast:
  vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
  tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
  tok.decoder = decoders.Fuse()
  out = transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
      unk_token="<unk>")
  out.chat_template = CHAT_TEMPLATE
  return out


def torch_logits(model, tokens, mask, positions):
  with torch.no_grad():
    out = model(input_ids=torch.from_numpy(tokens).long(),
                attention_mask=torch.from_numpy(mask).long(),
                position_ids=torch.from_numpy(positions).long())
  return out.logits.float().numpy()


def check_export(golden):
  """jaxrlhf load -> export -> transformers reload gives the golden logits again."""
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
      __file__)))))
  import jax
  from jaxrlhf.model import hf
  mesh = jax.make_mesh((1,), ("dp",), axis_types=(jax.sharding.AxisType.Auto,))
  tokens, mask, positions = golden["tokens"], golden["mask"], golden["positions"]
  for name, (_, model_cls, _, _) in ASSETS.items():
    path = os.path.join(HERE, name)
    cfg = hf.config_from_hf(path)
    params = hf.load_hf(path, cfg, mesh)
    with tempfile.TemporaryDirectory() as out:
      hf.export_hf(params, cfg, out, source="")  # the family chosen from cfg alone
      back = model_cls.from_pretrained(out, dtype=torch.float32,
                                       attn_implementation="eager").eval()
      assert type(back).__name__ == model_cls.__name__, type(back)
      diff = np.abs(torch_logits(back, tokens, mask, positions) - golden[f"{name}/logits"])
      err = float(diff[mask].max())
      print(f"{name:11s} export -> transformers reload: max |logits diff| {err:.2e}")
      assert err < 1e-5, (name, err)


def main():
  if os.path.isdir(HERE):
    shutil.rmtree(HERE)
  os.makedirs(HERE)
  tokens, mask, positions = inputs(96)
  golden = {"tokens": tokens, "mask": mask, "positions": positions}
  for i, (name, (config_cls, model_cls, kwargs, shard)) in enumerate(ASSETS.items()):
    torch.manual_seed(i)
    config = config_cls(**kwargs)
    model = model_cls(config).eval()
    redraw(model, torch.Generator().manual_seed(200 + i), norm_delta=name.startswith("gemma"))
    out = os.path.join(HERE, name)
    model.save_pretrained(out, **({"max_shard_size": shard} if shard else {}))
    if name in WITH_TOKENIZER:
      char_tokenizer().save_pretrained(out)
    ref = model_cls.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    golden[f"{name}/logits"] = torch_logits(ref, tokens, mask, positions)
    # Greedy decode of unpadded prompts with transformers' KV cache, past the window.
    prompt = torch.from_numpy(np.where(mask, tokens, 5)[:, -PROMPT:]).long()
    with torch.no_grad():
      seq = ref.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                         max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    golden[f"{name}/greedy"] = seq.numpy().astype(np.int32)
    files = sorted(os.listdir(out))
    size = sum(os.path.getsize(os.path.join(out, f)) for f in files)
    print(f"{name:11s} {size / 1024:7.1f} KiB  {files}")
  np.savez_compressed(os.path.join(HERE, "golden.npz"), **golden)
  with open(os.path.join(HERE, "VERSIONS.json"), "w") as f:
    json.dump({"torch": torch.__version__, "transformers": transformers.__version__}, f, indent=1)
  check_export(golden)


if __name__ == "__main__":
  main()
