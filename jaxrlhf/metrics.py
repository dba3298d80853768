"""Where training metrics go: the console, ``WORKDIR/metrics.jsonl`` and TensorBoard files.

One small interface, :class:`MetricsWriter`, fans each ``write(stage, step, metrics)`` out to
three sinks:

* the console: one progress line per stage (bar, ETA, a few key metrics), redrawn in place on a
  terminal and printed as plain periodic lines elsewhere (CI logs);
* ``metrics.jsonl``: one JSON object per write, ``{"stage", "step", "wall_time", **metrics}``,
  appended, so a resumed run continues the same file.  JSON has no NaN or infinity, so
  non-finite values are written as the strings ``"nan"``, ``"inf"`` and ``"-inf"``;
  :func:`read_jsonl` turns them back into floats;
* TensorBoard event files under ``WORKDIR/tensorboard/<stage>/``, written by a small writer of
  our own (TFRecord framing around hand-encoded ``Event`` protos with scalar summaries), so
  neither TensorFlow nor the tensorboard package is needed to write them.  :func:`read_events`
  parses them back.

The module imports nothing heavy: the report command reads metrics without starting jax.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
import struct
import sys
import time
from typing import IO, Callable, Iterator, Mapping, Optional

from jaxrlhf.config import LoggingConfig

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
    record = {"stage": stage, "step": int(step), "wall_time": wall_time}
    record.update((k, encode_value(v)) for k, v in metrics.items())
    self._f.write(json.dumps(record, allow_nan=False) + "\n")
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


# -------------------------------------------------------------------------- TensorBoard
#
# File format (what TensorBoard reads): a sequence of TFRecords, each
#   uint64 length | uint32 masked_crc32c(length bytes) | data | uint32 masked_crc32c(data)
# (little-endian), where data is a serialized tensorflow.Event proto:
#   Event   { double wall_time = 1; int64 step = 2; string file_version = 3;
#             Summary summary = 5; }
#   Summary { repeated Value value = 1; }
#   Value   { string tag = 1; float simple_value = 2; }
# The first record of a file carries file_version "brain.Event:2".

_WIRE_VARINT, _WIRE_FIXED64, _WIRE_BYTES, _WIRE_FIXED32 = 0, 1, 2, 5
FILE_VERSION = "brain.Event:2"


def _crc32c_table() -> list[int]:
  poly = 0x82F63B78  # Castagnoli, reflected
  table = []
  for n in range(256):
    c = n
    for _ in range(8):
      c = (c >> 1) ^ poly if c & 1 else c >> 1
    table.append(c)
  return table


_CRC_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
  crc = 0xFFFFFFFF
  table = _CRC_TABLE
  for b in data:
    crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
  return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
  """TFRecord's CRC: rotated and offset so a CRC of data containing CRCs stays well-mixed."""
  crc = crc32c(data)
  return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tfrecord(data: bytes) -> bytes:
  length = struct.pack("<Q", len(data))
  return (length + struct.pack("<I", masked_crc32c(length)) + data
          + struct.pack("<I", masked_crc32c(data)))


def _varint(n: int) -> bytes:
  n &= (1 << 64) - 1  # negative int64 as two's complement, as protobuf does
  out = bytearray()
  while True:
    byte = n & 0x7F
    n >>= 7
    if n:
      out.append(byte | 0x80)
    else:
      out.append(byte)
      return bytes(out)


def _key(field: int, wire: int) -> bytes:
  return _varint(field << 3 | wire)


def _bytes_field(field: int, payload: bytes) -> bytes:
  return _key(field, _WIRE_BYTES) + _varint(len(payload)) + payload


def encode_event(wall_time: float, step: int = 0, scalars: Optional[Mapping[str, float]] = None,
                 file_version: Optional[str] = None) -> bytes:
  """A serialized Event proto with the given scalar summaries (float32, as TensorBoard keeps)."""
  out = _key(1, _WIRE_FIXED64) + struct.pack("<d", wall_time)
  if step:
    out += _key(2, _WIRE_VARINT) + _varint(int(step))
  if file_version is not None:
    out += _bytes_field(3, file_version.encode())
  if scalars:
    summary = b"".join(
        _bytes_field(1, _bytes_field(1, tag.encode()) + _key(2, _WIRE_FIXED32)
                     + struct.pack("<f", value))
        for tag, value in scalars.items())
    out += _bytes_field(5, summary)
  return out


