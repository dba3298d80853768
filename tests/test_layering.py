"""The package's structure: no import circles among jaxrlhf's modules (module-level imports,
including a package's ``__init__``), and no per-algorithm name branches outside the algorithm
registry (train/spec.py and each algorithm's own module)."""

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
  """Modules of the package that ``path`` imports at module level (not inside functions)."""
  tree = ast.parse(open(path, encoding="utf-8").read())
  found = set()
  for node in tree.body:
    if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
      continue
    for sub in ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else [node]:
      if isinstance(sub, ast.Import):
        found.update(a.name for a in sub.names)
      elif isinstance(sub, ast.ImportFrom) and sub.module:
        base = sub.module
        found.add(base)
        found.update(f"{base}.{a.name}" for a in sub.names)
  return {m for m in found if m in modules and m != name}


def test_no_import_circles():
  modules = _modules()
  graph = {m: _imports(p, m, modules) for m, p in modules.items()}
  # Importing a.b.c runs a and a.b first: a submodule depends on its packages' __init__.
  for m in list(graph):
    parts = m.split(".")
    for i in range(1, len(parts)):
      parent = ".".join(parts[:i])
      if parent in graph and parent != m:
        graph[m] = graph[m] | {parent}
  state, stack, cycles = {}, [], []

  def visit(m):
    state[m] = 1
    stack.append(m)
    for d in sorted(graph[m]):
      if state.get(d) == 1:
        cyc = stack[stack.index(d):] + [d]
        # A package importing its own submodules (an __init__ that re-exports) is not a
        # circle unless the submodule needs something outside its own package that leads back.
        if not all(x.startswith(cyc[0] + ".") or x == cyc[0] for x in cyc):
          cycles.append(" -> ".join(cyc))
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
