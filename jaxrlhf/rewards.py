"""Reward sources and reward post-processing.

Sources come in two kinds (DESIGN.md): jittable rule functions over token arrays (:data:`RULES`,
run inside the step program, like the learned reward model's scalar head) and host functions
over decoded strings (arbitrary Python, run between two programs): registered ones
(:data:`HOST_RULES`, e.g. the math verifier) or the user's own, ``host:path/to/file.py:function``
and ``host:package.module:function`` (:func:`resolve_host_reward`, :func:`score_host`).  Several
sources combine with weights (:func:`combine_rewards`).  Then, in this order: missing-EOS
handling, the reward-hacking guard, and normalisation with non-finite rewards masked out and
counted.  Every jittable function here is a pure array function; configs stay outside.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
import threading
from typing import Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxrlhf import registry  # the loader of users' files (it imports config only)
from jaxrlhf.algorithms.stats import masked_moments
from jaxrlhf.config import ConfigError

NORMALIZE_MODES = ("none", "batch", "running")
GUARD_ACTIONS = ("penalty", "mask")
MISSING_EOS_MODES = ("none", "penalty", "mask")


def _check(name, value, choices):
  if value not in choices:
    raise ValueError(f"{name}={value!r} is not valid; choose one of {choices}")


# -------------------------------------------------------------------------- normalisation


@struct.dataclass
class RunningStats:
  """Running reward mean/variance (Welford / Chan et al. merge), kept in the train state."""
  count: jax.Array  # int32 scalar: rewards seen
  mean: jax.Array  # float32 scalar
  m2: jax.Array  # float32 scalar: sum of squared deviations from the mean

  @property
  def std(self):
    """Unbiased (ddof=1) standard deviation; 0 before two rewards were seen."""
    n = self.count.astype(jnp.float32)
    return jnp.where(n > 1, jnp.sqrt(jnp.maximum(self.m2, 0.0) / jnp.maximum(n - 1.0, 1.0)), 0.0)


def init_running_stats() -> RunningStats:
  return RunningStats(count=jnp.zeros((), jnp.int32), mean=jnp.zeros((), jnp.float32),
                      m2=jnp.zeros((), jnp.float32))


def update_running_stats(stats: RunningStats, r_B, valid_B) -> RunningStats:
  """Merges the valid rewards of a batch (under jit on a sharded array: the global batch)."""
  valid_B = jnp.asarray(valid_B).astype(bool)
  r_B = jnp.where(valid_B, jnp.asarray(r_B, jnp.float32), 0.0)
  mean_b, _, n_b = (v.reshape(()) for v in masked_moments(r_B, valid_B))
  m2_b = jnp.sum(jnp.square(jnp.where(valid_B, r_B - mean_b, 0.0)))
  n_a = stats.count.astype(jnp.float32)
  n = n_a + n_b
  delta = mean_b - stats.mean
  frac = n_b / jnp.maximum(n, 1.0)
  return RunningStats(count=stats.count + n_b.astype(jnp.int32),
                      mean=stats.mean + delta * frac,
                      m2=stats.m2 + m2_b + jnp.square(delta) * n_a * frac)


def finite_rewards(r_B, valid_B=None):
  """``(r_B, valid_B)`` with non-finite rewards set to 0 and marked invalid.  Rows to keep in
  the update after :func:`normalize_rewards` are exactly these ``valid_B``."""
  r_B = jnp.asarray(r_B, jnp.float32)
  valid_B = jnp.ones(r_B.shape, bool) if valid_B is None else jnp.asarray(valid_B).astype(bool)
  finite_B = jnp.isfinite(r_B)
  return jnp.where(finite_B & valid_B, r_B, 0.0), valid_B & finite_B


def normalize_rewards(r_B, valid_B, *, mode: str = "none", stats: Optional[RunningStats] = None,
                      clip: float = 0.0, eps: float = 1e-8):
  """Normalises sequence rewards; returns ``(r_B, stats, metrics)``.

  Non-finite rewards are masked out first (reward 0, excluded from every statistic, counted in
  ``metrics["reward/nonfinite"]``); the caller drops them from the update with
  ``finite_rewards(r_in, valid_B)[1]``.  Then:
    none:     unchanged.
    batch:    ``(r - mean) / (std + eps)`` over the valid rows of the whole (global) batch.
    running:  ``stats`` is first updated with this batch, then ``(r - mean) / (std + eps)`` with
              the running mean and unbiased std.
  ``clip > 0`` clips the result to ``[-clip, clip]``.  Invalid rows come back as 0.  Metrics
  (float32): ``reward/nonfinite``, ``reward/raw_mean``, ``reward/raw_std``, ``reward/mean``,
  ``reward/clip_frac``.
  """
  _check("reward normalize", mode, NORMALIZE_MODES)
  r_in = jnp.asarray(r_B, jnp.float32)
  given_B = jnp.ones(r_in.shape, bool) if valid_B is None else jnp.asarray(valid_B).astype(bool)
  r_B, valid_B = finite_rewards(r_in, given_B)
  raw_mean, raw_std, _ = (v.reshape(()) for v in masked_moments(r_B, valid_B))
  if mode == "batch":
    out_B = (r_B - raw_mean) / (raw_std + eps)
  elif mode == "running":
    if stats is None:
      raise ValueError("reward normalize='running' needs stats=init_running_stats() (kept in "
                       "the train state)")
    stats = update_running_stats(stats, r_B, valid_B)
    out_B = (r_B - stats.mean) / (stats.std + eps)
  else:
    out_B = r_B
  if clip and clip > 0:
    clipped_B = jnp.abs(out_B) > clip
    out_B = jnp.clip(out_B, -clip, clip)
  else:
    clipped_B = jnp.zeros(out_B.shape, bool)
  out_B = jnp.where(valid_B, out_B, 0.0)
  n_valid = jnp.maximum(jnp.sum(valid_B), 1).astype(jnp.float32)
  metrics = {
      "reward/nonfinite": jnp.sum(given_B & ~jnp.isfinite(r_in)).astype(jnp.float32),
      "reward/raw_mean": raw_mean,
      "reward/raw_std": raw_std,
      "reward/mean": jnp.sum(out_B) / n_valid,
      "reward/clip_frac": jnp.sum(clipped_B & valid_B).astype(jnp.float32) / n_valid,
  }
  return out_B, stats, metrics


# ---------------------------------------------------------------- guard and missing EOS


def apply_guard(r_B, guard_score_B, *, threshold: float, action: str = "penalty",
                penalty: float = -1.0, valid_B=None):
  """Reward-hacking guard: a generation whose guard score exceeds ``threshold`` (or is NaN: an
  unscorable generation is not trusted) is flagged.  ``penalty`` adds ``penalty`` to its reward;
  ``mask`` drops it from the update.  Returns ``(r_B, keep_B, metrics)`` with
  ``guard/flag_rate`` (over ``valid_B`` rows, default all) and ``guard/score_mean``."""
  _check("guard action", action, GUARD_ACTIONS)
  r_B = jnp.asarray(r_B, jnp.float32)
  score_B = jnp.asarray(guard_score_B, jnp.float32)
  valid_B = jnp.ones(r_B.shape, bool) if valid_B is None else jnp.asarray(valid_B).astype(bool)
  flagged_B = (score_B > threshold) | jnp.isnan(score_B)
  if action == "penalty":
    r_B = r_B + jnp.where(flagged_B, jnp.float32(penalty), 0.0)
    keep_B = jnp.ones(r_B.shape, bool)
  else:
    keep_B = ~flagged_B
  n_valid = jnp.maximum(jnp.sum(valid_B), 1).astype(jnp.float32)
  metrics = {
      "guard/flag_rate": jnp.sum(flagged_B & valid_B).astype(jnp.float32) / n_valid,
      "guard/score_mean": jnp.sum(jnp.where(valid_B & ~jnp.isnan(score_B), score_B, 0.0))
                          / n_valid,
  }
  return r_B, keep_B, metrics


def apply_missing_eos(r_B, has_eos_B, *, mode: str = "none", penalty: float = -1.0):
  """Sequences that ended without EOS (over-long): ``penalty`` adds ``penalty`` to the reward,
  ``mask`` drops them from the update, ``none`` leaves them.  Returns ``(r_B, keep_B)``."""
  _check("missing_eos", mode, MISSING_EOS_MODES)
  r_B = jnp.asarray(r_B, jnp.float32)
  has_eos_B = jnp.asarray(has_eos_B).astype(bool)
  keep_B = jnp.ones(r_B.shape, bool)
  if mode == "penalty":
    r_B = r_B + jnp.where(has_eos_B, 0.0, jnp.float32(penalty))
  elif mode == "mask":
    keep_B = has_eos_B
  return r_B, keep_B


def is_eos(tokens, eos_id: Union[int, Sequence[int]]):
  """True where ``tokens`` is an end token; ``eos_id`` is one id or several (stop tokens)."""
  ids = (eos_id,) if isinstance(eos_id, (int, np.integer)) else tuple(eos_id)
  if not ids:
    raise ValueError("eos_id: give at least one end-of-sequence token id")
  out = jnp.zeros(jnp.shape(tokens), bool)
  for i in ids:
    out = out | (tokens == i)
  return out


def has_eos(response_BN, response_mask_BN, *, eos_id):
  """Whether each response contains an end token among its valid positions, ``[B]`` bool."""
  return jnp.any(is_eos(response_BN, eos_id) & jnp.asarray(response_mask_BN).astype(bool), -1)


def combine_rewards(rewards: Sequence, weights: Sequence[float]):
  """``sum_i weights[i] * rewards[i]`` over ``[B]`` arrays.  Zero-weight sources are skipped,
  so a NaN from a source switched off cannot poison the sum (0 * NaN = NaN)."""
  if len(rewards) == 0 or len(rewards) != len(weights):
    raise ValueError(f"reward sources and weights must align: {len(rewards)} sources, "
                     f"{len(weights)} weights (set reward.weights to one weight per source)")
  total = jnp.zeros(jnp.shape(rewards[0]), jnp.float32)
  for r, w in zip(rewards, weights):
    if w != 0:
      total = total + jnp.float32(w) * jnp.asarray(r, jnp.float32)
  return total


# --------------------------------------------------------------------- jittable rule rewards

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


# ---------------------------------------------------------------------------- host rewards

# fn(responses: list[str], examples: list[dict]) -> list[float | None], one score per response.
# examples[i] is the example response i answers (each prompt's example repeated once per
# sample): its "prompt", "answer" and every other field of the data row (tests, metadata...).
# None or NaN: unscorable (masked out of the update and counted).
HostFn = Callable[[list, list], list]
HOST_RULES: dict[str, HostFn] = {}
HOST_ERROR_POLICIES = ("mask", "raise")
HOST_SIGNATURE = "fn(responses: list[str], examples: list[dict]) -> list[float]"


def register_host_reward(name: str, *, needs_answer: bool = True):
  """Decorator adding a host reward function to :data:`HOST_RULES` (source ``host:NAME``),
  called as :data:`HOST_SIGNATURE`; ``needs_answer=False`` for one that ignores each
  example's ``"answer"`` (see :func:`reads_answer`)."""
  return _adder(HOST_RULES, "host reward", name, f"host:{name}", needs_answer)


