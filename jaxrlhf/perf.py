"""Where a step's time goes and how well it uses the device.

* :func:`compiled_cost`: FLOPs and bytes of a jitted program from XLA's cost analysis.
* :func:`decoder_flops`: the same count done analytically for the decoder, for programs whose
  loops hide work from XLA (see below).
* :func:`utilisation`: MFU and memory-bandwidth use against an :class:`~jaxrlhf.hardware.
  Accelerator`'s ceilings.
* :class:`PhaseTimer`: wall time of named phases of a step, each waited for with
  ``jax.block_until_ready``, and their shares of the step.
* :class:`ProfileWindow`: ``--profile_steps=A:B`` -> a ``jax.profiler`` trace of those steps in
  ``WORKDIR/profile`` (open it in TensorBoard's profile plugin or Perfetto).
* :func:`memory_in_use`: device memory, or the process's resident memory where the backend
  keeps no statistics (the CPU).
* :func:`release_host_memory`, :func:`tune_host_allocator`: host memory that set-up and
  compilation freed goes back to the system, a step's temporaries stay in place between steps
  (glibc; ``JAXRLHF_MALLOC=reuse|trim|lean|default``);
  :func:`compile_ahead` compiles a step before its first call so that happens before the
  step's temporaries are allocated.
* :func:`enable_compilation_cache`: compiled programs kept on disk between runs, so only the
  first run of a configuration pays for compilation.

Two facts about XLA's cost analysis shape this module (checked with jax 0.10):
it reports the cost *per device* for a sharded (SPMD) program, so MFU divides by one device's
peak; and it counts the body of a ``while`` loop once, whatever the trip count, so a scan over
layers or a decoding loop is undercounted.  :func:`compiled_cost` lists the loops it finds,
and :func:`decoder_flops` gives the count to use for scanned models.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import re
import time
from typing import Callable, Optional

import jax

from jaxrlhf.config import ConfigError, ModelConfig
from kernels._backend import platform_of

# ----------------------------------------------------------------------------- FLOPs


_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def compiled_cost(fn, *args, **kwargs) -> dict:
  """FLOPs and bytes accessed per device of ``fn`` (a jitted function, lowered with ``args``,
  or an already compiled program).

  Returns ``{"flops", "bytes_accessed", "while_loops", "exact"}``: ``while_loops`` holds the
  trip count of each ``while`` loop in the optimised program (None when unknown), and
  ``exact`` is False when there are any, because XLA counts a loop body once.  Missing figures
  are NaN.  Compiling here does not compile twice: jax reuses it for the next call.
  """
  compiled = fn.lower(*args, **kwargs).compile() if hasattr(fn, "lower") else fn
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):  # older jax: one dict per HLO module
    cost = cost[0] if cost else None
  cost = cost or {}
  loops = []
  for line in compiled.as_text().splitlines():
    if " while(" in line:
      m = _TRIP_COUNT.search(line)
      loops.append(int(m.group(1)) if m else None)
  return {"flops": float(cost.get("flops", math.nan)),
          "bytes_accessed": float(cost.get("bytes accessed", math.nan)),
          "while_loops": loops, "exact": not loops}


def decoder_flops(cfg: ModelConfig, batch: int, q_len: int, kv_len: Optional[int] = None, *,
                  head: str = "lm", head_positions: Optional[int] = None,
                  train: bool = False, lora=None) -> float:
  """Matmul FLOPs of the decoder on ``batch`` rows of ``q_len`` new tokens attending over
  ``kv_len`` slots (default ``q_len``; a decode step with a cache has ``q_len=1``).

  Counts what :mod:`jaxrlhf.model.transformer` computes: the q/k/v/o and SwiGLU projections,
  full (unmasked) ``QK^T`` and ``PV`` products, and the head on ``head_positions`` positions
  per row (default all ``q_len``; the LM head is ``2*d*V`` per position, the scalar head
  ``2*d``).  Elementwise work (norms, rotary, softmax) is left out: it is small next to the
  matmuls at real sizes.  ``train=True`` adds the backward pass (twice the forward) and, with
  ``cfg.remat="full"``, one more forward of the layers.  With ``lora`` (a
  :class:`~jaxrlhf.config.LoraConfig` of rank > 0) the weights are frozen: the backward
  computes the activations' gradients only (once the forward), and the adapters' own
  ``(x @ a) @ b`` is counted with its full backward.
  """
  kv_len = q_len if kv_len is None else kv_len
  d, hd = cfg.d_model, cfg.head_dim
  proj = 2 * d * hd * (2 * cfg.n_heads + 2 * cfg.n_kv_heads) + 3 * 2 * d * cfg.mlp_dim
  attn = 2 * 2 * cfg.n_heads * hd * kv_len
  layers = batch * q_len * cfg.n_layers * (proj + attn)
  positions = q_len if head_positions is None else head_positions
  head_flops = batch * positions * (2 * d * cfg.vocab_size if head == "lm" else 2 * d)
  forward = layers + head_flops
  if not train:
    return float(forward)
  recompute = layers if cfg.remat == "full" else 0
  if lora is not None and lora.rank:
    dims = {"q": (d, cfg.n_heads * hd), "k": (d, cfg.n_kv_heads * hd),
            "v": (d, cfg.n_kv_heads * hd), "o": (cfg.n_heads * hd, d),
            "gate": (d, cfg.mlp_dim), "up": (d, cfg.mlp_dim), "down": (cfg.mlp_dim, d)}
    adapters = batch * q_len * cfg.n_layers * sum(2 * lora.rank * sum(dims[t])
                                                  for t in lora.targets)
    return float(2 * forward + 3 * adapters + recompute)
  return float(3 * forward + recompute)


# ------------------------------------------------------------------------- utilisation


def mfu(flops: float, seconds: float, peak_flops: float) -> float:
  """Model FLOPs utilisation: achieved FLOP/s over the peak (all per device)."""
  if not seconds > 0 or not peak_flops > 0:
    return math.nan
  return flops / seconds / peak_flops


def bandwidth_utilisation(nbytes: float, seconds: float, peak_bandwidth: float) -> float:
  """Achieved bytes/s over the memory bandwidth (per device): the figure that matters for
  memory-bound work such as decoding."""
  return mfu(nbytes, seconds, peak_bandwidth)


def utilisation(seconds: float, accelerator, *, flops: float = math.nan,
                bytes_accessed: float = math.nan, prefix: str = "perf") -> dict[str, float]:
  """Metrics for a program that ran ``seconds`` on ``accelerator``, from its per-device FLOPs
  and/or bytes: ``perf/mfu``, ``perf/flops_per_s``, ``perf/bandwidth_util``,
  ``perf/bytes_per_s`` (only those whose inputs are known)."""
  out = {}
  if math.isfinite(flops):
    out[f"{prefix}/flops_per_s"] = flops / seconds if seconds > 0 else math.nan
    out[f"{prefix}/mfu"] = mfu(flops, seconds, accelerator.peak_flops)
  if math.isfinite(bytes_accessed):
    out[f"{prefix}/bytes_per_s"] = bytes_accessed / seconds if seconds > 0 else math.nan
    out[f"{prefix}/bandwidth_util"] = bandwidth_utilisation(bytes_accessed, seconds,
                                                            accelerator.hbm_bandwidth)
  return out


# ------------------------------------------------------------------------------ phases


class PhaseTimer:
  """Times the named phases of a step.

      timer.start_step()
      with timer.phase("generate") as ready:
        rollout = ready(generate(params, prompts))   # waits for the device, returns its input
      out = timer.run("update", update, state, rollout)
      metrics = timer.end_step()

  jax dispatches asynchronously, so a phase is only honest if its result is waited for inside
  it: ``ready`` (or :meth:`run`) calls ``jax.block_until_ready``.  ``end_step`` returns
  ``time/step_s`` (start_step to end_step), ``time/phase/<name>_s`` per phase (repeated
  phases add up), ``time/phase/other_s`` (the host time between phases) and
  ``time/share/<name>`` (phase time over step time; with ``other`` they sum to 1).
  """

  def __init__(self, clock: Callable[[], float] = time.perf_counter):
    self._clock = clock
    self._start: Optional[float] = None
    self._phases: dict[str, float] = {}

  def start_step(self):
    self._start = self._clock()
    self._phases = {}

  @contextlib.contextmanager
  def phase(self, name: str):
    if self._start is None:
      raise RuntimeError("PhaseTimer.phase() outside a step: call start_step() first")
    if name == "other":
      raise ValueError("'other' is the timer's own name for time between phases")
    t0 = self._clock()
    try:
      yield jax.block_until_ready
    finally:
      self._phases[name] = self._phases.get(name, 0.0) + self._clock() - t0

  def run(self, name: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` timed as phase ``name``, waited for; returns its result."""
    with self.phase(name) as ready:
      return ready(fn(*args, **kwargs))

  def end_step(self) -> dict[str, float]:
    if self._start is None:
      raise RuntimeError("PhaseTimer.end_step() without start_step()")
    step_s = self._clock() - self._start
    self._start = None
    out = {"time/step_s": step_s}
    phases = dict(self._phases)
    phases["other"] = max(step_s - sum(phases.values()), 0.0)
    for name, seconds in phases.items():
      out[f"time/phase/{name}_s"] = seconds
      out[f"time/share/{name}"] = seconds / step_s if step_s > 0 else math.nan
    return out


