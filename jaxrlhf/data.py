"""Data: tokenizers, the built-in verifiable tasks, users' JSONL files, and fixed-shape batches.

Every batch uses one layout, shared with the rollout engine: a prompt left-padded to
``P = data.max_prompt_len`` followed by a response right-padded to ``R = data.max_response_len``
(the response ends with EOS).  So the response always starts at column ``P``.

Batches are a pure function of ``(seed, step)``: the data position saved in a checkpoint is the
step, and a resumed run sees exactly the batches it would have seen.
"""

from __future__ import annotations

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
    self.eos_id = self._tok.eos_token_id
    if self.eos_id is None:
      raise ConfigError(f"tokenizer in {path} has no eos_token; set one in tokenizer_config.json")
    self.pad_id = self._tok.pad_token_id if self._tok.pad_token_id is not None else self.eos_id
    self.bos_id = self._tok.bos_token_id
    self.vocab_size = len(self._tok)

  def encode(self, text: str) -> list[int]:
    return list(self._tok.encode(text, add_special_tokens=False))

  def decode(self, ids: Sequence[int]) -> str:
    ids = [int(i) for i in ids]
    if self.eos_id in ids:
      ids = ids[:ids.index(self.eos_id)]
    return self._tok.decode(ids, skip_special_tokens=True)


def make_tokenizer(cfg: DataConfig):
  return CharTokenizer() if cfg.tokenizer == "char" else HFTokenizer(cfg.tokenizer)


# ----------------------------------------------------------------------------- examples


@dataclasses.dataclass(frozen=True)
class Example:
  prompt: str
  answer: str = ""  # reference answer (rule rewards, exact-match eval)
  response: str = ""  # SFT target
  chosen: str = ""  # preference pair
  rejected: str = ""
  line: int = dataclasses.field(default=0, compare=False)  # line in the user's file (0: built-in)


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


# --------------------------------------------------------------------------------- JSONL

_REQUIRED = {"prompts": ("prompt",), "sft": ("prompt", "response"),
             "pairs": ("prompt", "chosen", "rejected")}


def read_jsonl(path: str, kind: str, field: str = "") -> list[Example]:
  """Reads a user's JSONL file of ``kind`` (prompts, sft, pairs), given as ``data.<field>``.
  Errors name the file and its physical line (blank lines count); examples carry their line."""
  field = field or _PATH_FIELD[kind]
  if not path:
    raise ConfigError(f"no {kind} file given; set data.{field}=FILE.jsonl")
  if not os.path.exists(path):
    raise ConfigError(f"{path}: file not found (data.{field})")
  if os.path.isdir(path):
    raise ConfigError(f"{path}: is a directory, not a JSONL file (data.{field}); give the path "
                      f"of a file with one JSON object per line like {_example(kind)}")
  required = _REQUIRED[kind]
  out = []
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
      missing = [k for k in required if not isinstance(obj.get(k), str)]
      if missing:
        raise ConfigError(f"{path}:{lineno}: missing string field(s) {', '.join(missing)}; "
                          f"each line needs {_example(kind)}")
      answer = obj.get("answer")  # optional in every kind; null is the same as absent
      if answer is not None and not isinstance(answer, str):
        raise ConfigError(f"{path}:{lineno}: field \"answer\" is {_describe(answer)}, not a "
                          f"string; write it as a string: \"answer\": "
                          f"{json.dumps(_as_text(answer))}")
      out.append(Example(prompt=obj["prompt"], answer=answer or "",
                         response=obj.get("response", ""), chosen=obj.get("chosen", ""),
                         rejected=obj.get("rejected", ""), line=lineno))
  if not out:
    raise ConfigError(f"{path}: the file is empty; it needs one JSON object per line like "
                      f"{_example(kind)}")
  return out


def _describe(value) -> str:
  if isinstance(value, bool):
    return f"the boolean {json.dumps(value)}"
  if isinstance(value, (int, float)):
    return f"the number {json.dumps(value)}"
  return f"a JSON {'array' if isinstance(value, list) else 'object'}"


def _as_text(value) -> str:
  """What a non-string answer most likely meant, written as the string to put in the file."""
  return json.dumps(value) if isinstance(value, (bool, int, float)) else "..."


_PATH_FIELD = {"prompts": "prompts_path", "sft": "sft_path", "pairs": "pairs_path"}
# The fields of each kind that batches encode (besides the prompt).
_TEXT_FIELDS = {"prompts": ("answer",), "sft": ("response", "answer"),
                "pairs": ("chosen", "rejected")}


def _example(kind):
  return json.dumps({k: "..." for k in _REQUIRED[kind]})


# ------------------------------------------------------------------------------ encoding


