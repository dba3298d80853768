"""What one example holds (prompt, answer, response, preference pair, every other field of the
user's row), chat messages, and the built-in verifiable task (fixed-width addition)."""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Optional

import numpy as np

from jaxrlhf.config import ConfigError


@dataclasses.dataclass(frozen=True)
class Chat:
  """Chat messages (``[{"role": ..., "content": ...}, ...]``), kept as canonical JSON so that
  an example stays hashable and comparable (DPO caches reference log-probs by example)."""

  json: str

  @classmethod
  def of(cls, messages) -> "Chat":
    return cls(json.dumps(list(messages), sort_keys=True, ensure_ascii=False))

  @property
  def messages(self) -> list[dict]:
    return json.loads(self.json)


@dataclasses.dataclass(frozen=True)
class Example:
  prompt: "str | Chat"
  answer: str = ""  # reference answer (rule rewards, exact-match eval)
  response: "str | Chat" = ""  # SFT target (chat: the final assistant message)
  chosen: "str | Chat" = ""  # preference pair
  rejected: "str | Chat" = ""
  completion: "str | Chat" = ""  # an unpaired example (KTO) ...
  label: Optional[bool] = None  # ... and whether it is desirable
  line: int = dataclasses.field(default=0, compare=False)  # line/row in the user's file (0: built-in)
  # Every other field of the data row (tests, metadata...), for host rewards.
  extra: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

  def record(self) -> dict:
    """The example as its data row: ``prompt`` (a string, or the list of messages),
    ``answer``, the response fields it has, and every other field of the row: a fresh copy, so
    a reward function that changes it cannot change the data."""
    out = copy.deepcopy(self.extra)
    for name in ("prompt", "answer", "response", "chosen", "rejected", "completion"):
      value = getattr(self, name)
      if name in ("prompt", "answer") or value:
        out[name] = value.messages if isinstance(value, Chat) else value
    if self.label is not None:
      out["label"] = self.label
    return out

  def unpaired(self) -> list["Example"]:
    """A preference pair as two unpaired examples (KTO): the chosen response desirable, the
    rejected one undesirable."""
    return [dataclasses.replace(self, completion=self.chosen, label=True),
            dataclasses.replace(self, completion=self.rejected, label=False)]


class AdditionTask:
  """``a+b=`` -> ``a+b`` for numbers of up to ``digits`` digits; exact-match checkable.

  Numbers are written fixed-width with leading zeros (``07+45=052``): the digits of the
  operands and the sum line up, which a small transformer learns far faster than ragged
  numbers.

  The held-out split is fixed by a hash of ``(a, b)``: about 1 in 8 pairs are evaluation-only
  and never appear in training batches.
  """

  def __init__(self, digits: int, reverse_answer: bool = False):
    if not 1 <= digits <= 6:
      raise ConfigError(f"data.digits={digits}: use 1..6")
    self.digits = digits
    self.reverse = reverse_answer
    self.limit = 10 ** digits

  def _is_eval(self, a, b):
    return ((a * 7919 + b * 104729) % 8) == 0

  def sample(self, rng: np.random.Generator, n: int, split: str) -> list[Example]:
    out = []
    want_eval = split == "eval"
    while len(out) < n:
      a, b = (int(x) for x in rng.integers(0, self.limit, size=2))
      if self._is_eval(a, b) != want_eval:
        continue
      d = self.digits
      answer = self._write(a + b)
      out.append(Example(prompt=f"{a:0{d}d}+{b:0{d}d}=", answer=answer, response=answer,
                         chosen=answer, rejected=self.wrong_answer(rng, a + b)))
    return out

  def _write(self, value: int) -> str:
    text = f"{value:0{self.digits + 1}d}"
    return text[::-1] if self.reverse else text

  def wrong_answer(self, rng: np.random.Generator, correct: int) -> str:
    """A plausible wrong answer of the same width: one digit changed, or off by a little."""
    width = self.digits + 1
    s = self._write(correct)
    while True:
      if rng.random() < 0.5:
        i = int(rng.integers(0, width))
        cand = s[:i] + str(int(rng.integers(0, 10))) + s[i + 1:]
      else:
        value = correct + int(rng.choice([-10, -2, -1, 1, 2, 10]))
        cand = self._write(value) if 0 <= value < 10 ** width else s
      if cand != s:
        return cand


def as_text(value) -> str:
  """A prompt or response as text for a sample row: the string, or a chat's last message."""
  if isinstance(value, str):
    return value
  messages = value.messages
  return str(messages[-1].get("content", "")) if messages else ""
