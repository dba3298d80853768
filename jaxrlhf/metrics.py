"""Where training metrics go: the console, ``WORKDIR/metrics.jsonl`` and the trackers of
``logging.sinks`` (TensorBoard, Weights & Biases, MLflow; :mod:`jaxrlhf.tracking`).

One small interface, :class:`MetricsWriter`, fans each ``write(stage, step, metrics)`` out to
the sinks:

* the console: one progress line per stage (bar, ETA, a few key metrics), redrawn in place on a
  terminal and printed as plain periodic lines elsewhere (CI logs);
* ``metrics.jsonl``, always: one JSON object per write, ``{"stage", "step", "wall_time",
  **metrics}``, appended, so a resumed run continues the same file.  JSON has no NaN or
  infinity, so non-finite values are written as the strings ``"nan"``, ``"inf"`` and
  ``"-inf"``; :func:`read_jsonl` turns them back into floats;
* ``samples.jsonl``, always: what the model generates (``write_samples``: prompt, response,
  reward, answer rows at each evaluation and from the RL rollout), one JSON object per row,
  appended like metrics.jsonl; the console shows a few of each batch, shortened, and each
  tracker keeps them its own way (TensorBoard text, a W&B table, an MLflow artifact);
* the trackers named in ``logging.sinks``.  One that raises is reported once and left out for
  the rest of the run (``logging.sink_errors=disable``), or ends the run (``stop``):
  metrics.jsonl and the checkpoints never depend on a tracker.

The module imports nothing heavy: the report command reads metrics without starting jax.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from typing import IO, Callable, Mapping, Optional, Sequence

from jaxrlhf import tracking
from jaxrlhf.config import ConfigError, LoggingConfig, sink_problems

# Keys every JSONL record carries besides the metrics themselves.
RECORD_KEYS = ("stage", "step", "wall_time")

_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


# ------------------------------------------------------------------------------- values


def to_float(key: str, value) -> float:
  """A metric value as a Python float; raises ValueError naming the key if it is not a
  scalar (jax/numpy 0-d arrays and 1-element arrays are fine)."""
  try:
    if hasattr(value, "shape") and getattr(value, "size", 1) != 1:
      raise TypeError
    return float(value.item() if hasattr(value, "item") else value)
  except (TypeError, ValueError):
    shape = getattr(value, "shape", None)
    raise ValueError(f"metric {key!r} must be a scalar, got {type(value).__name__}"
                     + (f" of shape {tuple(shape)}" if shape is not None else "")) from None


def encode_value(x: float):
  """A float as stored in JSONL: itself when finite, else "nan" / "inf" / "-inf"."""
  if math.isfinite(x):
    return x
  return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def decode_value(v):
  """Inverse of :func:`encode_value`; other values (e.g. the stage name) pass through."""
  if isinstance(v, str) and v in _NON_FINITE:
    return _NON_FINITE[v]
  if isinstance(v, int) and not isinstance(v, bool):
    return float(v)
  return v


def _check_keys(metrics: Mapping[str, object]):
  for key in metrics:
    if key in RECORD_KEYS:
      raise ValueError(f"metric name {key!r} is reserved for the record itself; rename it")


# -------------------------------------------------------------------------------- JSONL


def _drop_cut_last_line(path: str) -> None:
  """Removes a last line cut short by a crash (no newline: a partial record, which readers skip
  anyway), so that appending does not run the next record into it."""
  if not os.path.exists(path) or not os.path.getsize(path):
    return
  with open(path, "r+b") as f:
    f.seek(0, os.SEEK_END)
    size = f.tell()
    f.seek(size - 1)
    if f.read(1) == b"\n":
      return
    # Read back far enough to find the previous newline (records are well under 1 MiB).
    start = max(0, size - (1 << 20))
    f.seek(start)
    tail = f.read()
    cut = tail.rfind(b"\n")
    f.truncate(start + cut + 1 if cut >= 0 else (0 if start == 0 else size))


class JsonlSink:
  """Appends one JSON object per write to ``path`` and flushes, so a crash loses nothing."""

  def __init__(self, path: str):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    self.path = path
    _drop_cut_last_line(path)
    self._f = open(path, "a", encoding="utf-8")

  def write(self, stage: str, step: int, metrics: Mapping[str, float], wall_time: float):
    self.write_samples(stage, step, [metrics], wall_time)

  def write_samples(self, stage: str, step: int, rows: Sequence[Mapping], wall_time: float):
    """One record per row, ``{"stage", "step", "wall_time", **row}``: floats encoded by
    :func:`encode_value`, text (samples) kept readable as UTF-8."""
    for row in rows:
      record = {"stage": stage, "step": int(step), "wall_time": wall_time}
      record.update((k, encode_value(v) if isinstance(v, float) else v) for k, v in row.items())
      self._f.write(json.dumps(record, allow_nan=False, ensure_ascii=False) + "\n")
    self._f.flush()

  def close(self):
    self._f.close()


def read_jsonl(path: str) -> list[dict]:
  """The records of a metrics.jsonl file, with values decoded back to floats.

  A last line cut short by a crash is skipped; a bad line elsewhere raises ValueError naming
  the file and line.
  """
  with open(path, encoding="utf-8") as f:
    lines = f.read().split("\n")
  records = []
  for i, line in enumerate(lines):
    if not line.strip():
      continue
    try:
      raw = json.loads(line)
    except json.JSONDecodeError as e:
      if all(not rest.strip() for rest in lines[i + 1:]):
        break  # the run died mid-write; everything before is good
      raise ValueError(f"{path}:{i + 1}: not a JSON object ({e.msg})") from None
    if not isinstance(raw, dict) or "stage" not in raw or "step" not in raw:
      raise ValueError(f"{path}:{i + 1}: a record needs 'stage' and 'step'")
    rec = {k: decode_value(v) for k, v in raw.items()}
    rec["step"] = int(raw["step"])
    records.append(rec)
  return records


# ------------------------------------------------------------------------------ samples

# The columns a sample row may have, in the order they are shown; a row's other keys follow.
SAMPLE_COLUMNS = ("kind", "prompt", "response", "reward", "answer")


def sample_rows(rows: Sequence[Mapping]) -> list[dict]:
  """Rows of samples as the sinks take them: each value a string, a float or None (numbers
  fetched from device arrays), keys in :data:`SAMPLE_COLUMNS` order first."""
  out = []
  for row in rows:
    clean = {}
    for key in [k for k in SAMPLE_COLUMNS if k in row] + [k for k in row
                                                         if k not in SAMPLE_COLUMNS]:
      if key in RECORD_KEYS:
        raise ValueError(f"sample field {key!r} is reserved for the record itself; rename it")
      v = row[key]
      if v is None or isinstance(v, str):
        clean[key] = v
      elif isinstance(v, bool):
        clean[key] = float(v)
      else:
        try:
          clean[key] = to_float(key, v)
        except ValueError:
          clean[key] = str(v)
    out.append(clean)
  return out


# ------------------------------------------------------------------------------ console


def format_duration(seconds: float) -> str:
  if not math.isfinite(seconds) or seconds < 0:
    return "?"
  s = int(round(seconds))
  h, rem = divmod(s, 3600)
  m, s = divmod(rem, 60)
  return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


@dataclasses.dataclass
class _StageProgress:
  first_step: int
  first_time: float
  step: int = 0
  now: float = 0.0
  metrics: dict = dataclasses.field(default_factory=dict)
  last_print: float = -math.inf
  printed_step: Optional[int] = None
  note: str = ""  # shown at the end of the line (the latest checkpoint)


class ConsoleSink:
  """A progress line per stage: ``ppo  40/100 [####......]  40%  ETA 1m12s  loss 0.51 ...``.

  On a terminal the line is redrawn in place; otherwise (CI logs, files) a plain line is
  printed at each stage's first step, at most every ``every_s`` seconds after, and at its
  last step.  ETA is measured from the stage's first write, so compilation does not skew it.
  """

  BAR_WIDTH = 20
  SAMPLES_SHOWN = 3  # sample rows printed per batch of samples
  SAMPLE_WIDTH = 120  # characters of a response shown (a prompt: half)
  # A stage's samples of one kind are printed at most this often (samples.jsonl keeps every
  # batch): an SFT stop check evaluating every step would otherwise print four lines a step.
  SAMPLES_EVERY_S = 30.0

  def __init__(self, total_steps: Mapping[str, int], keys=(), every_s: float = 10.0,
               stream: Optional[IO[str]] = None, tty: Optional[bool] = None,
               clock: Callable[[], float] = time.monotonic):
    self.total_steps = dict(total_steps)
    self.keys = tuple(keys)
    self.every_s = every_s
    self.stream = stream if stream is not None else sys.stdout
    self.tty = tty if tty is not None else bool(getattr(self.stream, "isatty", lambda: False)())
    self.clock = clock
    self._stages: dict[str, _StageProgress] = {}
    self._open_line: Optional[str] = None  # stage whose bar is drawn and not yet ended
    self._samples_shown: dict[tuple[str, str], float] = {}  # (stage, kind) -> when printed
    self._held: dict[tuple[str, str], tuple] = {}  # (stage, kind) -> latest batch not printed
    self._early_notes: dict[str, str] = {}  # notes for stages not yet drawn

  def line(self, stage: str) -> str:
    p = self._stages[stage]
    total = self.total_steps.get(stage)
    parts = [stage]
    if total:
      frac = min(max(p.step / total, 0.0), 1.0)
      filled = int(round(frac * self.BAR_WIDTH))
      parts.append(f"{p.step}/{total} [{'#' * filled}{'.' * (self.BAR_WIDTH - filled)}] "
                   f"{frac * 100:3.0f}%")
      done_steps = p.step - p.first_step
      if p.step >= total:
        parts.append(f"done in {format_duration(p.now - p.first_time)}")
      elif done_steps > 0:
        eta = (p.now - p.first_time) / done_steps * (total - p.step)
        parts.append(f"ETA {format_duration(eta)}")
      else:
        parts.append("ETA ?")
    else:
      parts.append(f"step {p.step}")
    for key in self.keys:
      if key in p.metrics:
        parts.append(f"{key} {p.metrics[key]:.4g}")
    if p.note:
      parts.append(p.note)
    return "  ".join(parts)

  def _emit(self, stage: str):
    p = self._stages[stage]
    text = self.line(stage)
    if self.tty:
      if self._open_line is not None and self._open_line != stage:
        self.stream.write("\n")
      self.stream.write("\r" + text + "\x1b[K")
      self._open_line = stage
    else:
      self.stream.write(text + "\n")
    self.stream.flush()
    p.last_print, p.printed_step = p.now, p.step

  def write(self, stage: str, step: int, metrics: Mapping[str, float]):
    now = self.clock()
    p = self._stages.get(stage)
    if p is None:
      p = self._stages[stage] = _StageProgress(first_step=int(step), first_time=now,
                                               note=self._early_notes.pop(stage, ""))
    p.step, p.now = int(step), now
    p.metrics.update(metrics)  # eval metrics arrive on some steps only; keep the latest
    total = self.total_steps.get(stage)
    last = bool(total) and p.step >= total
    if self.tty or p.printed_step is None or last or now - p.last_print >= self.every_s:
      self._emit(stage)

  def note(self, stage: str, text: str):
    """``text`` at the end of ``stage``'s progress line from its next drawing on (replacing
    the previous note): e.g. ``ckpt 200 (12.3 MiB)``."""
    p = self._stages.get(stage)
    if p is None:  # before the stage's first line: it starts with the note
      self._early_notes[stage] = text
    else:
      p.note = text

  def end(self, stage: str):
    """The stage has finished at its latest step, before its planned total (e.g. it reached
    its target): its bar ends there, as done."""
    p = self._stages.get(stage)
    if p is not None:
      self.total_steps[stage] = p.step
      self._emit(stage)
    for key in [k for k in self._held if k[0] == stage]:  # what the stage ended with
      self._print_samples(stage, *self._held.pop(key))

  def write_samples(self, stage: str, step: int, rows: Sequence[Mapping], path: str = ""):
    """The first :attr:`SAMPLES_SHOWN` rows, one shortened line each: reward, prompt ->
    response, and the answer when there is one."""
    if not rows:
      return
    kind = rows[0].get("kind", "")
    now, last = self.clock(), self._samples_shown.get((stage, kind))
    p, total = self._stages.get(stage), self.total_steps.get(stage)
    final = p is not None and bool(total) and p.step >= total  # the stage's last step
    if not final and last is not None and now - last < self.SAMPLES_EVERY_S:
      self._held[(stage, kind)] = (step, rows, path)  # shown if the stage ends here
      return
    self._held.pop((stage, kind), None)
    self._samples_shown[(stage, kind)] = now
    self._print_samples(stage, step, rows, path)

  def _print_samples(self, stage: str, step: int, rows: Sequence[Mapping], path: str):
    kind = rows[0].get("kind", "")
    shown = rows[:self.SAMPLES_SHOWN]
    lines = [f"{stage} step {step}: {kind + ' ' if kind else ''}samples ({len(shown)} of "
             f"{len(rows)}" + (f"; all in {path})" if path else ")")]
    text, width = tracking.sample_text, self.SAMPLE_WIDTH
    for row in shown:
      reward = row.get("reward")
      head = f"  [{text(reward)}] " if isinstance(reward, float) else "  "
      if "response" in row:
        body = f"{text(row.get('prompt'), width // 2)} -> {text(row['response'], width)}"
      else:  # e.g. a preference pair: its fields as they come
        body = "  ".join(f"{k}: {text(v, width // 3)}"
                         for k, v in row.items() if k not in ("kind", "reward"))
      if row.get("answer"):
        body += f"  (answer: {text(row['answer'], width // 3)})"
      lines.append(head + body)
    self.message("\n".join(lines))

  def message(self, text: str):
    """Prints a line of text without breaking the progress line."""
    if self.tty and self._open_line is not None:
      self.stream.write("\r\x1b[K")
    self.stream.write(text + "\n")
    if self.tty and self._open_line is not None:
      self.stream.write("\r" + self.line(self._open_line) + "\x1b[K")
    self.stream.flush()

  def close(self):
    if not self.tty:
      for stage, p in self._stages.items():
        if p.printed_step != p.step:
          self._emit(stage)
    elif self._open_line is not None:
      self.stream.write("\n")
      self.stream.flush()
      self._open_line = None


# ------------------------------------------------------------------------------ fan-out


class SinkError(RuntimeError):
  """A tracker failed and ``logging.sink_errors=stop`` asked the run to end there."""


def run_files(workdir: str) -> list[str]:
  """What the writer keeps in ``workdir`` for one run: ``--resume=none`` moves these aside,
  so the new run's files and tracker runs hold only its own records."""
  return [os.path.join(workdir, name) for name in ("metrics.jsonl", "samples.jsonl",
                                                    *tracking.RUN_FILES)]


