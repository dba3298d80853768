"""Hugging Face interop: load Llama / Qwen2 / Mistral / Qwen3 / Gemma 2 / Gemma 3 (text)
checkpoints onto the mesh, export back.

* :func:`config_from_hf` maps a model directory's ``config.json`` (through
  ``transformers.AutoConfig``) onto :class:`~jaxrlhf.config.ModelConfig`.
* :func:`load_hf` reads the safetensors files (one file, or shards with
  ``model.safetensors.index.json``) tensor by tensor and builds every stacked parameter
  straight into its target sharding: each device's block is read from the files (only the rows
  and columns that device owns, layer by layer), converted to the parameter dtype and placed on
  that device.  The host never holds more than one device block at a time, so a checkpoint
  larger than a host's or a device's memory loads.  In a multi-process run each process reads
  only the blocks of its own devices (the directory must be visible to every process).
* :func:`export_hf` writes parameters back as a directory that ``transformers`` (and serving
  engines that read the same format) load: ``config.json``, safetensors shards with an index,
  and the tokenizer files.

Layout.  HF linear weights are ``[out, in]``; ours are ``[in, ...out]`` with heads split out,
e.g. ``q_proj.weight [H*Dh, D]`` is ``wq [D, H, Dh]``.  Our rotary embedding uses the same
half-split (``rotate_half``) convention as HF, so q/k need no permutation.  The ``_LAYER`` and
``_GLOBAL`` tables below say, for each of our parameters, which HF tensor holds it and how that
tensor's dimensions split into our logical axes; loading and export both read them.  Gemma's
norm weights are stored as HF stores them (the ``w`` of ``1 + w``, ``ModelConfig.norm_offset``),
so they load and export unchanged.

Families.  :func:`config_from_hf` sets the fields that tell the families apart (Qwen2's
``qkv_bias``, Qwen3's ``qk_norm``, Gemma's ``norm_offset``, ``post_norms``, GeGLU, embedding
scale, soft-caps, sliding window and layer pattern, Gemma 3's local rotary base); anything a
checkpoint asks for that this model does not compute is an :class:`HFError` naming the
``config.json`` field and what is supported.  :func:`family_of` is the inverse, for export.

Vocabulary padding.  A vocabulary the ``tp`` axis does not divide would leave the embedding and
LM head replicated, so :func:`config_from_hf` pads ``vocab_size`` up to a multiple of ``tp`` and
records the real size in ``unpadded_vocab_size``.  Padded embedding rows and LM-head columns
load as zeros (their logits are 0, so samplers must mask ids >= ``unpadded_vocab_size``);
:func:`export_hf` drops them, so the exported model has the checkpoint's vocabulary again.

Scalar heads.  Reward and value models use the ``"scalar"`` head.  A checkpoint with a
``score.weight [1, D]`` (``*ForSequenceClassification``, ``num_labels=1``) loads it; one without
(a causal LM used to start a reward or value model) gets a zero-initialised head.  HF's
sequence-classification head has no bias: export stores a non-zero ``score.b`` in
``config.json`` as ``jaxrlhf_score_bias`` (read back by :func:`load_hf`; ``transformers`` ignores
it, which shifts every score by that constant).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import shutil
from typing import Any, Iterator, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.config import ConfigError, ModelConfig
from jaxrlhf.mesh import PARAM_RULES, Rules
from jaxrlhf.model.sharded import abstract_params, init_sharded, param_shardings
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


# ------------------------------------------------------------------------------- mapping

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


# ------------------------------------------------------------------------------- config


def _read_json(path: str, what: str) -> dict:
  try:
    with open(path) as f:
      return json.load(f)
  except FileNotFoundError:
    raise HFError(f"{path}: not found; {what}") from None
  except json.JSONDecodeError as e:
    raise HFError(f"{path}: not valid JSON ({e})") from None


def _raw_config(path: str) -> dict:
  if not os.path.isdir(path):
    raise HFError(f"model.hf_path={path!r} is not a directory; point it at a local Hugging Face "
                  "model folder (config.json + *.safetensors)")
  return _read_json(os.path.join(path, "config.json"),
                    "a Hugging Face model directory needs its config.json")


def _check_family(path: str, raw: dict) -> str:
  model_type = raw.get("model_type")
  archs = raw.get("architectures") or []
  allowed = ({_class_name(model_type, h) for h in _HEAD_CLASSES} if model_type in FAMILIES
             else ())
  bad = [a for a in archs if a not in allowed]
  if model_type not in FAMILIES or bad:
    name = ", ".join(archs) if archs else f"model_type {model_type!r}"
    raise HFError(f"{path}/config.json: architecture {name} is not supported; supported: "
                  f"{', '.join(SUPPORTED_ARCHITECTURES)}")
  return model_type


def _rope(hf, layer_type: Optional[str] = None) -> dict:
  """The rotary settings (theta, type and scaling parameters) from either transformers' v5
  ``rope_parameters`` or the v4 ``rope_theta`` + ``rope_scaling`` fields.  ``layer_type``:
  the entry of per-layer-type ``rope_parameters`` (Gemma 3: ``full_attention`` and
  ``sliding_attention``)."""
  params = getattr(hf, "rope_parameters", None)
  if layer_type is not None:
    params = (params or {}).get(layer_type)
  if isinstance(params, dict) and "rope_theta" in params:
    out = dict(params)
  else:
    out = dict(getattr(hf, "rope_scaling", None) or {})
    out["rope_theta"] = getattr(hf, "rope_theta", 10000.0)
  out["rope_type"] = str(out.get("rope_type", out.get("type", "default")))
  return out


def _rope_scaling(rope: dict, where: str, field: str) -> dict:
  """ModelConfig's rotary scaling fields for one set of transformers rope parameters."""
  rope_type = rope["rope_type"]
  scaling = {"rope_scaling": "none"}
  if rope_type in ("linear", "llama3"):
    scaling = {"rope_scaling": rope_type, "rope_factor": float(rope["factor"])}
  if rope_type == "llama3":
    scaling.update(rope_low_freq_factor=float(rope["low_freq_factor"]),
                   rope_high_freq_factor=float(rope["high_freq_factor"]),
                   rope_original_max_len=int(rope["original_max_position_embeddings"]))
  elif rope_type not in ("default", "linear"):
    raise HFError(f"{where}: {field} rope_type {rope_type!r} (rope scaling) is not supported; "
                  "supported: default, linear, llama3 (jaxrlhf.model.transformer."
                  "rope_frequencies)")
  return scaling


_LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}


def _family_fields(model_type: str, hf, where: str) -> dict:
  """The ModelConfig fields that set the family's architecture apart from Llama's."""
  out = {}
  if model_type == "qwen2":
    out["qkv_bias"] = True
  if model_type in ("qwen2", "qwen3") and getattr(hf, "use_sliding_window", False):
    raise HFError(f"{where}: use_sliding_window=true is not supported for {model_type}; set it "
                  "to false")
  if model_type in ("qwen3", "gemma3_text"):
    out["qk_norm"] = True
  if model_type not in GEMMA:
    act = getattr(hf, "hidden_act", "silu")
    if act != "silu":
      raise HFError(f"{where}: hidden_act={act!r} is not supported; this model uses SwiGLU "
                    "(silu)")
    return out
  act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", None)
  if act != "gelu_pytorch_tanh":
    raise HFError(f"{where}: hidden_activation={act!r} is not supported for {model_type}; "
                  "supported: gelu_pytorch_tanh (GeGLU)")
  if getattr(hf, "use_bidirectional_attention", False):
    raise HFError(f"{where}: use_bidirectional_attention=true is not supported; this model is "
                  "a causal decoder")
  kinds = list(getattr(hf, "layer_types", None) or [])
  bad = sorted(set(kinds) - set(_LAYER_TYPES))
  if bad:
    raise HFError(f"{where}: layer_types {bad} are not supported; supported: "
                  f"{', '.join(_LAYER_TYPES)}")
  layer_types = tuple(_LAYER_TYPES[k] for k in kinds)
  window = int(getattr(hf, "sliding_window", None) or 0)
  if "sliding" in layer_types and window < 1:
    raise HFError(f"{where}: layer_types has sliding_attention layers but sliding_window="
                  f"{window}")
  soft = lambda name: float(getattr(hf, name, None) or 0.0)
  out.update(norm_offset=1.0, post_norms=True, mlp_activation="gelu_tanh", embed_scale=True,
             query_pre_attn_scalar=float(hf.query_pre_attn_scalar),
             attn_softcap=soft("attn_logit_softcapping"),
             final_softcap=soft("final_logit_softcapping"),
             sliding_window=window if "sliding" in layer_types else 0,
             layer_types=layer_types if "sliding" in layer_types else ())
  if model_type == "gemma3_text":
    local = _rope(hf, "sliding_attention")
    if local["rope_type"] != "default":
      raise HFError(f"{where}: rope_parameters.sliding_attention rope_type "
                    f"{local['rope_type']!r} is not supported; supported: default (the local "
                    "layers' base only, model.rope_local_theta)")
    out["rope_local_theta"] = float(local["rope_theta"])
  return out


