"""Low-rank adapters (LoRA) over the decoder's projections, as pure functions of pytrees.

A role trained with adapters keeps two trees: the *trainable* one, ``{"lora": {W: {"a", "b"}}}``
(plus ``"score"`` for a scalar head, which trains fully), and the frozen *base* (the whole
model, without the trained head).  :func:`view` combines them into the tree the model's
functions read: the base's arrays as they are and ``params["layers"]["lora"]``, whose ``b`` is
already multiplied by the scale, so :func:`~jaxrlhf.model.transformer.forward` adds
``(x @ a) @ b`` to each targeted projection and needs no setting of its own.  Without the
``"lora"`` entry the same base is the model with the adapters off: the reference of an RL or
DPO stage is that base, one copy for both roles.

Shapes: a projection ``W [L, *in, *out]`` gets ``a [L, *in, r]`` and ``b [L, r, *out]``, with
the logical axes of ``W``'s input and output dimensions, so the adapters shard like their
projection (the rank axis ``lora`` is never sharded).  :func:`export_peft` and
:func:`load_peft` read and write PEFT's layout (``adapter_config.json`` and
``adapter_model.safetensors`` with ``lora_A.weight [r, in]`` and ``lora_B.weight [out, r]``).
"""

from __future__ import annotations

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.config import ConfigError, LoraConfig, ModelConfig
from jaxrlhf.distributed import to_host
from jaxrlhf.model.sharded import cast_floating
from jaxrlhf.model.transformer import param_axes

# Short target name -> (our layer parameter, its number of input dimensions, the Hugging Face
# module under ``layers.{i}.``).
TARGETS = {
    "q": ("wq", 1, "self_attn.q_proj"),
    "k": ("wk", 1, "self_attn.k_proj"),
    "v": ("wv", 1, "self_attn.v_proj"),
    "o": ("wo", 2, "self_attn.o_proj"),
    "gate": ("w_gate", 1, "mlp.gate_proj"),
    "up": ("w_up", 1, "mlp.up_proj"),
    "down": ("w_down", 1, "mlp.down_proj"),
}
# Our layer parameter -> (its number of input dimensions, the Hugging Face module).
_BY_WEIGHT = {w: (n_in, module) for w, n_in, module in TARGETS.values()}
# Short target name -> PEFT's ``target_modules`` entry ("q" -> "q_proj").
_PEFT_MODULE = {t: module.split(".")[-1] for t, (_, _, module) in TARGETS.items()}
_SIZES = lambda cfg: {"layers": cfg.n_layers, "embed": cfg.d_model, "heads": cfg.n_heads,
                      "kv_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
                      "mlp": cfg.mlp_dim}


def adapter_axes(cfg: ModelConfig, lora: LoraConfig) -> dict:
  """``{"lora": {W: {"a": axes, "b": axes}}}`` for every target."""
  layers = param_axes(cfg)["layers"]
  out = {}
  for t in lora.targets:
    w, n_in, _ = TARGETS[t]
    axes = layers[w][1:]  # without "layers"
    out[w] = {"a": ("layers", *axes[:n_in], "lora"), "b": ("layers", "lora", *axes[n_in:])}
  return {"lora": out}


def trainable_axes(cfg: ModelConfig, lora: LoraConfig, head: str) -> dict:
  """The logical axes of a LoRA role's trainable tree: its adapters, and a scalar head."""
  axes = {"layers": adapter_axes(cfg, lora)}
  if head == "scalar":
    axes["score"] = param_axes(cfg, "scalar")["score"]
  return axes


def init_adapters(cfg: ModelConfig, lora: LoraConfig, key: jax.Array) -> dict:
  """Fresh adapters ``{"layers": {"lora": ...}}`` in ``cfg.param_dtype`` (a stage keeps them as
  its precision's masters, float32 by default: jaxrlhf.train.precision): ``a`` from
  ``lora.init``, ``b`` zero (so the adapted model starts as the base, exactly)."""
  sizes = {**_SIZES(cfg), "lora": lora.rank}
  dtype = jnp.dtype(cfg.param_dtype)
  out = {}
  for i, (w, ab) in enumerate(adapter_axes(cfg, lora)["lora"].items()):
    a_shape = tuple(sizes[x] for x in ab["a"])
    b_shape = tuple(sizes[x] for x in ab["b"])
    fan_in = math.prod(a_shape[1:-1])
    k = jax.random.fold_in(key, i)
    if lora.init == "gaussian":
      a = jax.random.normal(k, a_shape, jnp.float32) / lora.rank
    else:  # kaiming-uniform with a = sqrt(5), PEFT's default: bound 1 / sqrt(fan_in)
      bound = 1.0 / math.sqrt(fan_in)
      a = jax.random.uniform(k, a_shape, jnp.float32, -bound, bound)
    out[w] = {"a": a.astype(dtype), "b": jnp.zeros(b_shape, dtype)}
  return {"layers": {"lora": out}}