class Encoder:
  """Turns examples into fixed-shape numpy arrays in the shared prompt|response layout."""

  def __init__(self, cfg: DataConfig, tokenizer):
    self.cfg = cfg
    self.tok = tokenizer
    self.P = cfg.max_prompt_len
    self.R = cfg.max_response_len
    self.counts = {"data/truncated": 0, "data/skipped": 0}

  def encode(self, text: str, where: str = "", field: str = "prompt") -> list[int]:
    """``tok.encode``; an error (a character the char tokenizer lacks) names ``where`` (FILE:LINE)
    and the field."""
    try:
      return self.tok.encode(text)
    except ConfigError as e:
      if not where:
        raise
      raise ConfigError(f"{where}: \"{field}\": {e}") from None

  def prompt_ids(self, ex: Example, where: str = "") -> Optional[list[int]]:
    ids = ([self.tok.bos_id] if self.tok.bos_id is not None else []) + self.encode(ex.prompt, where)
    if len(ids) > self.P:
      policy = self.cfg.overlong
      if policy == "error":
        raise ConfigError(f"{where or 'prompt'}: prompt is {len(ids)} tokens, longer than "
                          f"data.max_prompt_len={self.P}; raise the limit or set "
                          f"data.overlong=truncate|skip")
      if policy == "skip":
        self.counts["data/skipped"] += 1
        return None
      self.counts["data/truncated"] += 1
      ids = ids[-self.P:]
    return ids

  def check(self, ex: Example, kind: str, where: str) -> Optional[Example]:
    """Checks one example of a file up front, so that errors name ``where`` (FILE:LINE) and not a
    batch: that every field it will encode is encodable (the char tokenizer rejects unknown
    characters), and the lengths of its prompt and of its response fields against
    ``data.max_prompt_len`` / ``data.max_response_len`` under ``data.overlong`` (None when the
    example is skipped).  A response longer than its slots would be cut silently: an SFT or
    preference target ending mid-text in an end token, or an answer no response can match."""
    if self.prompt_ids(ex, where) is None:
      return None
    for field in _TEXT_FIELDS[kind]:
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
    ``loss_mask`` (response tokens incl. EOS)."""
    toks, masks, lmask = [], [], []
    for ex in examples:
      p, pm = self._left(self.prompt_ids(ex))
      r, rm = self._right(self.response_ids(getattr(ex, field)), self.R)
      toks.append(np.concatenate([p, r]))
      masks.append(np.concatenate([pm, rm]))
      lmask.append(np.concatenate([np.zeros(self.P, bool), rm]))
    return {"tokens": np.stack(toks), "mask": np.stack(masks), "loss_mask": np.stack(lmask)}

  def pairs(self, examples: Sequence[Example]) -> dict:
    c = self.sequences(examples, "chosen")
    r = self.sequences(examples, "rejected")
    return {"chosen": c["tokens"], "chosen_mask": c["mask"], "chosen_loss_mask": c["loss_mask"],
            "rejected": r["tokens"], "rejected_mask": r["mask"],
            "rejected_loss_mask": r["loss_mask"]}


# ----------------------------------------------------------------------------- sources


class DataSource:
  """Examples for training (by step) and a fixed evaluation set, for one experiment."""

  def __init__(self, cfg: DataConfig, seed: int = 0):
    self.cfg = cfg
    self.seed = seed + cfg.seed
    self.tokenizer = make_tokenizer(cfg)
    self.encoder = Encoder(cfg, self.tokenizer)
    self._files: dict[tuple[str, str], list[Example]] = {}
    if cfg.task == "addition":
      self.task = AdditionTask(cfg.digits, cfg.reverse_answer)
    elif cfg.task == "jsonl":
      self.task = None
    else:
      raise ConfigError(f"data.task={cfg.task!r}: choose 'addition' or 'jsonl'")

  def _file(self, field: str, kind: str) -> list[Example]:
    """The examples of ``data.<field>`` read as ``kind``, each checked once (:meth:`Encoder.check`)
    with what ``data.overlong`` did reported; the same for training and evaluation files."""
    if (field, kind) not in self._files:
      path = getattr(self.cfg, field)
      examples = read_jsonl(path, kind, field)
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
    """The ``n`` training examples of batch ``step`` (deterministic in seed, stream, step)."""
    rng = np.random.default_rng([self.seed, stream, step])
    if self.task is not None:
      return self.task.sample(rng, n, "train")
    pool = self._file(_PATH_FIELD[kind], kind)
    return [pool[int(i)] for i in rng.integers(0, len(pool), size=n)]

  def eval_examples(self, kind: str = "prompts") -> list[Example]:
    if self.task is not None:
      return self.task.sample(np.random.default_rng([self.seed, 999_999]), self.cfg.eval_size,
                              "eval")
    # data.eval_path gets the same checks and data.overlong policy as the training files: an
    # over-long held-out prompt is an error at its line, or is truncated or skipped and counted.
    field = "eval_path" if self.cfg.eval_path else _PATH_FIELD[kind]
    return self._file(field, kind)[: self.cfg.eval_size]
