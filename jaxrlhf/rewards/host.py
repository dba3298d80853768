"""Host rewards over decoded strings (``host:NAME``, ``host:path/to/file.py:function``,
``host:package.module:function``): resolving a source to a checked function, and scoring a
batch with failures (an exception, a non-number, a call past ``reward.timeout_s``) masked and
counted."""

from __future__ import annotations

import dataclasses
import inspect
import math
import time
from typing import Callable, Optional, Sequence

import numpy as np

from jaxrlhf import registry, usercode
from jaxrlhf.config import ConfigError, RewardConfig
from jaxrlhf.rewards.shaping import _check
from jaxrlhf.rewards.rules import _adder, _lookup


# fn(responses: list[str], examples: list[dict]) -> list[float | None], one score per response.
# examples[i] is the example response i answers (each prompt's example repeated once per
# sample): its "prompt", "answer" and every other field of the data row (tests, metadata...).
# None or NaN: unscorable (masked out of the update and counted).
HostFn = Callable[[list, list], list]


HOST_RULES: dict[str, HostFn] = {}


HOST_ERROR_POLICIES = ("mask", "raise")


HOST_SIGNATURE = "fn(responses: list[str], examples: list[dict]) -> list[float]"

# TRL GRPOTrainer's convention, also accepted (chosen by the signature: a parameter named
# ``completions``, or only ``**kwargs``).  Every argument comes by keyword, one list entry per
# response: ``completions`` (strings; for chat prompts each a one-message list
# ``[{"role": "assistant", "content": ...}]``), ``prompts`` (strings, or message lists),
# ``completion_ids`` (each response's token ids up to and including its EOS), every column of
# the data row but ``prompt`` under its own name (``answer=[...]``, ``solution=[...]``), and
# ``trainer_state=None`` (jaxrlhf has no transformers TrainerState).  A function without
# ``**kwargs`` gets only the arguments it names.
TRL_SIGNATURE = "fn(completions, **kwargs) -> list[float]"

# The keyword arguments jaxrlhf passes in the TRL convention besides the data columns.
TRL_ARGUMENTS = ("completions", "prompts", "completion_ids", "trainer_state")


# Registered host rewards that bound their own time (jaxrlhf's built-ins): called on the
# calling thread, not on a daemon thread under reward.timeout_s (math_verify bounds each parse
# with SIGALRM, which works on the main thread only).
_BOUNDED: set[str] = set()


def register_host_reward(name: str, *, needs_answer: bool = True, bounded: bool = False):
  """Decorator adding a host reward function to :data:`HOST_RULES` (source ``host:NAME``),
  called as :data:`HOST_SIGNATURE`; ``needs_answer=False`` for one that ignores each
  example's ``"answer"`` (see :func:`reads_answer`); ``bounded=True`` for one that returns in
  bounded time by itself, which then runs on the calling thread without
  ``reward.timeout_s``."""
  add = _adder(HOST_RULES, "host reward", name, f"host:{name}", needs_answer)

  def deco(fn):
    fn = add(fn)
    (_BOUNDED.add if bounded else _BOUNDED.discard)(name)
    return fn

  return deco


def get_host_reward(name: str) -> HostFn:
  return _lookup(HOST_RULES, "host", "host reward", "register_host_reward", name)


@dataclasses.dataclass(frozen=True)
class HostReward:
  """A resolved ``host:...`` reward source: the function and how errors name it."""

  source: str  # as written in reward.sources
  fn: HostFn = dataclasses.field(repr=False)
  where: str  # "my_reward.py:score", "pkg.mod:score" or "host reward 'exact_match'"
  path: str = ""  # the user's file, when it came from one (for the line of an exception)
  # How it is called: "examples" (HOST_SIGNATURE) or "trl" (TRL_SIGNATURE, keywords).
  style: str = "examples"
  # style "trl" without **kwargs: the keyword names it takes (None: it takes any), and those
  # of them without a default (each must be supplied).
  takes: Optional[tuple] = None
  needs: tuple = ()
  # Bounds its own time (register_host_reward(bounded=True)): called without reward.timeout_s.
  bounded: bool = False


