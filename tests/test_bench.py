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


def test_gpu_script_smoke_mode_runs_on_cpu(tmp_path):
  out = tmp_path / "gpu.json"
  proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_1b", "--smoke", f"--out={out}"],
                        cwd=ROOT, env=_env(JAXRLHF_COMPILATION_CACHE=str(tmp_path / "xla")),
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  res = json.loads(out.read_text())
  assert 0 < res["update_mfu"] < 5 and 0 < res["decode_bandwidth_fraction"] < 5
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