# ----------------------------------------------------------------------------- profiler


def parse_profile_steps(text: Optional[str]) -> Optional[tuple[Optional[str], int, int]]:
  """``"A:B"`` or ``"STAGE:A:B"`` -> (stage or None, A, B); None or "" -> None.

  Steps are inclusive and counted like the metrics' steps.  Raises ConfigError.
  """
  if text is None or not text.strip():
    return None
  parts = text.strip().split(":")
  stage = None
  if len(parts) == 3:
    stage, parts = parts[0].strip(), parts[1:]
  usage = (f"--profile_steps={text!r}: use A:B (steps A..B of the first stage that reaches "
           f"A) or STAGE:A:B, with 0 <= A <= B, e.g. --profile_steps=10:12")
  if len(parts) != 2 or stage == "":
    raise ConfigError(usage)
  try:
    first, last = int(parts[0]), int(parts[1])
  except ValueError:
    raise ConfigError(usage) from None
  if not 0 <= first <= last:
    raise ConfigError(usage)
  return stage, first, last


class ProfileWindow:
  """Captures one ``jax.profiler`` trace of steps A..B into ``WORKDIR/profile``.

      window = ProfileWindow(flag_text, workdir)
      for step in ...:
        window.before_step(stage, step)
        with window.annotate(step):
          state, metrics = train_step(state, batch)
        window.after_step(stage, step, metrics)   # waits for ``metrics`` before stopping
      window.close()

  Inactive (every method a no-op) when the flag is empty.  One window per run: once the trace
  is written, later stages are not traced.
  """

  def __init__(self, spec: Optional[str], workdir: str):
    parsed = parse_profile_steps(spec)
    self.spec = spec
    self.enabled = parsed is not None
    self.stage, self.first, self.last = parsed if parsed else (None, 0, -1)
    self.trace_dir = os.path.join(workdir, "profile")
    self.active = False
    self.done = False

  def _wants(self, stage: str) -> bool:
    return self.enabled and not self.done and self.stage in (None, stage)

  def before_step(self, stage: str, step: int):
    if self._wants(stage) and not self.active and self.first <= step <= self.last:
      os.makedirs(self.trace_dir, exist_ok=True)
      jax.profiler.start_trace(self.trace_dir)
      self.active, self.stage = True, stage

  def annotate(self, step: int):
    """Marks a step in the trace (TensorBoard's profile plugin groups by it)."""
    if self.active:
      return jax.profiler.StepTraceAnnotation("train", step_num=int(step))
    return contextlib.nullcontext()

  def after_step(self, stage: str, step: int, outputs=None):
    if self.active and stage == self.stage and step >= self.last:
      self._stop(outputs)

  def _stop(self, outputs=None):
    # Work still in flight when the trace stops would be missing from it.
    jax.block_until_ready(outputs)
    jax.profiler.stop_trace()
    self.active, self.done = False, True
    print(f"{self.stage}: trace of steps {self.first}-{self.last} written to {self.trace_dir} "
          f"(tensorboard --logdir {self.trace_dir}, or Perfetto)", flush=True)

  def close(self):
    if self.active:
      self._stop()
    elif self.enabled and not self.done:
      print(f"--profile_steps={self.spec}: this run never reached "
            f"{'step' if self.stage is None else self.stage + ' step'} {self.first}; "
            "no trace was written", flush=True)


