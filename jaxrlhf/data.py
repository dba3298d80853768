"""Data: tokenizers, the built-in verifiable tasks, users' files (JSONL, Parquet, datasets
folders; plain text or chat messages rendered with the tokenizer's template), and fixed-shape
batches.

Every batch uses one layout, shared with the rollout engine: a prompt left-padded to
``P = data.max_prompt_len`` followed by a response right-padded to ``R = data.max_response_len``
(the response ends with EOS).  So the response always starts at column ``P``.

Batches are a pure function of ``(seed, step)``: the data position saved in a checkpoint is the
step, and a resumed run sees exactly the batches it would have seen.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from typing import Optional, Sequence

import numpy as np

from jaxrlhf.config import ConfigError, DataConfig

PAD, BOS, EOS = 0, 1, 2


# ---------------------------------------------------------------------------- tokenizers


class CharTokenizer:
  """A character tokenizer for the synthetic tasks: ids 0-2 are pad/bos/eos."""

  chars = "0123456789+-*=() abcdefghijklmnopqrstuvwxyz?:"

  def __init__(self):
    self.pad_id, self.bos_id, self.eos_id = PAD, BOS, EOS
    self._to_id = {c: i + 3 for i, c in enumerate(self.chars)}
    self.vocab_size = 3 + len(self.chars)

  def encode(self, text: str) -> list[int]:
    try:
      return [self._to_id[c] for c in text]
    except KeyError as e:
      raise ConfigError(f"character {e.args[0]!r} is not in the built-in char tokenizer "
                        f"({self.chars!r}); remove it, or set data.tokenizer to a tokenizer "
                        f"directory") from None

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


class HFTokenizer:
  """A transformers tokenizer from a local directory (no hub access)."""

  # One of these must be in the folder; without any, transformers fails with a message about
  # its backends that does not name the folder.
  FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt",
           "tokenizer.model", "spiece.model")

  def __init__(self, path: str):
    if not os.path.isdir(path):
      raise ConfigError(f"data.tokenizer={path!r} is not a directory; give a local tokenizer "
                        f"folder (tokenizer.json / tokenizer_config.json) or 'char'")
    if not any(os.path.isfile(os.path.join(path, f)) for f in self.FILES):
      raise ConfigError(f"data.tokenizer={path!r}: no tokenizer files in this folder (looked for "
                        f"{', '.join(self.FILES)}); save the tokenizer there with "
                        f"tokenizer.save_pretrained(DIR), or point data.tokenizer at the "
                        f"model's folder")
    from transformers import AutoTokenizer
    try:
      self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
      reason = " ".join(str(e).split())[:300]  # one line, however transformers wraps it
      raise ConfigError(f"data.tokenizer={path!r}: transformers cannot load a tokenizer from "
                        f"this folder ({type(e).__name__}: {reason}); re-save it with "
                        f"tokenizer.save_pretrained(DIR), or point data.tokenizer at the "
                        f"model's folder") from None
    self.path = path
    self.eos_id = self._tok.eos_token_id
    if self.eos_id is None:
      raise ConfigError(f"tokenizer in {path} has no eos_token; set one in tokenizer_config.json")
    self.pad_id = self._tok.pad_token_id if self._tok.pad_token_id is not None else self.eos_id
    self.bos_id = self._tok.bos_token_id
    self.vocab_size = len(self._tok)

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
  return CharTokenizer() if cfg.tokenizer == "char" else HFTokenizer(cfg.tokenizer)


# ----------------------------------------------------------------------------- examples


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


# ---------------------------------------------------------------------------- user files

# What a row of each kind needs (besides the alternatives _to_example accepts: "messages"
# for SFT, whole conversations as "chosen"/"rejected" for pairs).
_REQUIRED = {"prompts": ("prompt",), "sft": ("prompt", "response"),
             "pairs": ("prompt", "chosen", "rejected"),
             "unpaired": ("prompt", "completion")}  # and "label": true|false
_PATH_FIELD = {"prompts": "prompts_path", "sft": "sft_path", "pairs": "pairs_path",
               "unpaired": "unpaired_path"}
# The fields of each kind that batches encode (besides the prompt).
_TEXT_FIELDS = {"prompts": ("answer",), "sft": ("response", "answer"),
                "pairs": ("chosen", "rejected"), "unpaired": ("completion",)}
FORMATS = ("jsonl", "parquet", "hf_disk")


def _example(kind):
  row = {k: "..." for k in _REQUIRED[kind]}
  if kind == "unpaired":
    row["label"] = True
  return json.dumps(row)


def detect_format(path: str, fmt: str = "auto") -> str:
  """``data.format``, or for "auto": "hf_disk" for a folder written by ``save_to_disk``,
  "parquet" for a ``.parquet`` file, else "jsonl"."""
  if fmt != "auto":
    return fmt
  if os.path.isdir(path):
    return "hf_disk" if any(os.path.isfile(os.path.join(path, f)) for f in
                            ("dataset_info.json", "state.json", "dataset_dict.json")) else "jsonl"
  return "parquet" if path.lower().endswith((".parquet", ".pq")) else "jsonl"


def _jsonl_rows(path: str, kind: str, field: str):
  """``(line, object)`` for each non-blank line; errors name the file and physical line."""
  if os.path.isdir(path):
    raise ConfigError(f"{path}: is a directory, not a JSONL file (data.{field}); give the path "
                      f"of a file with one JSON object per line like {_example(kind)}, a .parquet "
                      f"file, or a folder written by datasets' save_to_disk")
  try:
    f = open(path, "rb")  # decoded line by line, so that a bad byte is reported at its line
  except OSError as e:
    raise ConfigError(f"{path}: cannot be read ({e.strerror}) (data.{field}); check the path "
                      f"and its permissions") from None
  with f:
    for lineno, raw in enumerate(f, 1):
      try:
        line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
      except UnicodeDecodeError as e:
        raise ConfigError(f"{path}:{lineno}: not UTF-8 text (byte 0x{raw[e.start]:02x} at "
                          f"column {e.start + 1}); save the file as UTF-8 (from Latin-1: "
                          f"iconv -f latin1 -t utf-8 {path} > NEW.jsonl)") from None
      if not line.strip():
        continue
      try:
        obj = json.loads(line)
      except json.JSONDecodeError as e:
        raise ConfigError(f"{path}:{lineno}: not valid JSON ({e.msg}); each line must be one "
                          f"JSON object like {_example(kind)}") from None
      if not isinstance(obj, dict):
        raise ConfigError(f"{path}:{lineno}: expected a JSON object like {_example(kind)}")
      yield lineno, obj


def _parquet_rows(path: str, field: str):
  """``(row, record)`` with rows counted from 1, like lines."""
  try:
    import pyarrow.parquet as pq
  except ImportError:
    raise ConfigError(f"{path} (data.{field}) is a Parquet file, which needs pyarrow; pip "
                      f"install 'jaxrlhf[data]'") from None
  if os.path.isdir(path):
    raise ConfigError(f"{path} (data.{field}): data.format=parquet reads one .parquet file, not "
                      f"a folder; give a file (or data.format=auto for a save_to_disk folder)")
  try:
    table = pq.read_table(path)
  except Exception as e:  # noqa: BLE001  (pyarrow's ArrowInvalid, OSError...)
    raise ConfigError(f"{path}: not a readable Parquet file (data.{field}): {type(e).__name__}: "
                      f"{' '.join(str(e).split())[:200]}; write it with "
                      f"pandas.DataFrame.to_parquet or pyarrow.parquet.write_table") from None
  yield from enumerate(table.to_pylist(), 1)


def _hf_disk_rows(path: str, field: str):
  """Rows of a folder written by ``datasets.Dataset.save_to_disk``, counted from 1."""
  try:
    import datasets
  except ImportError:
    raise ConfigError(f"{path} (data.{field}) is a datasets folder, which needs the datasets "
                      f"package; pip install 'jaxrlhf[data]'") from None
  if os.path.isfile(os.path.join(path, "dataset_dict.json")):
    with open(os.path.join(path, "dataset_dict.json")) as f:
      splits = json.load(f).get("splits", [])
    raise ConfigError(f"{path} (data.{field}) holds several splits ({', '.join(splits)}); point "
                      f"data.{field} at one of them, e.g. {os.path.join(path, splits[0] if splits else 'train')}")
  try:
    ds = datasets.load_from_disk(path)
  except Exception as e:  # noqa: BLE001  (FileNotFoundError, datasets' own errors)
    raise ConfigError(f"{path}: datasets.load_from_disk cannot read this folder (data.{field}): "
                      f"{type(e).__name__}: {' '.join(str(e).split())[:200]}; write it with "
                      f"Dataset.save_to_disk(DIR)") from None
  yield from enumerate(ds.to_list(), 1)


def _field_map(fields: Sequence[str]) -> dict[str, str]:
  return {src.strip(): dst.strip() for src, _, dst in (f.partition(":") for f in fields)}


def _describe(value) -> str:
  if isinstance(value, bool):
    return f"the boolean {json.dumps(value)}"
  if isinstance(value, (int, float)):
    return f"the number {json.dumps(value)}"
  if isinstance(value, list):
    return "a JSON array"
  return f"a JSON object" if isinstance(value, dict) else f"a {type(value).__name__}"


def _as_text(value) -> str:
  """What a non-string answer most likely meant, written as the string to put in the file."""
  return json.dumps(value) if isinstance(value, (bool, int, float)) else "..."


def _messages(value, where: str, name: str) -> Optional[Chat]:
  """``value`` as chat messages, or None when it is not a list; errors name ``where``."""
  if not isinstance(value, (list, tuple)):
    return None
  if not value:
    raise ConfigError(f"{where}: \"{name}\" is an empty list of messages; give at least one "
                      f"{{\"role\": ..., \"content\": ...}}")
  for i, m in enumerate(value):
    if not (isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)):
      raise ConfigError(f"{where}: \"{name}\"[{i}] is not a chat message; each message is "
                        f"{{\"role\": \"user\" | \"assistant\" | \"system\", \"content\": "
                        f"\"TEXT\"}} (got {json.dumps(m, default=str)[:80]})")
  return Chat.of(value)


def _text(obj: dict, name: str, where: str, kind: str) -> "str | Chat":
  value = obj.get(name)
  if isinstance(value, str):
    return value
  chat = _messages(value, where, name)
  if chat is None:
    raise ConfigError(f"{where}: missing string field(s) {name}; each line needs "
                      f"{_example(kind)} (a prompt or response may also be a list of chat "
                      f"messages)")
  return chat


def _last_assistant(msgs: list, where: str, name: str) -> int:
  idx = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
  if not idx:
    raise ConfigError(f"{where}: \"{name}\" has no assistant message; a conversation to train "
                      f"on needs the assistant's reply")
  if idx[-1] != len(msgs) - 1:
    raise ConfigError(f"{where}: \"{name}\" ends with a {msgs[-1]['role']!r} message after the "
                      f"last assistant reply; end each conversation with the assistant turn to "
                      f"train on (drop the trailing messages)")
  return idx[-1]


def _to_example(obj: dict, kind: str, where: str, line: int) -> Example:
  """One row (after ``data.fields`` renames) as an :class:`Example`; errors name ``where``."""
  answer = obj.get("answer")  # optional in every kind; null is the same as absent
  if answer is not None and not isinstance(answer, str):
    raise ConfigError(f"{where}: field \"answer\" is {_describe(answer)}, not a string; write "
                      f"it as a string: \"answer\": {json.dumps(_as_text(answer))} (a table "
                      f"column: cast it to string)")
  extra = {k: v for k, v in obj.items()
           if k not in ("prompt", "answer", "response", "chosen", "rejected", "messages",
                        "completion", "label")}
  fields = {}
  if kind == "unpaired":
    label = obj.get("label")
    if not isinstance(label, bool):
      raise ConfigError(f"{where}: field \"label\" is {_describe(label)}, not true or false; "
                        f"each line needs {_example(kind)} (true: a desirable completion)")
    fields["label"] = label
  if kind == "sft" and "messages" in obj and "prompt" not in obj:  # not a stage name
    msgs = _messages(obj["messages"], where, "messages")
    if msgs is None:
      raise ConfigError(f"{where}: \"messages\" must be a list of chat messages "
                        f"[{{\"role\": ..., \"content\": ...}}, ...]")
    m = msgs.messages
    k = _last_assistant(m, where, "messages")
    if k == 0:
      raise ConfigError(f"{where}: \"messages\" starts with the assistant's reply; put the user "
                        f"turn (the prompt) before it")
    fields = dict(prompt=Chat.of(m[:k]), response=Chat.of(m[k:]))
  elif kind == "pairs" and "prompt" not in obj and all(
      isinstance(obj.get(n), list) for n in ("chosen", "rejected")):
    # Whole conversations: the prompt is the messages both share.
    c = _messages(obj["chosen"], where, "chosen").messages
    r = _messages(obj["rejected"], where, "rejected").messages
    n = 0
    while n < min(len(c), len(r)) and c[n] == r[n]:
      n += 1
    if n == 0:
      raise ConfigError(f"{where}: \"chosen\" and \"rejected\" share no first message, so there "
                        f"is no prompt; add a \"prompt\" field, or start both with the same "
                        f"user turn")
    for name, conv in (("chosen", c), ("rejected", r)):
      if len(conv) != n + 1 or conv[n]["role"] != "assistant":
        raise ConfigError(f"{where}: after the shared prompt, \"{name}\" must be one assistant "
                          f"message (it has {len(conv) - n} message(s) more)")
    fields = dict(prompt=Chat.of(c[:n]), chosen=Chat.of(c[n:]), rejected=Chat.of(r[n:]))
  else:
    missing = [k for k in _REQUIRED[kind] if not isinstance(obj.get(k), (str, list))]
    if missing:
      alt = {"sft": " or {\"messages\": [...]}",
             "pairs": " or {\"chosen\": [messages], \"rejected\": [messages]}"}.get(kind, "")
      raise ConfigError(f"{where}: missing string field(s) {', '.join(missing)}; each line "
                        f"needs {_example(kind)}{alt}")
    fields.update({k: _text(obj, k, where, kind) for k in _REQUIRED[kind]})
    for k in _REQUIRED[kind][1:]:
      if isinstance(fields[k], Chat):
        m = fields[k].messages
        if len(m) != 1 or m[0]["role"] != "assistant":
          raise ConfigError(f"{where}: \"{k}\" as messages must be one assistant message "
                            f"[{{\"role\": \"assistant\", \"content\": ...}}] (put earlier "
                            f"turns in \"prompt\")")
  return Example(answer=answer or "", line=line, extra=extra, **fields)


def read_examples(path: str, kind: str, field: str = "", fmt: str = "auto",
                  fields: Sequence[str] = ()) -> list[Example]:
  """Reads a user's file of ``kind`` (prompts, sft, pairs), given as ``data.<field>``, in
  format ``fmt`` (see :func:`detect_format`), with the ``data.fields`` renames.  Errors name
  the file and its line (JSONL, blank lines count) or row (tables, from 1); examples carry it."""
  field = field or _PATH_FIELD[kind]
  if not path:
    raise ConfigError(f"no {kind} file given; set data.{field}=FILE.jsonl (or a .parquet file, or a "
                      f"datasets save_to_disk folder)")
  if not os.path.exists(path):
    raise ConfigError(f"{path}: file not found (data.{field})")
  fmt = detect_format(path, fmt)
  rows = {"jsonl": lambda: _jsonl_rows(path, kind, field),
          "parquet": lambda: _parquet_rows(path, field),
          "hf_disk": lambda: _hf_disk_rows(path, field)}[fmt]()
  renames = _field_map(fields)
  out = []
  for line, obj in rows:
    where = f"{path}:{line}"
    if renames:
      absent = [s for s in renames if s not in obj]
      if absent:
        raise ConfigError(f"{where}: data.fields renames {', '.join(map(repr, absent))}, but this "
                          f"row has no such field (it has: {', '.join(map(str, obj))}); fix "
                          f"data.fields=SOURCE:TARGET,...")
      clash = [k for k in obj if k not in renames and k in renames.values()]
      if clash:
        src = next(s for s, d in renames.items() if d == clash[0])
        raise ConfigError(f"{where}: data.fields renames {src!r} to {clash[0]!r}, but this row "
                          f"already has a {clash[0]!r} field, which would be lost; rename that "
                          f"one too (e.g. data.fields={src}:{clash[0]},{clash[0]}:original_"
                          f"{clash[0]}) or drop the column")
      obj = {renames.get(k, k): v for k, v in obj.items()}
    out.append(_to_example(obj, kind, where, line))
  if not out:
    raise ConfigError(f"{path}: the file is empty; it needs one JSON object per line like "
                      f"{_example(kind)}" if fmt == "jsonl" else
                      f"{path}: no rows (data.{field}); it needs rows like {_example(kind)}")
  return out


def read_jsonl(path: str, kind: str, field: str = "") -> list[Example]:
  """A JSONL file of ``kind`` (see :func:`read_examples`)."""
  return read_examples(path, kind, field, "jsonl")


# ------------------------------------------------------------------------------ encoding


def _as_chat(value: "str | Chat", role: str) -> list[dict]:
  return value.messages if isinstance(value, Chat) else [{"role": role, "content": value}]


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
      ids = ([self.tok.bos_id] if self.tok.bos_id is not None else []) + self.encode(ex.prompt,
                                                                                      where)
    cut = self._fit_prompt(ids, where)
    return None if cut is None else ids[cut:]

  @staticmethod
  def is_chat(ex: Example, field: str = "") -> bool:
    return isinstance(ex.prompt, Chat) or (bool(field) and isinstance(getattr(ex, field), Chat))

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


# ----------------------------------------------------------------------------- sources


class DataSource:
  """Examples for training (by step) and a fixed evaluation set per kind, for one experiment."""

  def __init__(self, cfg: DataConfig, seed: int = 0):
    self.cfg = cfg
    self.seed = seed + cfg.seed
    self.tokenizer = make_tokenizer(cfg)
    self.encoder = Encoder(cfg, self.tokenizer)
    self._files: dict[tuple[str, str], list[Example]] = {}
    self._said: set[str] = set()
    if cfg.task == "addition":
      self.task = AdditionTask(cfg.digits, cfg.reverse_answer)
    elif cfg.task == "jsonl":
      self.task = None
    else:
      raise ConfigError(f"data.task={cfg.task!r}: choose 'addition' or 'jsonl' (your files: "
                        f"JSONL, Parquet or datasets folders)")

  def _file(self, field: str, kind: str) -> list[Example]:
    """The examples of ``data.<field>`` read as ``kind``, each checked once (:meth:`Encoder.check`)
    with what ``data.overlong`` did reported; the same for training and evaluation files."""
    if (field, kind) not in self._files:
      path = getattr(self.cfg, field)
      examples = read_examples(path, kind, field, self.cfg.format, self.cfg.fields)
      before = dict(self.encoder.counts)
      kept = [ex for ex in examples if self.encoder.check(ex, kind, f"{path}:{ex.line}")]
      if not kept:
        raise ConfigError(f"{path}: every example (data.{field}) was skipped as over-long "
                          f"(data.max_prompt_len={self.cfg.max_prompt_len}, data.max_response_len="
                          f"{self.cfg.max_response_len}, data.overlong=skip); raise the limits or "
                          f"shorten the examples")
      dropped = len(examples) - len(kept)
      truncated = self.encoder.counts["data/truncated"] - before["data/truncated"]
      if dropped or truncated:
        # Never silent: say what the data.overlong policy did to this file.
        print(f"{path}: {dropped} over-long example(s) skipped, {truncated} truncated to "
              f"data.max_prompt_len={self.cfg.max_prompt_len} / data.max_response_len="
              f"{self.cfg.max_response_len} (data.overlong={self.cfg.overlong}); "
              f"{len(kept)} examples kept")
      self._files[(field, kind)] = kept
    return self._files[(field, kind)]

  def _split(self, field: str, kind: str) -> tuple[list[Example], list[Example]]:
    """``(train, held_out)`` of a training file: with ``data.eval_split > 0`` a fixed random
    part (by ``data.seed``) is held out and never trained on; else nothing is."""
    examples = self._file(field, kind)
    frac = self.cfg.eval_split
    if frac <= 0:
      return examples, []
    n_eval = max(1, int(round(frac * len(examples))))
    if n_eval >= len(examples):
      path = getattr(self.cfg, field)
      raise ConfigError(f"data.eval_split={frac} of the {len(examples)} examples in {path} "
                        f"(data.{field}) leaves none to train on; lower data.eval_split or give "
                        f"a held-out file")
    order = np.random.default_rng([self.cfg.seed, 7_777]).permutation(len(examples))
    held = set(int(i) for i in order[:n_eval])
    return ([ex for i, ex in enumerate(examples) if i not in held],
            [ex for i, ex in enumerate(examples) if i in held])

  def check_answers(self, sources: Sequence[str], setting: str,
                    weights: Optional[Sequence[float]] = None) -> None:
    """Stops a run up front when a reward source that compares responses with the reference
    answer (:func:`jaxrlhf.rewards.reads_answer`) meets training prompts without one: an empty
    answer would reward empty responses.  ``setting`` names where ``sources`` come from (e.g.
    ``grpo.reward.sources``); sources with weight 0 are off and need nothing."""
    from jaxrlhf.rewards import reads_answer  # rewards imports jax; data stays numpy-only
    weights = weights if weights is not None else [1.0] * len(sources)
    needy = [s for s, w in zip(sources, weights) if w != 0 and reads_answer(s)]
    if not needy or self.task is not None:  # the built-in task always has answers
      return
    examples = self._file("prompts_path", "prompts")
    lacking = [ex for ex in examples if not ex.answer]
    if lacking:
      path, names = self.cfg.prompts_path, " and ".join(needy)
      raise ConfigError(
          f"{path}:{lacking[0].line}: {len(lacking)} of the {len(examples)} prompts in {path} "
          f"lack \"answer\" (the first on this line), but {setting} uses {names}, which "
          f"compares each response with it (an empty answer rewards empty responses); add an "
          f"\"answer\" to every line, or drop {names} from {setting}")

  def examples(self, kind: str, step: int, n: int, stream: int = 0) -> list[Example]:
    """The ``n`` training examples of batch ``step`` (deterministic in seed, stream, step);
    examples held out by ``data.eval_split`` never appear."""
    if kind == "unpaired" and (self.task is not None or not self.cfg.unpaired_path):
      # Derived from the pairs: each pair's two sides, the batch half desirable.
      pairs = self.examples("pairs", step, (n + 1) // 2, stream)
      return [u for ex in pairs for u in ex.unpaired()][:n]
    rng = np.random.default_rng([self.seed, stream, step])
    if self.task is not None:
      return self.task.sample(rng, n, "train")
    pool = self._split(_PATH_FIELD[kind], kind)[0]
    return [pool[int(i)] for i in rng.integers(0, len(pool), size=n)]

  def eval_source(self, kind: str = "prompts") -> tuple[str, str]:
    """Where the evaluation examples of ``kind`` come from: ``(field, how)``, ``how`` one of
    "file" (a held-out file), "split" (held out of the training file by data.eval_split) or
    "train" (the first training examples: not held out)."""
    own = f"{kind}_eval_path"
    if getattr(self.cfg, own, ""):
      return own, "file"
    if self.cfg.eval_path:
      return "eval_path", "file"
    field = _PATH_FIELD[kind]
    if kind == "prompts" and not self.cfg.prompts_path:
      # No prompts file (an SFT or DPO run): the prompts (and any answers) of the file it has,
      # a DPO run's held-out pairs included.
      if self.cfg.sft_path:
        field = "sft_path"
      elif self.cfg.pairs_path:
        return self.eval_source("pairs")
    return field, ("split" if self.cfg.eval_split > 0 else "train")

  def eval_examples(self, kind: str = "prompts") -> list[Example]:
    """The fixed evaluation set of ``kind`` ("prompts": greedy answers checked against
    "answer"; "pairs": preference accuracy), at most ``data.eval_size``; where it comes from is
    said on the console once (:meth:`eval_source`)."""
    if self.task is not None:
      return self.task.sample(np.random.default_rng([self.seed, 999_999]), self.cfg.eval_size,
                              "eval")
    # An evaluation file gets the same checks and data.overlong policy as the training files: an
    # over-long held-out prompt is an error at its line, or is truncated or skipped and counted.
    field, how = self.eval_source(kind)
    read_as = {"sft_path": "sft", "pairs_path": "pairs", "pairs_eval_path": "pairs"}.get(field,
                                                                                        kind)
    path = getattr(self.cfg, field)
    if how == "file":
      examples = self._file(field, read_as)[: self.cfg.eval_size]
      note = f"{len(examples)} held-out examples from data.{field}={path}"
    elif how == "split":
      examples = self._split(field, read_as)[1][: self.cfg.eval_size]
      note = (f"{len(examples)} examples held out of data.{field}={path} by data.eval_split="
              f"{self.cfg.eval_split:g} (not trained on)")
    else:
      examples = self._file(field, read_as)[: self.cfg.eval_size]
      note = (f"the first {len(examples)} examples of the training file data.{field}={path}, "
              f"which are also trained on (not held out); set data.{kind}_eval_path=FILE or "
              f"data.eval_split=0.05 for a held-out set")
    if kind not in self._said:
      self._said.add(kind)
      what = "exact match" if kind == "prompts" else "pair accuracy"
      print(f"evaluation ({what}, {kind}): {note}", flush=True)
    return examples