def calling_style(fn, where: str) -> tuple[str, Optional[tuple], tuple]:
  """How a host reward is called, read from its signature: ``("examples", None, ())`` for
  :data:`HOST_SIGNATURE`; ``("trl", takes, needs)`` for TRL GRPOTrainer's
  :data:`TRL_SIGNATURE` (a parameter named ``completions`` and none named ``examples``, or
  only keyword arguments); ConfigError (one line) for a signature that fits neither."""
  try:
    sig = inspect.signature(fn)
  except (TypeError, ValueError):
    return "examples", None, ()  # no signature to read (a builtin): the first call will tell
  params = sig.parameters
  kinds = inspect.Parameter
  var_kw = any(p.kind == kinds.VAR_KEYWORD for p in params.values())
  named = {n: p for n, p in params.items()
           if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)}
  positional_only = [n for n, p in params.items() if p.kind == kinds.POSITIONAL_ONLY
                     and p.default is p.empty]
  var_pos = any(p.kind == kinds.VAR_POSITIONAL for p in params.values())
  # fn(**kwargs) (every named parameter optional): nothing but TRL's keywords can reach it.
  keywords_only = var_kw and not var_pos and all(p.default is not p.empty
                                                 for p in named.values())
  trl = ("completions" in named and "examples" not in params) or keywords_only
  if trl and not positional_only:
    needs = tuple(n for n, p in named.items() if p.default is p.empty)
    return "trl", (None if var_kw else tuple(named)), needs
  if not registry.signature_refusing(fn, [], []):
    return "examples", None, ()
  raise ConfigError(f"{where}{sig} fits neither host reward signature: write "
                    f"{HOST_SIGNATURE}, or TRL's {TRL_SIGNATURE} (keyword arguments "
                    f"{', '.join(TRL_ARGUMENTS)} and the data columns)")


def resolve_host_reward(source: str, setting: str = "reward.sources") -> HostReward:
  """Turns ``host:NAME``, ``host:path/to/file.py:function`` or ``host:package.module:function``
  into a checked :class:`HostReward`; raises ConfigError naming ``setting``, the file, the
  function and the fix (file not found, no such function, not callable, a signature that fits
  neither :data:`HOST_SIGNATURE` nor TRL's :data:`TRL_SIGNATURE`)."""
  kind, _, rest = source.partition(":")
  if kind != "host" or not rest:
    raise ConfigError(f"{setting}: {source!r} is not a host reward; write host:NAME, "
                      f"host:path/to/file.py:function or host:package.module:function")
  if ":" not in rest:
    if rest not in HOST_RULES:
      raise ConfigError(f"{setting}: {source!r}: no host reward {rest!r} is registered "
                        f"(registered: {', '.join(sorted(HOST_RULES))}); for your own function "
                        f"write host:path/to/file.py:function or host:package.module:function")
    return HostReward(source, HOST_RULES[rest], f"host reward {rest!r}",
                      bounded=rest in _BOUNDED)
  target, _, fname = rest.rpartition(":")
  what = f"{setting}: {source}"
  if not fname.isidentifier():
    raise ConfigError(f"{what}: {fname!r} is not a function name; write "
                      f"host:path/to/file.py:function")
  module = registry.load_target(
      target, what, "host:path/to/file.py:function or host:package.module:function")
  path = target if target.endswith(".py") else ""
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
  style, takes, needs = calling_style(fn, f"{what}: {where}")
  return HostReward(source, fn, where, path, style, takes, needs)


@dataclasses.dataclass(frozen=True)
class HostScores:
  """What a host reward gave a batch: ``scores`` float32 ``[B]`` (NaN where it gave None or
  NaN, raised, returned something that is not a number, or did not return within
  ``reward.timeout_s``: masked downstream), and counts."""

  scores: np.ndarray
  errors: int = 0  # responses whose scoring raised an exception
  invalid: int = 0  # values that were not numbers (a string, a list, ...)
  unscored: int = 0  # None or non-finite values (the function's own "cannot score")
  timeouts: int = 0  # responses of calls abandoned after reward.timeout_s

  def metrics(self, prefix: str = "reward/host") -> dict:
    return {f"{prefix}_errors": float(self.errors), f"{prefix}_invalid": float(self.invalid),
            f"{prefix}_unscored": float(self.unscored),
            f"{prefix}_timeouts": float(self.timeouts)}


# (source, "failed" | "timeout") whose first masked failure of that kind was reported: said
# once per process (training and evaluation score with the same functions).
_WARNED: set[tuple[str, str]] = set()


def _describe_exception(reward: HostReward, e: BaseException) -> str:
  where = registry.user_frame(e, reward.path) if reward.path else ""
  return f"{type(e).__name__}: {e}{where}"


