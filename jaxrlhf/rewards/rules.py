"""Jittable rule rewards over token arrays (``rule:NAME``), run inside the step program
(exact match and token accuracy against the reference answer), the registries' helpers, and
which sources read the reference answer."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jaxrlhf.rewards.shaping import is_eos


# fn(response_BN, response_mask_BN, answer_BA, answer_mask_BA, *, eos_id) -> float32 [B]
RuleFn = Callable[..., jax.Array]


RULES: dict[str, RuleFn] = {}


# Sources ("rule:NAME", "host:NAME") registered with needs_answer=False.  Every other rule and
# host reward is taken to compare responses with the prompt's reference answer, so a run whose
# prompts lack answers cannot use it (jaxrlhf.data.DataSource.check_answers).
_ANSWER_FREE: set[str] = set()


def _adder(table: dict, kind: str, name: str, source: str, needs_answer: bool):
  def add(fn):
    if name in table:
      raise ValueError(f"{kind} {name!r} is already registered; pick another name")
    table[name] = fn
    (_ANSWER_FREE.discard if needs_answer else _ANSWER_FREE.add)(source)
    return fn
  return add


def reads_answer(source: str) -> bool:
  """Whether reward source ``source`` (``model``, ``rule:NAME``, ``host:NAME``) needs each
  prompt's reference answer: every rule and host reward not registered with
  ``needs_answer=False``; the reward model does not."""
  if is_user_host_source(source):
    return False  # the user's function reads whichever fields it wants
  return source.partition(":")[0] in ("rule", "host") and source not in _ANSWER_FREE


def _lookup(table: dict, prefix: str, kind: str, register: str, name: str):
  if name not in table:
    raise ValueError(f"reward source '{prefix}:{name}' is not registered; registered {kind}s: "
                     f"{sorted(table)} (add one with jaxrlhf.rewards.{register})")
  return table[name]


def register_rule(name: str, *, needs_answer: bool = True):
  """Decorator adding a jittable rule reward to :data:`RULES` (source ``rule:NAME``);
  ``needs_answer=False`` for one that ignores the answer arrays (see :func:`reads_answer`)."""
  return _adder(RULES, "rule reward", name, f"rule:{name}", needs_answer)


def get_rule(name: str) -> RuleFn:
  return _lookup(RULES, "rule", "rule", "register_rule", name)


def _compact(tokens_BN, keep_BN, fill: int):
  """Kept tokens moved to the front in order, ``fill`` after them; and how many were kept."""
  order_BN = jnp.argsort(~keep_BN, axis=-1, stable=True)
  out_BN = jnp.take_along_axis(tokens_BN, order_BN, axis=-1)
  n_B = jnp.sum(keep_BN, axis=-1)
  return jnp.where(jnp.arange(tokens_BN.shape[-1]) < n_B[:, None], out_BN, fill), n_B


def _response_vs_answer(response_BN, response_mask_BN, answer_BA, answer_mask_BA, eos_id):
  """(matching positions, response length, answer length): the response is its valid tokens
  before the first end token (the end token excluded; all valid tokens if there is none),
  compared position by position with the answer's valid tokens."""
  mask_BN = jnp.asarray(response_mask_BN).astype(bool)
  ended_BN = jnp.cumsum(is_eos(response_BN, eos_id) & mask_BN, axis=-1) > 0
  resp_BN, n_r = _compact(response_BN, mask_BN & ~ended_BN, -1)
  ans_BA, n_a = _compact(answer_BA, jnp.asarray(answer_mask_BA).astype(bool), -2)
  w = max(resp_BN.shape[-1], ans_BA.shape[-1])
  resp_BW = jnp.pad(resp_BN, ((0, 0), (0, w - resp_BN.shape[-1])), constant_values=-1)
  ans_BW = jnp.pad(ans_BA, ((0, 0), (0, w - ans_BA.shape[-1])), constant_values=-2)
  matches_B = jnp.sum(resp_BW == ans_BW, axis=-1)  # the fills never match each other
  return matches_B, n_r, n_a


@register_rule("exact_match")
def exact_match(response_BN, response_mask_BN, answer_BA, answer_mask_BA, *, eos_id):
  """1.0 when the response's tokens before (excluding) the first end token equal the answer's
  valid tokens exactly, else 0.0.  ``response_mask`` covers the generated tokens including the
  end token; ``answer_mask`` covers the answer only.  A response without an end token is
  compared whole (missing-EOS handling is :func:`apply_missing_eos`'s job)."""
  matches_B, n_r, n_a = _response_vs_answer(response_BN, response_mask_BN, answer_BA,
                                            answer_mask_BA, eos_id)
  return ((n_r == n_a) & (matches_B == n_a)).astype(jnp.float32)


@register_rule("token_accuracy")
def token_accuracy(response_BN, response_mask_BN, answer_BA, answer_mask_BA, *, eos_id):
  """Partial credit: positions where the response (as in :func:`exact_match`) equals the answer,
  divided by the longer of the two lengths; 1.0 exactly when :func:`exact_match` is."""
  matches_B, n_r, n_a = _response_vs_answer(response_BN, response_mask_BN, answer_BA,
                                            answer_mask_BA, eos_id)
  return matches_B.astype(jnp.float32) / jnp.maximum(jnp.maximum(n_r, n_a), 1).astype(jnp.float32)


def is_user_host_source(source: str) -> bool:
  """``host:path/to/file.py:function`` or ``host:package.module:function`` (not a name
  registered in :data:`HOST_RULES`)."""
  kind, _, rest = source.partition(":")
  return kind == "host" and ":" in rest