def get_host_reward(name: str) -> HostFn:
  return _lookup(HOST_RULES, "host", "host reward", "register_host_reward", name)


@dataclasses.dataclass(frozen=True)
class HostReward:
  """A resolved ``host:...`` reward source: the function and how errors name it."""

  source: str  # as written in reward.sources
  fn: HostFn = dataclasses.field(repr=False)
  where: str  # "my_reward.py:score", "pkg.mod:score" or "host reward 'exact_match'"
  path: str = ""  # the user's file, when it came from one (for the line of an exception)


def is_user_host_source(source: str) -> bool:
  """``host:path/to/file.py:function`` or ``host:package.module:function`` (not a name
  registered in :data:`HOST_RULES`)."""
  kind, _, rest = source.partition(":")
  return kind == "host" and ":" in rest


def resolve_host_reward(source: str, setting: str = "reward.sources") -> HostReward:
  """Turns ``host:NAME``, ``host:path/to/file.py:function`` or ``host:package.module:function``
  into a checked :class:`HostReward`; raises ConfigError naming ``setting``, the file, the
  function and the fix (file not found, no such function, not callable, a signature that cannot
  take ``(responses, examples)``)."""
  kind, _, rest = source.partition(":")
  if kind != "host" or not rest:
    raise ConfigError(f"{setting}: {source!r} is not a host reward; write host:NAME, "
                      f"host:path/to/file.py:function or host:package.module:function")
  if ":" not in rest:
    if rest not in HOST_RULES:
      raise ConfigError(f"{setting}: {source!r}: no host reward {rest!r} is registered "
                        f"(registered: {', '.join(sorted(HOST_RULES))}); for your own function "
                        f"write host:path/to/file.py:function or host:package.module:function")
    return HostReward(source, HOST_RULES[rest], f"host reward {rest!r}")
  target, _, fname = rest.rpartition(":")
  what = f"{setting}: {source}"
  if not fname.isidentifier():
    raise ConfigError(f"{what}: {fname!r} is not a function name; write "
                      f"host:path/to/file.py:function")
  if target.endswith(".py"):
    module, path = registry.load_python_file(target, what), target
    where = f"{target}:{fname}"
  else:
    if "/" in target or os.sep in target:
      raise ConfigError(f"{what}: {target} is not a .py file nor a module name; write "
                        f"host:path/to/file.py:function or host:package.module:function")
    module, path = registry.import_module(target, what), ""
    where = f"{target}:{fname}"
  if not hasattr(module, fname):
    defined = sorted(n for n, v in vars(module).items()
                     if callable(v) and not n.startswith("_")
                     and getattr(v, "__module__", None) == module.__name__)
    raise ConfigError(f"{what}: {target} defines no {fname!r}"
                      + (f" (its functions: {', '.join(defined)})" if defined else "")
                      + f"; define {HOST_SIGNATURE} there, or fix the name after the last ':'")
  fn = getattr(module, fname)
  if not callable(fn):
    raise ConfigError(f"{what}: {where} is a {type(fn).__name__}, not a function; it must be "
                      f"{HOST_SIGNATURE}")
  try:
    sig = inspect.signature(fn)
  except (TypeError, ValueError):
    sig = None  # some builtins have none: the first call will tell
  if sig is not None:
    try:
      sig.bind([], [])
    except TypeError:
      raise ConfigError(f"{what}: {where}{sig} cannot be called with (responses, examples); a "
                        f"host reward is {HOST_SIGNATURE}") from None
  return HostReward(source, fn, where, path)