def _parse_fields(buf: bytes) -> Iterator[tuple[int, int, object]]:
  """(field number, wire type, value) of each field of a serialized proto message."""
  i, n = 0, len(buf)

  def varint():
    nonlocal i
    shift = result = 0
    while True:
      b = buf[i]
      i += 1
      result |= (b & 0x7F) << shift
      shift += 7
      if not b & 0x80:
        return result

  while i < n:
    key = varint()
    field, wire = key >> 3, key & 7
    if wire == _WIRE_VARINT:
      value = varint()
    elif wire == _WIRE_FIXED64:
      value, i = buf[i:i + 8], i + 8
    elif wire == _WIRE_BYTES:
      size = varint()
      value, i = buf[i:i + size], i + size
    elif wire == _WIRE_FIXED32:
      value, i = buf[i:i + 4], i + 4
    else:
      raise ValueError(f"unsupported protobuf wire type {wire} (field {field})")
    yield field, wire, value


@dataclasses.dataclass(frozen=True)
class Event:
  wall_time: float
  step: int
  file_version: str
  scalars: dict  # tag -> float


def decode_event(data: bytes) -> Event:
  wall_time, step, version, scalars = 0.0, 0, "", {}
  for field, wire, value in _parse_fields(data):
    if field == 1 and wire == _WIRE_FIXED64:
      wall_time = struct.unpack("<d", value)[0]
    elif field == 2 and wire == _WIRE_VARINT:
      step = value - (1 << 64) if value >= 1 << 63 else value
    elif field == 3 and wire == _WIRE_BYTES:
      version = bytes(value).decode()
    elif field == 5 and wire == _WIRE_BYTES:
      for vfield, vwire, vbytes in _parse_fields(value):
        if vfield != 1 or vwire != _WIRE_BYTES:
          continue
        tag, simple = None, None
        for f, w, v in _parse_fields(vbytes):
          if f == 1 and w == _WIRE_BYTES:
            tag = bytes(v).decode()
          elif f == 2 and w == _WIRE_FIXED32:
            simple = struct.unpack("<f", v)[0]
        if tag is not None and simple is not None:
          scalars[tag] = simple
  return Event(wall_time, step, version, scalars)


def read_events(path: str) -> list[Event]:
  """The events of one event file; raises ValueError if a length or data CRC is wrong."""
  with open(path, "rb") as f:
    buf = f.read()
  events, i = [], 0
  while i < len(buf):
    if len(buf) - i < 12:
      raise ValueError(f"{path}: truncated record header at byte {i}")
    header = buf[i:i + 8]
    (length,) = struct.unpack("<Q", header)
    (len_crc,) = struct.unpack("<I", buf[i + 8:i + 12])
    if masked_crc32c(header) != len_crc:
      raise ValueError(f"{path}: bad length CRC at byte {i}")
    data = buf[i + 12:i + 12 + length]
    (data_crc,) = struct.unpack("<I", buf[i + 12 + length:i + 16 + length])
    if len(data) != length or masked_crc32c(data) != data_crc:
      raise ValueError(f"{path}: bad data CRC at byte {i}")
    events.append(decode_event(data))
    i += 16 + length
  return events


def read_scalars(logdir: str) -> dict[str, list[tuple[int, float]]]:
  """Every scalar under ``logdir`` (recursively), as tag -> [(step, value)] in file order."""
  out: dict[str, list[tuple[int, float]]] = {}
  for root, _, files in sorted(os.walk(logdir)):
    for name in sorted(files):
      if "tfevents" not in name:
        continue
      for ev in read_events(os.path.join(root, name)):
        for tag, value in ev.scalars.items():
          out.setdefault(tag, []).append((ev.step, value))
  return out


class EventFileWriter:
  """Writes scalar summaries to a new ``events.out.tfevents.*`` file in ``logdir``."""

  _count = 0  # disambiguates files opened in the same second by one process

  def __init__(self, logdir: str):
    os.makedirs(logdir, exist_ok=True)
    EventFileWriter._count += 1
    name = (f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}."
            f"{os.getpid()}.{EventFileWriter._count}")
    self.path = os.path.join(logdir, name)
    self._f = open(self.path, "wb")
    self._f.write(tfrecord(encode_event(time.time(), file_version=FILE_VERSION)))
    self._f.flush()

  def add_scalars(self, step: int, scalars: Mapping[str, float],
                  wall_time: Optional[float] = None):
    event = encode_event(time.time() if wall_time is None else wall_time, step, scalars)
    self._f.write(tfrecord(event))

  def flush(self):
    self._f.flush()

  def close(self):
    self._f.close()


