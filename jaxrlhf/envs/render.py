"""How a multi-turn episode is laid out in tokens, append-only: the prompt, then after each of
the policy's actions the ids to append for the next observation (env.format "text" or "chat").

The policy's own tokens are never re-tokenised: each observation's ids are appended after
them, and in chat format they are exactly what the tokenizer's chat template renders for the
whole conversation after the tokens it renders for the conversation so far.
"""

from __future__ import annotations

from jaxrlhf.config import ConfigError


class TextFormat:
  """Observations as plain text: the prompt is what the tokenizer puts before a text (its BOS
  rule, ``tok.start_ids()``) + the first observation's tokens; each later observation's tokens
  are appended as they are (so an observation carries its own separators, e.g.
  ``<result>84</result>``)."""

  def __init__(self, tok):
    self.tok = tok

  def prompt_ids(self, observation: str) -> list[int]:
    return list(self.tok.start_ids()) + list(self.tok.encode(observation))

  def observation_ids(self, history: list[dict], observation: str,
                      action_ended_with_eos: bool) -> list[int]:
    return list(self.tok.encode(observation))


# Two assistant contents that differ in every character: what their renderings share at the
# end is what the template writes after an assistant message (its closing tokens).
_SENTINELS = ("ab", "yz")


def _first_difference(a: list, b: list) -> int:
  return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


class ChatFormat:
  """Observations as chat messages of ``role`` rendered by the tokenizer's chat template
  (``tok.chat(messages, add_generation_prompt)``).

  ``history`` is the conversation so far as messages: the observations (``role``) and the
  policy's actions (``assistant``, the decoded action text without EOS), ending with the
  action just taken.  The ids to append are the assistant turn's closing tokens that the
  policy did not emit (the template's closing minus a leading EOS the action ended with),
  then what the template renders for the next observation and the next generation prompt.
  The template must render append-only: a conversation's tokens start with the tokens of every
  prefix of it (checked at every turn; ConfigError naming data.tokenizer otherwise).
  """

  def __init__(self, tok, role: str = "user", setting: str = "data.tokenizer"):
    self.tok, self.role = tok, role
    self.name = f"{setting}={getattr(tok, 'path', '') or getattr(tok, 'name', '?')}"
    probe = [{"role": role, "content": "x"}]
    start = tok.chat(probe, True)
    tails = []
    for content in _SENTINELS:
      full = tok.chat(probe + [{"role": "assistant", "content": content}], False)
      if full[:len(start)] != start:
        raise ConfigError(
            f"the chat template of {self.name} cannot be rendered incrementally: a "
            f"{role!r} message with the generation prompt renders differently (from token "
            f"{_first_difference(start, full)}) once the assistant's reply follows, so the "
            f"policy's tokens cannot follow the prompt's; use a template whose generation "
            f"prompt opens the assistant turn as it is rendered, or set env.format=text")
      tails.append(full[len(start):])
    n = 0
    while n < min(map(len, tails)) and tails[0][-1 - n] == tails[1][-1 - n]:
      n += 1
    if n == min(map(len, tails)):
      raise ConfigError(
          f"the chat template of {self.name} cannot be rendered incrementally: the assistant's "
          f"message leaves no tokens of its own in the rendering, so its end cannot be found; "
          f"use a template that writes assistant messages, or set env.format=text")
    # The tokens the template writes after an assistant message's content.
    self.closing = tails[0][len(tails[0]) - n:]
    self.eos_first = self.closing[:1] == [tok.eos_id]

  def prompt_ids(self, observation: str) -> list[int]:
    return self.tok.chat([{"role": self.role, "content": observation}], True)

  def observation_ids(self, history: list[dict], observation: str,
                      action_ended_with_eos: bool) -> list[int]:
    if not history or history[-1].get("role") != "assistant":
      raise ValueError("history must end with the assistant's action (role 'assistant')")
    turn = sum(m.get("role") == "assistant" for m in history)
    before = self.tok.chat(history[:-1], True)  # what the policy's action followed
    done = self.tok.chat(history, False)  # ... with the action and its closing tokens
    after = self.tok.chat(history + [{"role": self.role, "content": observation}], True)
    close = len(self.closing)
    if done[:len(before)] != before:
      self._not_append_only(turn, "the conversation before the action",
                            _first_difference(before, done))
    if close and done[-close:] != self.closing:
      self._not_append_only(turn, "the assistant's closing tokens", len(done) - close)
    if after[:len(done)] != done:
      self._not_append_only(turn, "the conversation up to the action",
                            _first_difference(done, after))
    closing = self.closing[1:] if action_ended_with_eos and self.eos_first else self.closing
    return list(closing) + after[len(done):]

  def _not_append_only(self, turn: int, what: str, at: int):
    raise ConfigError(
        f"the chat template of {self.name} is not append-only at turn {turn}: {what} renders "
        f"differently (from token {at}) once the next message follows, so observations cannot "
        f"be appended to the policy's tokens; use a template that renders earlier turns "
        f"unchanged (no per-turn rewriting, no dropped messages), or set env.format=text")


def make_format(tok, fmt: str, role: str = "user"):
  """``env.format``: :class:`TextFormat` ("text") or :class:`ChatFormat` ("chat", messages of
  ``env.observation_role``)."""
  if fmt == "text":
    return TextFormat(tok)
  if fmt == "chat":
    return ChatFormat(tok, role)
  raise ConfigError(f"env.format={fmt!r}: choose 'text' or 'chat'")
