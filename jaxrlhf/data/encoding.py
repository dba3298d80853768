"""Fixed-shape batches: prompts left-padded to ``P``, responses right-padded to ``R`` (ending
with EOS), chat rendered with the tokenizer's template and only assistant turns in the loss."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from jaxrlhf.config import ConfigError, DataConfig
from jaxrlhf.data.examples import Chat, Example
from jaxrlhf.data.files import _TEXT_FIELDS


def _as_chat(value: "str | Chat", role: str) -> list[dict]:
  return value.messages if isinstance(value, Chat) else [{"role": role, "content": value}]


def _blank(value: "str | Chat") -> bool:
  """No text: an empty or whitespace string, or messages whose contents all are."""
  if isinstance(value, Chat):
    return all(not str(m.get("content", "")).strip() for m in value.messages)
  return not str(value).strip()


# The fields of each kind whose tokens the loss trains on (besides the end token); a pair's
# sides are compared with each other, so an empty side still carries a signal.
_TRAINED = {"sft": ("response",), "unpaired": ("completion",)}  # not a stage name: data kinds


class Encoder:
  """Turns examples into fixed-shape numpy arrays in the shared prompt|response layout."""

  def __init__(self, cfg: DataConfig, tokenizer):
    self.cfg = cfg
    self.tok = tokenizer
    self.P = cfg.max_prompt_len
    self.R = cfg.max_response_len
    self.counts = {"data/truncated": 0, "data/skipped": 0}
    self._chat_cache: dict = {}

  def encode(self, text: str, where: str = "", field: str = "prompt") -> list[int]:
    """``tok.encode``; an error (a character the char tokenizer lacks) names ``where`` (FILE:LINE)
    and the field."""
    try:
      return self.tok.encode(text)
    except ConfigError as e:
      if not where:
        raise
      raise ConfigError(f"{where}: \"{field}\": {e}") from None

  def _chat(self, messages: list, gen: bool, where: str) -> list[int]:
    try:
      return self.tok.chat(messages, gen)
    except ConfigError as e:
      if not where:
        raise
      raise ConfigError(f"{where}: {e}") from None

  def chat_parts(self, ex: Example, field: str, where: str = "", train_prompt_turns=False):
    """Prompt + ``field`` as one conversation rendered by the chat template: ``(prompt_ids,
    prompt_loss, response_ids)``.  ``prompt_ids`` is the prompt with the generation prompt;
    ``response_ids`` the final assistant turn up to and including the first end token (EOS
    appended when the template writes none).  ``prompt_loss`` marks the earlier assistant turns
    inside the prompt (SFT trains on every assistant turn).  Each assistant turn is located by
    rendering the conversation up to it, so the template must render append-only: a prefix
    of the conversation renders as a prefix of its tokens."""
    key = (ex.prompt, getattr(ex, field), train_prompt_turns)
    if key in self._chat_cache:
      return self._chat_cache[key]
    prompt = _as_chat(ex.prompt, "user")
    conv = prompt + _as_chat(getattr(ex, field), "assistant")
    full = self._chat(conv, False, where)
    eos = self.tok.eos_id

    def prefix(n: int, gen: bool) -> int:
      ids = self._chat(conv[:n], gen, where)
      if full[:len(ids)] != ids:
        at = next((i for i, (a, b) in enumerate(zip(ids, full)) if a != b), min(len(ids), len(full)))
        raise ConfigError(
            f"{where or 'chat example'}: the chat template of data.tokenizer does not render "
            f"append-only: the first {n} message(s) render differently (from token {at}) once "
            f"later messages follow, so the assistant's tokens cannot be located; use a template "
            f"that renders earlier turns unchanged, or give one example per assistant turn")
      return len(ids)

    split = prefix(len(prompt), True)
    response = full[split:]
    if eos in response:
      response = response[:response.index(eos) + 1]
    else:
      response = response + [eos]
    loss = np.zeros(split, bool)
    if train_prompt_turns:
      for i, m in enumerate(prompt):
        if m["role"] == "assistant":
          a, b = prefix(i, True), prefix(i + 1, False)
          span = full[a:b]
          if eos in span:
            b = a + span.index(eos) + 1
          loss[a:b] = True
    out = (full[:split], loss, response)
    self._chat_cache[key] = out
    return out

  def _fit_prompt(self, ids: list, where: str) -> Optional[int]:
    """How many leading tokens to cut so the prompt fits (``data.overlong``), or None to skip."""
    if len(ids) <= self.P:
      return 0
    policy = self.cfg.overlong
    if policy == "error":
      raise ConfigError(f"{where or 'prompt'}: prompt is {len(ids)} tokens, longer than "
                        f"data.max_prompt_len={self.P}; raise the limit or set "
                        f"data.overlong=truncate|skip")
    if policy == "skip":
      self.counts["data/skipped"] += 1
      return None
    self.counts["data/truncated"] += 1
    return len(ids) - self.P

  def prompt_ids(self, ex: Example, where: str = "") -> Optional[list[int]]:
    if isinstance(ex.prompt, Chat):
      if ex.prompt not in self._chat_cache:  # rendered once per prompt, not once per batch
        self._chat_cache[ex.prompt] = self._chat(ex.prompt.messages, True, where)
      ids = self._chat_cache[ex.prompt]  # the template writes any BOS
    else:
      # What the tokenizer itself puts first (tokenizers.HFTokenizer.start_ids): BOS for the
      # built-in char tokenizers and a Llama 2 tokenizer, nothing for a chat model's.
      ids = self.tok.start_ids() + self.encode(ex.prompt, where)
    cut = self._fit_prompt(ids, where)
    return None if cut is None else ids[cut:]

  @staticmethod
  def is_chat(ex: Example, field: str = "") -> bool:
    return isinstance(ex.prompt, Chat) or (bool(field) and isinstance(getattr(ex, field), Chat))

  def degenerate(self, ex: Example, kind: str, where: str) -> str:
    """Why ``ex`` is degenerate, or "" when it is not: an empty prompt (it would become a
    BOS-only prompt), an empty turn to train on (an SFT response or KTO completion: the loss
    would teach the end token alone), or such a turn whose text encodes to no tokens.  The
    caller skips these and reports how many (:class:`jaxrlhf.data.DataSource`)."""
    if _blank(ex.prompt):
      return "an empty prompt"
    for field in _TRAINED.get(kind, ()):
      value = getattr(ex, field)
      if _blank(value):
        return f"an empty assistant turn in \"{field}\""
      if self.is_chat(ex, field):
        n = len(self.chat_parts(ex, field, where, field == "response")[2]) - 1
      else:
        n = len(self.encode(value, where, field))
      if n == 0:
        return f"no token to train on in \"{field}\" (its text encodes to none)"
    return ""

  def check(self, ex: Example, kind: str, where: str) -> Optional[Example]:
    """Checks one example of a file up front, so that errors name ``where`` (FILE:LINE) and not a
    batch: that every field it will encode is encodable (the char tokenizer rejects unknown
    characters; a chat example needs a template that renders append-only), and the lengths of
    its prompt and of its response fields against ``data.max_prompt_len`` /
    ``data.max_response_len`` under ``data.overlong`` (None when the example is skipped).  A
    response longer than its slots would be cut silently: an SFT or preference target ending
    mid-text in an end token, or an answer no response can match."""
    if self.prompt_ids(ex, where) is None:
      return None
    for field in _TEXT_FIELDS[kind]:
      if field != "answer" and self.is_chat(ex, field):
        n = len(self.chat_parts(ex, field, where, field == "response")[2]) - 1
      else:
        n = len(self.encode(getattr(ex, field), where, field))
      # Responses keep one slot for the end token; an answer is compared without it.
      room = self.R if field == "answer" else self.R - 1
      if n > room:
        policy = self.cfg.overlong
        if policy == "error":
          raise ConfigError(
              f"{where}: \"{field}\" is {n} tokens, longer than the {room} that "
              f"data.max_response_len={self.R} leaves for it"
              + ("" if field == "answer" else " (one slot is the end token)")
              + "; raise data.max_response_len, shorten it, or set data.overlong=truncate|skip")
        if policy == "skip":
          self.counts["data/skipped"] += 1
          return None
        self.counts["data/truncated"] += 1
    return ex

  def response_ids(self, text: str) -> list[int]:
    ids = self.tok.encode(text)[: self.R - 1]
    return ids + [self.tok.eos_id]

  def _left(self, ids):
    row = np.full(self.P, self.tok.pad_id, np.int32)
    mask = np.zeros(self.P, bool)
    if ids:
      row[-len(ids):] = ids
      mask[-len(ids):] = True
    return row, mask

  def _right(self, ids, length):
    row = np.full(length, self.tok.pad_id, np.int32)
    mask = np.zeros(length, bool)
    row[:len(ids)] = ids
    mask[:len(ids)] = True
    return row, mask

  def prompts(self, examples: Sequence[Example]) -> dict:
    """``prompt [B,P]``, ``prompt_mask``, ``answer [B,R]`` (the reference answer's tokens,
    without EOS: what rule rewards compare a response to), ``answer_mask``."""
    rows = [self._left(self.prompt_ids(ex)) for ex in examples]
    ans = [self._right(self.tok.encode(ex.answer)[:self.R], self.R) for ex in examples]
    return {"prompt": np.stack([r[0] for r in rows]), "prompt_mask": np.stack([r[1] for r in rows]),
            "answer": np.stack([a[0] for a in ans]), "answer_mask": np.stack([a[1] for a in ans])}

  def sequences(self, examples: Sequence[Example], field: str) -> dict:
    """Prompt + ``field`` (response/chosen/rejected): ``tokens [B,P+R]``, ``mask``,
    ``loss_mask`` (response tokens incl. EOS; for chat SFT, every assistant turn)."""
    toks, masks, lmask = [], [], []
    for ex in examples:
      if self.is_chat(ex, field):
        p_ids, p_loss, r_ids = self.chat_parts(ex, field, train_prompt_turns=field == "response")
        cut = self._fit_prompt(p_ids, "") or 0  # "skip" examples were dropped when read
        p_ids, p_loss = p_ids[cut:], p_loss[cut:]
        if len(r_ids) > self.R:
          r_ids = r_ids[:self.R - 1] + [self.tok.eos_id]
      else:
        p_ids, r_ids = self.prompt_ids(ex), self.response_ids(getattr(ex, field))
        p_loss = np.zeros(len(p_ids), bool)
      p, pm = self._left(p_ids)
      pl = np.zeros(self.P, bool)
      if len(p_ids):
        pl[-len(p_ids):] = p_loss
      r, rm = self._right(r_ids, self.R)
      toks.append(np.concatenate([p, r]))
      masks.append(np.concatenate([pm, rm]))
      lmask.append(np.concatenate([pl, rm]))
    return {"tokens": np.stack(toks), "mask": np.stack(masks), "loss_mask": np.stack(lmask)}

  def unpaired(self, examples: Sequence[Example]) -> dict:
    """Unpaired examples (KTO): ``completion [B,P+R]``, ``completion_mask``,
    ``completion_loss_mask`` and ``label [B]`` (True: desirable)."""
    c = self.sequences(examples, "completion")
    return {"completion": c["tokens"], "completion_mask": c["mask"],
            "completion_loss_mask": c["loss_mask"],
            "label": np.array([bool(ex.label) for ex in examples], np.bool_)}

  def pairs(self, examples: Sequence[Example]) -> dict:
    c = self.sequences(examples, "chosen")
    r = self.sequences(examples, "rejected")
    return {"chosen": c["tokens"], "chosen_mask": c["mask"], "chosen_loss_mask": c["loss_mask"],
            "rejected": r["tokens"], "rejected_mask": r["mask"],
            "rejected_loss_mask": r["loss_mask"]}
