"""Tokenizers: the built-in character tokenizer of the synthetic tasks, and a local
transformers tokenizer folder (with its chat template)."""

from __future__ import annotations

import os
from typing import Sequence

from jaxrlhf.config import ConfigError, DataConfig, one_line


PAD, BOS, EOS = 0, 1, 2


class CharTokenizer:
  """A character tokenizer for the synthetic tasks: ids 0-2 are pad/bos/eos."""

  chars = "0123456789+-*=() abcdefghijklmnopqrstuvwxyz?:"
  name = "char"  # data.tokenizer

  def __init__(self):
    self.pad_id, self.bos_id, self.eos_id = PAD, BOS, EOS
    self._to_id = {c: i + 3 for i, c in enumerate(self.chars)}
    self.vocab_size = 3 + len(self.chars)

  def start_ids(self) -> list[int]:
    """The ids put before a plain-text prompt: BOS (these models are trained that way)."""
    return [self.bos_id]

  def encode(self, text: str) -> list[int]:
    try:
      return [self._to_id[c] for c in text]
    except KeyError as e:
      c = e.args[0]
      hint = (" or set data.tokenizer=char_tools (adds '<', '>' and '/'),"
              if c in CharToolsTokenizer.chars and self.name == "char" else "")
      raise ConfigError(f"character {c!r} is not in the built-in {self.name} tokenizer "
                        f"({self.chars!r}); remove it,{hint} or set data.tokenizer to a "
                        f"tokenizer directory") from None

  def chat(self, messages: list, add_generation_prompt: bool) -> list[int]:
    raise ConfigError("chat messages need a chat template, and the built-in char tokenizer has "
                      "none; set data.tokenizer to a tokenizer folder whose tokenizer_config.json "
                      "has a chat_template, or write prompts and responses as plain strings")

  def decode(self, ids: Sequence[int]) -> str:
    out = []
    for i in ids:
      i = int(i)
      if i == self.eos_id:
        break
      if i >= 3:
        out.append(self.chars[i - 3])
    return "".join(out)


class CharToolsTokenizer(CharTokenizer):
  """The char tokenizer with ``<``, ``>`` and ``/`` appended (tool tags such as ``<calc>``):
  ids 0..47 are the char tokenizer's, so a model trained on ``char`` reads the same ids."""

  chars = CharTokenizer.chars + "<>/"
  name = "char_tools"


# data.tokenizer values that name a built-in tokenizer rather than a folder.
CHAR_TOKENIZERS = {t.name: t for t in (CharTokenizer, CharToolsTokenizer)}


class HFTokenizer:
  """A transformers tokenizer from a local directory (no hub access)."""

  # One of these must be in the folder; without any, transformers fails with a message about
  # its backends that does not name the folder.
  FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt",
           "tokenizer.model", "spiece.model")

  def __init__(self, path: str):
    if not os.path.isdir(path):
      raise ConfigError(f"data.tokenizer={path!r} is not a directory; give a local tokenizer "
                        f"folder (tokenizer.json / tokenizer_config.json), or a built-in: "
                        f"{' or '.join(repr(n) for n in CHAR_TOKENIZERS)}")
    if not any(os.path.isfile(os.path.join(path, f)) for f in self.FILES):
      raise ConfigError(f"data.tokenizer={path!r}: no tokenizer files in this folder (looked for "
                        f"{', '.join(self.FILES)}); save the tokenizer there with "
                        f"tokenizer.save_pretrained(DIR), or point data.tokenizer at the "
                        f"model's folder")
    from transformers import AutoTokenizer
    try:
      self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001  (OSError, JSON errors, the tokenizers library's own)
      raise ConfigError(f"data.tokenizer={path!r}: transformers cannot load a tokenizer from "
                        f"this folder ({one_line(e, 300)}); re-save it with "
                        f"tokenizer.save_pretrained(DIR), or point data.tokenizer at the "
                        f"model's folder") from None
    self.path = path
    self.eos_id = self._tok.eos_token_id
    if self.eos_id is None:
      raise ConfigError(f"tokenizer in {path} has no eos_token; set one in tokenizer_config.json")
    self.pad_id = self._tok.pad_token_id if self._tok.pad_token_id is not None else self.eos_id
    self.bos_id = self._tok.bos_token_id
    self.vocab_size = len(self._tok)
    self._start = self._start_rule()

  def _start_rule(self) -> list[int]:
    """What the tokenizer itself puts before a text (``tokenizer(text)``: its post-processor,
    ``add_bos_token``): a Llama 2 tokenizer adds BOS, a chat model's such as SmolLM2's (whose
    BOS ``<|im_start|>`` opens a chat turn) adds nothing.  Read by encoding a probe with and
    without special tokens; what follows the text (an EOS some tokenizers append) is not kept:
    a prompt goes on with the response."""
    probe = "x"
    plain = list(self._tok.encode(probe, add_special_tokens=False))
    full = list(self._tok.encode(probe, add_special_tokens=True))
    n = len(plain)
    at = next((i for i in range(len(full) - n + 1) if full[i:i + n] == plain), None)
    if at is None:  # the specials changed the text's own tokens: keep the leading specials
      special = set(self._tok.all_special_ids)
      at = next((i for i, t in enumerate(full) if t not in special), len(full))
    return full[:at]

  def start_ids(self) -> list[int]:
    """The ids the tokenizer's own rule puts before a plain-text prompt (see _start_rule)."""
    return list(self._start)

  def encode(self, text: str) -> list[int]:
    return list(self._tok.encode(text, add_special_tokens=False))

  def chat(self, messages: list, add_generation_prompt: bool) -> list[int]:
    """The token ids of ``messages`` rendered by the tokenizer's own chat template (which
    writes any BOS itself); ``add_generation_prompt`` appends the assistant-turn opening."""
    if not self._tok.chat_template:
      raise ConfigError(f"data.tokenizer={self.path!r} has no chat template, so chat messages "
                        f"cannot be rendered; use the tokenizer of a chat (instruct) model, or "
                        f"set one: tok.chat_template = open('template.jinja').read(); "
                        f"tok.save_pretrained({self.path!r}); or write prompts as plain strings")
    try:
      out = self._tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                          tokenize=True, return_dict=False)
    except ImportError as e:
      raise ConfigError(f"rendering the chat template of {self.path} needs jinja2 ({e}); "
                        f"pip install jinja2") from None
    except Exception as e:  # noqa: BLE001  (jinja's TemplateError, a template's raise_exception)
      raise ConfigError(f"the chat template of data.tokenizer={self.path!r} failed on these "
                        f"messages ({type(e).__name__}: {' '.join(str(e).split())[:200]}); check "
                        f"the roles and order the template expects") from None
    if isinstance(out, dict) or hasattr(out, "input_ids"):
      out = out["input_ids"]
    return [int(i) for i in out]

  def decode(self, ids: Sequence[int]) -> str:
    ids = [int(i) for i in ids]
    if self.eos_id in ids:
      ids = ids[:ids.index(self.eos_id)]
    return self._tok.decode(ids, skip_special_tokens=True)


def make_tokenizer(cfg: DataConfig):
  if cfg.tokenizer in CHAR_TOKENIZERS:
    return CHAR_TOKENIZERS[cfg.tokenizer]()
  return HFTokenizer(cfg.tokenizer)