# -------------------------------------------------------------------- compilation cache

COMPILATION_CACHE_ENV = "JAXRLHF_COMPILATION_CACHE"
DEFAULT_COMPILATION_CACHE = "~/.cache/jaxrlhf/xla"


def enable_compilation_cache(path: Optional[str] = None) -> Optional[str]:
  """Turns on jax's persistent compilation cache; returns its directory (None: off).

  ``path`` defaults to ``$JAXRLHF_COMPILATION_CACHE``, else ``~/.cache/jaxrlhf/xla``; ``off``
  (or ``none``, ``0``, empty) turns it off.  A directory the user gave jax directly
  (``JAX_COMPILATION_CACHE_DIR``) wins over both.  Every program is cached, however small or
  quickly compiled (unless the user set jax's ``JAX_PERSISTENT_CACHE_MIN_*`` thresholds): a
  training step is a handful of programs and each one skipped counts.  The cache is trusted
  code: keep it private to the user.
  """
  path_given = jax.config.jax_compilation_cache_dir
  if not path_given:
    if path is None:
      path = os.environ.get(COMPILATION_CACHE_ENV, DEFAULT_COMPILATION_CACHE)
    if path.strip().lower() in ("", "off", "none", "0", "false"):
      return None
    path = os.path.abspath(os.path.expanduser(path))
    try:
      os.makedirs(path, exist_ok=True)
    except OSError as e:
      raise ConfigError(f"{COMPILATION_CACHE_ENV}={path}: cannot create the compilation cache "
                        f"directory ({e.strerror}); point it at a writable directory or set "
                        f"it to 'off'") from None
    jax.config.update("jax_compilation_cache_dir", path)
  # jax's own thresholds skip programs that compile in under a second; a user's explicit
  # setting of them wins.
  if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  if "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES" not in os.environ:
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  return path_given or path