def config_from_hf(path: str, base: Optional[ModelConfig] = None, *, tp: int = 1) -> ModelConfig:
  """The :class:`ModelConfig` of a Hugging Face model directory.

  Architecture fields come from ``config.json``; everything else (dtypes, remat, scanning)
  from ``base`` (default ``ModelConfig()``).  ``hf_path`` is set to ``path``.  A vocabulary
  that ``tp`` does not divide is padded up to a multiple of ``tp`` (``unpadded_vocab_size``
  keeps the real size).  ``max_seq_len`` is the checkpoint's ``max_position_embeddings``,
  capped at its sliding window (Mistral): within the window, sliding-window attention equals
  the full causal attention this model computes.
  """
  import transformers  # heavy; only needed here

  raw = _raw_config(path)
  model_type = _check_family(path, raw)
  hf = transformers.AutoConfig.from_pretrained(path)
  where = f"{path}/config.json"
  act = getattr(hf, "hidden_act", "silu")
  if act != "silu":
    raise HFError(f"{where}: hidden_act={act!r} is not supported; this model uses SwiGLU (silu)")
  if getattr(hf, "attention_bias", False) or getattr(hf, "mlp_bias", False):
    raise HFError(f"{where}: attention_bias / mlp_bias are not supported (this model has "
                  "biases on q/k/v only, as Qwen2 does)")
  family = _family_fields(model_type, hf, where)
  if model_type == "gemma3_text":
    rope = _rope(hf, "full_attention")
    scaling = _rope_scaling(rope, where, "rope_parameters.full_attention")
  else:
    rope = _rope(hf)
    scaling = _rope_scaling(rope, where, "rope_parameters")
  n_heads = hf.num_attention_heads
  head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // n_heads
  max_len = hf.max_position_embeddings
  window = getattr(hf, "sliding_window", None) if model_type == "mistral" else None
  if window:
    max_len = min(max_len, window)
  vocab = hf.vocab_size
  padded = -(-vocab // tp) * tp if tp > 1 else vocab
  base = base if base is not None else ModelConfig()
  return dataclasses.replace(
      base, vocab_size=padded, unpadded_vocab_size=vocab if padded != vocab else 0,
      d_model=hf.hidden_size, n_layers=hf.num_hidden_layers, n_heads=n_heads,
      n_kv_heads=getattr(hf, "num_key_value_heads", None) or n_heads, head_dim=head_dim,
      mlp_dim=hf.intermediate_size, max_seq_len=max_len,
      rope_theta=float(rope["rope_theta"]), **scaling,
      norm_eps=float(hf.rms_norm_eps), tie_embeddings=bool(getattr(hf, "tie_word_embeddings",
                                                                    False)),
      **{"qkv_bias": False, **family}, hf_path=path)


def resolve_hf_config(cfg: ModelConfig, tp: int = 1) -> ModelConfig:
  """``cfg`` with its architecture read from ``cfg.hf_path`` when that is set (else ``cfg``)."""
  return config_from_hf(cfg.hf_path, cfg, tp=tp) if cfg.hf_path else cfg


# Fields that must agree between a ModelConfig and the checkpoint it loads.
_ARCH_FIELDS = ("d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_dim",
                "rope_theta", "rope_scaling", "rope_factor", "rope_low_freq_factor",
                "rope_high_freq_factor", "rope_original_max_len", "norm_eps", "tie_embeddings",
                "qkv_bias", "qk_norm", "norm_offset", "post_norms", "mlp_activation",
                "embed_scale", "query_pre_attn_scalar", "attn_softcap", "final_softcap",
                "sliding_window", "layer_types", "rope_local_theta")


def _check_config(path: str, cfg: ModelConfig, head: str):
  want = config_from_hf(path, cfg)
  fields = [f for f in _ARCH_FIELDS if not (f == "tie_embeddings" and head != "lm")]
  bad = [f"model.{f}={getattr(cfg, f)!r} but the checkpoint has {getattr(want, f)!r}"
         for f in fields if getattr(cfg, f) != getattr(want, f)]
  real = cfg.unpadded_vocab_size or cfg.vocab_size
  if real != want.vocab_size:
    bad.append(f"model vocabulary {real} but the checkpoint has {want.vocab_size}")
  if bad:
    raise HFError(f"{path}: the model config does not match config.json: " + "; ".join(bad) +
                  " (build the config with jaxrlhf.model.hf.config_from_hf)")


# ------------------------------------------------------------------------------ reading


class _Checkpoint:
  """The safetensors files of a directory, opened lazily; tensor names, shapes and slices."""

  def __init__(self, path: str, stack: contextlib.ExitStack):
    self.path = path
    self._stack = stack
    self._open: dict[str, Any] = {}
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
      weight_map = _read_json(index, "").get("weight_map")
      if not isinstance(weight_map, dict):
        raise HFError(f"{index}: has no 'weight_map'")
      files = sorted(set(weight_map.values()))
      missing = [f for f in files if not os.path.exists(os.path.join(path, f))]
      if missing:
        raise HFError(f"{index} names shard files that are not in {path}: {', '.join(missing)}")
    elif os.path.exists(os.path.join(path, SINGLE_FILE)):
      files = [SINGLE_FILE]
    else:
      files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
      if not files:
        others = [f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth"))]
        hint = (f" (found {', '.join(others)}: re-save it with save_pretrained(..., "
                "safe_serialization=True))") if others else ""
        raise HFError(f"{path}: no safetensors weights ({SINGLE_FILE} or {INDEX_FILE}){hint}")
    # name -> (file, shape, dtype); headers only, no tensor data is read here.
    self.tensors: dict[str, tuple[str, tuple[int, ...], str]] = {}
    for file in files:
      f = self._file(file)
      for name in f.keys():
        s = f.get_slice(name)
        self.tensors[name] = (file, tuple(s.get_shape()), s.get_dtype())

  def _file(self, file: str):
    from safetensors import safe_open
    if file not in self._open:
      self._open[file] = self._stack.enter_context(
          safe_open(os.path.join(self.path, file), framework="np"))
    return self._open[file]

  def slice(self, name: str):
    return self._file(self.tensors[name][0]).get_slice(name)


def _prefix(names) -> str:
  return "model." if any(n.startswith("model.") for n in names) else ""


def _norm_index(index, shape) -> tuple[tuple[int, int], ...]:
  return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def _read_block(ckpt: _Checkpoint, name: str, entry: _Entry, hf_sizes, box) -> np.ndarray:
  """Our block ``box`` (a (start, stop) per axis of ``entry.axes``) of the HF tensor ``name``:
  reads the rows/columns it covers, splits grouped dimensions, pads the vocabulary, transposes."""
  view = [a for g in entry.groups for a in g]
  want = {a: (0, 1) for a in view}
  want.update(zip(entry.axes, box))
  hf_index, shapes, inner_index, pads = [], [], [], []
  for g in entry.groups:
    lo, hi = want[g[0]]
    inner = math.prod(hf_sizes[a] for a in g[1:])
    real_hi = min(hi, hf_sizes[g[0]])  # beyond it: vocabulary padding (single-axis groups)
    hf_index.append(slice(lo * inner, real_hi * inner))
    shapes += [real_hi - lo] + [hf_sizes[a] for a in g[1:]]
    inner_index += [slice(None)] + [slice(*want[a]) for a in g[1:]]
    pads += [(0, hi - real_hi)] + [(0, 0)] * (len(g) - 1)
  block = ckpt.slice(name)[tuple(hf_index)]
  block = np.asarray(block).reshape(shapes)[tuple(inner_index)]
  if any(p[1] for p in pads):
    block = np.pad(block, pads)
  perm = [view.index(a) for a in entry.axes]
  perm += [i for i in range(len(view)) if i not in perm]  # size-1 "one" axes, dropped below
  block = np.transpose(block, perm)
  return block.reshape(block.shape[:len(entry.axes)])


def _place(shape, sharding, read) -> jax.Array:
  """A global array whose every addressable device block is ``read(index)``: one block in host
  memory at a time; a block several devices share (replicated axes) is read once and copied."""
  placed, arrays = {}, []
  for device, index in sharding.addressable_devices_indices_map(shape).items():
    key = _norm_index(index, shape)
    if key in placed:
      arrays.append(jax.device_put(placed[key], device))
    else:
      placed[key] = jax.device_put(read(key), device)
      arrays.append(placed[key])
  return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def _check_tensors(ckpt: _Checkpoint, entries: list[_Entry], cfg: ModelConfig, head: str,
                   prefix: str):
  hf_sizes = _sizes(cfg, hf=True)
  expected = {}
  for e in entries:
    for n in e.hf_names:
      expected[n] = e
  have = ckpt.tensors
  optional = set()
  if head == "scalar":
    optional.add("score.weight")  # created when absent
  # Heads the chosen role does not use are allowed (a causal LM as a reward model, a tied
  # checkpoint that still stores lm_head.weight, ...).
  unused = {"lm_head.weight", "score.weight"} - set(expected)
  missing = [n for n in expected if n not in have and n not in optional]
  unexpected = [n for n in have if n not in expected and n not in unused and
                not _IGNORED.search(n)]
  shapes = []
  for n, e in expected.items():
    if n in have and have[n][1] != _hf_shape(e, hf_sizes):
      hint = ""
      if "vocab" in e.groups[0] and have[n][1][1:] == _hf_shape(e, hf_sizes)[1:]:
        hint = (" (a vocabulary padded to a multiple: set model.unpadded_vocab_size to the "
                "checkpoint's vocabulary, as config_from_hf(path, tp=...) does)")
      shapes.append(f"{n}: checkpoint {have[n][1]} vs model {_hf_shape(e, hf_sizes)} "
                    f"{_describe(e, hf_sizes)}{hint}")
  problems = []
  if missing:
    problems.append(f"missing tensors ({len(missing)}): {_summarise(missing)}")
  if unexpected:
    problems.append(f"unexpected tensors ({len(unexpected)}): {_summarise(unexpected)}")
  if shapes:
    problems.append(f"shape mismatches ({len(shapes)}): " + "; ".join(shapes))
  if problems:
    raise HFError(f"{ckpt.path} does not match the model config (head={head!r}, "
                  f"tensor prefix {prefix!r}): " + " | ".join(problems))


def _summarise(names: list[str], limit: int = 12) -> str:
  """Names with layer indices folded: ``model.layers.{0,1,5}.mlp.up_proj.weight``."""
  folded: dict[str, list[int]] = {}
  for n in names:
    m = re.match(r"(.*layers\.)(\d+)(\..*)", n)
    key = f"{m.group(1)}{{}}{m.group(3)}" if m else n
    folded.setdefault(key, []).append(int(m.group(2)) if m else -1)
  out = []
  for key, layers in folded.items():
    if layers[0] >= 0:
      idx = sorted(layers)
      text = f"{idx[0]}..{idx[-1]}" if len(idx) > 2 and idx == list(
          range(idx[0], idx[-1] + 1)) else ",".join(map(str, idx))
      out.append(key.replace("{}", text if len(idx) == 1 else "{" + text + "}"))
    else:
      out.append(key)
  more = f", ... ({len(out) - limit} more)" if len(out) > limit else ""
  return ", ".join(out[:limit]) + more


def load_hf(path: str, cfg: ModelConfig, mesh, head: str = "lm", dtype: Optional[str] = None,
            *, rules: Rules = PARAM_RULES, shardings=None) -> dict:
  """Parameters of ``cfg``/``head`` read from the Hugging Face directory ``path``, each placed
  directly in its sharding on ``mesh`` (``param_shardings(cfg, mesh, head, rules)`` unless
  ``shardings`` is given) and converted to ``dtype`` (default ``cfg.param_dtype``).

  ``cfg`` must describe the checkpoint (build it with :func:`config_from_hf`); missing,
  unexpected or mis-shaped tensors and config mismatches raise :class:`HFError` listing them.
  """
  raw = _raw_config(path)
  _check_family(path, raw)
  dtype = np.dtype(jnp.dtype(dtype or cfg.param_dtype))
  if shardings is None:
    shardings = param_shardings(cfg, mesh, head, rules)
  abstract = abstract_params(cfg, head)
  hf_sizes = _sizes(cfg, hf=True)
  with contextlib.ExitStack() as stack:
    ckpt = _Checkpoint(path, stack)
    prefix = _prefix(ckpt.tensors)
    entries = _entries(cfg, head, prefix)
    _check_tensors(ckpt, entries, cfg, head, prefix)
    _check_config(path, cfg, head)
    params = jax.tree.map(lambda x: None, abstract)
    for e in entries:
      shape, sharding = _leaf(abstract, e.path).shape, _leaf(shardings, e.path)
      if e.path == ("score", "w") and "score.weight" not in ckpt.tensors:
        value = _place(shape, sharding, lambda box: np.zeros([b - a for a, b in box], dtype))
      elif e.stacked:
        def read(box, e=e):
          (l0, l1), rest = box[0], box[1:]
          block = np.empty([b - a for a, b in box], dtype)
          for i in range(l0, l1):  # layer by layer into one buffer: no second copy
            block[i - l0] = _read_block(ckpt, e.hf_names[i], e, hf_sizes, rest)
          return block
        value = _place(shape, sharding, read)
      else:
        value = _place(shape, sharding,
                       lambda box, e=e: _read_block(ckpt, e.hf_names[0], e, hf_sizes,
                                                    box).astype(dtype))
      params = _set_leaf(params, e.path, value)
  if head == "scalar":
    bias = np.asarray(float(raw.get(SCORE_BIAS_KEY, 0.0)) if "score.weight" in ckpt.tensors
                      else 0.0, dtype)
    params["score"]["b"] = _place((), shardings["score"]["b"], lambda box: bias)
  return params


def load_or_init(cfg: ModelConfig, mesh, key: jax.Array, head: str = "lm",
                 rules: Rules = PARAM_RULES) -> dict:
  """A role's parameters: loaded from ``cfg.hf_path`` when set, else a random sharded init."""
  if cfg.hf_path:
    return load_hf(cfg.hf_path, cfg, mesh, head, rules=rules)
  return init_sharded(cfg, key, mesh, head, rules)


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


# ------------------------------------------------------------------------------- export


def _to_host(x: jax.Array) -> np.ndarray:
  if x.is_fully_addressable:
    return np.asarray(jax.device_get(x))
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _to_hf(block: np.ndarray, entry: _Entry, hf_sizes) -> np.ndarray:
  """Inverse of :func:`_read_block` for a whole parameter: our axes -> the HF tensor (padded
  vocabulary rows dropped)."""
  view = [a for g in entry.groups for a in g]
  extra = [a for a in view if a not in entry.axes]
  block = block.reshape(block.shape + (1,) * len(extra))
  order = list(entry.axes) + extra
  block = np.transpose(block, [order.index(a) for a in view])
  if "vocab" in view:
    i = view.index("vocab")
    block = block[(slice(None),) * i + (slice(0, hf_sizes["vocab"]),)]
  return np.ascontiguousarray(block.reshape(_hf_shape(entry, hf_sizes)))


def _export_tensors(params, entries, hf_sizes, dtype) -> Iterator[tuple[str, np.ndarray]]:
  """(HF name, host array) one tensor at a time; a stacked parameter one layer at a time."""
  for e in entries:
    x = _leaf(params, e.path)
    if e.stacked:
      for i, name in enumerate(e.hf_names):
        yield name, _to_hf(_to_host(x[i]), e, hf_sizes).astype(dtype)
    else:
      yield e.hf_names[0], _to_hf(_to_host(x), e, hf_sizes).astype(dtype)


# Gemma's fixed architecture: what a config needs to be written as Gemma 2 or 3.
_GEMMA_FIXED = dict(norm_offset=1.0, post_norms=True, mlp_activation="gelu_tanh",
                    embed_scale=True)
_GEMMA_ONLY = ("norm_offset", "post_norms", "mlp_activation", "embed_scale",
               "query_pre_attn_scalar", "attn_softcap", "final_softcap", "sliding_window",
               "layer_types", "rope_local_theta")


def family_of(cfg: ModelConfig) -> str:
  """The transformers ``model_type`` that holds ``cfg``'s architecture (Llama for the plain
  one; a Mistral checkpoint exports as itself); an HFError for a mix no family has."""
  default = ModelConfig()
  gemma_set = [f for f in _GEMMA_ONLY if getattr(cfg, f) != getattr(default, f)]
  if gemma_set:
    off = [f"model.{f}={getattr(cfg, f)!r}" for f, v in _GEMMA_FIXED.items()
           if getattr(cfg, f) != v]
    if off or cfg.qkv_bias:
      raise HFError(f"export: model.{', model.'.join(gemma_set)} exist only in Gemma 2 / 3, "
                    f"whose architecture also needs {_GEMMA_FIXED} and no qkv_bias; this "
                    f"config has {', '.join(off) or 'model.qkv_bias=True'}")
    if cfg.qk_norm:
      return "gemma3_text"
    if cfg.rope_local_theta:
      raise HFError("export: model.rope_local_theta is Gemma 3's, which also has q/k norms "
                    "(model.qk_norm=True); Gemma 2 has one rotary base")
    return "gemma2"
  if cfg.qk_norm and cfg.qkv_bias:
    raise HFError("export: model.qk_norm=True with model.qkv_bias=True: no supported family "
                  "has both (Qwen3: q/k norms; Qwen2: q/k/v biases)")
  return "qwen3" if cfg.qk_norm else "qwen2" if cfg.qkv_bias else "llama"


def _rope_parameters(cfg: ModelConfig, local: bool = False) -> dict:
  """transformers v5 ``rope_parameters`` for our rotary settings (the local layers' with
  ``local``)."""
  if local and cfg.rope_local_theta:
    return {"rope_type": "default", "rope_theta": cfg.rope_local_theta}
  scaling = {}
  if cfg.rope_scaling != "none":
    scaling = {"rope_type": cfg.rope_scaling, "factor": cfg.rope_factor}
  if cfg.rope_scaling == "llama3":
    scaling.update(low_freq_factor=cfg.rope_low_freq_factor,
                   high_freq_factor=cfg.rope_high_freq_factor,
                   original_max_position_embeddings=cfg.rope_original_max_len)
  return {"rope_type": "default", "rope_theta": cfg.rope_theta, **scaling}


def _export_config(cfg: ModelConfig, head: str, source: str, dtype: str, score_bias: float):
  import transformers

  want = family_of(cfg)
  if source:
    raw = _raw_config(source)
    model_type = _check_family(source, raw)
  else:
    raw, model_type = {}, want
  if model_type != want and not {model_type, want} <= {"llama", "mistral"}:
    raise HFError(f"export: this model config is a {want} architecture and cannot be written "
                  f"as the source's {model_type} model (model.qkv_bias={cfg.qkv_bias}, "
                  f"model.qk_norm={cfg.qk_norm}, model.post_norms={cfg.post_norms}); export "
                  "without a source config (source='') to get the matching family")
  gemma = model_type in GEMMA
  kwargs = {k: v for k, v in raw.items() if k not in (
      "model_type", "transformers_version", "architectures", "layer_types", "rope_theta",
      "rope_scaling", "rope_parameters", "torch_dtype", "dtype", "id2label", "label2id",
      "num_labels", SCORE_BIAS_KEY, "sliding_window", "use_sliding_window", "hidden_act",
      "hidden_activation", "rope_local_base_freq", "sliding_window_pattern",
      "attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar")}
  kwargs.update(
      vocab_size=cfg.unpadded_vocab_size or cfg.vocab_size, hidden_size=cfg.d_model,
      intermediate_size=cfg.mlp_dim, num_hidden_layers=cfg.n_layers,
      num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
      head_dim=cfg.head_dim, rms_norm_eps=cfg.norm_eps,
      tie_word_embeddings=cfg.tie_embeddings if head == "lm" else False,
      max_position_embeddings=raw.get("max_position_embeddings", cfg.max_seq_len))
  if model_type == "mistral":
    kwargs["sliding_window"] = raw.get("sliding_window")
  if gemma:
    types = cfg.layer_types or (("sliding" if cfg.sliding_window else "full"),) * cfg.n_layers
    scalar = cfg.query_pre_attn_scalar or cfg.head_dim
    kwargs.update(
        hidden_activation="gelu_pytorch_tanh",
        # transformers types it int (every Gemma has an integral one).
        query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,
        sliding_window=cfg.sliding_window or None,
        layer_types=[f"{t}_attention" for t in types],
        attn_logit_softcapping=cfg.attn_softcap or None,
        final_logit_softcapping=cfg.final_softcap or None)
  else:
    kwargs["hidden_act"] = "silu"
  major = int(transformers.__version__.split(".")[0])
  if major >= 5:
    if model_type == "gemma3_text":
      kwargs["rope_parameters"] = {"full_attention": _rope_parameters(cfg),
                                   "sliding_attention": _rope_parameters(cfg, local=True)}
    else:
      kwargs["rope_parameters"] = _rope_parameters(cfg)
    kwargs["dtype"] = dtype
  else:
    rope = _rope_parameters(cfg)
    kwargs["rope_theta"] = rope.pop("rope_theta")
    kwargs["rope_scaling"] = rope if cfg.rope_scaling != "none" else None
    if model_type == "gemma3_text":
      kwargs["rope_local_base_freq"] = cfg.rope_local_theta or cfg.rope_theta
    kwargs["torch_dtype"] = dtype
  if head == "scalar":
    kwargs["num_labels"] = 1
    kwargs["architectures"] = [_class_name(model_type, "ForSequenceClassification")]
    if score_bias:
      kwargs[SCORE_BIAS_KEY] = score_bias
  else:
    kwargs["architectures"] = [_class_name(model_type, "ForCausalLM")]
  return transformers.AutoConfig.for_model(model_type, **kwargs)


def _parse_size(size) -> int:
  if isinstance(size, int):
    return size
  m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B)\s*", str(size), re.I)
  if not m:
    raise HFError(f"max_shard_size={size!r}: use bytes or e.g. '5GB', '500MB'")
  unit = m.group(2).upper()
  base = 1024 if "I" in unit else 1000
  return int(float(m.group(1)) * base ** "KMG".index(unit[0]) * base)


def export_hf(params: dict, cfg: ModelConfig, out_dir: str, tokenizer_path: Optional[str] = None,
              head: str = "lm", *, dtype: Optional[str] = None, max_shard_size="5GB",
              source: Optional[str] = None) -> str:
  """Writes ``params`` as a Hugging Face model directory ``out_dir`` and returns it.

  ``config.json`` starts from ``source``'s (default ``cfg.hf_path``; keeps token ids and other
  fields) with the architecture set from ``cfg``; without one, the family that holds ``cfg``
  (:func:`family_of`: Llama, Qwen2 with ``qkv_bias``, Qwen3 with ``qk_norm``, Gemma 2 / 3).
  ``head="lm"`` writes ``*ForCausalLM``, ``"scalar"`` ``*ForSequenceClassification`` with
  ``num_labels=1``.  Weights go in ``dtype`` (default
  ``cfg.param_dtype``) into safetensors shards of at most ``max_shard_size`` with an index
  (one ``model.safetensors`` when they fit).  Padded vocabulary rows are dropped.  Tokenizer
  files (and ``generation_config.json``) are copied from ``tokenizer_path`` (default: the
  source directory, when it has them).  Multi-process: every process must call it (the
  gathers are collective); process 0 writes.
  """
  from safetensors.numpy import save_file

  source = cfg.hf_path if source is None else source
  dtype_name = dtype or cfg.param_dtype
  np_dtype = np.dtype(jnp.dtype(dtype_name))
  hf_sizes = _sizes(cfg, hf=True)
  entries = _entries(cfg, head, "model.")
  score_bias = float(_to_host(params["score"]["b"])) if head == "scalar" else 0.0
  hf_config = _export_config(cfg, head, source, dtype_name, score_bias)
  writer = jax.process_index() == 0

  # Shards are planned from shapes alone, so no more than one shard is ever on the host.
  limit = _parse_size(max_shard_size)
  plan: list[list[str]] = [[]]
  used = 0
  for e in entries:
    nbytes = math.prod(_hf_shape(e, hf_sizes)) * np_dtype.itemsize
    for name in e.hf_names:
      if plan[-1] and used + nbytes > limit:
        plan.append([])
        used = 0
      plan[-1].append(name)
      used += nbytes
  files = ([SINGLE_FILE] if len(plan) == 1 else
           [f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))])
  file_of = {n: files[i] for i, names in enumerate(plan) for n in names}

  if writer:
    os.makedirs(out_dir, exist_ok=True)
    for f in os.listdir(out_dir):  # stale shards of an earlier export would confuse loaders
      if f in (SINGLE_FILE, INDEX_FILE) or re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", f):
        os.remove(os.path.join(out_dir, f))
  shard: dict[str, np.ndarray] = {}
  total = 0
  tensors = _export_tensors(params, entries, hf_sizes, np_dtype)
  for name, array in tensors:
    shard[name] = array
    total += array.nbytes
    if len(shard) == len(plan[files.index(file_of[name])]):
      if writer:
        save_file(shard, os.path.join(out_dir, file_of[name]), metadata={"format": "pt"})
      shard = {}
  if not writer:
    return out_dir
  if len(files) > 1:
    with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
      json.dump({"metadata": {"total_size": total}, "weight_map": file_of}, f, indent=2)
  hf_config.save_pretrained(out_dir)
  _copy_tokenizer(tokenizer_path, source, out_dir)
  return out_dir


def _copy_tokenizer(tokenizer_path: Optional[str], source: str, out_dir: str):
  folder = tokenizer_path or source
  if not folder:
    return
  names = [f for f in TOKENIZER_FILES + ("generation_config.json",)
           if os.path.exists(os.path.join(folder, f))]
  if tokenizer_path and not any(n in TOKENIZER_FILES for n in names):
    raise HFError(f"tokenizer_path={tokenizer_path!r} has no tokenizer files (one of "
                  f"{', '.join(TOKENIZER_FILES)})")
  for n in names:
    shutil.copyfile(os.path.join(folder, n), os.path.join(out_dir, n))


def resolve_models(cfg, tp: int):
  """``cfg`` with the architecture of every role that names a Hugging Face directory read
  from it (model, reward_model, value_model, guard_model)."""
  changes = {}
  for field in ("model", "reward_model", "value_model", "guard_model"):
    m = getattr(cfg, field)
    if m is not None and m.hf_path:
      changes[field] = resolve_hf_config(m, tp)
  return dataclasses.replace(cfg, **changes) if changes else cfg
