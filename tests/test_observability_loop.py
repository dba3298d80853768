"""What a real training run reports: metrics.jsonl with the documented schema, TensorBoard
files that parse back to the same numbers, phase times that add up to the step, MFU, a
profiler trace, and report PNGs — from one short run of the entry point (RM -> GRPO, phase
timing on) — plus the analytic step FLOP count checked against XLA's cost analysis.
"""

import dataclasses
import glob
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from helpers import mesh
from jaxrlhf import perf, report
from jaxrlhf.config import DataConfig, ModelConfig
from jaxrlhf.data import DataSource
from jaxrlhf.metrics import read_jsonl
from jaxrlhf.train import phases
from jaxrlhf.train.spec import build_stage
from jaxrlhf.train.types import StepCarry
from jaxrlhf.train.work import step_flops
from test_metrics import tb_scalars
from test_train import config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 4
FLAGS = ["--experiment=tiny_ppo", f"--steps={STEPS}", "--set=stages=rm,grpo",
         "--set=rm.batch_size=16", "--set=rm.eval_every=2", "--set=grpo.batch_size=8",
         "--set=grpo.num_samples=4", "--set=grpo.eval_every=2", "--set=logging.phase_timing=true",
         "--set=checkpoint.enabled=false", "--profile_steps=grpo:3:3"]
RL_KEYS = ("reward/mean", "reward/std", "reward/min", "reward/max", "kl/mean", "entropy/mean",
           "policy/clip_frac", "policy/approx_kl", "response_length/mean",
           "rollout/logprob_mismatch", "time/step_s", "throughput/tokens_per_s", "perf/mfu",
           "memory/bytes_in_use", "memory/peak_bytes_in_use")
# GRPO's timed programs (PPO adds "values": GRPO has no value model, so no such phase).
PHASES = ("generate", "reference", "reward", "update")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """``python -m jaxrlhf.main`` on one CPU device: (workdir, console output, records)."""
  wd = str(tmp_path_factory.mktemp("obs"))
  env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
  p = subprocess.run([sys.executable, "-m", "jaxrlhf.main", f"--workdir={wd}", *FLAGS],
                     capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  return wd, p.stdout, read_jsonl(os.path.join(wd, "metrics.jsonl"))


def _merged(records, stage):
  by_step = {}
  for r in records:
    if r["stage"] == stage:
      by_step.setdefault(r["step"], {}).update(r)
  return by_step


def test_metrics_jsonl_has_the_documented_schema(run):
  wd, out, records = run
  assert {r["stage"] for r in records} == {"rm", "grpo"}
  assert all(isinstance(r["step"], int) and isinstance(r["wall_time"], float) for r in records)
  grpo, rm = _merged(records, "grpo"), _merged(records, "rm")
  assert sorted(grpo) == sorted(rm) == list(range(1, STEPS + 1))
  for step, m in grpo.items():
    missing = [k for k in RL_KEYS if k not in m]
    assert not missing, (step, missing)
    assert all(isinstance(m[k], float) for k in RL_KEYS)
    assert 0 < m["perf/mfu"] < 1.5 and m["throughput/tokens_per_s"] > 0
    assert ("eval/accuracy" in m) == (step % 2 == 0)
  for step, m in rm.items():
    assert "loss" in m and "time/step_s" in m and "perf/mfu" in m
    # The one-program step is compiled ahead of its first call, and says how long it took.
    assert ("time/compile_s" in m) == (step == 1)
    assert ("eval/pair_accuracy" in m) == (step % 2 == 0)
    if step % 2 == 0:
      assert 0 <= m["eval/pair_accuracy"] <= 1
  # The CPU's peak is measured at start-up and said to be.
  assert "perf/mfu is measured against cpu:" in out and "(measured here)" in out


def test_phase_times_add_up_to_the_step_time(run):
  _, _, records = run
  grpo = _merged(records, "grpo")
  steps = range(2, STEPS + 1)  # step 1 compiles each phase program
  phases = sum(grpo[s][f"time/phase/{p}_s"] for s in steps for p in PHASES)
  step_time = sum(grpo[s]["time/step_s"] for s in steps)
  assert phases == pytest.approx(step_time, rel=0.05)
  for s in steps:
    m = grpo[s]
    shares = sum(m[f"time/share/{p}"] for p in PHASES) + m["time/share/other"]
    assert shares == pytest.approx(1.0, abs=1e-6)
    assert m["perf/generate/bandwidth_util"] > 0 and m["perf/update/mfu"] > 0


def test_tensorboard_events_hold_the_same_numbers(run):
  wd, _, records = run
  runs = tb_scalars(os.path.join(wd, "tensorboard"))  # read by TensorBoard itself
  assert set(runs) == {"rm", "grpo"}
  grpo = _merged(records, "grpo")
  for tag in ("reward/mean", "kl/mean", "time/step_s", "perf/mfu", "eval/accuracy"):
    want = [(s, np.float32(m[tag])) for s, m in sorted(grpo.items()) if tag in m]
    assert [(s, np.float32(v)) for s, v, _ in runs["grpo"][tag]] == want, tag
  assert "eval/pair_accuracy" in runs["rm"]


def test_report_draws_pngs_of_the_run(run):
  wd, _, _ = run
  pngs, summary = report.make_report(wd)
  names = {os.path.basename(p) for p in pngs}
  assert {"rm_accuracy.png", "rm_step_time.png", "grpo_reward.png", "grpo_kl.png",
          "grpo_accuracy.png", "grpo_response_length.png", "grpo_step_time.png"} <= names
  for p in pngs:
    with open(p, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n" and os.path.getsize(p) > 1000, p
  assert "grpo:" in summary and "rm:" in summary


def test_profile_steps_write_a_trace(run):
  wd, _, _ = run
  assert glob.glob(os.path.join(wd, "profile", "plugins", "profile", "*", "*.xplane.pb"))


def test_step_flops_agree_with_xla_cost_analysis():
  # Unscanned layers and one minibatch: no loops hide work from XLA, so its count is exact;
  # the analytic count leaves out elementwise work and the optimizer, a few percent here.
  model = ModelConfig(vocab_size=512, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2,
                      head_dim=64, mlp_dim=1024, max_seq_len=64, scan_layers=False)
  data = DataConfig(task="addition", digits=2, max_prompt_len=16, max_response_len=16,
                    eval_size=8)
  m = mesh()
  cfg = config(model=model, data=data)
  cfg = dataclasses.replace(cfg, grpo=dataclasses.replace(cfg.grpo, num_minibatches=1))
  with jax.set_mesh(m):
    sft = build_stage("sft", cfg, m, DataSource(cfg.data, cfg.seed))
    state, frozen = sft.abstract_init()
    xla = perf.compiled_cost(jax.jit(sft.step), state, frozen, sft.abstract_batch())
    assert step_flops(sft)["update"] == pytest.approx(xla["flops"], rel=0.06)

    grpo = build_stage("grpo", cfg, m, DataSource(cfg.data, cfg.seed))
    state, frozen = grpo.abstract_init()
    carry = jax.eval_shape(
        lambda st, b: phases.generate(grpo.statics, {}, b, StepCarry(state=st)), state,
        grpo.abstract_batch())
    ref = lambda f, c: phases.reference(grpo.statics, f, {}, c)
    xla = perf.compiled_cost(jax.jit(ref), frozen, carry)
    assert step_flops(grpo)["reference"] == pytest.approx(xla["flops"], rel=0.06)