def split_full(params: dict) -> tuple[dict, dict]:
  """A whole model -> ``(base, head)``: the base without the scalar head, and the head (empty
  for an LM head, which stays frozen in the base)."""
  base = {k: v for k, v in params.items() if k != "score"}
  head = {"score": params["score"]} if "score" in params else {}
  return base, head


def cast_base(base: dict, dtype: str) -> dict:
  """The frozen base in ``lora.base_dtype`` (floating arrays only; "" keeps them)."""
  return cast_floating(base, dtype) if dtype else base


def view(trainable: dict, base: dict, lora: LoraConfig) -> dict:
  """The tree the model reads: ``base`` (minus a scalar head the trainable tree replaces) with
  the scaled adapters in ``layers.lora``."""
  s = lora.scale()
  adapters = {w: {"a": ab["a"], "b": ab["b"] * jnp.asarray(s, ab["b"].dtype)}
              for w, ab in trainable["layers"]["lora"].items()}
  out = {k: v for k, v in base.items() if not ("score" in trainable and k == "score")}
  out["layers"] = {**base["layers"], "lora": adapters}
  if "score" in trainable:
    out["score"] = trainable["score"]
  return out


def delta(a: jax.Array, b: jax.Array) -> jax.Array:
  """``a @ b`` over the rank, shaped like the projection: ``[L, *in, *out]``, float32."""
  a2 = a.astype(jnp.float32).reshape(a.shape[0], -1, a.shape[-1])
  b2 = b.astype(jnp.float32).reshape(b.shape[0], b.shape[1], -1)
  d = jnp.einsum("lir,lro->lio", a2, b2)
  return d.reshape(a.shape[:-1] + b.shape[2:])


def merge(trainable: dict, base: dict, lora: LoraConfig, dtype) -> dict:
  """The adapted model as plain weights: ``W + scale * a @ b`` for every target (computed in
  float32, stored in ``dtype``, the model's ``param_dtype``), the rest of the base cast to
  ``dtype``, and the trained head.  What later stages and the Hugging Face export read."""
  dt = jnp.dtype(dtype)
  full = cast_floating({k: v for k, v in base.items() if k != "score"}, dt)
  layers = dict(full["layers"])
  s = lora.scale()
  for w, ab in trainable["layers"]["lora"].items():
    layers[w] = (base["layers"][w].astype(jnp.float32) + s * delta(ab["a"], ab["b"])).astype(dt)
  full["layers"] = layers
  if "score" in trainable:
    full["score"] = trainable["score"]
  return full


# ---------------------------------------------------------------------------- PEFT layout


def _peft_name(i: int, module: str, ab: str) -> str:
  return f"base_model.model.model.layers.{i}.{module}.lora_{ab}.weight"


def export_peft(trainable: dict, cfg: ModelConfig, lora: LoraConfig, out_dir: str, *,
                base_model: str = "", dtype: str = "float32") -> str:
  """Writes the adapters as a PEFT LoRA adapter (``adapter_config.json`` +
  ``adapter_model.safetensors``) into ``out_dir``; ``base_model`` goes into the config's
  ``base_model_name_or_path``.  Returns ``out_dir``."""
  from safetensors.numpy import save_file
  tensors = {}
  for t in lora.targets:
    w, n_in, module = TARGETS[t]
    ab = trainable["layers"]["lora"][w]
    a, b = (to_host(jnp.asarray(ab[x])).astype(np.float32) for x in ("a", "b"))
    for i in range(cfg.n_layers):
      # ours: a [*in, r], b [r, *out]; PEFT: lora_A [r, in], lora_B [out, r]
      tensors[_peft_name(i, module, "A")] = np.ascontiguousarray(
          a[i].reshape(-1, lora.rank).T.astype(dtype))
      tensors[_peft_name(i, module, "B")] = np.ascontiguousarray(
          b[i].reshape(lora.rank, -1).T.astype(dtype))
  if jax.process_index() != 0:  # every process gathers (collective), process 0 writes
    return out_dir
  os.makedirs(out_dir, exist_ok=True)
  save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"),
            metadata={"format": "pt"})
  config = {
      "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
      "lora_dropout": lora.dropout, "use_rslora": lora.rslora, "bias": "none",
      "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True,
      "target_modules": sorted(_PEFT_MODULE[t] for t in lora.targets),
      "modules_to_save": None, "base_model_name_or_path": base_model or None,
  }
  with open(os.path.join(out_dir, "adapter_config.json"), "w", encoding="utf-8") as f:
    json.dump(config, f, indent=2)
  return out_dir


