"""Dotted-name overrides (``--set=section.field=value``) parsed by the fields' types, and the
config as JSON (``--print_config``) and back (``--config=run.json``)."""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Literal

from jaxrlhf.config.sections import ConfigError, ModelConfig
from jaxrlhf.config.experiment import ExperimentConfig


def _type_name(tp) -> str:
  origin = typing.get_origin(tp)
  if origin is Literal:
    return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
  if origin is tuple:
    return "comma-separated " + _type_name(typing.get_args(tp)[0]) + "s"
  return getattr(tp, "__name__", str(tp))


def _parse_value(text: str, tp, where: str):
  """Parses ``text`` as type ``tp``; raises ConfigError naming ``where`` on failure."""
  origin = typing.get_origin(tp)
  args = typing.get_args(tp)
  if origin is typing.Union:  # Optional[X]
    if text.strip().lower() in ("none", "null", ""):
      return None
    inner = [a for a in args if a is not type(None)][0]
    return _parse_value(text, inner, where)
  if origin is Literal:
    for choice in args:
      if str(choice) == text:
        return choice
    raise ConfigError(f"{where}: {text!r} is not valid; choose {_type_name(tp)}")
  if origin is tuple:
    item = args[0]
    # Accept `a,b`, `(a,b)` and `["a", "b"]`: the brackets and quotes people type from habit.
    body = text.strip()
    if body[:1] + body[-1:] in ("()", "[]"):
      body = body[1:-1]
    parts = [p.strip().strip("'\"") for p in body.split(",") if p.strip() != ""]
    return tuple(_parse_value(p, item, where) for p in parts)
  if tp is bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
      return True
    if low in ("0", "false", "no", "off"):
      return False
    raise ConfigError(f"{where}: {text!r} is not a bool; use true or false")
  if tp is int:
    try:
      return int(text)
    except ValueError:
      try:
        as_float = float(text)
      except ValueError:
        as_float = None
      if as_float is not None and as_float.is_integer():
        return int(as_float)
      raise ConfigError(f"{where}: {text!r} is not an int") from None
  if tp is float:
    try:
      return float(text)
    except ValueError:
      raise ConfigError(f"{where}: {text!r} is not a float") from None
  if tp is str:
    return text
  raise ConfigError(f"{where}: fields of type {tp} cannot be set from the command line")


def _hints(cls):
  return typing.get_type_hints(cls)


def _dataclass_of(tp):
  """The dataclass inside ``tp`` (unwrapping Optional), or None."""
  if typing.get_origin(tp) is typing.Union:
    inner = [a for a in typing.get_args(tp) if a is not type(None)]
    tp = inner[0] if len(inner) == 1 else None
  return tp if dataclasses.is_dataclass(tp) else None


def set_field(cfg, dotted: str, text: str, _prefix: str = ""):
  """Returns a copy of ``cfg`` with the field at ``dotted`` parsed from ``text``."""
  head, _, rest = dotted.partition(".")
  hints = _hints(type(cfg))
  where = _prefix + head
  if head not in hints:
    valid = ", ".join(f.name for f in dataclasses.fields(cfg))
    raise ConfigError(f"unknown config field {where!r}; valid fields here: {valid}")
  tp = hints[head]
  if rest:
    sub_cls = _dataclass_of(tp)
    if sub_cls is None:
      raise ConfigError(f"{where!r} is a {_type_name(tp)}, not a section; "
                        f"use --set={where}=VALUE")
    current = getattr(cfg, head)
    if current is None:
      # An unset optional model section starts from the main model's shape.
      current = cfg.model if sub_cls is ModelConfig and hasattr(cfg, "model") else sub_cls()
    new_sub = set_field(current, rest, text, where + ".")
    return dataclasses.replace(cfg, **{head: new_sub})
  if _dataclass_of(tp) is not None:
    raise ConfigError(f"{where!r} is a section; set one of its fields, e.g. "
                      f"--set={where}.{dataclasses.fields(_dataclass_of(tp))[0].name}=VALUE")
  return dataclasses.replace(cfg, **{head: _parse_value(text, tp, where)})


