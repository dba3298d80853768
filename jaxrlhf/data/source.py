"""Where a run's examples come from (a built-in task or the user's files, training and
evaluation sets per kind), drawn as a pure function of ``(seed, step)``."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from jaxrlhf.config import ConfigError, DataConfig
from jaxrlhf.data.tokenizers import make_tokenizer
from jaxrlhf.data.examples import AdditionTask, Example
from jaxrlhf.data.tasks import CalculatorTask, GuessTask
from jaxrlhf.data.files import _PATH_FIELD, RowShape, read_examples
from jaxrlhf.data.encoding import Encoder


def _rows(lines: list, limit: int = 5) -> str:
  """``rows 1, 4, 9, ...``: the first ``limit`` of a file's rows (JSONL lines, table rows)."""
  return ("row " if len(lines) == 1 else "rows ") + ", ".join(map(str, lines[:limit])) + (
      ", ..." if len(lines) > limit else "")


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
    elif cfg.task == "calculator":
      if cfg.tokenizer == "char":
        raise ConfigError("data.task=calculator writes <calc>...</calc> tool calls, which the "
                          "char tokenizer cannot spell; set data.tokenizer=char_tools")
      self.task = CalculatorTask()
    elif cfg.task == "guess":
      self.task = GuessTask()
    elif cfg.task == "jsonl":
      self.task = None
    else:
      raise ConfigError(f"data.task={cfg.task!r}: choose 'addition', 'calculator', 'guess' "
                        f"(the built-in tasks; the last two are multi-turn, for env.name) or "
                        f"'jsonl' (your files: JSONL, Parquet or datasets folders)")

  def _file(self, field: str, kind: str) -> list[Example]:
    """The examples of ``data.<field>`` read as ``kind``, each checked once (:meth:`Encoder.check`):
    degenerate ones (:meth:`Encoder.degenerate`: an empty prompt or turn to train on) skipped,
    and those and what ``data.overlong`` did reported on the console; ConfigError when none is
    left.  The same for training and evaluation files."""
    if (field, kind) not in self._files:
      path = getattr(self.cfg, field)
      examples = read_examples(path, kind, field, self.cfg.format, self.cfg.fields,
                               RowShape.of(self.cfg))
      before = dict(self.encoder.counts)
      kept, empty = [], {}
      for ex in examples:
        where = f"{path}:{ex.line}"
        why = self.encoder.degenerate(ex, kind, where)
        if why:
          empty.setdefault(why, []).append(ex.line)
        elif self.encoder.check(ex, kind, where):
          kept.append(ex)
      overlong = self.encoder.counts["data/skipped"] - before["data/skipped"]
      truncated = self.encoder.counts["data/truncated"] - before["data/truncated"]
      self.encoder.counts["data/skipped"] += sum(map(len, empty.values()))
      # Never silent: what was skipped (and why), and what data.overlong did to this file.
      said = [f"{len(lines)} with {why} ({_rows(lines)})" for why, lines in empty.items()]
      if not kept:
        if not empty:
          raise ConfigError(f"{path}: every example (data.{field}) was skipped as over-long "
                            f"(data.max_prompt_len={self.cfg.max_prompt_len}, data."
                            f"max_response_len={self.cfg.max_response_len}, data.overlong=skip); "
                            f"raise the limits or shorten the examples")
        if overlong:
          said.append(f"{overlong} over-long (data.overlong=skip)")
        raise ConfigError(f"{path}: no example left to use (data.{field}): all {len(examples)} "
                          f"were skipped, {'; '.join(said)}; fill in those rows or give "
                          f"another file")
      if said:
        print(f"{path}: skipped {'; '.join(said)} (data.{field}); {len(kept)} of "
              f"{len(examples)} examples kept", flush=True)
      if overlong or truncated:
        print(f"{path}: {overlong} over-long example(s) skipped, {truncated} truncated to "
              f"data.max_prompt_len={self.cfg.max_prompt_len} / data.max_response_len="
              f"{self.cfg.max_response_len} (data.overlong={self.cfg.overlong}); "
              f"{len(kept)} examples kept", flush=True)
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
    return self._eval_origin(kind)[:2]

  def _eval_origin(self, kind: str) -> tuple[str, str, str]:
    """:meth:`eval_source` and the kind its file is read as (a DPO run's prompts are its
    pairs' prompts)."""
    own = f"{kind}_eval_path"
    if getattr(self.cfg, own, ""):
      return own, "file", kind
    if kind == "prompts" and not self.cfg.prompts_path and not self.cfg.sft_path \
        and self.cfg.pairs_path:
      # Pairs only (a DPO run): exact match on the prompts of its evaluation pairs (scored
      # against their "answer" where the rows have one), wherever those pairs come from.
      return self._eval_origin("pairs")
    if self.cfg.eval_path:
      return "eval_path", "file", kind
    field = _PATH_FIELD[kind]
    if kind == "prompts" and not self.cfg.prompts_path and self.cfg.sft_path:
      # No prompts file (an SFT run): the prompts (and any answers) of its SFT file.
      return "sft_path", ("split" if self.cfg.eval_split > 0 else "train"), "sft"
    return field, ("split" if self.cfg.eval_split > 0 else "train"), kind

  def eval_held_out(self, kind: str = "prompts") -> bool:
    """Whether nothing in the evaluation set of ``kind`` is trained on: a held-out file,
    data.eval_split, or the built-in task's evaluation split; not the first training
    examples (:meth:`eval_source` "train")."""
    if self.task is not None:  # a built-in task: its own split (the guessing game has none)
      return getattr(self.task, "held_out", True)
    return self.eval_source(kind)[1] != "train"

  def eval_name(self, kind: str, noun: str) -> str:
    """``noun`` (e.g. "exact match", "prompts") named for what the evaluation set of ``kind``
    is, for the console and the summary: "held-out exact match", or "training-set exact match
    (not held out)" when it is the first training examples."""
    return f"held-out {noun}" if self.eval_held_out(kind) else f"training-set {noun} (not held out)"

  def eval_examples(self, kind: str = "prompts") -> list[Example]:
    """The fixed evaluation set of ``kind`` ("prompts": greedy answers checked against
    "answer"; "pairs": preference accuracy), at most ``data.eval_size``; where it comes from is
    said on the console once (:meth:`eval_source`)."""
    if self.task is not None:
      return self.task.sample(np.random.default_rng([self.seed, 999_999]), self.cfg.eval_size,
                              "eval")
    # An evaluation file gets the same checks and data.overlong policy as the training files: an
    # over-long held-out prompt is an error at its line, or is truncated or skipped and counted.
    field, how, read_as = self._eval_origin(kind)
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
      what = {"prompts": "greedy answers",
              "sft": "loss"}.get(kind, "pair accuracy")  # not a stage name: a data kind
      print(f"evaluation ({what}, {kind}): {note}", flush=True)
    return examples