# ------------------------------------------------------------------------------- memory


ALLOCATOR_ENV = "JAXRLHF_MALLOC"
ALLOCATOR_MODES = ("reuse", "trim", "lean", "default")
# glibc's mallopt parameter numbers (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4


def _glibc():
  """glibc's C library, or None (another libc, or not Linux)."""
  try:
    lib = ctypes.CDLL("libc.so.6")
    lib.mallopt, lib.malloc_trim  # noqa: B018 -- both must exist
    return lib
  except (OSError, AttributeError):
    return None


def _allocator_mode() -> str:
  mode = os.environ.get(ALLOCATOR_ENV, "").strip().lower() or "reuse"
  if mode not in ALLOCATOR_MODES:
    raise ConfigError(f"{ALLOCATOR_ENV}={mode!r}: choose one of {', '.join(ALLOCATOR_MODES)} "
                      f"(default reuse)")
  return mode


def tune_host_allocator(mmap_threshold: int = 1 << 20) -> bool:
  """Applies ``JAXRLHF_MALLOC``'s host-memory setting (glibc; True if it changed glibc's).
  Call it before anything else starts jax's backend: it configures the CPU client, then starts
  the backend to see whether the CPU is the one computing.

  XLA allocates every buffer and each program's temporaries with ``malloc``.  glibc serves a
  block over its mapping threshold (which it raises, up to 32 MiB, as it frees such blocks)
  from a fresh mapping, unmapped again on ``free``; smaller blocks come from a heap, which
  keeps what is freed in its middle.

  * ``reuse`` (the default), on the CPU backend only: a step's temporaries are one block over
    that limit (139 MiB for the GRPO benchmark), so every step mapped it afresh and faulted
    in each of its pages (36,000 faults, 80 ms of kernel time per GRPO step).  Programs now
    run on the calling thread (jax's ``jax_cpu_enable_async_dispatch`` off; the loop waits
    for every step's metrics anyway), whose heap serves such blocks without a mapping and
    keeps the freed top: the next step finds its temporaries there, already faulted in.
    GRPO, DPO and PPO steps 7.6%, 10% and 6.7% faster; the peak is the same (the block was resident
    during every step anyway); between steps the process keeps it (benchmarks/NOTES.md,
    change 12).  Plus ``trim``.
  * ``trim``: :func:`release_host_memory` after set-up and the first step only.
  * ``lean``: ``trim`` and a fixed 1 MiB threshold, so blocks over it always go back to the
    system: the PPO benchmark's warm peak 709 -> 692 MiB before change 10, but twice the page
    faults and steps 3-10% slower (change 7).
  * ``default``: glibc as it is.
  """
  mode = _allocator_mode()
  if mode == "reuse" and "JAX_CPU_ENABLE_ASYNC_DISPATCH" not in os.environ:
    jax.config.update("jax_cpu_enable_async_dispatch", False)
  lib = _glibc() if mode in ("reuse", "lean") else None
  if lib is None:
    return False
  if mode == "lean":
    return bool(lib.mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold)))
  if platform_of(jax.devices()[0]) != "cpu":  # device buffers are not malloc'd: leave the host
    return False
  return bool(lib.mallopt(_M_MMAP_MAX, 0) and lib.mallopt(_M_TRIM_THRESHOLD, 1 << 30))


