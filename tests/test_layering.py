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


def test_no_algorithm_name_branches_outside_the_registry():
  allowed = {os.path.join(ROOT, "train", f) for f in
             ("spec.py", "sft.py", "rm.py", "ppo.py", "grpo.py", "dpo.py", "__init__.py")}
  names = r'"(?:sft|rm|ppo|grpo|dpo)"'
  branch = re.compile(rf"(?:==|!=|\bin)\s*\(?\s*{names}|{names}\s*(?:==|!=)")
  hits = []
  for path in _modules().values():
    if path in allowed or os.sep + "pools" + os.sep in path:  # the pools are PPO's, by design
      continue
    for i, line in enumerate(open(path, encoding="utf-8"), 1):
      # A method or data-kind name spelled like a stage says so: "# not a stage name".
      if branch.search(line.split("#")[0]) and "not a stage name" not in line:
        hits.append(f"{os.path.relpath(path, ROOT)}:{i}: {line.strip()}")
  assert not hits, "branches on an algorithm's name (read its spec instead):\n" + "\n".join(hits)
