"""Users' files: JSONL, Parquet and ``datasets.save_to_disk`` folders, columns mapped by
``data.fields``, plain text or chat messages; every bad row is an error at ``FILE:ROW``."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Optional, Sequence

from jaxrlhf.config import ConfigError, one_line
from jaxrlhf.data.examples import Chat, Example


# What a row of each kind needs (besides the alternatives _to_example accepts: "messages"
# for SFT, whole conversations as "chosen"/"rejected" for pairs).
# ("sft" here and below: not a stage name, the kind of file data.sft_path names.)
_REQUIRED = {"prompts": ("prompt",), "sft": ("prompt", "response"),  # not a stage name
             "pairs": ("prompt", "chosen", "rejected"),
             "unpaired": ("prompt", "completion")}  # and "label": true|false


_PATH_FIELD = {"prompts": "prompts_path", "sft": "sft_path",  # not a stage name
               "pairs": "pairs_path", "unpaired": "unpaired_path"}


# The fields of each kind that batches encode (besides the prompt).
_TEXT_FIELDS = {"prompts": ("answer",), "sft": ("response", "answer"),  # not a stage name
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
    rows = pq.read_table(path).to_pylist()
  except Exception as e:  # noqa: BLE001  (pyarrow's ArrowInvalid, OSError...)
    raise ConfigError(f"{path}: not a readable Parquet file (data.{field}): {one_line(e)}; "
                      f"write it again with pandas.DataFrame.to_parquet or "
                      f"pyarrow.parquet.write_table (a file cut short by a copy or download "
                      f"has no footer)") from None
  yield from enumerate(rows, 1)


def _hf_disk_rows(path: str, field: str):
  """Rows of a folder written by ``datasets.Dataset.save_to_disk``, counted from 1."""
  try:
    import datasets
  except ImportError:
    raise ConfigError(f"{path} (data.{field}) is a datasets folder, which needs the datasets "
                      f"package; pip install 'jaxrlhf[data]'") from None
  if os.path.isfile(os.path.join(path, "dataset_dict.json")):
    try:
      with open(os.path.join(path, "dataset_dict.json")) as f:
        splits = list(json.load(f).get("splits", []))
    except (ValueError, AttributeError, TypeError) as e:
      raise ConfigError(f"{os.path.join(path, 'dataset_dict.json')}: not a datasets split list "
                        f"({one_line(e)}); write the folder again with "
                        f"DatasetDict.save_to_disk(DIR)") from None
    raise ConfigError(f"{path} (data.{field}) holds several splits ({', '.join(splits)}); point "
                      f"data.{field} at one of them, e.g. {os.path.join(path, splits[0] if splits else 'train')}")
  try:
    rows = datasets.load_from_disk(path).to_list()
  except Exception as e:  # noqa: BLE001  (FileNotFoundError, datasets' own errors)
    raise ConfigError(f"{path}: datasets.load_from_disk cannot read this folder (data.{field}): "
                      f"{one_line(e)}; write it again with Dataset.save_to_disk(DIR)") from None
  yield from enumerate(rows, 1)


def _field_map(fields: Sequence[str]) -> dict[str, str]:
  return {src.strip(): dst.strip() for src, _, dst in (f.partition(":") for f in fields)}


def _describe(value) -> str:
  if isinstance(value, bool):
    return f"the boolean {json.dumps(value)}"
  if isinstance(value, (int, float)):
    return f"the number {json.dumps(value)}"
  if isinstance(value, list):
    return "a JSON array"
  return "a JSON object" if isinstance(value, dict) else f"a {type(value).__name__}"


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


_HH_TURN = re.compile(r"\n\n(Human|Assistant): ?")


def hh_messages(text: str, where: str, name: str) -> list[dict]:
  """An Anthropic HH-RLHF transcript (``"\\n\\nHuman: ...\\n\\nAssistant: ..."``) as chat
  messages, user and assistant turns in order; errors name ``where``."""
  parts = _HH_TURN.split(text)
  if parts[0].strip() or len(parts) < 3:
    raise ConfigError(f"{where}: \"{name}\" is not an HH transcript (data.transcripts=hh): it "
                      f"must start with \"\\n\\nHuman: \" and alternate \"\\n\\nHuman: \" / "
                      f"\"\\n\\nAssistant: \" turns (got {text[:60]!r}); set data.transcripts= "
                      f"for plain text")
  roles = {"Human": "user", "Assistant": "assistant"}
  return [{"role": roles[who], "content": body.strip()}
          for who, body in zip(parts[1::2], parts[2::2])]


class SkipRow(Exception):
  """A row :class:`RowShape` leaves out (counted and reported, never silently)."""


@dataclasses.dataclass(frozen=True)
class RowShape:
  """How each row's text is read before it becomes an :class:`Example` (``DataConfig``'s
  ``transcripts``, ``chat``, ``prompt_template`` and ``answer_pattern``)."""

  transcripts: str = ""
  chat: bool = False
  prompt_template: str = ""
  answer_pattern: str = ""

  @classmethod
  def of(cls, cfg) -> "RowShape":
    return cls(cfg.transcripts, cfg.chat, cfg.prompt_template, cfg.answer_pattern)

  def __call__(self, obj: dict, kind: str, where: str) -> dict:
    obj = dict(obj)
    texts = ("prompt",) + _TEXT_FIELDS[kind]
    if self.transcripts == "hh":
      for name in texts:
        if name != "answer" and isinstance(obj.get(name), str) and obj[name].strip():
          obj[name] = hh_messages(obj[name], where, name)
      if kind == "pairs" and "prompt" not in obj and all(
          isinstance(obj.get(n), list) for n in ("chosen", "rejected")):
        c, r = obj["chosen"], obj["rejected"]
        n = 0
        while n < min(len(c), len(r)) and c[n] == r[n]:
          n += 1
        if not (n and len(c) == len(r) == n + 1 and c[n]["role"] == r[n]["role"] == "assistant"):
          # Scraped transcripts hold a few of these (a turn pasted into a reply, sides that
          # part before the last reply): no pair to learn from, skipped and counted.
          raise SkipRow("sides that differ before their last assistant reply")
    if self.answer_pattern:
      source = "answer" if isinstance(obj.get("answer"), str) else "response"
      text = obj.get(source)
      m = re.search(self.answer_pattern, text, re.MULTILINE) if isinstance(text, str) else None
      if m is None:
        raise ConfigError(f"{where}: data.answer_pattern={self.answer_pattern!r} finds no answer "
                          f"in \"{source}\" ({str(text)[-60:]!r}); fix the pattern (its first "
                          f"group is the answer) or the row")
      obj["answer"] = (m.group(1) if m.groups() else m.group(0)).strip()
    if self.prompt_template and isinstance(obj.get("prompt"), str):
      obj["prompt"] = self.prompt_template.replace("{prompt}", obj["prompt"])
    if self.chat:
      for name in texts:
        if name != "answer" and isinstance(obj.get(name), str):
          obj[name] = [{"role": "user" if name == "prompt" else "assistant",
                        "content": obj[name]}]
    return obj


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
      alt = {"sft": " or {\"messages\": [...]}",  # not a stage name
             "pairs": " or {\"chosen\": [messages], \"rejected\": [messages]}"}.get(kind, "")
      others = [k for k, v in obj.items() if isinstance(v, (str, list)) and k not in missing]
      rename = (f"; this row has {', '.join(map(repr, others))}: name the one to use with "
                f"data.fields={others[0]}:{missing[0]}" if others else "")
      raise ConfigError(f"{where}: missing string field(s) {', '.join(missing)}; each line "
                        f"needs {_example(kind)}{alt}{rename}")
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
                  fields: Sequence[str] = (), shape: RowShape = RowShape()) -> list[Example]:
  """Reads a user's file of ``kind`` (prompts, sft, pairs), given as ``data.<field>``, in
  format ``fmt`` (see :func:`detect_format`), with the ``data.fields`` renames, then read as
  ``shape`` says.  Errors name the file and its line (JSONL, blank lines count) or row (tables,
  from 1); examples carry it."""
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
  out, skipped = [], {}
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
    try:
      obj = shape(obj, kind, where)
    except SkipRow as e:
      skipped.setdefault(str(e), []).append(line)
      continue
    out.append(_to_example(obj, kind, where, line))
  for why, lines in skipped.items():
    print(f"{path}: {len(lines)} row(s) with {why} skipped (data.transcripts="
          f"{shape.transcripts}; rows {', '.join(map(str, lines[:5]))}"
          f"{', ...' if len(lines) > 5 else ''})")
  if not out:
    raise ConfigError(f"{path}: the file is empty; it needs one JSON object per line like "
                      f"{_example(kind)}" if fmt == "jsonl" else
                      f"{path}: no rows (data.{field}); it needs rows like {_example(kind)}")
  return out


def read_jsonl(path: str, kind: str, field: str = "") -> list[Example]:
  """A JSONL file of ``kind`` (see :func:`read_examples`)."""
  return read_examples(path, kind, field, "jsonl")
