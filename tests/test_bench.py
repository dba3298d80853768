"""The benchmark suite's pieces: the fixed workload shape, the GPU script's smoke mode, and the
persistent compilation cache the trainer turns on."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env(**extra):
  # One CPU device, and no cache directory given to jax directly (it would win).
  env = {k: v for k, v in os.environ.items()
         if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")}
  env.update(extra)
  return env


def test_workload_model_has_the_issue_parameter_count():
  sys.path.insert(0, ROOT)
  from benchmarks import suite
  cfg = suite.workload_config("grpo")
  assert cfg.model.num_params("lm") == suite.PARAM_COUNT == 4_458_752
  assert (cfg.grpo.batch_size, cfg.grpo.num_samples, cfg.rollout.max_new_tokens) == (8, 4, 32)
  dpo = suite.workload_config("dpo")
  assert dpo.data.max_prompt_len + dpo.data.max_response_len == 128
  with pytest.raises(ValueError, match="unknown workload"):
    suite.workload_config("sft")


def test_real_model_workloads_fix_the_issue_shape():
  # smol_grpo is the shape TRL was measured at in issue 43: 4 prompts x 4 samples x 128 new
  # tokens, prompts up to 192 tokens; the suite runs it through the trainer, evaluation off.
  sys.path.insert(0, ROOT)
  sys.path.insert(0, os.path.join(ROOT, "tests"))
  from benchmarks import suite
  from helpers import real_model
  from experiments.smol import _shared
  folder, why = real_model()
  if folder is None:
    pytest.skip(why)
  if not _shared("gsm8k", "train.jsonl"):
    pytest.skip("../shared/data is not beside this checkout")
  cfg = suite.smol_config("smol_grpo", steps=3)
  assert (cfg.grpo.batch_size, cfg.grpo.num_samples, cfg.rollout.max_new_tokens,
          cfg.data.max_prompt_len, cfg.grpo.steps, cfg.grpo.eval_every) == (4, 4, 128, 192, 3, 0)
  assert cfg.model.hf_path and cfg.model.compute_dtype == "float32"
  dpo = suite.smol_config("smol_dpo", steps=2)
  assert (dpo.dpo.steps, dpo.dpo.eval_every) == (2, 0)


def test_peer_trl_smol_rewards_are_the_experiments_terms():
  # The TRL side of smol_grpo scores as smol_gsm8k_grpo does: 0.5 for exactly one non-empty
  # box, 1.0 more when it holds the answer (commas ignored).
  sys.path.insert(0, ROOT)
  from benchmarks.peer_trl import smol_rewards
  texts = ["The answer is \\boxed{1,200}.", "The answer is \\boxed{7}.", "\\boxed{}",
           "\\boxed{3} or \\boxed{4}", "no box", [{"content": "\\boxed{1200}"}]]
  assert smol_rewards(texts, ["1200", "1200", "1200", "3", "5", "1200"]) == [
      1.5, 0.5, 0.0, 0.0, 0.0, 1.5]


def test_spread_workload_lengths_and_packing(tmp_path):
  """The spread-length set: lengths from 8 to 512 (log-uniform: median near 64), the same
  4.46M policy, and its packed batches holding the padded batches' tokens in fewer slots."""
  sys.path.insert(0, ROOT)
  import numpy as np
  from benchmarks import suite
  from jaxrlhf.data import DataSource
  from jaxrlhf.train.spec import build_stage
  lengths = suite.spread_lengths(4096)
  assert lengths.min() == 8 and lengths.max() >= 508 and 50 <= np.median(lengths) <= 80
  stages = {}
  for pack in (False, True):
    cfg = suite.spread_config("sft_spread", pack, str(tmp_path))
    assert cfg.model.num_params("lm") == suite.PARAM_COUNT
    stages[pack] = build_stage("sft", cfg, None, DataSource(cfg.data, cfg.seed))
  padded, packed = stages[False].batch(0), stages[True].batch(0)
  assert padded["mask"].sum() == packed["mask"].sum()
  assert packed["mask"].size * 2 <= padded["mask"].size  # under half the slots
  assert packed["mask"].shape[1] == padded["mask"].shape[1] == 512


def test_gpu_script_smoke_mode_runs_on_cpu(tmp_path):
  out = tmp_path / "gpu.json"
  proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_1b", "--smoke", f"--out={out}"],
                        cwd=ROOT, env=_env(JAXRLHF_COMPILATION_CACHE=str(tmp_path / "xla")),
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  res = json.loads(out.read_text())
  assert 0 < res["update_mfu"] < 5
  # Decode's time is generate's less the prefill's: unmeasured (None, and said so) when a
  # busy machine makes the difference noise, never a figure out of that noise.
  fraction = res["decode_bandwidth_fraction"]
  assert fraction is None or 0 < fraction < 5, fraction
  assert {"generate", "reference", "update"} <= set(res["phases_s"])
  assert "update MFU" in proc.stdout and "decode bandwidth" in proc.stdout


