"""Regenerates the tiny Hugging Face checkpoints and golden outputs in tests/assets/hf/.

Needs PyTorch (CPU) and transformers; CI never runs it, the tests only read what it wrote:

    .venv/bin/pip install torch==2.13.0   # a CPU build; not a project dependency
    .venv/bin/python tests/assets/make_hf_assets.py

Each model is built at random by transformers itself, with weights re-drawn larger than its
default init so attention is sharp and every weight matters (a wrong rotary convention or a
transposed matrix moves the logits far beyond the test tolerance), saved with
``save_pretrained``, and run once in float32 on fixed inputs (one row left-padded, explicit
positions).  What each asset exercises:

  llama      float32, one safetensors file, untied head, GQA, a char-level tokenizer
  qwen2      q/k/v biases, tied embeddings, vocabulary 99 (not a multiple of tp=4),
             sharded into several files with model.safetensors.index.json
  mistral    stored in bfloat16, sliding window, rope_theta 1e6
  llama_rm   LlamaForSequenceClassification (num_labels=1): a reward model with score.weight
  llama31    Llama 3.1 rotary scaling (rope_type llama3)

The golden file ``golden.npz`` holds ``tokens``, ``mask``, ``positions`` and, per asset,
``NAME/logits`` (float32 ``[B, T, V]``, or ``[B, T]`` scores for llama_rm).
"""

import json
import os
import shutil

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf")
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
# 96 printable ASCII characters + 4 specials: the llama vocabulary of 100.
CHARS = [chr(c) for c in range(32, 127)] + ["\n"]
B, T = 3, 12

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)

ASSETS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
              dict(COMMON, vocab_size=100, head_dim=16), torch.float32, None),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
              dict(COMMON, vocab_size=99, tie_word_embeddings=True, rope_theta=10000.0),
              torch.float32, "100KB"),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM,
                dict(COMMON, vocab_size=96, head_dim=16, sliding_window=32,
                     rope_theta=1000000.0), torch.bfloat16, None),
    "llama_rm": (transformers.LlamaConfig, transformers.LlamaForSequenceClassification,
                 dict(COMMON, vocab_size=100, head_dim=16, num_hidden_layers=1, num_labels=1),
                 torch.float32, None),
    # Llama 3.1-style rotary scaling; the original context (8) is shorter than the test rows
    # (12), so a model that ignored the scaling would be far off.
    "llama31": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                dict(COMMON, vocab_size=100, head_dim=16, rope_parameters=dict(
                    rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                    high_freq_factor=4.0, original_max_position_embeddings=8)),
                torch.float32, None),
}


def char_tokenizer() -> transformers.PreTrainedTokenizerFast:
  vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
  tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
  tok.decoder = decoders.Fuse()
  return transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
      unk_token="<unk>")


def redraw(model: torch.nn.Module, gen: torch.Generator, norm_delta: bool = False):
  """Weights large enough that every one of them shows in the logits.  ``norm_delta``: the
  norms store ``w`` of ``(1 + w)`` (Gemma), drawn around 0 so the scale stays near 1."""
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_((torch.rand(p.shape, generator=gen) - 0.5) if norm_delta else
                0.5 + torch.rand(p.shape, generator=gen))
      elif name.endswith("bias"):
        p.copy_(0.5 * torch.randn(p.shape, generator=gen))
      else:
        fan_in = p.shape[-1]
        scale = 2.0 if ("q_proj" in name or "k_proj" in name) else 1.0
        p.copy_(scale / fan_in ** 0.5 * torch.randn(p.shape, generator=gen))


def inputs(vocab: int):
  rng = np.random.default_rng(0)
  tokens = rng.integers(4, 96, size=(B, T)).astype(np.int32)
  mask = np.ones((B, T), bool)
  mask[1, :4] = False  # a left-padded row
  tokens[~mask] = 0
  positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
  assert tokens.max() < vocab
  return tokens, mask, positions


def main():
  if os.path.isdir(HERE):
    shutil.rmtree(HERE)
  os.makedirs(HERE)
  tokens, mask, positions = inputs(96)
  golden = {"tokens": tokens, "mask": mask, "positions": positions}
  for i, (name, (config_cls, model_cls, kwargs, dtype, shard)) in enumerate(ASSETS.items()):
    torch.manual_seed(i)
    config = config_cls(**kwargs)
    model = model_cls(config).eval()
    redraw(model, torch.Generator().manual_seed(100 + i))
    out = os.path.join(HERE, name)
    model.to(dtype).save_pretrained(out, **({"max_shard_size": shard} if shard else {}))
    if name == "llama":
      char_tokenizer().save_pretrained(out)
    # The reference run: float32 weights as stored (bfloat16 ones upcast exactly).
    ref = model_cls.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
      res = ref(input_ids=torch.from_numpy(tokens).long(),
                attention_mask=torch.from_numpy(mask).long(),
                position_ids=torch.from_numpy(positions).long())
    logits = res.logits.float().numpy()
    if name == "llama_rm":
      # Per-token scores [B, T] (HF pools the last non-pad one; the tests check every token).
      with torch.no_grad():
        h = ref.model(input_ids=torch.from_numpy(tokens).long(),
                      attention_mask=torch.from_numpy(mask).long(),
                      position_ids=torch.from_numpy(positions).long()).last_hidden_state
        logits = ref.score(h)[..., 0].float().numpy()
    golden[f"{name}/logits"] = logits
    files = sorted(os.listdir(out))
    size = sum(os.path.getsize(os.path.join(out, f)) for f in files)
    print(f"{name:9s} {size / 1024:7.1f} KiB  {files}")
  np.savez_compressed(os.path.join(HERE, "golden.npz"), **golden)
  with open(os.path.join(HERE, "VERSIONS.json"), "w") as f:
    json.dump({"torch": torch.__version__, "transformers": transformers.__version__}, f, indent=1)


if __name__ == "__main__":
  main()