def trl_arguments(reward: HostReward, responses: list, examples: list,
                  completion_ids: Optional[list] = None) -> dict:
  """The keyword arguments of a TRL-style call (:data:`TRL_SIGNATURE`): one list entry per
  response.  Chat prompts (message lists) make it TRL's conversational format: each completion
  is ``[{"role": "assistant", "content": text}]``.  Raises ConfigError naming an argument the
  function requires that neither jaxrlhf nor the data rows provide."""
  prompts = [ex.get("prompt", "") for ex in examples]
  chat = any(isinstance(p, list) for p in prompts)
  completions = ([[{"role": "assistant", "content": r}] for r in responses] if chat
                 else list(responses))
  columns = list(dict.fromkeys(k for ex in examples for k in ex if k != "prompt"))
  args = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids,
          "trainer_state": None,
          **{k: [ex.get(k) for ex in examples] for k in columns if k not in TRL_ARGUMENTS}}
  missing = [n for n in reward.needs if n not in args]
  if missing:
    raise ConfigError(
        f"{reward.where} requires {', '.join(repr(m) for m in missing)}, which the data rows do "
        f"not have (their columns: {', '.join(columns) or 'none'}; jaxrlhf also passes "
        f"{', '.join(TRL_ARGUMENTS)}); add the column to the data, rename one to it with "
        f"data.fields=SOURCE:{missing[0]}, or give the parameter a default")
  if reward.takes is not None:
    args = {k: v for k, v in args.items() if k in reward.takes}
  return args


def _call(reward: HostReward, responses: list, examples: list,
          completion_ids: Optional[list] = None):
  signature = TRL_SIGNATURE if reward.style == "trl" else HOST_SIGNATURE
  if reward.style == "trl":
    out = reward.fn(**trl_arguments(reward, responses, examples, completion_ids))
  else:
    out = reward.fn(responses, examples)
  if isinstance(out, (str, bytes, dict)) or not hasattr(out, "__len__"):
    raise ConfigError(f"{reward.where} returned {type(out).__name__} {str(out)[:60]!r}; a host "
                      f"reward returns a list with one float per response "
                      f"({len(responses)} here): {signature}")
  out = list(np.asarray(out).reshape(-1)) if hasattr(out, "shape") else list(out)
  if len(out) != len(responses):
    # Never broadcast: one score for a batch of responses is a bug in the function.
    raise ConfigError(f"{reward.where} returned {len(out)} score(s) for {len(responses)} "
                      f"responses; return one float per response, in order "
                      f"({signature})")
  return out


def _attempt(reward: HostReward, timeout_s: float, *args) -> tuple[str, object]:
  """One call of :func:`_call`: ``(kind, value)`` as :func:`jaxrlhf.usercode.call` gives it,
  on a daemon thread under ``timeout_s`` (on this thread for a ``bounded`` function, or with
  ``timeout_s=0``: no limit).  A ConfigError (a wrong number of scores, a missing TRL
  argument) is raised here."""
  if reward.bounded or timeout_s == 0:
    try:
      return usercode.OK, _call(reward, *args)
    except ConfigError:
      raise
    except Exception as e:  # noqa: BLE001  (the function's own failure)
      return usercode.RAISED, e
  kind, value = usercode.call(_call, timeout_s, reward, *args)
  if kind == usercode.RAISED and isinstance(value, ConfigError):
    raise value
  return kind, value


