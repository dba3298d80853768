"""Writing parameters back as a checkpoint a ``transformers`` install reads: tensors, config.json
and the tokenizer."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from typing import Iterator, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.config import ModelConfig
from jaxrlhf.distributed import to_host
from jaxrlhf.model.hf.mapping import (GEMMA, HFError, INDEX_FILE, SCORE_BIAS_KEY, SINGLE_FILE,
                                      TOKENIZER_FILES, _Entry, _class_name, _entries, _hf_shape,
                                      _leaf, _sizes)
from jaxrlhf.model.hf.configs import _check_family, _raw_config


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
        yield name, _to_hf(to_host(x[i]), e, hf_sizes).astype(dtype)
    else:
      yield e.hf_names[0], _to_hf(to_host(x), e, hf_sizes).astype(dtype)


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


def rope_fields(cfg: ModelConfig, model_type: str) -> dict:
  """The rotary settings of ``cfg`` in both transformers conventions, for a ``config.json``
  that loads the same in 4.x and 5.x: 4.x reads ``rope_theta`` / ``rope_scaling`` (Gemma 3:
  and ``rope_local_base_freq``) and ignores ``rope_parameters``; 5.x reads
  ``rope_parameters``.  Either alone loads as rope theta 10000 in the other version."""
  rope = _rope_parameters(cfg)
  scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
  out = {"rope_theta": cfg.rope_theta,
         "rope_scaling": scaling if cfg.rope_scaling != "none" else None}
  if model_type == "gemma3_text":
    out["rope_local_base_freq"] = cfg.rope_local_theta or cfg.rope_theta
    out["rope_parameters"] = {"full_attention": rope,
                              "sliding_attention": _rope_parameters(cfg, local=True)}
  else:
    out["rope_parameters"] = rope
  return out


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
  score_bias = float(to_host(params["score"]["b"])) if head == "scalar" else 0.0
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
  # Whichever transformers wrote it, the file carries both rotary conventions and both dtype
  # keys (4.x: torch_dtype, 5.x: dtype), so it loads the same in 4.x and 5.x.
  path = os.path.join(out_dir, "config.json")
  with open(path, encoding="utf-8") as f:
    written = json.load(f)
  written.update(rope_fields(cfg, hf_config.model_type), torch_dtype=dtype_name,
                 dtype=dtype_name)
  with open(path, "w", encoding="utf-8") as f:
    json.dump(written, f, indent=2, sort_keys=True)
    f.write("\n")
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