class MetricsWriter:
  """Fans ``write(stage, step, metrics)`` out to the console, metrics.jsonl and the trackers of
  ``cfg.sinks``.

  ``step`` counts completed steps of the stage (1..total), so ``step == total`` is the end of
  the bar.  Only the primary process (``jax.process_index() == 0`` unless ``primary`` says
  otherwise) writes anything; other processes' writers do nothing, so the trainer can call
  every method on every process.  ``config`` (the resolved config as a dict) is what W&B and
  MLflow record; ``run_name`` names their run (default: the workdir's name).
  """

  def __init__(self, workdir: str, cfg: LoggingConfig = LoggingConfig(),
               total_steps_by_stage: Optional[Mapping[str, int]] = None, *,
               config: Optional[Mapping] = None, run_name: Optional[str] = None,
               primary: Optional[bool] = None, stream: Optional[IO[str]] = None,
               tty: Optional[bool] = None):
    if primary is None:
      import jax  # only here: reading metrics (the report) must not need jax
      primary = jax.process_index() == 0
    self.primary = primary
    self.workdir = workdir
    self.jsonl_path = os.path.join(workdir, "metrics.jsonl")
    self.samples_path = os.path.join(workdir, "samples.jsonl")
    self.tensorboard_dir = os.path.join(workdir, "tensorboard")
    self.sink_errors = cfg.sink_errors
    self._jsonl = self._console = self._samples = None
    self._sinks: list[tuple[str, object]] = []  # (name, tracker), in logging.sinks order
    if not primary:
      return
    problems = sink_problems(cfg.sinks)
    if problems:
      raise ConfigError("; ".join(problems))
    os.makedirs(workdir, exist_ok=True)
    self._jsonl = JsonlSink(self.jsonl_path)
    self._samples = JsonlSink(self.samples_path)
    if cfg.console:
      self._console = ConsoleSink(total_steps_by_stage or {}, cfg.console_keys,
                                  cfg.console_every_s, stream=stream, tty=tty)
    name = run_name or os.path.basename(os.path.abspath(workdir))
    for sink in dict.fromkeys(cfg.sinks):
      if sink == "jsonl":
        continue
      try:
        self._sinks.append((sink, tracking.make_sink(sink, workdir, config or {}, name)))
      except Exception as e:  # noqa: BLE001 - a tracker's failure must not stop training
        try:
          self._failed(sink, "starting", e)
        except SinkError:
          self.close()  # the trackers already started end their runs
          raise

  def _failed(self, name: str, doing: str, error: Exception):
    """A tracker raised: ends the run (``sink_errors=stop``) or reports it once and drops it."""
    lines = str(error).strip().splitlines()
    what = type(error).__name__ + (f": {lines[0]}" if lines else "")
    if self.sink_errors == "stop":
      raise SinkError(f"the {name} sink failed {doing} ({what}); logging.sink_errors=stop ends "
                      "the run here. The checkpoints written so far are kept: fix the cause and "
                      "rerun the same command to resume, or set logging.sink_errors=disable to "
                      "train on without it") from error
    self.message(f"warning: the {name} sink failed {doing} ({what}); it is off for the rest of "
                 "this run (metrics.jsonl keeps every record; logging.sink_errors=stop ends "
                 "the run instead)")

  def _each(self, doing: str, call: Callable[[object], None]):
    for entry in list(self._sinks):
      try:
        call(entry[1])
      except Exception as e:  # noqa: BLE001 - see _failed
        self._sinks.remove(entry)
        with contextlib.suppress(Exception):
          entry[1].close()
        self._failed(entry[0], doing, e)

  @property
  def sinks(self) -> list[str]:
    """The trackers still writing."""
    return [name for name, _ in self._sinks]

  def write(self, stage: str, step: int, metrics: Mapping[str, object]):
    """Converts every value to a float (fetching device arrays) and writes one record."""
    if not self.primary:
      return
    _check_keys(metrics)
    values = {k: to_float(k, v) for k, v in metrics.items()}
    wall_time = time.time()
    self._jsonl.write(stage, step, values, wall_time)
    self._each(f"writing {stage} step {step}",
               lambda sink: sink.write(stage, step, values, wall_time))
    if self._console is not None:
      self._console.write(stage, step, values)

  def write_samples(self, stage: str, step: int, rows: Sequence[Mapping]):
    """Records rows of samples (``prompt``, ``response``, ``reward``, ``answer``, ``kind``
    ("eval", "rollout", ...) and any other fields) of ``stage`` at ``step``: samples.jsonl, a
    few on the console, and each tracker."""
    if not self.primary or not rows:
      return
    rows = sample_rows(rows)
    wall_time = time.time()
    self._samples.write_samples(stage, step, rows, wall_time)
    self._each(f"writing {stage} samples at step {step}",
               lambda sink: sink.write_samples(stage, step, rows, wall_time))
    if self._console is not None:
      self._console.write_samples(stage, step, rows, self.samples_path)

  def finish(self, summary: Mapping, artifacts: Callable[[], Sequence[str]] = lambda: ()):
    """The run completed: the trackers record its summary, and MLflow the files
    ``artifacts()`` makes (the report's PNGs and summary.txt; the caller, above this module,
    knows how to draw them)."""
    if self.primary:
      self._each("recording the summary", lambda sink: sink.finish(summary, artifacts))

  def end_stage(self, stage: str):
    """Ends ``stage``'s progress bar at its latest step (a stage that finished early)."""
    if self.primary and self._console is not None:
      self._console.end(stage)

  def note(self, stage: str, text: str):
    """A short status at the end of ``stage``'s progress line (the latest checkpoint); not
    printed on its own where there is no console."""
    if self.primary and self._console is not None:
      self._console.note(stage, text)

  def message(self, text: str):
    """A line for the user (e.g. where checkpoints go) that keeps the progress bar intact."""
    if not self.primary:
      return
    if self._console is not None:
      self._console.message(text)
    else:
      print(text, flush=True)

  def close(self):
    """Closes every sink; a tracker failing to close is reported, never raised (training has
    ended, and this runs while an error may be on its way out)."""
    if self._console is not None:
      self._console.close()
    for name, sink in self._sinks:
      try:
        sink.close()
      except Exception as e:  # noqa: BLE001
        print(f"warning: the {name} sink failed closing ({type(e).__name__}: {e})", flush=True)
    if self._jsonl is not None:
      self._jsonl.close()
    if self._samples is not None:
      self._samples.close()
    self._jsonl = self._console = self._samples = None
    self._sinks = []
    self.primary = False  # writes after close are no-ops rather than errors on closed files

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