def score_host(reward: HostReward, responses: Sequence[str], examples: Sequence[dict],
               num_samples: int = 1, on_error: str = "mask",
               completion_ids: Optional[Sequence] = None,
               timeout_s: float = RewardConfig.timeout_s) -> HostScores:
  """Runs a host reward on a batch: ``responses[i]`` answers ``examples[i // num_samples]``
  (every field of the data row, as a dict); ``completion_ids[i]``: its token ids, for a
  TRL-style function (None when not known).  Returns float32 scores with failures masked as
  NaN and counted; ``on_error="raise"`` stops at the first exception, non-number or timeout
  instead (ConfigError naming the function, the response and the fix).  A wrong number of
  scores always stops.  When a batch call raises, each response is scored alone (all of them
  together again within ``timeout_s``), so one bad response masks only itself.  A call still
  running after ``timeout_s`` seconds is abandoned on its daemon thread and its responses are
  masked (``timeouts``); ``timeout_s=0`` calls the function on this thread, without a limit."""
  _check("reward.host_errors", on_error, HOST_ERROR_POLICIES)
  responses = [str(r) for r in responses]
  rows = [dict(ex) for ex in examples for _ in range(num_samples)]
  if len(rows) != len(responses):
    raise ValueError(f"{reward.where}: {len(responses)} responses for {len(examples)} examples x "
                     f"{num_samples} samples")
  n = len(responses)
  ids = ([[int(t) for t in row] for row in completion_ids] if completion_ids is not None
         else None)
  part = lambda i: None if ids is None else ids[i:i + 1]  # noqa: E731
  errors = timeouts = 0
  failure = late = ""
  raised = object()  # the value of a response whose scoring raised or timed out
  limit = f"reward.timeout_s={timeout_s:g} s"
  kind, values = _attempt(reward, timeout_s, responses, rows, ids)
  if kind == usercode.TIMEOUT:
    if on_error == "raise":
      raise ConfigError(f"{reward.where} did not return within {limit} on a batch of {n} "
                        f"responses (the call was abandoned); fix the function, raise "
                        f"reward.timeout_s, or set reward.host_errors=mask to mask such batches "
                        f"(counted in reward/host_timeouts)")
    values, timeouts = [raised] * n, n
    late = f"the call on {n} responses did not return within {limit}"
  elif kind == usercode.RAISED:
    e = values
    if on_error == "raise":
      raise ConfigError(f"{reward.where} raised {_describe_exception(reward, e)} on a batch of "
                        f"{n} responses; fix the function, or set reward.host_errors=mask to "
                        f"score such responses as masked (counted in reward/host_errors)") from e
    values = []
    deadline = time.monotonic() + timeout_s  # the batch's own limit, for all of them together
    for i in range(n):  # one at a time: find the responses that fail
      left = 0 if timeout_s == 0 else deadline - time.monotonic()  # 0: no limit
      k, v = ((usercode.TIMEOUT, None) if timeout_s and left <= 0 else
              _attempt(reward, left, responses[i:i + 1], rows[i:i + 1], part(i)))
      if k == usercode.OK:
        values.extend(v)
        continue
      values.append(raised)
      if k == usercode.TIMEOUT:
        timeouts += 1
        late = late or (f"scored one at a time after the batch call raised, responses {i} to "
                        f"{n - 1} did not return within {limit}")
      else:
        errors += 1
        failure = failure or f"response {i}: {_describe_exception(reward, v)}"
  scores, invalid, unscored, bad = _to_scores(reward, values, raised, on_error)
  failure = failure or bad
  # Masked, counted in the metrics, and said once on the console per kind: never silent.
  if failure:
    _warn_once(reward, "failed", f"{errors + invalid} of {n} responses could not be scored "
               f"(first, {failure}); they are masked out of the update and counted in "
               f"reward/host_errors and reward/host_invalid (set reward.host_errors=raise to "
               f"stop instead)")
  if late:
    _warn_once(reward, "timeout", f"{late}; the call was abandoned (it may still be running), "
               f"and its {timeouts} responses are masked out of the update and counted in "
               f"reward/host_timeouts (raise reward.timeout_s if the function is slow, or set "
               f"reward.host_errors=raise to stop instead; said once)")
  return HostScores(scores, errors, invalid, unscored, timeouts)


def _to_scores(reward: HostReward, values: list, raised, on_error: str):
  """``(float32 scores, invalid, unscored, first failure)`` of what a host reward returned
  per response: NaN where it raised or timed out (``raised``), returned None (unscored) or
  not a number (invalid; ``on_error="raise"`` stops there instead)."""
  scores = np.full(len(values), np.nan, np.float32)
  invalid = unscored = 0
  failure = ""
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
  return scores, invalid, unscored, failure


def _warn_once(reward: HostReward, kind: str, text: str) -> None:
  if (reward.source, kind) not in _WARNED:
    _WARNED.add((reward.source, kind))
    print(f"warning: {reward.where}: {text}", flush=True)


@register_host_reward("exact_match", bounded=True)
def host_exact_match(responses: list, examples: list) -> list:
  """1.0 when the decoded response equals the answer after stripping surrounding whitespace."""
  if len(responses) != len(examples):
    raise ValueError(f"exact_match: {len(responses)} responses but {len(examples)} examples")
  return [1.0 if r.strip() == str(ex.get("answer", "")).strip() else 0.0
          for r, ex in zip(responses, examples)]