@dataclasses.dataclass(frozen=True)
class HostScores:
  """What a host reward gave a batch: ``scores`` float32 ``[B]`` (NaN where it gave None or
  NaN, raised, or returned something that is not a number: masked downstream), and counts."""

  scores: np.ndarray
  errors: int = 0  # responses whose scoring raised an exception
  invalid: int = 0  # values that were not numbers (a string, a list, ...)
  unscored: int = 0  # None or non-finite values (the function's own "cannot score")

  def metrics(self, prefix: str = "reward/host") -> dict:
    return {f"{prefix}_errors": float(self.errors), f"{prefix}_invalid": float(self.invalid),
            f"{prefix}_unscored": float(self.unscored)}


_WARNED: set[str] = set()  # sources whose first masked failure was already reported


def _describe_exception(reward: HostReward, e: BaseException) -> str:
  where = registry.user_frame(e, reward.path) if reward.path else ""
  return f"{type(e).__name__}: {e}{where}"


def _call(reward: HostReward, responses: list, examples: list):
  out = reward.fn(responses, examples)
  if isinstance(out, (str, bytes, dict)) or not hasattr(out, "__len__"):
    raise ConfigError(f"{reward.where} returned {type(out).__name__} {str(out)[:60]!r}; a host "
                      f"reward returns a list with one float per response "
                      f"({len(responses)} here): {HOST_SIGNATURE}")
  out = list(np.asarray(out).reshape(-1)) if hasattr(out, "shape") else list(out)
  if len(out) != len(responses):
    # Never broadcast: one score for a batch of responses is a bug in the function.
    raise ConfigError(f"{reward.where} returned {len(out)} score(s) for {len(responses)} "
                      f"responses; return one float per response, in order "
                      f"({HOST_SIGNATURE})")
  return out


