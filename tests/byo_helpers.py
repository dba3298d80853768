"""Test helpers for users' own data and rewards: a local tokenizer with a chat template, a
copy of a tiny family checkpoint as a Hub folder, and small chat data sets written as JSONL,
Parquet and datasets folders."""

import json
import os
import shutil

HERE = os.path.dirname(os.path.abspath(__file__))
LLAMA = os.path.join(HERE, "assets", "hf", "llama")
FAMILIES = os.path.join(HERE, "assets", "hf_families")

# The family assets' template over their char-level vocabulary (make_family_assets.py):
# "<bos>ROLE\nCONTENT<eos>\n" turns, "<bos>assistant\n" as the generation prompt.
FAMILY_TEMPLATE = ("{% for m in messages %}<bos>{{ m['role'] }}\n{{ m['content'] }}<eos>\n"
                   "{% endfor %}{% if add_generation_prompt %}<bos>assistant\n{% endif %}")

# A short template over the char-level test vocabulary: "U:..", "S:..", "A:..</s>" lines.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}{{ 'A:' + m['content'] + eos_token + '\n' }}"
    "{% else %}{{ m['role'][0] | upper + ':' + m['content'] + '\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'A:' }}{% endif %}")


def chat_tokenizer(folder, template=CHAT_TEMPLATE):
  """The tiny Llama asset's tokenizer saved in ``folder`` with ``template`` (None: none)."""
  from transformers import AutoTokenizer
  os.makedirs(folder, exist_ok=True)
  tok = AutoTokenizer.from_pretrained(LLAMA, local_files_only=True)
  tok.chat_template = template
  tok.save_pretrained(folder)
  return str(folder)


def family_model(folder, name, template=FAMILY_TEMPLATE):
  """A copy of the tiny ``name`` family checkpoint (tests/assets/hf_families: qwen3, gemma3,
  ...) in ``folder``, as a Hub download would be: weights, config and a tokenizer whose
  ``chat_template`` is ``template`` (the asset's char-level tokenizer, given one)."""
  from transformers import AutoTokenizer
  src = os.path.join(FAMILIES, name)
  shutil.copytree(src, folder)
  tok_from = src if os.path.exists(os.path.join(src, "tokenizer.json")) else \
      os.path.join(FAMILIES, "qwen3")  # the same 100-id char tokenizer for every asset
  tok = AutoTokenizer.from_pretrained(tok_from, local_files_only=True)
  tok.chat_template = template
  tok.save_pretrained(folder)
  return str(folder)


def write_jsonl(path, rows):
  with open(path, "w") as f:
    for r in rows:
      f.write(json.dumps(r) + "\n")
  return str(path)


def write_parquet(path, rows):
  import pyarrow as pa
  import pyarrow.parquet as pq
  pq.write_table(pa.Table.from_pylist(rows), str(path))
  return str(path)


def write_hf_disk(path, rows):
  import datasets
  datasets.Dataset.from_list(rows).save_to_disk(str(path))
  return str(path)


def tiny_llama(folder, vocab=600, bos_rule=False, template=None, seed=0):
  """A random Llama-architecture HF folder whose vocabulary (``vocab``, larger than the
  templates' placeholder 512) the tokenizer fills: 4 specials, printable ASCII one character a
  token, then unused ``<xN>`` tokens up to ``vocab``.  ``bos_rule``: the tokenizer's own
  post-processor puts ``<s>`` before every text (as Llama 2's does; SmolLM2's adds none).
  Written by jaxrlhf's own export (no PyTorch)."""
  import jax
  import transformers
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

  from jaxrlhf import model as M
  from jaxrlhf.config import ModelConfig
  from jaxrlhf.model import hf
  specials = ["<pad>", "<s>", "</s>", "<unk>"]
  chars = [chr(c) for c in range(32, 127)] + ["\n"]
  names = specials + chars + [f"<x{i}>" for i in range(vocab - len(specials) - len(chars))]
  tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(names)}, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
  tok.decoder = decoders.Fuse()
  if bos_rule:
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
  fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>",
                                              bos_token="<s>", eos_token="</s>",
                                              unk_token="<unk>")
  if template:
    fast.chat_template = template
  folder = str(folder)
  fast.save_pretrained(folder + ".tokenizer")
  assert len(fast) == vocab
  cfg = ModelConfig(vocab_size=vocab, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                    head_dim=8, mlp_dim=64, max_seq_len=128, rope_theta=50000.0)
  params = M.init_params(cfg, jax.random.key(seed))
  hf.export_hf(params, cfg, folder, tokenizer_path=folder + ".tokenizer")
  shutil.rmtree(folder + ".tokenizer")
  return folder


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_main(cwd, *args, timeout: int = 600) -> str:
  """``python -m jaxrlhf.main ARGS`` as a user outside the repository runs it (from ``cwd``,
  one CPU device); asserts it succeeded and returns its stdout (also printed, so pytest shows
  it when a later check fails)."""
  import subprocess
  import sys
  env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
  p = subprocess.run([sys.executable, "-m", "jaxrlhf.main", *args], capture_output=True,
                     text=True, cwd=cwd, env=env, timeout=timeout)
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  print(p.stdout)
  return p.stdout