def apply_overrides(cfg, overrides) -> ExperimentConfig:
  """Applies ``["a.b=1", ...]`` overrides in order."""
  for item in overrides:
    if "=" not in item:
      raise ConfigError(f"--set={item!r} needs the form FIELD=VALUE, e.g. --set=ppo.kl.coef=0.05")
    key, _, value = item.partition("=")
    cfg = set_field(cfg, key.strip(), value.strip())
  return cfg


def to_dict(cfg) -> dict:
  return dataclasses.asdict(cfg)


def to_json(cfg) -> str:
  return json.dumps(to_dict(cfg), indent=2, sort_keys=True)


def from_dict(cls, data: dict):
  """Inverse of :func:`to_dict` (used to read a saved config back)."""
  hints = _hints(cls)
  kwargs = {}
  for f in dataclasses.fields(cls):
    if f.name not in data:
      continue
    value = data[f.name]
    sub = _dataclass_of(hints[f.name])
    if sub is not None and value is not None:
      value = from_dict(sub, value)
    elif typing.get_origin(hints[f.name]) is tuple and value is not None:
      value = tuple(value)
    kwargs[f.name] = value
  return cls(**kwargs)


def diff(a, b, prefix: str = "") -> list[tuple[str, object, object]]:
  """Fields that differ between two configs of the same class, as (dotted, a, b)."""
  out = []
  for f in dataclasses.fields(a):
    va, vb = getattr(a, f.name), getattr(b, f.name)
    if dataclasses.is_dataclass(va) and dataclasses.is_dataclass(vb):
      out.extend(diff(va, vb, prefix + f.name + "."))
    elif va != vb:
      out.append((prefix + f.name, va, vb))
  return out


def _from_json(tp, value, where: str, path: str):
  """``value`` (parsed JSON) as type ``tp``, checked; errors name the file and dotted key."""
  def bad(expected):
    raise ConfigError(f"{path}: {where} is {json.dumps(value)[:60]}, not {expected}; fix the "
                      f"file (python -m jaxrlhf.main --print_config writes a valid one)")
  origin, args = typing.get_origin(tp), typing.get_args(tp)
  if origin is typing.Union:  # Optional[X]
    if value is None:
      return None
    return _from_json([a for a in args if a is not type(None)][0], value, where, path)
  cls = _dataclass_of(tp)
  if cls is not None:
    if not isinstance(value, dict):
      bad("a JSON object (a config section)")
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in value if k not in hints]
    if unknown:
      raise ConfigError(f"{path}: unknown config field {where + '.' if where else ''}"
                        f"{unknown[0]}; valid fields here: {', '.join(names)}")
    return cls(**{k: _from_json(hints[k], v, f"{where}.{k}" if where else k, path)
                  for k, v in value.items()})
  if origin is Literal:
    if value not in args:
      bad(_type_name(tp))
    return value
  if origin is tuple:
    if not isinstance(value, list):
      bad(_type_name(tp) + " (a JSON list)")
    return tuple(_from_json(args[0], v, f"{where}[{i}]", path) for i, v in enumerate(value))
  if tp is bool:
    if not isinstance(value, bool):
      bad("true or false")
    return value
  if tp is int:
    if isinstance(value, bool) or not (isinstance(value, int) or
                                       (isinstance(value, float) and value.is_integer())):
      bad("an int")
    return int(value)
  if tp is float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      bad("a number")
    return float(value)
  if tp is str:
    if not isinstance(value, str):
      bad("a string")
    return value
  bad(_type_name(tp))


def load_config_file(path: str) -> ExperimentConfig:
  """``--config=run.json``: a config written by ``--print_config`` (or saved with a run) read
  back and checked field by field; missing fields keep their defaults."""
  try:
    with open(path) as f:
      text = f.read()
  except OSError as e:
    raise ConfigError(f"--config={path}: cannot be read ({e.strerror}); give the path of a JSON "
                      f"file written by --print_config") from None
  try:
    data = json.loads(text)
  except json.JSONDecodeError as e:
    raise ConfigError(f"--config={path}:{e.lineno}: not valid JSON ({e.msg}); write the file "
                      f"with python -m jaxrlhf.main --experiment=NAME --print_config > {path}") from None
  return _from_json(ExperimentConfig, data, "", path)