def read_peft_config(path: str, setting: str = "lora.init_from") -> dict:
  """``adapter_config.json`` of a PEFT adapter directory, checked to be a LoRA adapter."""
  file = os.path.join(path, "adapter_config.json")
  if not os.path.isfile(file):
    raise ConfigError(f"{setting}={path!r}: no adapter_config.json there; point it at a PEFT "
                      "adapter directory (adapter_config.json + adapter_model.safetensors)")
  from jaxrlhf.model.hf.configs import _read_json  # not valid JSON, not an object: one line
  config = _read_json(file, "")
  if config.get("peft_type", "LORA") != "LORA":
    raise ConfigError(f"{file}: peft_type={config.get('peft_type')!r}; only LoRA adapters load")
  return config


def load_peft(path: str, cfg: ModelConfig, lora: LoraConfig,
              setting: str = "lora.init_from") -> dict:
  """A PEFT LoRA adapter directory -> the adapters ``{"layers": {"lora": ...}}`` (host numpy
  arrays in ``cfg.param_dtype``).  Its rank, alpha and target modules must be the settings'
  (each mismatch named with the setting that would match it)."""
  from safetensors.numpy import load_file
  config = read_peft_config(path, setting)
  file = os.path.join(path, "adapter_config.json")
  prefix = setting.rsplit(".", 1)[0]
  wanted = sorted(_PEFT_MODULE[t] for t in lora.targets)
  modules = config.get("target_modules") or []
  if isinstance(modules, str):
    raise ConfigError(f"{file}: target_modules is a pattern ({modules!r}); list the modules")
  problems = []
  for key in ("r", "lora_alpha"):
    v = config.get(key, 8)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
      raise ConfigError(f"{file}: {key}={v!r} is not a number; write it as one (PEFT's "
                        f"save_pretrained writes e.g. \"{key}\": 16)")
  if config.get("r") != lora.rank:
    problems.append(f"r={config.get('r')} (set --set={prefix}.rank={config.get('r')})")
  if float(config.get("lora_alpha", 8)) != float(lora.alpha):
    problems.append(f"lora_alpha={config.get('lora_alpha')} "
                    f"(set --set={prefix}.alpha={config.get('lora_alpha')})")
  if bool(config.get("use_rslora", False)) != lora.rslora:
    problems.append(f"use_rslora={config.get('use_rslora')} (set {prefix}.rslora to match)")
  if sorted(modules) != wanted:
    unknown = [m for m in modules if m not in _PEFT_MODULE.values()]
    same = ",".join(t for t in TARGETS if _PEFT_MODULE[t] in modules)
    fix = (f"adapters on {', '.join(unknown)} have no counterpart here" if unknown else
           f"set --set={prefix}.targets={same}")
    problems.append(f"target_modules={sorted(modules)} against {wanted} ({fix})")
  if problems:
    raise ConfigError(f"{file} does not match {prefix}: " + "; ".join(problems))
  weights = os.path.join(path, "adapter_model.safetensors")
  if not os.path.isfile(weights):
    raise ConfigError(f"{setting}={path!r}: no adapter_model.safetensors there")
  from jaxrlhf.model.hf.mapping import safetensors_errors
  with safetensors_errors(weights, "the adapter"):
    tensors = load_file(weights)
  dtype = np.dtype(cfg.param_dtype) if cfg.param_dtype != "bfloat16" else jnp.bfloat16
  sizes = {**_SIZES(cfg), "lora": lora.rank}
  out = {}
  for w, ab in adapter_axes(cfg, lora)["lora"].items():
    module = _BY_WEIGHT[w][1]
    a_shape = tuple(sizes[x] for x in ab["a"])
    b_shape = tuple(sizes[x] for x in ab["b"])
    a_layers, b_layers = [], []
    for i in range(cfg.n_layers):
      names = _peft_name(i, module, "A"), _peft_name(i, module, "B")
      missing = [n for n in names if n not in tensors]
      if missing:
        raise ConfigError(f"{weights}: no tensor {missing[0]} (an adapter for another model, "
                          f"or saved with another prefix)")
      a, b = (np.asarray(tensors[n], np.float32) for n in names)
      want_a = (lora.rank, math.prod(a_shape[1:-1]))
      want_b = (math.prod(b_shape[2:]), lora.rank)
      if a.shape != want_a or b.shape != want_b:
        raise ConfigError(f"{weights}: {names[0]} is {list(a.shape)} and {names[1]} "
                          f"{list(b.shape)}, but this model's {module} needs {list(want_a)} "
                          f"and {list(want_b)}: an adapter for another model size")
      a_layers.append(a.T.reshape(a_shape[1:]))
      b_layers.append(b.T.reshape(b_shape[1:]))
    out[w] = {"a": np.stack(a_layers).astype(dtype), "b": np.stack(b_layers).astype(dtype)}
  return {"layers": {"lora": out}}
