"""Reading a checkpoint (safetensors, one file or sharded) into its shardings on the mesh."""

from __future__ import annotations

import contextlib
import math
import os
import re
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.config import ModelConfig
from jaxrlhf.mesh import PARAM_RULES, Rules
from jaxrlhf.model.sharded import abstract_params, init_sharded, param_shardings
from jaxrlhf.model.hf.mapping import (HFError, INDEX_FILE, SCORE_BIAS_KEY, SINGLE_FILE, _Entry,
                                      _IGNORED, _describe, _entries, _hf_shape, _leaf, _set_leaf,
                                      _sizes, safetensors_errors)
from jaxrlhf.model.hf.configs import _check_config, _check_family, _raw_config, _read_json


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
      with safetensors_errors(os.path.join(path, file)):
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

  def read(self, name: str, index) -> np.ndarray:
    """The block ``index`` of tensor ``name``; a file that fails to read is an HFError."""
    with safetensors_errors(os.path.join(self.path, self.tensors[name][0])):
      return np.asarray(self.slice(name)[index])


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
  block = ckpt.read(name, tuple(hf_index))
  block = block.reshape(shapes)[tuple(inner_index)]
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
