"""What the planner reads from XLA's optimised HLO text, beyond memory and cost analysis.

Three things a compiled program knows but its summary figures hide:

* **Collective traffic per device** (:func:`collective_traffic`): every all-gather,
  all-reduce, reduce-scatter, all-to-all and collective-permute, its result size, its
  replica groups, and how many times it runs — a collective inside a ``while`` body (a scan
  over layers, a decoding loop, a scan over minibatches) runs once per trip.  Known trip counts
  come from XLA's ``known_trip_count``; loops without one (the decoding loop, which stops when
  every row has ended) take a caller-given bound.  Bytes moved per device use the ring
  algorithm's volumes, split into traffic inside a node and traffic that crosses nodes.
* **f32 copies of bf16 arrays that the CPU compiler adds** (:func:`cpu_upcast_bytes`): XLA's
  CPU backend runs bf16 matmuls in f32, so it inserts ``convert`` ops, and loop-invariant code
  motion hoists the convert of a whole stacked weight (or a stacked remat residual) out of the
  scan.  A GPU or TPU compiler multiplies bf16 directly and makes no such copy.  We estimate
  how much these copies add to the peak with a small liveness simulation over the scheduled
  HLO (each computation's instructions in schedule order, buffers live from definition to
  last use, ``while``/``call`` bodies adding their own peak), run with and without them.
* **How much collective time the schedule hides** (:func:`schedule`): a target compiler's
  program (XLA:GPU's) is printed in schedule order with each asynchronous collective as a
  ``*-start`` / ``*-done`` pair; the instructions between them run while it moves its bytes.
  One run is laid on a timeline (a compute stream, one collective stream), each instruction
  costed by its roofline, each collective by the bytes :func:`collective_traffic` counts.

Only what the planner needs is parsed; anything unrecognised is skipped, never guessed.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Optional, Union

import numpy as np

_DTYPE_BYTES = {
    "pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2,
    "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
    "c64": 8, "c128": 16, "token": 0,
}

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")

# An array type is (dtype, dims); a tuple type is a list of types.
Type = Union[tuple, list]


@dataclasses.dataclass
class Instr:
  name: str
  type: Type
  opcode: str
  operands: list[str]
  attrs: str
  root: bool = False
  param: int = -1  # a parameter's number


@dataclasses.dataclass
class Module:
  computations: dict[str, list[Instr]]
  entry: str


# ------------------------------------------------------------------------------- parsing


def _parse_type(s: str, i: int) -> tuple[Type, int]:
  """Parses a type starting at ``s[i]``; returns (type, index after it)."""
  if s[i] == "(":
    elems, i = [], i + 1
    while s[i] != ")":
      if s.startswith("/*", i):
        i = s.index("*/", i) + 2
        continue
      if s[i] in ", ":
        i += 1
        continue
      t, i = _parse_type(s, i)
      elems.append(t)
    return elems, i + 1
  m = re.compile(r"(\w+)\[([\d,]*)\]").match(s, i)
  if not m:
    end = s.find(" ", i)
    return ("token", ()), (len(s) if end < 0 else end)
  dims = tuple(int(d) for d in m.group(2).split(",") if d)
  i = m.end()
  if i < len(s) and s[i] == "{":  # layout, maybe with memory-space annotations
    depth = 0
    while True:
      depth += {"{": 1, "}": -1}.get(s[i], 0)
      i += 1
      if depth == 0:
        break
  return (m.group(1), dims), i


def _matching(s: str, i: int) -> int:
  """Index just past the parenthesis that closes the one at ``s[i]``."""
  depth = 0
  for j in range(i, len(s)):
    depth += {"(": 1, ")": -1}.get(s[j], 0)
    if depth == 0:
      return j + 1
  return len(s)


_INSTR = re.compile(r"\s+(ROOT )?%([\w.\-]+) = ")
_HEADER = re.compile(r"(ENTRY )?%([\w.\-]+) ")


def parse_hlo(text: str) -> Module:
  comps: dict[str, list[Instr]] = {}
  entry, current = "", None
  for line in text.splitlines():
    if not line:
      continue
    if not line[0].isspace():
      h = _HEADER.match(line)
      if h and line.rstrip().endswith("{"):
        current = comps.setdefault(h.group(2), [])
        if h.group(1):
          entry = h.group(2)
      elif line.startswith("}"):
        current = None
      continue
    m = _INSTR.match(line)
    if m is None or current is None:
      continue
    typ, i = _parse_type(line, m.end())
    rest = line[i:].lstrip()
    op_end = rest.find("(")
    if op_end < 0:
      continue
    opcode = rest[:op_end]
    close = _matching(rest, op_end)
    operands = re.findall(r"%([\w.\-]+)", rest[op_end:close])
    number = re.fullmatch(r"\((\d+)\)", rest[op_end:close]) if opcode == "parameter" else None
    param = int(number.group(1)) if number else -1
    current.append(Instr(m.group(2), typ, opcode, operands, rest[close:], bool(m.group(1)),
                         param))
  return Module(comps, entry)


def type_bytes(t: Type) -> int:
  if isinstance(t, list):
    return sum(type_bytes(e) for e in t)
  return _DTYPE_BYTES.get(t[0], 4) * math.prod(t[1])


def _callees(ins: Instr) -> list[str]:
  names = re.findall(r"(?:body|condition|calls|to_apply|true_computation|false_computation)"
                     r"=%([\w.\-]+)", ins.attrs)
  m = re.search(r"branch_computations=\{([^}]*)\}", ins.attrs)
  if m:
    names += re.findall(r"%([\w.\-]+)", m.group(1))
  return names


def _trip_count(ins: Instr) -> Optional[int]:
  m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', ins.attrs)
  return int(m.group(1)) if m else None


def multiplicities(module: Module, unknown_trip: int) -> dict[str, float]:
  """How many times each computation runs per call of the entry computation."""
  mult: dict[str, float] = {}

  def visit(name: str, m: float, depth: int):
    if depth > 64 or name not in module.computations:
      return
    mult[name] = mult.get(name, 0.0) + m
    for ins in module.computations[name]:
      if ins.opcode == "fusion":
        continue  # fused computations hold no collectives or loops
      trips = 1
      if ins.opcode == "while":
        trips = _trip_count(ins) or unknown_trip
      for callee in _callees(ins):
        visit(callee, m * trips, depth + 1)

  visit(module.entry, 1.0, 0)
  return mult


# --------------------------------------------------------------------------- collectives


def _iota(dims, perm) -> np.ndarray:
  ids = np.arange(math.prod(dims)).reshape(dims)
  return ids.transpose(perm) if perm else ids


def _ints(text: str) -> list[int]:
  return [int(x) for x in re.findall(r"\d+", text)]


def replica_groups(attrs: str, n_devices: int) -> Optional[np.ndarray]:
  """The replica groups of a collective as a ``[groups, size]`` array of device ids, or None
  when the attribute is missing or in a form we do not read."""
  m = re.search(r"replica_groups=\{(\{[\d,{}]*\})\}", attrs)
  if m:
    groups = [_ints(g) for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
    if groups and all(len(g) == len(groups[0]) for g in groups):
      return np.asarray(groups)
    return None
  if re.search(r"replica_groups=\{\}", attrs):
    return np.arange(n_devices)[None]
  m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
  if m:
    shape, dims = _ints(m.group(1)), _ints(m.group(2))
    perm = _ints(m.group(3)) if m.group(3) else None
    return _iota(dims, perm).reshape(shape[0], -1)
  m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\]"
                r"(?:T\(([\d,]+)\))?\))? \{([^}]*)\}", attrs)
  if m:
    axes = re.findall(r"'(\w+)'=(\d+)", m.group(1))
    names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
    if m.group(2):
      ids = _iota(_ints(m.group(2)), _ints(m.group(3)) if m.group(3) else None)
    else:
      ids = np.arange(math.prod(sizes))
    ids = ids.reshape(sizes)
    grouped = re.findall(r"'(\w+)'", m.group(4))
    if not grouped or any(g not in names for g in grouped):
      return None
    keep = [i for i, a in enumerate(names) if a not in grouped]
    over = [names.index(g) for g in grouped]
    size = math.prod(sizes[i] for i in over)
    return ids.transpose(keep + over).reshape(-1, size)
  return None


def _permute_pairs(attrs: str) -> list[tuple[int, int]]:
  m = re.search(r"source_target_pairs=\{(.*?)\}\}", attrs)
  if not m:
    return []
  return [tuple(_ints(p)) for p in re.findall(r"\{(\d+,\d+)\}?", m.group(1) + "}")]


@dataclasses.dataclass
class Traffic:
  """Bytes one device sends per program run, inside its node and across nodes."""

  intra_bytes: float = 0.0
  inter_bytes: float = 0.0
  ops: int = 0  # collective instructions in the program (static count)
  executions: float = 0.0  # collective executions per run (loops multiplied out)
  unread: int = 0  # collectives whose groups we could not read (counted as crossing nodes)
  by_kind: dict = dataclasses.field(default_factory=dict)

  @property
  def total_bytes(self) -> float:
    return self.intra_bytes + self.inter_bytes


def _scaled_bytes(t: Type, f32_scale: float) -> float:
  if isinstance(t, list):
    return sum(_scaled_bytes(e, f32_scale) for e in t)
  return type_bytes(t) * (f32_scale if t[0] == "f32" else 1.0)


def _collective_kind(ins: Instr) -> Optional[str]:
  """The collective ``ins`` is, synchronous or the start of an asynchronous one."""
  return next((k for k in COLLECTIVES if ins.opcode in (k, k + "-start")), None)


def _sent(ins: Instr, n_devices: int, node_size: int, f32_scale: float):
  """``(kind, bytes one device sends, crosses nodes, unread groups 0/1)`` for one execution
  of a collective (ring volumes), or None when ``ins`` is none."""
  kind = _collective_kind(ins)
  if kind is None:
    return None
  result = ins.type[-1] if ins.opcode.endswith("-start") and isinstance(ins.type, list) \
      and ins.type else ins.type  # an async start's type is (operands, results)
  size = _scaled_bytes(result, f32_scale)
  if kind == "collective-permute":
    pairs = _permute_pairs(ins.attrs)
    crosses = any(a // node_size != b // node_size for a, b in pairs) if pairs else (
        n_devices > node_size)
    return kind, size, crosses, 0
  groups = replica_groups(ins.attrs, n_devices)
  if groups is None:
    g, crosses = n_devices, n_devices > node_size
  else:
    g = groups.shape[1]
    nodes = groups // node_size
    crosses = bool(np.any(nodes.min(axis=1) != nodes.max(axis=1)))
  if g <= 1:
    return kind, 0.0, crosses, int(groups is None)
  moved = {"all-gather": size * (g - 1) / g, "all-to-all": size * (g - 1) / g,
           "reduce-scatter": size * (g - 1), "all-reduce": 2 * size * (g - 1) / g}[kind]
  return kind, moved, crosses, int(groups is None)


def collective_traffic(module: Module, n_devices: int, node_size: int,
                       unknown_trip: int = 1, f32_scale: float = 1.0) -> Traffic:
  """Per-device bytes each collective moves, times how often it runs (ring volumes: an
  all-gather or all-to-all of a result of S bytes over g devices moves ``S (g-1)/g``, a
  reduce-scatter ``S (g-1)``, an all-reduce ``2 S (g-1)/g``, a permute ``S``).  A group whose
  devices lie in more than one node of ``node_size`` consecutive ids crosses nodes."""
  mult = multiplicities(module, unknown_trip)
  out = Traffic()
  for comp, m in mult.items():
    for ins in module.computations[comp]:
      sent = _sent(ins, n_devices, node_size, f32_scale)
      if sent is None:
        continue
      kind, moved, crosses, unread = sent
      out.unread += unread
      if moved == 0:
        continue
      out.ops += 1
      out.executions += m
      if crosses:
        out.inter_bytes += moved * m
      else:
        out.intra_bytes += moved * m
      out.by_kind[kind] = out.by_kind.get(kind, 0.0) + moved * m
  return out


# ------------------------------------------------------------------ the scheduled overlap


@dataclasses.dataclass(frozen=True)
class Rates:
  """Per-device rates a schedule is costed at (the plan's roofline rates): FLOP/s, HBM
  bytes/s, and collective bytes/s inside a node and across nodes."""

  flops: float
  hbm: float
  intra: float
  inter: float


@dataclasses.dataclass
class Schedule:
  """One run of a compiled program laid on a timeline in its scheduled order (seconds).

  ``ops_seconds``: every other instruction's roofline (``ops_scale`` times), one after
  another; ``comm_seconds``: every collective's time at its link.  ``seconds`` runs each
  asynchronous collective, on one collective stream, beside what is scheduled between its
  start and its done, so it lies between ``max(ops, comm)`` and ``ops + comm``.  Loops
  count once per trip."""

  ops_seconds: float = 0.0
  comm_seconds: float = 0.0
  seconds: float = 0.0
  async_collectives: int = 0  # static counts (a loop body's once)
  sync_collectives: int = 0

  @property
  def hidden_seconds(self) -> float:
    """Collective time the schedule hides behind the other instructions."""
    return max(self.ops_seconds + self.comm_seconds - self.seconds, 0.0)


# Instructions that move no data of their own (views, tuples, markers) or whose work is
# counted elsewhere (a loop's or call's body, an async collective's start and done).
_FREE_OPS = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all",
             "partition-id", "replica-id", "optimization-barrier", "add-dependency", "domain",
             "while", "call", "conditional", "async-start", "async-update", "async-done"}


def _dot_flops(ins: Instr, types: dict[str, Type]) -> float:
  """2 x output elements x contracted size of a dot, or of a cuBLAS gemm custom call."""
  m = (re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attrs)
       or re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', ins.attrs))
  lhs = types.get(ins.operands[0]) if ins.operands else None
  out = ins.type[0] if isinstance(ins.type, list) and ins.type else ins.type
  if m is None or not isinstance(lhs, tuple) or not isinstance(out, tuple):
    return 0.0
  k = math.prod(lhs[1][d] for d in _ints(m.group(1)) if d < len(lhs[1]))
  return 2.0 * math.prod(out[1]) * k


def _fused_flops(module: Module, comp: str, depth: int = 0) -> float:
  """The matmul FLOPs of a fused computation, nested fusions included."""
  instrs = module.computations.get(comp, [])
  types = {i.name: i.type for i in instrs}
  flops = 0.0
  for ins in instrs:
    if ins.opcode == "dot":
      flops += _dot_flops(ins, types)
    elif depth < 8:
      flops += sum(_fused_flops(module, c, depth + 1) for c in _callees(ins))
  return flops


def _fusion_bytes(module: Module, ins: Instr, types: dict[str, Type]) -> float:
  """HBM bytes a fusion reads and writes: its operands and result, except an operand that is
  only sliced inside (a layer's slice of a stacked weight: the slice is read) or only updated
  in place (a loop's stacked output: the update is written)."""
  m = re.search(r"calls=%([\w.\-]+)", ins.attrs)
  body = module.computations.get(m.group(1), []) if m else []
  params = {b.param: b.name for b in body if b.opcode == "parameter"}
  users: dict[str, list[Instr]] = {}
  for b in body:
    for op in b.operands:
      users.setdefault(op, []).append(b)
  total = 0.0
  for k, op in enumerate(ins.operands):
    us = users.get(params.get(k, ""), [])
    if us and all(u.opcode in ("dynamic-slice", "slice", "gather") for u in us):
      total += sum(type_bytes(u.type) for u in us)
    elif not (us and all(u.opcode == "dynamic-update-slice" and u.operands[0] == params[k]
                         for u in us)):
      total += type_bytes(types.get(op, ("token", ())))
  root = next((b for b in body if b.root), None)
  if root is not None and root.opcode == "dynamic-update-slice" and len(root.operands) > 1:
    inner = {b.name: b.type for b in body}
    return total + type_bytes(inner.get(root.operands[1], ("token", ())))
  return total + type_bytes(ins.type)


def op_seconds(module: Module, ins: Instr, types: dict[str, Type], rates: Rates) -> float:
  """The roofline of one non-collective instruction: the slower of its matmul FLOPs and the
  HBM bytes of its operands and result (each fusion is one kernel reading from and writing
  to HBM).  A Pallas kernel's FLOPs are not in the HLO: it is costed by its bytes."""
  if ins.opcode in _FREE_OPS or ins.opcode.endswith(("-start", "-done")):
    return 0.0
  if ins.opcode == "fusion":
    m = re.search(r"calls=%([\w.\-]+)", ins.attrs)
    flops = _fused_flops(module, m.group(1)) if m else 0.0
    moved = _fusion_bytes(module, ins, types)
  else:
    flops = _dot_flops(ins, types) if ins.opcode in ("dot", "custom-call") else 0.0
    if ins.opcode == "dynamic-update-slice" and len(ins.operands) > 1:
      moved = 2 * type_bytes(types.get(ins.operands[1], ("token", ())))
    elif ins.opcode in ("dynamic-slice", "slice", "copy"):
      moved = 2 * type_bytes(ins.type)
    else:
      moved = type_bytes(ins.type) + sum(type_bytes(types.get(op, ("token", ())))
                                         for op in set(ins.operands))
  return max(flops / rates.flops, moved / rates.hbm)


def _is_sync(ins: Instr) -> bool:
  return '"is_sync":true' in ins.attrs


def schedule(module: Module, n_devices: int, node_size: int, rates: Rates,
             unknown_trip: int = 1, f32_scale: float = 1.0, ops_scale: float = 1.0) -> Schedule:
  """Lays one run of ``module`` on a timeline with a compute stream and one collective
  stream, in the order the compiler scheduled it.

  An asynchronous collective (``*-start`` ... ``*-done``, or ``async-start`` wrapping one;
  not one XLA marked ``is_sync``) starts when the collective stream is free and the compute
  stream has reached its start, and the compute stream waits for it at its done: it is
  hidden behind whatever the compiler placed in between.  A synchronous collective stops
  both streams.  A loop's body runs its trip count times, each trip on its own (overlap
  across trips is not counted); a loop or call that holds collectives waits for the
  collective stream first.  Collective times use :func:`collective_traffic`'s bytes at
  ``rates.intra`` / ``rates.inter``; other instructions :func:`op_seconds` x ``ops_scale``.
  """
  memo: dict[str, Schedule] = {}

  def coll_seconds(ins: Instr) -> float:
    if ins.opcode == "async-start":
      return sum(coll_seconds(i) for c in _callees(ins) for i in module.computations.get(c, []))
    sent = _sent(ins, n_devices, node_size, f32_scale)
    if sent is None:
      return 0.0
    _, moved, crosses, _ = sent
    return moved / (rates.inter if crosses else rates.intra)

  def run(comp: str, depth: int) -> Schedule:
    if comp in memo:
      return memo[comp]
    memo[comp] = Schedule()  # recursion guard
    out = Schedule()
    instrs = module.computations.get(comp, [])
    types = {i.name: i.type for i in instrs}
    t_ops = t_coll = 0.0  # when each stream is next free
    pending: dict[str, float] = {}  # async start -> when its collective ends
    for ins in instrs:
      starts = ins.opcode.endswith("-start") and _collective_kind(ins) is not None or (
          ins.opcode == "async-start" and coll_seconds(ins) > 0)
      if starts or _collective_kind(ins) is not None:
        t = coll_seconds(ins)
        out.comm_seconds += t
        if starts and not _is_sync(ins):
          out.async_collectives += 1
          t_coll = max(t_coll, t_ops) + t
          pending[ins.name] = t_coll
        else:
          out.sync_collectives += 1
          t_ops = t_coll = max(t_coll, t_ops) + t
          if starts:
            pending[ins.name] = t_ops
      elif ins.opcode.endswith("-done") and ins.operands and ins.operands[0] in pending:
        t_ops = max(t_ops, pending.pop(ins.operands[0]))
      elif ins.opcode in ("while", "call", "conditional") and depth < 64:
        subs = [run(c, depth + 1) for c in _callees(ins)]
        if ins.opcode == "while":
          trips = _trip_count(ins) or unknown_trip
          sub = Schedule(*(trips * sum(getattr(s, f) for s in subs)
                           for f in ("ops_seconds", "comm_seconds", "seconds")))
        else:  # a call's body, or the costliest branch
          sub = max(subs, key=lambda s: s.seconds, default=Schedule())
        out.ops_seconds += sub.ops_seconds
        out.comm_seconds += sub.comm_seconds
        out.async_collectives += sum(s.async_collectives for s in subs)
        out.sync_collectives += sum(s.sync_collectives for s in subs)
        if sub.comm_seconds > 0:
          t_ops = t_coll = max(t_ops, t_coll) + sub.seconds
        else:
          t_ops += sub.seconds
      else:
        t = op_seconds(module, ins, types, rates) * ops_scale
        out.ops_seconds += t
        t_ops += t
    out.seconds = max([t_ops, t_coll, *pending.values()])
    memo[comp] = out
    return out

  return run(module.entry, 0)


# ------------------------------------------------------------------------ CPU upcasts


_ALIAS_OPS = {"parameter", "tuple", "get-tuple-element", "bitcast", "while",
              "optimization-barrier"}


def _is_upcast(ins: Instr, types: dict[str, Type]) -> bool:
  """An f32 copy of a whole bf16/f16 array: a ``convert``, or a CPU ``wrapped_convert``
  fusion, whose single operand has the same dimensions in a 16-bit float type."""
  if not (isinstance(ins.type, tuple) and ins.type[0] == "f32" and ins.operands):
    return False
  if ins.opcode == "fusion":
    if not re.search(r"calls=%wrapped_convert", ins.attrs):
      return False
  elif ins.opcode != "convert":
    return False
  src = types.get(ins.operands[0])
  return isinstance(src, tuple) and src[0] in ("bf16", "f16") and src[1] == ins.type[1]


def _in_place_target(ins: Instr, types: dict[str, Type]) -> Optional[str]:
  """The operand a dynamic-update-slice or scatter (or a fusion rooted in one) writes into
  in place: XLA reuses its buffer, so the result is no new allocation."""
  if ins.opcode in ("dynamic-update-slice", "scatter"):
    return ins.operands[0] if ins.operands else None
  if ins.opcode == "fusion" and ins.name.startswith(("dynamic-update-slice", "scatter")):
    return next((op for op in ins.operands if types.get(op) == ins.type), None)
  return None


def _simulate(module: Module, comp: str, skip_upcasts: bool, memo: dict):
  """Liveness of the buffers a computation defines (parameters excluded), in schedule order.

  Returns ``(peak, at_peak)``: the peak bytes, adding the peak of any computation called
  while that call runs, and the buffers live at that point as ``(bytes, instruction)``.
  """
  key = (comp, skip_upcasts)
  if key in memo:
    return memo[key]
  memo[key] = (0, [])  # recursion guard
  instrs = module.computations.get(comp, [])
  types = {ins.name: ins.type for ins in instrs}
  struct: dict[str, object] = {}
  owners, sizes, first, last = [], [], [], []

  def flat(s):
    if isinstance(s, list):
      return [b for e in s for b in flat(e)]
    return list(s)

  for i, ins in enumerate(instrs):
    for op in ins.operands:
      for b in flat(struct.get(op, ())):
        last[b] = i
    if ins.opcode == "parameter":
      struct[ins.name] = ()
    elif ins.opcode == "tuple":
      struct[ins.name] = [struct.get(op, ()) for op in ins.operands]
    elif ins.opcode == "get-tuple-element":
      src = struct.get(ins.operands[0], ()) if ins.operands else ()
      m = re.search(r"index=(\d+)", ins.attrs)
      k = int(m.group(1)) if m else 0
      struct[ins.name] = src[k] if isinstance(src, list) and k < len(src) else src
    elif ins.opcode in _ALIAS_OPS:
      struct[ins.name] = struct.get(ins.operands[0], ()) if ins.operands else ()
    elif _in_place_target(ins, types) is not None:
      struct[ins.name] = struct.get(_in_place_target(ins, types), ())
    else:
      size = 0 if skip_upcasts and _is_upcast(ins, types) else type_bytes(ins.type)
      owners.append(ins)
      sizes.append(size)
      first.append(i)
      last.append(i)
      struct[ins.name] = (len(sizes) - 1,)
    if ins.root:
      for b in flat(struct[ins.name]):
        last[b] = len(instrs)
  delta = np.zeros(len(instrs) + 2)
  for s, a, b in zip(sizes, first, last):
    delta[a] += s
    delta[b + 1] -= s
  live = np.cumsum(delta)[:max(len(instrs), 1)]
  best, best_i = (float(live.max()), int(live.argmax())) if len(instrs) else (0.0, 0)
  inner_best: list = []
  for i, ins in enumerate(instrs):
    if ins.opcode in ("while", "call", "conditional", "async-start"):
      inner = [_simulate(module, c, skip_upcasts, memo) for c in _callees(ins)]
      peak_in, at_in = max(inner, key=lambda r: r[0], default=(0, []))
      if live[i] + peak_in > best:
        best, best_i, inner_best = live[i] + peak_in, i, at_in
  at_peak = [(s, ins) for s, ins, a, b in zip(sizes, owners, first, last)
             if a <= best_i <= b and s > 0] + inner_best
  memo[key] = (int(best), at_peak)
  return memo[key]


def largest_live(module: Module, skip_upcasts: bool = True, top: int = 5):
  """The largest buffers live at the simulated peak: ``[(bytes, description)]``, where the
  description is the array type and the jax operation that made it (XLA metadata)."""
  _, at_peak = _simulate(module, module.entry, skip_upcasts, {})
  out = []
  for size, ins in sorted(at_peak, key=lambda r: -r[0])[:top]:
    m = re.search(r'op_name="([^"]*)"', ins.attrs)
    t = ins.type
    shape = f"{t[0]}[{','.join(map(str, t[1]))}]" if isinstance(t, tuple) else "tuple"
    where = ins.opcode
    if m:  # the jax op path, without the long dot_general equations in parentheses
      where = m.group(1).split("/(")[0][-80:]
    out.append((size, f"{shape} from {where}"))
  return out


def cpu_upcast_bytes(module: Module) -> int:
  """How much the CPU compiler's f32 copies of bf16/f16 arrays add to the program's peak
  (estimate: the simulated peak with them minus without them; 0 for f32 programs)."""
  memo: dict = {}
  with_copies = _simulate(module, module.entry, False, memo)[0]
  without = _simulate(module, module.entry, True, memo)[0]
  return max(0, with_copies - without)

