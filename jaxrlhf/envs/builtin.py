"""The built-in environments: ``calculator`` (arithmetic with a calculator tool) and ``guess``
(a number-guessing game); their prompts and SFT demonstrations are the data tasks of the same
names (jaxrlhf/data/tasks.py), whose text helpers write the observations here too."""

from __future__ import annotations

import re
from typing import Optional

from jaxrlhf.data.tasks import CALC_CLOSE, CALC_OPEN, calc_result, guess_feedback
from jaxrlhf.envs.base import Env, register_env


MAX_EXPRESSION_CHARS = 32
MAX_NUMBER_DIGITS = 9
MAX_VALUE = 10 ** 15  # a larger intermediate or result is an error (no huge integers)
_NUMBER = re.compile(r"[0-9]+")


class _Parser:
  """expr := term (('+' | '-') term)*;  term := factor ('*' factor)*;
  factor := '-' factor | '(' expr ')' | number.  Integers only."""

  def __init__(self, text: str):
    self.text, self.i = text, 0

  def peek(self) -> str:
    return self.text[self.i] if self.i < len(self.text) else ""

  def expr(self) -> int:
    value = self.term()
    while self.peek() in ("+", "-"):
      op = self.text[self.i]
      self.i += 1
      value = _bounded(value + self.term() if op == "+" else value - self.term())
    return value

  def term(self) -> int:
    value = self.factor()
    while self.peek() == "*":
      self.i += 1
      value = _bounded(value * self.factor())
    return value

  def factor(self) -> int:
    c = self.peek()
    if c == "-":
      self.i += 1
      return -self.factor()
    if c == "(":
      self.i += 1
      value = self.expr()
      if self.peek() != ")":
        raise ValueError("unbalanced parenthesis")
      self.i += 1
      return value
    m = _NUMBER.match(self.text, self.i)
    if not m or len(m.group()) > MAX_NUMBER_DIGITS:
      raise ValueError("expected a number")
    self.i = m.end()
    return int(m.group())


def _bounded(value: int) -> int:
  if abs(value) >= MAX_VALUE:
    raise ValueError("value out of range")
  return value


def evaluate(expression: str) -> Optional[int]:
  """The integer value of ``expression`` (digits, ``+ - * ( )`` and spaces; at most
  :data:`MAX_EXPRESSION_CHARS` characters, numbers of at most :data:`MAX_NUMBER_DIGITS`
  digits, every value below :data:`MAX_VALUE`), or None when it is anything else.  A small
  parser: nothing is ever passed to ``eval``."""
  if not isinstance(expression, str) or len(expression) > MAX_EXPRESSION_CHARS:
    return None
  if re.search(r"[0-9] +[0-9]", expression):  # "1 2" is not 12
    return None
  text = expression.replace(" ", "")
  if not text or not re.fullmatch(r"[0-9+\-*()]+", text):
    return None
  parser = _Parser(text)
  try:
    value = parser.expr()
  except ValueError:
    return None
  return value if parser.i == len(text) else None


@register_env("calculator")
class CalculatorEnv(Env):
  """Arithmetic with a calculator (data.task=calculator, data.tokenizer=char_tools).

  An action ending with ``</calc>`` is a tool call: the expression after its last ``<calc>``
  is evaluated (:func:`evaluate`) and the observation is ``<result>VALUE</result>``, or
  ``<result>error</result>`` when it cannot be; reward 0.0, not done.  Any other action is the
  final answer: reward 1.0 when it equals the example's ``answer`` (surrounding whitespace
  stripped), else 0.0; done.
  """

  stop_strings = (CALC_CLOSE,)

  def reset(self, example: dict) -> str:
    self.answer = str(example.get("answer", "")).strip()
    return str(example["prompt"])

  def step(self, action: str) -> tuple[str, float, bool]:
    if action.endswith(CALC_CLOSE):
      start = action.rfind(CALC_OPEN)
      value = None if start < 0 else evaluate(action[start + len(CALC_OPEN):-len(CALC_CLOSE)])
      return calc_result(value), 0.0, False
    return "", float(bool(self.answer) and action.strip() == self.answer), True


@register_env("guess")
class GuessEnv(Env):
  """Guess the secret number (data.task=guess): the example's ``answer``, in ``1..high`` (the
  row's ``high`` field, 31 by default).

  Each action is a number ended by ``?``.  The right number: reward 1.0, done.  A wrong one:
  observation ``higher `` or ``lower `` (where the secret lies), reward 0.0; an action that is
  no number: ``invalid ``.  After ``max_guesses`` wrong actions the episode ends with reward
  0.0 (env.max_turns usually ends it first).  Reward 1.0 means solved (env.success_reward).
  """

  stop_strings = ("?",)
  max_guesses = 10

  def reset(self, example: dict) -> str:
    self.secret = int(str(example["answer"]).strip())
    self.guesses = 0
    return str(example["prompt"])

  def step(self, action: str) -> tuple[str, float, bool]:
    self.guesses += 1
    text = action.strip()
    text = text[:-1].strip() if text.endswith("?") else text
    guess = int(text) if re.fullmatch(r"[0-9]{1,6}", text) else None
    if guess == self.secret:
      return "", 1.0, True
    if self.guesses >= self.max_guesses:
      return "", 0.0, True
    return guess_feedback(guess, self.secret), 0.0, False
