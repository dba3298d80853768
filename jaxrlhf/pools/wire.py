"""The wire format of the pools' messages: named numpy arrays as raw bytes plus a small typed
JSON header — never pickle, so a message from the network can carry data but never code.

A message is the field map of one Redis stream entry::

  h        JSON header: magic, version, kind, run, batch, step, policy_version, producer,
           meta (numbers), arrays ([{name, dtype, shape}] in order)
  a:NAME   the array's bytes, C order, little-endian

:func:`decode` checks everything a consumer relies on (magic, version, kind, run, batch id,
every array's dtype, shape and byte count, and optionally an expected schema) and raises
:class:`WireError` with the reason; a consumer logs it and drops the message.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Mapping, Optional, Sequence, Union

import numpy as np

MAGIC = "jaxrlhf-pools"
VERSION = 1
KINDS = ("rollout", "scores")
# Little-endian on the wire whatever the host; bool is one byte.
DTYPES = {"bool": "|b1", "int32": "<i4", "uint32": "<u4", "int64": "<i8", "float32": "<f4",
          "float16": "<f2"}
MAX_HEADER_BYTES = 64 * 1024
# A header is a flat record (its deepest part is arrays -> spec -> shape): anything deeper is
# not ours, and a deeply nested one would otherwise blow the parser's recursion limit.
MAX_HEADER_DEPTH = 4
MAX_ARRAYS = 64
MAX_NAME_CHARS = 128


class WireError(ValueError):
  """A message that is malformed, foreign (another run) or not what the consumer expects."""


@dataclasses.dataclass(frozen=True)
class Message:
  kind: str
  run: str
  batch: int  # the batch id: the RL step the rollout belongs to
  step: int  # the producer's own step count when it sent this
  policy_version: int  # updates applied to the policy that generated the rollout
  producer: str
  meta: dict  # name -> number
  arrays: dict  # name -> np.ndarray


def encode(msg: Message) -> dict[bytes, bytes]:
  """``msg`` as stream-entry fields (bytes -> bytes)."""
  if msg.kind not in KINDS:
    raise WireError(f"kind {msg.kind!r}; valid: {', '.join(KINDS)}")
  specs, fields = [], {}
  for name, x in msg.arrays.items():
    x = np.asarray(x)
    dtype = x.dtype.name
    if dtype not in DTYPES:
      raise WireError(f"array {name!r} has dtype {dtype}; the wire carries "
                      f"{', '.join(DTYPES)}")
    specs.append({"name": name, "dtype": dtype, "shape": list(x.shape)})
    fields[f"a:{name}".encode()] = np.ascontiguousarray(x, dtype=DTYPES[dtype]).tobytes()
  meta = {k: float(v) for k, v in msg.meta.items()}
  header = {"magic": MAGIC, "version": VERSION, "kind": msg.kind, "run": msg.run,
            "batch": int(msg.batch), "step": int(msg.step),
            "policy_version": int(msg.policy_version), "producer": msg.producer, "meta": meta,
            "arrays": specs}
  return {b"h": json.dumps(header, allow_nan=True).encode(), **fields}


def _mismatch(arrays: dict, schema: Mapping[str, tuple]) -> str:
  """Why ``arrays`` do not fit ``schema`` (name -> (shape, dtype)), or ""."""
  missing = sorted(set(schema) - set(arrays))
  extra = sorted(set(arrays) - set(schema))
  if missing or extra:
    return f"arrays missing {missing} / unexpected {extra}"
  for name, (shape, dtype) in schema.items():
    x = arrays[name]
    if tuple(x.shape) != tuple(shape) or x.dtype.name != np.dtype(dtype).name:
      return (f"array {name!r} is {x.dtype.name}{list(x.shape)}; this run uses "
              f"{np.dtype(dtype).name}{list(shape)}")
  return ""


def _int(header: dict, key: str) -> int:
  v = header.get(key)
  if not isinstance(v, int) or isinstance(v, bool) or v < 0:
    raise WireError(f"header field {key!r} is {v!r}, not a non-negative integer")
  return v


def _depth(x, limit: int, at: int = 1) -> None:
  """Raises if ``x`` nests containers (dicts, lists) more than ``limit`` deep."""
  if not isinstance(x, (dict, list)):
    return
  if at > limit:
    raise WireError(f"header nested deeper than {limit} levels")
  for v in (x.values() if isinstance(x, dict) else x):
    _depth(v, limit, at + 1)


def entry_bytes(fields: Mapping) -> int:
  """Bytes of a stream entry's fields (names and values), what a consumer holds to decode it."""
  return sum(len(k) + len(v) for k, v in fields.items())


