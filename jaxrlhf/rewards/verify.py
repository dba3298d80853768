"""The built-in math verifier (``host:math_verify``: final answers compared by value with the
math-verify library) and its format reward (``host:math_format``)."""

from __future__ import annotations

import threading

from jaxrlhf.config import ConfigError
from jaxrlhf.rewards.host import register_host_reward


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


@register_host_reward("math_verify", bounded=True)
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


@register_host_reward("math_format", needs_answer=False, bounded=True)
def math_format_reward(responses: list, examples: list) -> list:
  """1.0 when the response gives exactly one non-empty ``\\boxed{...}`` answer, else 0.0: a
  small shaping term to add to ``host:math_verify`` (e.g. weights 1.0 and 0.1)."""
  del examples
  return [1.0 if len(b := boxed_answers(r)) == 1 and b[0].strip() else 0.0 for r in responses]