def configure_process() -> Optional[str]:
  """The process-wide settings every training process applies before its first jax call:
  :func:`tune_host_allocator` (``$JAXRLHF_MALLOC``), then :func:`enable_compilation_cache`
  (``$JAXRLHF_COMPILATION_CACHE``).  Used by :func:`jaxrlhf.train.pipeline.run` and by each
  pool process (``--role``); returns the cache directory (None: off)."""
  tune_host_allocator()
  return enable_compilation_cache()


def release_host_memory() -> None:
  """Returns the heap's free pages to the system (glibc ``malloc_trim``; elsewhere nothing).
  Called after set-up and after the first step: what their compilation and loading freed
  would otherwise stay resident for the whole run (the PPO benchmark's warm peak 728 -> 709
  MiB).  Free at run time; ``JAXRLHF_MALLOC=default`` skips it.  It releases a step's
  temporaries kept by ``reuse`` too: the next step faults them in once more."""
  if _allocator_mode() == "default":
    return
  lib = _glibc()
  if lib:
    lib.malloc_trim(0)


def compile_ahead(fn, *args) -> Optional[float]:
  """Compiles the jitted ``fn`` for ``args`` before its first call, then gives the memory the
  compiler (or loading a cached program) freed back to the system; the seconds it took, or
  ``None`` for a callable that is not a ``jax.jit`` function (left alone).

  The first call with the same arguments, under the same mesh context, then runs the
  executable jax's caches already hold: it compiles nothing.  Without this the first step
  allocates its temporaries on top of the heap compilation left behind: the PPO benchmark's
  warm-cache peak was 707 MiB that way, 634 MiB with the heap released in between."""
  lower = getattr(fn, "lower", None)
  if lower is None:
    return None
  t0 = time.perf_counter()
  lower(*args).compile()
  release_host_memory()
  return time.perf_counter() - t0


def _rss_bytes() -> tuple[float, float]:
  """(current, peak) resident memory of this process."""
  import resource
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0  # KiB on Linux
  try:
    with open("/proc/self/statm") as f:
      current = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
  except (OSError, ValueError, IndexError):
    current = peak
  return float(current), peak


def memory_in_use(devices=None) -> dict[str, float]:
  """``memory/bytes_in_use`` and ``memory/peak_bytes_in_use``: the most on any local device
  where the backend keeps statistics (GPU, TPU), else the process's resident memory (CPU);
  ``memory/on_device`` says which (1.0 or 0.0)."""
  devices = jax.local_devices() if devices is None else devices
  in_use, peak = [], []
  for d in devices:
    stats = d.memory_stats() if hasattr(d, "memory_stats") else None
    if stats and "bytes_in_use" in stats:
      in_use.append(stats["bytes_in_use"])
      peak.append(stats.get("peak_bytes_in_use", stats["bytes_in_use"]))
  if in_use:
    return {"memory/bytes_in_use": float(max(in_use)),
            "memory/peak_bytes_in_use": float(max(peak)), "memory/on_device": 1.0}
  current, peak_rss = _rss_bytes()
  return {"memory/bytes_in_use": current, "memory/peak_bytes_in_use": peak_rss,
          "memory/on_device": 0.0}
