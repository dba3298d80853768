"""A checkpoint's config.json as a :class:`~jaxrlhf.config.ModelConfig` (each family's fields,
rope settings, and a clear error for what is not supported), and back for a role's model."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

from jaxrlhf.config import ModelConfig, one_line
from jaxrlhf.model.hf.mapping import (FAMILIES, GEMMA, HFError, SUPPORTED_ARCHITECTURES,
                                      _HEAD_CLASSES, _class_name)


def _read_json(path: str, what: str) -> dict:
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  except FileNotFoundError:
    raise HFError(f"{path}: not found; {what}") from None
  except ValueError as e:  # JSONDecodeError, UnicodeDecodeError (a binary file)
    raise HFError(f"{path}: not valid JSON ({one_line(e)}); the file is damaged or cut short: "
                  f"copy or download it again") from None
  if not isinstance(data, dict):
    raise HFError(f"{path}: holds a JSON {type(data).__name__}, not an object of settings; "
                  f"copy or download it again")
  return data


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

  def value(key: str, kind=float):
    v = rope.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
      raise HFError(f"{where}: {field} (rope_type {rope_type!r}) "
                    + (f"has no {key!r}" if v is None else f"{key}={v!r} is not a number")
                    + f"; rope_type {rope_type!r} needs {key} as a number (copy the model's "
                      f"original config.json, or remove the rope scaling for the base "
                      f"context length)")
    return kind(v)

  scaling = {"rope_scaling": "none"}
  if rope_type in ("linear", "llama3"):
    scaling = {"rope_scaling": rope_type, "rope_factor": value("factor")}
  if rope_type == "llama3":
    scaling.update(rope_low_freq_factor=value("low_freq_factor"),
                   rope_high_freq_factor=value("high_freq_factor"),
                   rope_original_max_len=value("original_max_position_embeddings", int))
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
  where = f"{path}/config.json"
  _check_numbers(raw, where)
  try:
    hf = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
  except Exception as e:  # noqa: BLE001  (its validation's errors, KeyError, ValueError...)
    raise HFError(f"{where}: transformers cannot read this config ({one_line(e, 300)}); fix "
                  f"the field it names in config.json (the model's original config.json has "
                  f"the right one)") from None
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


# config.json fields read as sizes (a positive integer, or null where optional) and as numbers.
_COUNTS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
           "max_position_embeddings", "vocab_size")
_OPTIONAL_COUNTS = ("num_key_value_heads", "head_dim", "sliding_window")
_NUMBERS = ("rms_norm_eps", "rope_theta")


def _check_numbers(raw: dict, where: str) -> None:
  """The sizes and numbers this model reads from config.json, checked for their JSON types
  (a size written as a string, ``"128"``, is a mistake to name, not to guess at)."""
  for name in _COUNTS + _OPTIONAL_COUNTS + _NUMBERS:
    if name not in raw or (raw[name] is None and name not in _COUNTS):
      continue
    v = raw[name]
    if name in _NUMBERS:
      ok = isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
      rule = "a number > 0"
    else:
      ok = isinstance(v, int) and not isinstance(v, bool) and v >= (0 if name ==
                                                                      "sliding_window" else 1)
      rule = "a positive integer"
    if not ok:
      shown = f"{v!r} (a JSON string)" if isinstance(v, str) else json.dumps(v)
      fix = (f"write it without quotes, \"{name}\": {v.strip()}"
             if isinstance(v, str) and v.strip().isdigit() and int(v) > 0 else
             f"write {rule} there")
      raise HFError(f"{where}: \"{name}\" is {shown}, not {rule}; {fix} (the model's original "
                    f"config.json has the right value)")


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


def resolve_models(cfg, tp: Optional[int] = None):
  """``cfg`` with the architecture of every role that names a Hugging Face directory read
  from it (model, reward_model, value_model, guard_model).

  ``tp``: the tensor-parallel size the vocabulary is padded for (default ``cfg.mesh.tp``).  With
  ``mesh.tp=-1`` the size depends on the devices present, unknown before jax starts: the
  vocabulary is left unpadded here and the run pads it once its mesh exists (resolving again
  is harmless: every architecture field is read from the checkpoint anew).  Called before any
  check (``jaxrlhf.main.resolve_config``, ``pipeline.run``), so ``validate``, the preflight,
  ``--plan`` and ``--print_config`` all see the checkpoint's model, not a template's
  placeholder."""
  if tp is None:
    tp = cfg.mesh.tp if cfg.mesh.tp > 0 else 1
  changes = {}
  for field in ("model", "reward_model", "value_model", "guard_model"):
    m = getattr(cfg, field)
    if m is not None and m.hf_path:
      changes[field] = resolve_hf_config(m, tp)
  return dataclasses.replace(cfg, **changes) if changes else cfg