class TensorBoardSink:
  """One event file per stage, in ``root/<stage>/``, so TensorBoard shows stages as runs."""

  def __init__(self, root: str):
    self.root = root
    self._writers: dict[str, EventFileWriter] = {}

  def write(self, stage: str, step: int, metrics: Mapping[str, float], wall_time: float):
    if stage not in self._writers:
      self._writers[stage] = EventFileWriter(os.path.join(self.root, stage))
    writer = self._writers[stage]
    writer.add_scalars(step, metrics, wall_time)
    writer.flush()

  def close(self):
    for w in self._writers.values():
      w.close()


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


class ConsoleSink:
  """A progress line per stage: ``ppo  40/100 [####......]  40%  ETA 1m12s  loss 0.51 ...``.

  On a terminal the line is redrawn in place; otherwise (CI logs, files) a plain line is
  printed at each stage's first step, at most every ``every_s`` seconds after, and at its
  last step.  ETA is measured from the stage's first write, so compilation does not skew it.
  """

  BAR_WIDTH = 20

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
      p = self._stages[stage] = _StageProgress(first_step=int(step), first_time=now)
    p.step, p.now = int(step), now
    p.metrics.update(metrics)  # eval metrics arrive on some steps only; keep the latest
    total = self.total_steps.get(stage)
    last = bool(total) and p.step >= total
    if self.tty or p.printed_step is None or last or now - p.last_print >= self.every_s:
      self._emit(stage)

  def end(self, stage: str):
    """The stage has finished at its latest step, before its planned total (e.g. it reached
    its target): its bar ends there, as done."""
    p = self._stages.get(stage)
    if p is not None:
      self.total_steps[stage] = p.step
      self._emit(stage)

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


class MetricsWriter:
  """Fans ``write(stage, step, metrics)`` out to the console, metrics.jsonl and TensorBoard.

  ``step`` counts completed steps of the stage (1..total), so ``step == total`` is the end of
  the bar.  Only the primary process (``jax.process_index() == 0`` unless ``primary`` says
  otherwise) writes anything; other processes' writers do nothing, so the trainer can call
  every method on every process.
  """

  def __init__(self, workdir: str, cfg: LoggingConfig = LoggingConfig(),
               total_steps_by_stage: Optional[Mapping[str, int]] = None, *,
               primary: Optional[bool] = None, stream: Optional[IO[str]] = None,
               tty: Optional[bool] = None):
    if primary is None:
      import jax  # only here: reading metrics (the report) must not need jax
      primary = jax.process_index() == 0
    self.primary = primary
    self.workdir = workdir
    self.jsonl_path = os.path.join(workdir, "metrics.jsonl")
    self.tensorboard_dir = os.path.join(workdir, "tensorboard")
    self._jsonl = self._tb = self._console = None
    if not primary:
      return
    os.makedirs(workdir, exist_ok=True)
    self._jsonl = JsonlSink(self.jsonl_path)
    if cfg.tensorboard:
      self._tb = TensorBoardSink(self.tensorboard_dir)
    if cfg.console:
      self._console = ConsoleSink(total_steps_by_stage or {}, cfg.console_keys,
                                  cfg.console_every_s, stream=stream, tty=tty)

  def write(self, stage: str, step: int, metrics: Mapping[str, object]):
    """Converts every value to a float (fetching device arrays) and writes one record."""
    if not self.primary:
      return
    _check_keys(metrics)
    values = {k: to_float(k, v) for k, v in metrics.items()}
    wall_time = time.time()
    self._jsonl.write(stage, step, values, wall_time)
    if self._tb is not None:
      self._tb.write(stage, step, values, wall_time)
    if self._console is not None:
      self._console.write(stage, step, values)

  def end_stage(self, stage: str):
    """Ends ``stage``'s progress bar at its latest step (a stage that finished early)."""
    if self.primary and self._console is not None:
      self._console.end(stage)

  def message(self, text: str):
    """A line for the user (e.g. "saved checkpoint 200") that keeps the progress bar intact."""
    if not self.primary:
      return
    if self._console is not None:
      self._console.message(text)
    else:
      print(text, flush=True)

  def close(self):
    for sink in (self._console, self._tb, self._jsonl):
      if sink is not None:
        sink.close()
    self._jsonl = self._tb = self._console = None
    self.primary = False  # writes after close are no-ops rather than errors on closed files

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
