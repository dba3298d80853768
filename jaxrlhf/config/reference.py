"""The configuration reference, generated from the config dataclasses themselves: every field
of every section with its type, default and the comment written above it in the source, so
the docs cannot drift from the code.

``python -m jaxrlhf.config.reference > docs/reference/config.md`` writes the page the docs site
shows; tests/test_docs.py fails when the page is stale or a field has no comment.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import sys
import textwrap
import typing
from typing import Iterator

from jaxrlhf.config.experiment import ExperimentConfig


@dataclasses.dataclass(frozen=True)
class Field:
  """One config field as the source declares it."""
  owner: type  # the class whose body declares it (a base class for inherited fields)
  name: str
  type: str  # the annotation as written
  default: str  # the default as written
  comment: str  # the comment lines directly above it, joined; "" when there is none


@functools.lru_cache(maxsize=None)
def _declared(cls: type) -> dict[str, Field]:
  """The fields ``cls``'s own body declares, with their source text and comments."""
  lines, _ = inspect.getsourcelines(cls)
  src = textwrap.dedent("".join(lines))
  body = src.splitlines()
  out = {}
  for node in ast.parse(src).body[0].body:
    if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
      continue
    comment, i = [], node.lineno - 2
    while i >= 0 and body[i].strip().startswith("#"):
      comment.insert(0, body[i].strip().lstrip("#").strip())
      i -= 1
    out[node.target.id] = Field(cls, node.target.id, ast.unparse(node.annotation),
                                ast.unparse(node.value) if node.value is not None else "",
                                " ".join(c for c in comment if c))
  return out


def fields_of(cls: type) -> list[Field]:
  """Every dataclass field of ``cls`` in declaration order, each from the class that declares
  it last (a subclass's redeclaration wins)."""
  out = []
  for f in dataclasses.fields(cls):
    owner = next(c for c in cls.__mro__ if f.name in c.__dict__.get("__annotations__", {}))
    out.append(_declared(owner)[f.name])
  return out


def _nested(tp) -> list[type]:
  """The config dataclasses a field's type holds (``X``, ``Optional[X]``)."""
  if dataclasses.is_dataclass(tp):
    return [tp]
  return [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]


def sections(root: type = ExperimentConfig) -> list[tuple[type, list[str]]]:
  """Each config dataclass reachable from ``root``, breadth first, with the dotted paths
  where it appears (``OptimizerConfig``: ``sft.optim``, ``ppo.value_optim``, ...)."""
  order: list[type] = [root]
  paths: dict[type, list[str]] = {root: [""]}
  queue = [(root, "")]
  while queue:
    cls, prefix = queue.pop(0)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
      for sub in _nested(hints[f.name]):
        path = f"{prefix}{f.name}"
        if sub not in paths:
          order.append(sub)
          paths[sub] = []
        if path not in paths[sub]:
          paths[sub].append(path)
          queue.append((sub, path + "."))
  return [(c, paths[c]) for c in order]


def missing_comments(root: type = ExperimentConfig) -> list[str]:
  """``Class.field`` of every field without a comment above it."""
  return [f"{f.owner.__name__}.{f.name}" for cls, _ in sections(root) for f in fields_of(cls)
          if not f.comment]


def _cell(text: str) -> str:
  return text.replace("|", "\\|").replace("\n", " ")


def _code(text: str, limit: int = 80) -> str:
  if not text:
    return ""
  if len(text) > limit:
    text = text[:limit - 3] + "..."
  return "`" + text.replace("|", "\\|").replace("`", "'") + "`"


def markdown(root: type = ExperimentConfig) -> Iterator[str]:
  """The reference page, line by line."""
  yield "# Configuration reference"
  yield ""
  yield ("Every field of an experiment's config, generated from the dataclasses in "
         "`jaxrlhf/config/` (`python -m jaxrlhf.config.reference > docs/reference/config.md`). "
         "Set any of them with `--set=PATH.FIELD=VALUE` (`--set=ppo.kl.coef=0.05`), or in a "
         "config file (`--print_config` writes one); a value is parsed by the field's type, "
         "and a `Literal` type lists the accepted choices. A section's defaults are the "
         "dataclass's; an experiment may set others (`--print_config` shows the resolved "
         "values).")
  yield ""
  for cls, paths in sections(root):
    where = ", ".join(f"`{p}`" for p in paths if p) or "the top level"
    yield f"## {cls.__name__}"
    yield ""
    yield f"Set as: {where}."
    yield ""
    doc = inspect.getdoc(cls) or ""
    if doc and not doc.startswith(f"{cls.__name__}("):  # dataclasses' generated signature
      yield " ".join(doc.split())
      yield ""
    yield "| field | type | default | meaning |"
    yield "|---|---|---|---|"
    for f in fields_of(cls):
      yield f"| `{f.name}` | {_code(f.type)} | {_code(f.default)} | {_cell(f.comment)} |"
    yield ""


def main() -> int:
  sys.stdout.write("\n".join(markdown()).rstrip() + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