def decode(fields: Optional[Mapping[bytes, bytes]], *, kind: str, run: str,
           schema: Union[Mapping[str, tuple], Sequence[Mapping[str, tuple]], None] = None
           ) -> Message:
  """The message in ``fields``, checked; :class:`WireError` names what is wrong.

  ``schema``: name -> (shape, dtype name) every message must carry exactly (the consumer's
  compiled programs take these shapes), or a sequence of such maps, one of which it must
  match (a run with prompt or length buckets: one per bucket; the first is the full width).

  Whatever the bytes, the only exception is :class:`WireError`: an entry from the network
  that made the consumer raise anything else would crash it again on every restart (the
  unacked entry is delivered again).
  """
  try:
    return _decode(fields, kind=kind, run=run, schema=schema)
  except WireError:
    raise
  except Exception as e:  # noqa: BLE001 - any failure on foreign bytes is a rejection
    raise WireError(f"undecodable entry ({type(e).__name__}: {str(e)[:200]})") from None


def _decode(fields, *, kind, run, schema) -> Message:
  if not fields:
    raise WireError("empty entry (deleted from the stream, or not a message)")
  fields = {(k.encode() if isinstance(k, str) else k): v for k, v in fields.items()}
  raw = fields.get(b"h")
  if raw is None:
    raise WireError(f"no header field 'h' (fields: {sorted(k.decode('latin-1') for k in fields)[:8]})")
  if len(raw) > MAX_HEADER_BYTES:
    raise WireError(f"header of {len(raw)} bytes (limit {MAX_HEADER_BYTES})")
  try:
    header = json.loads(raw)
  except (ValueError, UnicodeDecodeError) as e:
    raise WireError(f"header is not JSON ({e})") from None
  _depth(header, MAX_HEADER_DEPTH)
  if not isinstance(header, dict) or header.get("magic") != MAGIC:
    raise WireError(f"not a jaxrlhf pools message (magic "
                    f"{header.get('magic') if isinstance(header, dict) else None!r})")
  if header.get("version") != VERSION:
    raise WireError(f"wire version {header.get('version')!r}; this program reads {VERSION}")
  if header.get("kind") != kind:
    raise WireError(f"a {header.get('kind')!r} message where {kind!r} was expected")
  if header.get("run") != run:
    raise WireError(f"foreign message: run {header.get('run')!r}, this run is {run!r}")
  batch, step, version = _int(header, "batch"), _int(header, "step"), _int(header,
                                                                           "policy_version")
  meta = header.get("meta", {})
  if not isinstance(meta, dict) or not all(
      isinstance(v, (int, float)) and not isinstance(v, bool) for v in meta.values()):
    raise WireError("header 'meta' must map names to numbers")
  specs = header.get("arrays")
  if not isinstance(specs, list):
    raise WireError("header 'arrays' is missing or not a list")
  if len(specs) > MAX_ARRAYS:
    raise WireError(f"{len(specs)} arrays declared (limit {MAX_ARRAYS})")
  arrays = {}
  for spec in specs:
    if (not isinstance(spec, dict) or not isinstance(spec.get("name"), str)
        or len(spec["name"]) > MAX_NAME_CHARS):
      raise WireError(f"bad array spec {str(spec)[:200]}")
    name, dtype, shape = spec["name"], spec.get("dtype"), spec.get("shape")
    if dtype not in DTYPES:
      raise WireError(f"array {name!r}: dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if (not isinstance(shape, list) or len(shape) > 8 or
        not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d for d in shape)):
      raise WireError(f"array {name!r}: bad shape {shape!r}")
    data = fields.get(f"a:{name}".encode())
    if data is None:
      raise WireError(f"array {name!r} is declared but has no field 'a:{name}'")
    want = math.prod(shape) * np.dtype(DTYPES[dtype]).itemsize
    if len(data) != want:
      raise WireError(f"array {name!r}: {len(data)} bytes for {dtype}{shape} ({want} expected)")
    x = np.frombuffer(data, dtype=DTYPES[dtype]).reshape(shape)
    arrays[name] = x.astype(np.dtype(dtype), copy=False)
  if schema is not None:
    schemas = [schema] if isinstance(schema, Mapping) else list(schema)
    reasons = [_mismatch(arrays, s) for s in schemas]
    if all(reasons):
      more = f" (nor any of its {len(schemas) - 1} other bucket shapes)" if len(
          schemas) > 1 else ""
      raise WireError(reasons[0] + more)
  return Message(kind=kind, run=run, batch=batch, step=step, policy_version=version,
                 producer=str(header.get("producer", "")), meta=meta, arrays=arrays)
