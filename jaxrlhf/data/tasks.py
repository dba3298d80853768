"""The built-in multi-turn tasks: prompts, answers and tool-using SFT demonstrations for the
``calculator`` and ``guess`` environments (jaxrlhf/envs/builtin.py).

A demonstration (``Example.response``) is the whole episode after the prompt, laid out as the
multi-turn rollout lays it out in text format: action 1 (with its stop string), observation 1,
action 2, ..., the action that ends the episode; the encoder appends EOS.  The text of each
observation is written by the helpers here, which the environments call too, so that a
demonstration and its environment agree character for character.

This module is data: it knows nothing of the environments (jaxrlhf.envs imports it).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from jaxrlhf.data.examples import Example


CALC_OPEN, CALC_CLOSE = "<calc>", "</calc>"
RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"


def calc_call(expression: str) -> str:
  """The action that asks the calculator: ``<calc>12*7</calc>`` (``</calc>`` is the stop
  string)."""
  return f"{CALC_OPEN}{expression}{CALC_CLOSE}"


def calc_result(value: Optional[int]) -> str:
  """The calculator's observation: ``<result>84</result>``, ``<result>error</result>`` for an
  expression it cannot evaluate (None)."""
  return f"{RESULT_OPEN}{'error' if value is None else value}{RESULT_CLOSE}"


def _held_out(*values: int) -> bool:
  """A fixed 1-in-8 evaluation split by a hash of the values (never by the seed)."""
  h = 0
  for v in values:
    h = (h * 1_000_003 + v * 7919 + 104729) % 2_147_483_647
  return (h * 2_654_435_761 >> 11) % 8 == 0


class CalculatorTask:
  """``a*b+c=`` with two-digit ``a``, ``b``, ``c`` (10..99); the answer is the value.

  The product of two two-digit numbers is hard for a tiny model to work out in its head, but
  copying is easy, so the demonstration asks the tool for the whole expression and copies the
  result as its final answer::

      prompt    37*46+58=                                        (9 chars, always)
      response  <calc>37*46+58</calc><result>1760</result>1760   (44-46 chars)

  The first action ends at the stop string ``</calc>``; the observation is
  ``<result>1760</result>``; the second action (the final answer, then EOS) ends the episode.
  Set data.max_prompt_len >= 10 (BOS + 9) and data.max_response_len >= 47 (46 + EOS).
  Needs data.tokenizer=char_tools (``<``, ``>`` and ``/``).

  The held-out split is fixed by a hash of ``(a, b, c)``: about 1 in 8 problems are
  evaluation-only.  ``chosen`` is the demonstration, ``rejected`` a wrong answer without the
  tool (for preference stages).
  """

  max_prompt_chars = 9
  max_response_chars = 46

  def sample(self, rng: np.random.Generator, n: int, split: str) -> list[Example]:
    out = []
    want_eval = split == "eval"
    while len(out) < n:
      a, b, c = (int(x) for x in rng.integers(10, 100, size=3))
      if _held_out(a, b, c) != want_eval:
        continue
      expression, value = f"{a}*{b}+{c}", a * b + c
      response = calc_call(expression) + calc_result(value) + str(value)
      wrong = value + int(rng.choice([-10, -1, 1, 10]))
      out.append(Example(prompt=expression + "=", answer=str(value), response=response,
                         chosen=response, rejected=str(wrong)))
    return out


GUESS_HIGHER, GUESS_LOWER, GUESS_INVALID = "higher ", "lower ", "invalid "


def guess_feedback(guess: Optional[int], secret: int) -> str:
  """The guessing game's observation after a wrong guess: ``higher `` when the secret is
  higher than the guess, ``lower `` when lower, ``invalid `` for an action that is no number
  (the trailing space separates it from the next guess)."""
  if guess is None:
    return GUESS_INVALID
  return GUESS_HIGHER if secret > guess else GUESS_LOWER


class GuessTask:
  """Guess a secret number in ``1..high`` (``high`` = 31 by default) from ``higher`` /
  ``lower`` replies; each guess is a number ended by the stop string ``?``.  The answer is the
  secret (as text), also carried in the row's ``high`` field for the environment.

  The demonstration plays binary search (guess the middle of what is left), which needs at
  most ``high.bit_length()`` guesses (5 for 31)::

      prompt    guess 1-31:                                (11 chars for high=31)
      response  16?lower 8?higher 12?higher 14?lower 13?   (at most 43 chars for high=31)

  The episode ends at the right guess (its observation is never appended); the encoder appends
  EOS after it for SFT.  Set data.max_prompt_len >= 12 and data.max_response_len >= 44, and
  env.max_turns >= 5.  Works with data.tokenizer=char (and char_tools).

  There is no held-out split: the prompt is the same for every secret and the secret is
  hidden in the environment, so what is learned and measured is the search, and the
  evaluation plays every secret in turn (``1, 2, ..., high, 1, ...``: 256 episodes weigh the
  31 secrets within one of each other).
  """

  held_out = False  # evaluation plays the training secrets (DataSource.eval_held_out)

  def __init__(self, high: int = 31):
    if high < 2:
      raise ValueError(f"GuessTask(high={high}): the secret needs a range of at least 2")
    self.high = high
    self.max_guesses = high.bit_length()
    self.max_prompt_chars = len(self.prompt)
    self.max_response_chars = max(len(self.demonstration(s)) for s in range(1, high + 1))

  @property
  def prompt(self) -> str:
    return f"guess 1-{self.high}:"

  def demonstration(self, secret: int) -> str:
    """Binary search over ``1..high`` until ``secret``, as the rollout lays it out."""
    lo, hi, parts = 1, self.high, []
    while True:
      guess = (lo + hi) // 2
      parts.append(f"{guess}?")
      if guess == secret:
        return "".join(parts)
      parts.append(guess_feedback(guess, secret))
      lo, hi = (guess + 1, hi) if secret > guess else (lo, guess - 1)

  def sample(self, rng: np.random.Generator, n: int, split: str) -> list[Example]:
    out = []
    for i in range(n):
      secret = i % self.high + 1 if split == "eval" else int(rng.integers(1, self.high + 1))
      response = self.demonstration(secret)
      other = secret + 1 if secret < self.high else secret - 1
      # The same search with a wrong last guess (the response ends with f"{secret}?").
      rejected = response[:-len(f"{secret}?")] + f"{other}?"
      out.append(Example(prompt=self.prompt, answer=str(secret), response=response,
                         chosen=response, rejected=rejected, extra={"high": self.high}))
    return out
