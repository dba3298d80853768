"""Test helpers for users' own data and rewards: a local tokenizer with a chat template, and
small chat data sets written as JSONL, Parquet and datasets folders."""

import json
import os
import shutil

HERE = os.path.dirname(os.path.abspath(__file__))
LLAMA = os.path.join(HERE, "assets", "hf", "llama")

# A short template over the char-level test vocabulary: "U:..", "S:..", "A:..</s>" lines.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}{{ 'A:' + m['content'] + eos_token + '\n' }}"
    "{% else %}{{ m['role'][0] | upper + ':' + m['content'] + '\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'A:' }}{% endif %}")


def chat_tokenizer(folder, template=CHAT_TEMPLATE, with_model=False):
  """The tiny Llama asset's tokenizer saved in ``folder`` with ``template`` (None: none);
  ``with_model`` copies the checkpoint too, so ``folder`` is a whole HF model."""
  from transformers import AutoTokenizer
  os.makedirs(folder, exist_ok=True)
  tok = AutoTokenizer.from_pretrained(LLAMA, local_files_only=True)
  tok.chat_template = template
  tok.save_pretrained(folder)
  if with_model:
    for f in ("config.json", "generation_config.json", "model.safetensors"):
      shutil.copy(os.path.join(LLAMA, f), os.path.join(folder, f))
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