def score_host(reward: HostReward, responses: Sequence[str], examples: Sequence[dict],
               num_samples: int = 1, on_error: str = "mask") -> HostScores:
  """Runs a host reward on a batch: ``responses[i]`` answers ``examples[i // num_samples]``
  (every field of the data row, as a dict).  Returns float32 scores with failures masked as
  NaN and counted; ``on_error="raise"`` stops at the first exception or non-number instead
  (ConfigError naming the function, the response and the fix).  A wrong number of scores always
  stops.  When a batch call raises, each response is scored alone, so one bad response masks
  only itself."""
  _check("reward.host_errors", on_error, HOST_ERROR_POLICIES)
  responses = [str(r) for r in responses]
  rows = [dict(ex) for ex in examples for _ in range(num_samples)]
  if len(rows) != len(responses):
    raise ValueError(f"{reward.where}: {len(responses)} responses for {len(examples)} examples x "
                     f"{num_samples} samples")
  n = len(responses)
  errors = 0
  failure = ""
  raised = object()  # the value of a response whose scoring raised
  try:
    values = _call(reward, responses, rows)
  except ConfigError:
    raise
  except Exception as e:  # noqa: BLE001  (the user's code)
    if on_error == "raise":
      raise ConfigError(f"{reward.where} raised {_describe_exception(reward, e)} on a batch of "
                        f"{n} responses; fix the function, or set reward.host_errors=mask to "
                        f"score such responses as masked (counted in reward/host_errors)") from e
    values = []
    for i in range(n):  # one at a time: find the responses that fail
      try:
        values.extend(_call(reward, responses[i:i + 1], rows[i:i + 1]))
      except ConfigError:
        raise
      except Exception as e1:  # noqa: BLE001
        values.append(raised)
        errors += 1
        failure = failure or f"response {i}: {_describe_exception(reward, e1)}"
  scores = np.full(n, np.nan, np.float32)
  invalid = unscored = 0
  for i, v in enumerate(values):
    if v is raised:
      continue
    if v is None:
      unscored += 1
      continue
    # Numbers and booleans (a pass/fail check: 1.0 / 0.0); strings are not parsed.
    if not isinstance(v, (int, float, np.integer, np.floating, np.bool_)):
      if on_error == "raise":
        raise ConfigError(f"{reward.where} returned {v!r} ({type(v).__name__}) for response {i}; "
                          f"return a float (or None when it cannot score), or set "
                          f"reward.host_errors=mask")
      invalid += 1
      failure = failure or f"response {i}: returned {v!r} ({type(v).__name__}), not a float"
      continue
    scores[i] = float(v)
    unscored += int(not math.isfinite(float(v)))
  if failure and reward.source not in _WARNED:
    # Masked, counted in the metrics, and said once on the console: never silent.
    _WARNED.add(reward.source)
    print(f"warning: {reward.where}: {errors + invalid} of {n} responses could not be scored "
          f"(first, {failure}); they are masked out of the update and counted in "
          f"reward/host_errors and reward/host_invalid (set reward.host_errors=raise to stop "
          f"instead)", flush=True)
  return HostScores(scores, errors, invalid, unscored)