_CACHE_PROBE = """
import sys, jax, jax.numpy as jnp
from jaxrlhf.perf import enable_compilation_cache
print(enable_compilation_cache())
jax.jit(lambda x: x * 2 + 1)(jnp.ones(3)).block_until_ready()
"""


@pytest.mark.parametrize("setting", ["dir", "off", "jax_dir_wins"])
def test_compilation_cache_keeps_programs_on_disk_unless_off(tmp_path, setting):
  cache, jax_cache = tmp_path / "xla", tmp_path / "jax"
  env = _env(JAXRLHF_COMPILATION_CACHE=str(cache) if setting != "off" else "off")
  if setting == "jax_dir_wins":
    env["JAX_COMPILATION_CACHE_DIR"] = str(jax_cache)
  proc = subprocess.run([sys.executable, "-c", _CACHE_PROBE], cwd=ROOT, capture_output=True,
                        text=True, timeout=120, env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  used = {"dir": cache, "jax_dir_wins": jax_cache}.get(setting)
  if used is None:
    assert proc.stdout.split()[-1] == "None" and not cache.exists()
  else:
    assert proc.stdout.split()[-1] == str(used)
    # A program that compiles in milliseconds is kept too (jax's default skips it).
    assert any(used.iterdir()), "a compiled program should have been written to the cache"


_ALLOC_PROBE = """
import ctypes, sys
from jaxrlhf import perf

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def rss_mib():
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * 4096 / 2**20

mode = sys.argv[1]
if mode == "tuned":
  print("applied", perf.tune_host_allocator())
# What XLA's host buffers do to glibc: one large block freed (glibc raises its mmap threshold
# past it), then blocks under that size interleaved with longer-lived smaller allocations.
libc.free(libc.malloc(8 << 20))
base = rss_mib()
big, keep = [], []
for i in range(40):
  big.append(libc.malloc(4 << 20))
  ctypes.memset(big[-1], 1, 4 << 20)
  keep.append(libc.malloc(256000))  # larger than any hole the imports left: lands between
for p in big:
  libc.free(p)
if mode == "released":
  perf.release_host_memory()
print("retained", rss_mib() - base)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc allocator")
@pytest.mark.parametrize("mode", ["default", "tuned", "released"])
def test_freed_host_buffers_go_back_to_the_system(mode):
  """``release_host_memory`` (what the trainer does after set-up and the first step) and
  ``JAXRLHF_MALLOC=lean`` return freed heap blocks that glibc would otherwise keep."""
  from jaxrlhf import perf
  if perf._glibc() is None:
    pytest.skip("not glibc")
  # "default": nothing called (what glibc does alone); "released": the trainer's default trim.
  env = _env(JAXRLHF_MALLOC={"tuned": "lean", "released": "trim"}.get(mode, "default"))
  proc = subprocess.run([sys.executable, "-c", _ALLOC_PROBE, mode], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  retained = float(proc.stdout.split("retained")[-1])
  if mode == "default":  # the problem exists: 160 MiB freed, most of it still resident
    assert retained > 100, proc.stdout
  else:
    assert retained < 20, proc.stdout
  if mode == "tuned":
    assert "applied True" in proc.stdout


_FAULT_PROBE = """
import resource
from jaxrlhf import perf
print("applied", perf.tune_host_allocator())  # before anything else starts jax, as the trainer
import jax, jax.numpy as jnp
a = jnp.ones((4096, 64), jnp.float32)
f = jax.jit(lambda a: jnp.sum(jnp.dot(jnp.dot(a, a.T), a)))  # a 64 MiB temporary
jax.block_until_ready(f(a))
faults = []
for _ in range(4):
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  jax.block_until_ready(f(a))
  faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print("faults", min(faults))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc allocator")
@pytest.mark.parametrize("mode", ["trim", "reuse"])
def test_step_temporaries_stay_in_place_between_steps(mode):
  """A program's temporaries over glibc's 32 MiB mapping limit were mapped and faulted in
  afresh at every call (``trim``, the old default); ``reuse`` keeps them in the heap."""
  from jaxrlhf import perf
  if perf._glibc() is None:
    pytest.skip("not glibc")
  env = {k: v for k, v in _env(JAXRLHF_MALLOC=mode).items()
         if k != "JAX_CPU_ENABLE_ASYNC_DISPATCH"}
  proc = subprocess.run([sys.executable, "-c", _FAULT_PROBE], cwd=ROOT, capture_output=True,
                        env=env, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  faults = int(proc.stdout.split("faults")[-1])
  if mode == "trim":  # 64 MiB of 4 KiB pages, each faulted in again
    assert faults > 8000, proc.stdout
  else:
    assert "applied True" in proc.stdout and faults < 1000, proc.stdout


def test_bad_allocator_setting_names_the_choices(monkeypatch):
  from jaxrlhf import perf
  from jaxrlhf.config import ConfigError
  monkeypatch.setenv("JAXRLHF_MALLOC", "jemalloc")
  with pytest.raises(ConfigError, match=r"JAXRLHF_MALLOC='jemalloc': choose one of reuse, trim, "
                                        r"lean, default"):
    perf.tune_host_allocator()
  monkeypatch.setenv("JAXRLHF_MALLOC", "default")
  assert perf.tune_host_allocator() is False


def test_compile_ahead_leaves_the_first_call_nothing_to_compile():
  """The loop compiles a step before its first call (to release the compiler's heap before
  the step's temporaries are allocated); that first call must then run the compiled program,
  not compile it a second time."""
  import jax
  import jax.numpy as jnp
  from jax._src import dispatch
  from jaxrlhf import perf
  compiles = []
  def listener(event, duration, **kwargs):
    if event == dispatch.BACKEND_COMPILE_EVENT:
      compiles.append(duration)
  step = jax.jit(lambda s, x: (s + x.sum(), x * 2.0), donate_argnums=(0,))
  s, x = jax.block_until_ready((jnp.zeros(()), jnp.arange(12.0).reshape(3, 4)))
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    seconds = perf.compile_ahead(step, s, x)
    assert seconds is not None and seconds >= 0 and len(compiles) == 1
    s, y = step(s, x)
    assert len(compiles) == 1  # the first call reused the program compiled ahead
    assert float(s) == 66.0 and y.shape == (3, 4)
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  # Anything that is not a jitted function (the phased RL step) is left to compile itself.
  assert perf.compile_ahead(lambda s, x: (s, x), s, x) is None


def test_report_gives_each_phase_its_share_of_its_own_floor():
  sys.path.insert(0, ROOT)
  from benchmarks import suite
  r = {"workload": "grpo", "params": 1, "setup_s": 1.0, "first_step_s": 2.0,
       "step_s": {"median": 0.5, "min": 0.4, "max": 0.6, "n": 15}, "flops_per_step": 60e9,
       "flops_by_phase": {"generate": 10e9, "update": 50e9}, "matmul_flops_per_s": 200e9,
       "matmul_1280x256x1024_flops_per_s": 200e9, "loadavg_1min": [1.0, 1.0],
       "floor_s": 0.3, "floor_fraction": 0.6, "model_flops_per_s": 120e9,
       "floor_fraction_at_best": 0.6, "peak_rss_bytes": 2**29,
       "phases_s": {"generate": 0.125, "update": 0.3125, "reward": 0.001, "step": 0.44},
       "phase_flops": {"generate": 10e9, "update": 50e9}}
  # generate: 10 G at 200 G/s is 0.05 s of floor in 0.125 s; update: 0.25 in 0.3125.
  assert suite.phase_floor_fractions(r) == pytest.approx({"generate": 0.4, "update": 0.8})
  line = next(l for l in suite.report(r).splitlines() if "phases" in l)
  assert "generate 0.1250 (40%)" in line and "update 0.3125 (80%)" in line
  assert "reward 0.0010;" in line  # no FLOPs counted for it: no share printed


def test_turns_workload_reports_turns_and_useful_tokens():
  """The multi-turn workload (calc_turns) on a few steps: the trainer's own phase timing and
  episode counts give turns/s, useful tokens/s and the fraction of slots used."""
  from benchmarks import suite
  r = suite.worker_turns("calc_turns", steps=2, sft_steps=3)
  assert r["steps"] == 2 and r["rows"] == 128
  assert r["turns_per_episode"] >= 1 and r["turns_per_s"] > 0
  assert r["useful_tokens_per_s"] >= r["policy_tokens_per_s"] > 0
  assert 0 < r["useful_fraction"] <= 1 and 0 < r["episodes_share"] < 1
  assert "turns/s" in suite.report_turns(r)


def test_the_long_tail_is_the_documented_pareto_tail():
  """benchmarks.lengths.pareto_lengths: P(L) = s/(L-1) - s/L, median 2s, and s/(limit-1) of
  the responses running to the limit (the long-tail workload's policy)."""
  sys.path.insert(0, ROOT)
  from benchmarks.lengths import pareto_lengths
  p = pareto_lengths(128, 8)
  assert len(p) == 129 and abs(sum(p) - 1) < 1e-12 and p[1:9] == [0.0] * 8
  assert abs(sum(p[1:17]) - 0.5) < 1e-12  # median 16
  assert abs(p[0] - 8 / 127) < 1e-12 and abs(p[20] - (8 / 19 - 8 / 20)) < 1e-12
