"""The package's structure: no import circles among jaxrlhf's modules (every import: module
level, inside functions, under ``TYPE_CHECKING``, and a package's ``__init__``), and no
per-algorithm name branches outside the algorithm registry (train/spec.py and each
algorithm's own module)."""

import ast
import os
import re

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "jaxrlhf")


def _modules():
  out = {}
  for dirpath, _, files in os.walk(ROOT):
    for f in files:
      if f.endswith(".py"):
        path = os.path.join(dirpath, f)
        rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
        out[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = path
  return out


def _imports(path: str, name: str, modules: dict) -> set:
  """Modules of the package that ``path`` imports anywhere: a lazy import inside a function
  is still a dependency (it only moves the circle to run time)."""
  tree = ast.parse(open(path, encoding="utf-8").read())
  found = set()
  for sub in ast.walk(tree):
    if isinstance(sub, ast.Import):
      found.update(a.name for a in sub.names)
    elif isinstance(sub, ast.ImportFrom) and sub.module:
      # "from pkg import submodule" needs the submodule; "from pkg import name" the package.
      for a in sub.names:
        full = f"{sub.module}.{a.name}"
        found.add(full if full in modules else sub.module)
  return {m for m in found if m in modules and m != name}


def test_no_import_circles():
  modules = _modules()
  graph = {m: _imports(p, m, modules) for m, p in modules.items()}
  state, stack, cycles = {}, [], []

  def visit(m):
    state[m] = 1
    stack.append(m)
    for d in sorted(graph[m]):
      if state.get(d) == 1:
        cycles.append(" -> ".join(stack[stack.index(d):] + [d]))
      elif d not in state:
        visit(d)
    stack.pop()
    state[m] = 2

  for m in sorted(graph):
    if m not in state:
      visit(m)
  assert not cycles, "import circles:\n" + "\n".join(cycles)


def _algorithm_names() -> tuple:
  import jaxrlhf.train  # noqa: F401 - registers every algorithm
  from jaxrlhf.train import spec
  return spec.names()


def _registry_files() -> set:
  """Where an algorithm's name may be spelled: the registry and each algorithm's module."""
  import sys
  from jaxrlhf.train import spec
  own = {sys.modules[spec.get(n).stage.__module__].__file__ for n in spec.names()}
  return {os.path.join(ROOT, "train", "spec.py"), os.path.join(ROOT, "train", "__init__.py"),
          *map(os.path.abspath, own)}


def name_uses(source: str, names) -> list[tuple[int, str]]:
  """``(line, what)`` for each place ``source`` keys behaviour on an algorithm's name: a
  comparison with one (``==``, ``!=``, ``in``, ``not in``, either side, or a tuple, list or
  set holding one), and a dict literal with one as a key (a lookup table).  A line that
  says "# not a stage name" is a method or data-kind name spelled like one."""
  import ast
  lines = source.splitlines()
  names = set(names)

  def named(node):
    if isinstance(node, ast.Constant) and node.value in names:
      return node.value
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
      return next((v for v in map(named, node.elts) if v), None)
    return None

  out = []
  for node in ast.walk(ast.parse(source)):
    hit = None
    if isinstance(node, ast.Compare):
      hit = next((n for n in map(named, [node.left, *node.comparators]) if n), None)
      what = "comparison"
    elif isinstance(node, ast.Dict):
      key = next((k for k in node.keys if isinstance(k, ast.Constant) and k.value in names),
                 None)
      hit, what = (key.value, "lookup table") if key is not None else (None, "")
      node = key if key is not None else node  # the escape comment goes on the key's line
    if hit and "not a stage name" not in lines[node.lineno - 1]:
      out.append((node.lineno, f"{what} on {hit!r}: {lines[node.lineno - 1].strip()}"))
  return out


def test_no_algorithm_name_branches_outside_the_registry():
  names, allowed = _algorithm_names(), _registry_files()
  hits = []
  for path in _modules().values():
    if os.path.abspath(path) in allowed:
      continue
    with open(path, encoding="utf-8") as f:
      for line, what in name_uses(f.read(), names):
        hits.append(f"{os.path.relpath(path, ROOT)}:{line}: {what}")
  assert not hits, "branches on an algorithm's name (read its spec instead):\n" + "\n".join(hits)


def test_the_name_check_catches_each_form_it_is_for():
  """A mutation check: each way of keying on an algorithm's name is caught, for every name
  in the registry (a new algorithm is covered without editing this file)."""
  names = _algorithm_names()
  assert {"sft", "rm", "ppo", "grpo", "dpo", "kto"} <= set(names)
  for n in names:
    for src in (f"x = stage == {n!r}\n", f"if {n!r} != name:\n  pass\n",
                f"ok = {n!r} in cfg.stages\n", f"ok = name in ({n!r}, 'other')\n",
                f"ok = {n!r} not in stages\n", f"KIND = {{{n!r}: 'prompts'}}\n",
                f"KIND = {{\n    'x': 1,\n    {n!r}: 2}}\n"):
      assert name_uses(src, names), src
  # ...and what is not keyed on a name passes: other strings, and the escape comment.
  assert not name_uses("x = name == 'tiny_ppo'\nKIND = {'prompts': 1}\n", names)
  assert not name_uses("ok = loss == 'ppo'  # not a stage name\n", names)


def test_every_algorithm_has_what_the_registry_docstring_lists():
  """spec.py's docstring says what a new algorithm needs; each registered one has it, and
  its config type's held-out data agrees with its spec's evaluation."""
  import dataclasses
  import typing
  from jaxrlhf.config import ExperimentConfig, Stage, StageConfig
  from jaxrlhf.train import spec
  fields = {f.name: f for f in dataclasses.fields(ExperimentConfig)}
  for n in _algorithm_names():
    s = spec.get(n)
    assert n in typing.get_args(Stage), n
    assert issubclass(s.config_type, StageConfig), n
    assert isinstance(getattr(ExperimentConfig(), n), s.config_type), n
    assert n in fields, n
    want = "pairs" if s.evaluation.startswith("pairs") else "prompts"
    assert s.config_type.eval_data == want, (n, s.evaluation, s.config_type.eval_data)