def run_host_reward(name: str, responses: Sequence[str], answers: Sequence[str]) -> np.ndarray:
  """A registered host reward on responses and their answers only: float32 ``[B]``, with None
  (unscorable) as NaN; a function that fails stops here (``on_error="raise"``)."""
  return score_host(resolve_host_reward(f"host:{name}"), responses,
                    [{"answer": a} for a in answers], on_error="raise").scores


@register_host_reward("exact_match")
def host_exact_match(responses: list, examples: list) -> list:
  """1.0 when the decoded response equals the answer after stripping surrounding whitespace."""
  if len(responses) != len(examples):
    raise ValueError(f"exact_match: {len(responses)} responses but {len(examples)} examples")
  return [1.0 if r.strip() == str(ex.get("answer", "")).strip() else 0.0
          for r, ex in zip(responses, examples)]


# ------------------------------------------------------------------------ math verification

_BOXED = "\\boxed"


def boxed_answers(text: str) -> list[str]:
  """The contents of every ``\\boxed{...}`` in ``text`` (braces balanced), in order."""
  out, start = [], 0
  while (i := text.find(_BOXED, start)) >= 0:
    j = i + len(_BOXED)
    while j < len(text) and text[j] == " ":
      j += 1
    if j >= len(text) or text[j] != "{":
      start = j
      continue
    depth, k = 0, j
    while k < len(text):
      depth += {"{": 1, "}": -1}.get(text[k], 0)
      if depth == 0:
        break
      k += 1
    if depth:  # unclosed: not an answer
      break
    out.append(text[j + 1:k])
    start = k + 1
  return out


