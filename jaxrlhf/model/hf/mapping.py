"""Hugging Face checkpoints <-> jaxrlhf parameters: the families a checkpoint may be
(Llama, Qwen2/3, Mistral, Gemma 2/3), and where each tensor of a checkpoint goes."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re

from jaxrlhf.config import ConfigError, ModelConfig, one_line
from jaxrlhf.model.transformer import param_axes


# model_type -> the prefix of its transformers class names.
FAMILIES = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral", "qwen3": "Qwen3",
            "gemma2": "Gemma2", "gemma3_text": "Gemma3"}


_HEAD_CLASSES = ("ForCausalLM", "ForSequenceClassification", "Model")


# Class names that do not follow "{prefix}{head}": Gemma 3's text-only classes.
_CLASS_NAMES = {("gemma3_text", "ForSequenceClassification"): "Gemma3TextForSequenceClassification",
                ("gemma3_text", "Model"): "Gemma3TextModel"}


GEMMA = ("gemma2", "gemma3_text")


def _class_name(model_type: str, head_class: str) -> str:
  return _CLASS_NAMES.get((model_type, head_class), FAMILIES[model_type] + head_class)


SUPPORTED_ARCHITECTURES = tuple(_class_name(m, h) for m in FAMILIES for h in _HEAD_CLASSES[:2])


INDEX_FILE = "model.safetensors.index.json"


SINGLE_FILE = "model.safetensors"


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json")


SCORE_BIAS_KEY = "jaxrlhf_score_bias"


# Tensors some checkpoints carry that are derived, not learned (older Llama saves).
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


class HFError(ConfigError):
  """A Hugging Face directory that cannot be loaded into (or written from) the model config."""


@contextlib.contextmanager
def safetensors_errors(file: str, what: str = "the checkpoint"):
  """Turns the safetensors library's failure on the user's ``file`` (cut short by an
  interrupted download or copy, a Git LFS pointer, not safetensors at all) into an HFError
  naming the file and the fix."""
  try:
    yield
  except HFError:
    raise
  except Exception as e:  # noqa: BLE001  (SafetensorError, OSError, ...)
    size = os.path.getsize(file) if os.path.isfile(file) else 0
    raise HFError(f"{file}: safetensors cannot read this file ({one_line(e)}; {size} bytes): it "
                  f"is damaged or cut short (an interrupted download or copy, or a Git LFS "
                  f"pointer); download or copy {what} again") from None


# Each parameter: (HF name, HF dimensions as groups of our logical axes).  A group of several
# axes is one HF dimension that splits into them, outermost first (``[H*Dh]`` -> heads,
# head_dim).  Our own axis order comes from ``param_axes``; "one" is a size-1 HF dimension we
# drop.  Layer names are relative to ``layers.{i}.``.
_LAYER = {
    "attn_norm": ("input_layernorm.weight", (("embed",),)),
    "wq": ("self_attn.q_proj.weight", (("heads", "head_dim"), ("embed",))),
    "wk": ("self_attn.k_proj.weight", (("kv_heads", "head_dim"), ("embed",))),
    "wv": ("self_attn.v_proj.weight", (("kv_heads", "head_dim"), ("embed",))),
    "wo": ("self_attn.o_proj.weight", (("embed",), ("heads", "head_dim"))),
    "bq": ("self_attn.q_proj.bias", (("heads", "head_dim"),)),
    "bk": ("self_attn.k_proj.bias", (("kv_heads", "head_dim"),)),
    "bv": ("self_attn.v_proj.bias", (("kv_heads", "head_dim"),)),
    "mlp_norm": ("post_attention_layernorm.weight", (("embed",),)),
    "w_gate": ("mlp.gate_proj.weight", (("mlp",), ("embed",))),
    "w_up": ("mlp.up_proj.weight", (("mlp",), ("embed",))),
    "w_down": ("mlp.down_proj.weight", (("embed",), ("mlp",))),
    "q_norm": ("self_attn.q_norm.weight", (("head_dim",),)),
    "k_norm": ("self_attn.k_norm.weight", (("head_dim",),)),
    "post_attn_norm": ("post_attention_layernorm.weight", (("embed",),)),
    "post_mlp_norm": ("post_feedforward_layernorm.weight", (("embed",),)),
}


# With post-norms (Gemma), post_attention_layernorm is the attention's output norm and the
# norm before the MLP has its own name.
_PRE_MLP_NORM = ("pre_feedforward_layernorm.weight", (("embed",),))


def _layer_tensor(cfg: ModelConfig, key: str):
  return _PRE_MLP_NORM if key == "mlp_norm" and cfg.post_norms else _LAYER[key]


# Global parameters by tree path.  Backbone names get the checkpoint's prefix ("model." for
# *ForCausalLM / *ForSequenceClassification); head names are top-level.
_GLOBAL = {
    ("embed",): ("embed_tokens.weight", (("vocab",), ("embed",)), True),
    ("final_norm",): ("norm.weight", (("embed",),), True),
    ("unembed",): ("lm_head.weight", (("vocab",), ("embed",)), False),
    ("score", "w"): ("score.weight", (("one",), ("embed",)), False),
}


@dataclasses.dataclass(frozen=True)
class _Entry:
  """One of our parameters and the HF tensor(s) behind it."""

  path: tuple[str, ...]  # our tree path, e.g. ("layers", "wq")
  hf_names: tuple[str, ...]  # one per layer for stacked parameters, else one
  groups: tuple[tuple[str, ...], ...]
  axes: tuple[str, ...]  # our logical axes without "layers"
  stacked: bool


def _sizes(cfg: ModelConfig, hf: bool) -> dict[str, int]:
  vocab = cfg.vocab_size
  if hf and cfg.unpadded_vocab_size:
    vocab = cfg.unpadded_vocab_size
  return {"embed": cfg.d_model, "heads": cfg.n_heads, "kv_heads": cfg.n_kv_heads,
          "head_dim": cfg.head_dim, "mlp": cfg.mlp_dim, "vocab": vocab, "one": 1}


def _entries(cfg: ModelConfig, head: str, prefix: str) -> list[_Entry]:
  """Every parameter of ``param_axes(cfg, head)`` except the score bias, in HF file order
  (embedding, layers, final norm, head)."""
  axes = param_axes(cfg, head)

  def single(path):
    name, groups, backbone = _GLOBAL[path]
    return _Entry(path, ((prefix if backbone else "") + name,), groups, _leaf(axes, path), False)

  out = [single(("embed",))]
  # Stacked layers: one entry per parameter, its names cover every layer.
  for key, layer_axes in axes["layers"].items():
    name, groups = _layer_tensor(cfg, key)
    names = tuple(f"{prefix}layers.{i}.{name}" for i in range(cfg.n_layers))
    out.append(_Entry(("layers", key), names, groups, layer_axes[1:], True))
  out.append(single(("final_norm",)))
  out += [single(path) for path in (("unembed",), ("score", "w")) if path[0] in axes]
  return out


def _hf_shape(entry: _Entry, hf_sizes: dict[str, int]) -> tuple[int, ...]:
  return tuple(math.prod(hf_sizes[a] for a in g) for g in entry.groups)


def _describe(entry: _Entry, sizes: dict[str, int]) -> str:
  field = {"embed": "d_model", "heads": "n_heads", "kv_heads": "n_kv_heads",
           "head_dim": "head_dim", "mlp": "mlp_dim", "vocab": "vocab_size", "one": "1"}
  dims = []
  for g in entry.groups:
    dims.append("*".join(f"{field[a]}={sizes[a]}" if a != "one" else "1" for a in g))
  return "[" + ", ".join(dims) + "]"


def _leaf(tree, path):
  for k in path:
    tree = tree[k]
  return tree


def _set_leaf(tree, path, value):
  sub = tree
  for k in path[:-1]:
    sub = sub[k]
  sub[path[-1]] = value
  return tree