def _math_verify():
  try:
    import math_verify
  except ImportError:
    raise ConfigError("host:math_verify needs the math-verify package; pip install "
                      "'jaxrlhf[math]' (or pip install 'math-verify[antlr4_13_2]')") from None
  return math_verify


def _timeout():
  # math-verify bounds its parsing with SIGALRM, which only the main thread may set.
  return 5 if threading.current_thread() is threading.main_thread() else None


def _parse_math(mv, text: str, **kw):
  return mv.parse(text, parsing_timeout=_timeout(), **kw)


def _parse_reference(mv, answer: str) -> list:
  """The reference answer as values: plain ("0.5", "1/2") or LaTeX ("\\frac{1}{2}"), with
  no fallback to the raw string (an answer it cannot read is unscorable, not a string to
  match)."""
  strict = dict(fallback_mode="no_fallback")
  return _parse_math(mv, answer, **strict) or _parse_math(mv, f"${answer}$", **strict)


@register_host_reward("math_verify")
def math_verify_reward(responses: list, examples: list) -> list:
  """1.0 when the response's final answer (a ``\\boxed{}`` one first, else the last value it
  states) equals the example's ``"answer"`` by value (``\\frac{1}{2}`` = ``0.5`` = ``1/2``,
  units and trailing text ignored), with the ``math-verify`` library; 0.0 otherwise; None (masked)
  when the reference answer itself cannot be parsed."""
  mv = _math_verify()
  gold_cache: dict[str, list] = {}
  out = []
  for r, ex in zip(responses, examples):
    answer = str(ex.get("answer", ""))
    if answer not in gold_cache:
      gold_cache[answer] = _parse_reference(mv, answer)
    gold = gold_cache[answer]
    if not gold:
      out.append(None)
      continue
    pred = _parse_math(mv, r)
    t = _timeout()
    out.append(1.0 if pred and mv.verify(gold, pred, timeout_seconds=t) else 0.0)
  return out


@register_host_reward("math_format", needs_answer=False)
def math_format_reward(responses: list, examples: list) -> list:
  """1.0 when the response gives exactly one non-empty ``\\boxed{...}`` answer, else 0.0: a
  small shaping term to add to ``host:math_verify`` (e.g. weights 1.0 and 0.1)."""
  del examples
  return [1.0 if len(b := boxed_answers(r)) == 1 and b[0].strip() else 0.0 for r in responses]
