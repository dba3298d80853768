"""The planner (jaxrlhf.plan): compile-truth memory per device, its agreement with the programs
the trainer actually runs, scaling with devices, the not-fit report, plan.json, the search,
the HLO readers, and the wrong-machine guard."""

import dataclasses
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxrlhf import hardware, plan, registry
from jaxrlhf.plan import hlo as plan_hlo
from jaxrlhf.config import (DataConfig, ExperimentConfig, MeshConfig, ModelConfig, SFTConfig,
                            apply_overrides)
from jaxrlhf.data import DataSource
from jaxrlhf.mesh import make_mesh
from jaxrlhf.train.common import put_batch
from jaxrlhf.train.spec import build_stage

H100 = hardware.get_accelerator("h100")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The 70B experiments' layout (bf16, remat full, scanned layers, GQA) at a size that compiles
# in a second or two.
SMALL = ModelConfig(vocab_size=4096, d_model=256, n_layers=2, n_heads=8, n_kv_heads=2,
                    head_dim=32, mlp_dim=512, max_seq_len=64, param_dtype="bfloat16",
                    compute_dtype="bfloat16", remat="full", scan_layers=True)
SMALL_SFT = ExperimentConfig(name="small_sft", stages=("sft",), model=SMALL,
                             data=DataConfig(max_prompt_len=16, max_response_len=16),
                             sft=SFTConfig(steps=100, batch_size=8))


def _run_footprint(cfg, name: str, mesh) -> int:
  """arguments + outputs + temporaries - aliased bytes of the step program the training loop
  compiles for stage ``name``, from the real (allocated) state and batch."""
  stage = build_stage(name, cfg, mesh, DataSource(cfg.data, cfg.seed))
  state, frozen = stage.init(jax.random.key(0), {})
  batch = put_batch(mesh, stage.batch(0))
  with jax.set_mesh(mesh):
    m = stage.make_step_fn(state, frozen, batch).lower(state, frozen,
                                                       batch).compile().memory_analysis()
  return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
          - m.alias_size_in_bytes)


@pytest.fixture(scope="module")
def small_plans():
  """SMALL_SFT planned on 2 and 8 devices (tp=2, fsdp 1 then 4)."""
  return {n: plan.build_plan(SMALL_SFT, n, H100, mesh_cfg=MeshConfig(dp=1, fsdp=n // 2, tp=2))
          for n in (2, 8)}


# ------------------------------------------------------------ planner vs the real program


def test_sft_step_peak_matches_the_program_the_trainer_runs():
  cfg = registry.get("tiny_ppo")
  mesh = make_mesh(cfg.mesh)
  sp = plan.plan_stage(cfg, "sft", mesh, H100)
  planned = sp.programs[0]
  # Its SFT stops at an accuracy: the plan calls its steps a budget.
  assert (sp.steps, sp.may_end_early) == (400, "sft.stop_accuracy=0.8")
  actual = _run_footprint(cfg, "sft", mesh)
  assert planned.name == "sft/step" and planned.resident_bytes == 0
  assert abs(planned.peak_bytes_per_device - actual) <= 0.1 * actual


def test_ppo_step_peak_matches_the_program_the_trainer_runs():
  # By default an RL step (generate, score, update) is one program: compare with it.
  cfg = apply_overrides(registry.get("tiny_ppo"), ["ppo.batch_size=8"])
  mesh = make_mesh(cfg.mesh)
  sp = plan.plan_stage(cfg, "ppo", mesh, H100, full=False)
  (planned,) = sp.programs
  assert planned.name == "ppo/step" and planned.runs
  actual = _run_footprint(cfg, "ppo", mesh)
  assert abs(planned.peak_bytes_per_device - actual) <= 0.1 * actual


# ------------------------------------------------------------------- scaling and fitting


def test_memory_per_device_falls_as_devices_rise(small_plans):
  small, large = (small_plans[n].stages[0].programs[0] for n in (2, 8))
  assert large.peak_bytes_per_device < small.peak_bytes_per_device
  # Parameters and both AdamW moments shard over fsdp: 4x the fsdp, a quarter the arguments.
  assert large.argument_bytes == pytest.approx(small.argument_bytes / 4, rel=0.1)
  assert large.temp_bytes < small.temp_bytes


def test_a_plan_that_cannot_fit_says_so_and_names_the_largest_consumer(small_plans):
  p = small_plans[2]
  tiny_gpu = dataclasses.replace(H100, name="tiny", memory_bytes=1e6)
  small = dataclasses.replace(p, accelerator=tiny_gpu)
  assert p.fits and not small.fits
  what, size, fix = small.largest_consumer()
  consumers = p.stages[0].consumers
  assert what in consumers or what.startswith("temporaries of sft/step")
  assert size >= max(consumers.values())
  text = plan.format_plan(small)
  assert "DOES NOT FIT" in text and what in text and fix in text
  assert json.loads(json.dumps(plan.to_json(small), default=float))["fits"] is False


def test_plan_json_schema_and_table(tmp_path, monkeypatch, capsys, small_plans):
  monkeypatch.setenv("JAXRLHF_COMPILATION_CACHE", "off")
  cfg = dataclasses.replace(SMALL_SFT, mesh=MeshConfig(dp=1, fsdp=1, tp=2),
                            plan=dataclasses.replace(SMALL_SFT.plan, devices=2,
                                                     accelerator="b200"))
  assert plan.main(cfg, str(tmp_path)) == 0
  doc = json.loads((tmp_path / "plan.json").read_text())
  assert doc["experiment"] == "small_sft" and doc["devices"] == 2
  assert doc["accelerator"] == "b200" and doc["fits"] is True
  for key in ("est_step_seconds", "est_usd_per_step"):
    assert isinstance(doc[key], float) and doc[key] > 0
  (prog,) = doc["programs"]
  assert prog["name"] == "sft/step"
  for key in ("peak_bytes_per_device", "flops", "bytes_accessed", "est_seconds"):
    assert isinstance(prog[key], (int, float)) and prog[key] > 0
  # The same programs as the H100 plan: the memory is the same, the time is not.
  h100 = small_plans[2].stages[0].programs[0]
  assert prog["peak_bytes_per_device"] == h100.peak_bytes_per_device
  assert prog["est_seconds"] < h100.est_seconds
  assert doc["est_usd_per_step"] == pytest.approx(doc["est_step_seconds"] * 2 * 5.0 / 3600)
  assert doc["cost"]["band"].startswith("under $50k")
  out = capsys.readouterr().out
  assert "sft/step" in out and "fits: peak" in out and "plan.json" in out
  # Nothing overlapped: compute plus collectives, above the roofline; the cost is on the
  # roofline.  XLA:CPU schedules no asynchronous collectives: no overlapped time, and why.
  assert doc["unoverlapped_step_seconds"] >= doc["est_step_seconds"]
  assert prog["t_unoverlapped"] == pytest.approx(
      max(prog["t_compute"], prog["t_memory"]) + prog["t_comm"])
  assert doc["cost"]["step_time"].startswith("est_step_seconds: the roofline")
  if doc["compiler"] == "cpu":
    assert doc["overlapped_step_seconds"] is None and prog["t_overlapped"] is None
    assert "XLA:CPU compiled it" in doc["overlap_absent"] and "overlap: not estimated" in out


def test_search_finds_the_smallest_device_count(small_plans):
  p2, p8 = (small_plans[n].stages[0].peak.peak_bytes_per_device for n in (2, 8))
  # A device between the two peaks: 1 device cannot even hold the states (skipped without
  # compiling), 2 compile but do not fit, 8 fit.
  gpu = dataclasses.replace(H100, memory_bytes=(p2 + p8) / 2 / plan.USABLE_FRACTION)
  assert plan.state_bytes(SMALL_SFT) > gpu.memory_bytes * plan.USABLE_FRACTION
  found, tried = plan.find_smallest(SMALL_SFT, gpu, counts=(1, 2, 8), per_count=1,
                                    log=lambda *_: None)
  assert [(t[0], t[3]) for t in tried] == [(1, "states alone exceed memory"), (2, "too big"),
                                           (8, "fits")]
  assert found.devices == 8 and found.mesh == {"dp": 1, "fsdp": 4, "tp": 2}


# ------------------------------------------------------------------------ HLO readers


def test_collective_traffic_counts_ring_bytes_nodes_and_loop_trips():
  mesh = make_mesh(MeshConfig(dp=8), jax.devices()[:8])
  x = jax.ShapeDtypeStruct((8, 128), jnp.float32, sharding=NamedSharding(mesh, P("dp")))
  gather = jax.jit(lambda a: a * 2, out_shardings=NamedSharding(mesh, P()))
  module = plan_hlo.parse_hlo(gather.lower(x).compile().as_text())
  one_node = plan_hlo.collective_traffic(module, 8, node_size=8)
  assert one_node.intra_bytes == pytest.approx(8 * 128 * 4 * 7 / 8)
  assert one_node.inter_bytes == 0
  two_nodes = plan_hlo.collective_traffic(module, 8, node_size=4)
  assert two_nodes.inter_bytes == one_node.intra_bytes

  def looped(a):
    def body(c, _):  # a reduction over the sharded rows that depends on the carry
      return jnp.sum(a * c), None
    return jax.lax.scan(body, jnp.ones((), jnp.float32), None, length=3)[0]

  module = plan_hlo.parse_hlo(jax.jit(looped).lower(x).compile().as_text())
  t = plan_hlo.collective_traffic(module, 8, node_size=8)
  assert t.executions == pytest.approx(3 * t.ops)


def test_replica_group_formats():
  explicit = plan_hlo.replica_groups("replica_groups={{0,1},{2,3}}, dimensions", 4)
  np.testing.assert_array_equal(explicit, [[0, 1], [2, 3]])
  iota = plan_hlo.replica_groups("replica_groups=[2,4]<=[4,2]T(1,0), x", 8)
  np.testing.assert_array_equal(iota, [[0, 2, 4, 6], [1, 3, 5, 7]])
  named = plan_hlo.replica_groups("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, x", 8)
  np.testing.assert_array_equal(named, [[0, 4], [1, 5], [2, 6], [3, 7]])
  permuted = plan_hlo.replica_groups(
      "replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([4,2]T(1,0)) {'axis_1'}", 8)
  np.testing.assert_array_equal(permuted, [[0, 2, 4, 6], [1, 3, 5, 7]])
  assert plan_hlo.replica_groups("no groups here", 8) is None


def test_cpu_upcast_copies_are_found_in_bf16_programs_only():
  def scanned(w_LDD, h_BD):
    return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h_BD, w_LDD)[0]

  def upcast(dtype):
    w = jax.ShapeDtypeStruct((4, 256, 256), dtype)
    h = jax.ShapeDtypeStruct((8, 256), dtype)
    text = jax.jit(jax.grad(lambda w, h: jnp.sum(scanned(w, h).astype(jnp.float32)))).lower(
        w, h).compile().as_text()
    return plan_hlo.cpu_upcast_bytes(plan_hlo.parse_hlo(text))

  assert upcast(jnp.float32) == 0
  assert upcast(jnp.bfloat16) >= 4 * 256 * 256 * 4  # at least one f32 copy of the weights


# -------------------------------------------------------------------- the guard


def test_guard_lets_tiny_experiments_through_at_once():
  t0 = time.perf_counter()
  plan.preflight(registry.get("tiny_ppo"))
  assert time.perf_counter() - t0 < 5


def test_the_literal_70b_command_fails_fast_before_allocating(tmp_path):
  workdir = tmp_path / "run"
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  t0 = time.perf_counter()
  res = subprocess.run([sys.executable, "-m", "jaxrlhf.main", "--experiment=ppo70b",
                        f"--workdir={workdir}"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
  assert res.returncode == 2, res.stderr[-2000:]
  assert time.perf_counter() - t0 < 60
  err = res.stderr
  assert "GB per device" in err and "a device holds" in err
  assert "--plan --devices=64 --accelerator=h100" in err and "--plan_search" in err
  assert not workdir.exists()  # nothing written, nothing allocated


def test_the_plan_reports_decode_reads_with_and_without_shared_prefixes():
  """Per decoded token and device: the weights, the KV cache (its prompts' part), and the KV
  with ``rollout.prefix_sharing`` (a prompt read once per group); and the decode loop's time
  at the HBM roofline both ways."""
  from jaxrlhf.config import GRPOConfig, RolloutConfig
  from jaxrlhf.plan.report import format_plan
  b, n, P, N = 4, 8, 32, 16
  cfg = ExperimentConfig(name="small_grpo", stages=("grpo",), model=SMALL,
                         data=DataConfig(max_prompt_len=P, max_response_len=N),
                         rollout=RolloutConfig(max_new_tokens=N),
                         grpo=GRPOConfig(steps=10, batch_size=b, num_samples=n))
  p = plan.build_plan(cfg, 2, H100, mesh_cfg=MeshConfig(dp=1, fsdp=1, tp=2), full=False)
  d = p.stages[0].decode
  t, sec = d["token_bytes"], d["decode_hbm_seconds"]
  per_slot = 2 * SMALL.n_layers * SMALL.n_kv_heads * SMALL.head_dim * 2  # bf16 K and V
  # Two devices, each with half the KV heads (tp=2) and half the weights.
  assert t["kv"] == b * n * (P + N - 1) * per_slot / 2
  assert t["kv_prompt"] == b * n * P * per_slot / 2
  assert t["kv_shared"] == (b * P + b * n * (N - 1)) * per_slot / 2
  assert t["weights"] == SMALL.num_params("lm") * 2 / 2
  assert sec["dense"] == pytest.approx((N - 1) * (t["weights"] + t["kv"]) / H100.hbm_bandwidth)
  assert sec["shared"] < sec["dense"]
  text = format_plan(p)
  assert "decode reads per token and device" in text
  assert "with shared prefixes" in text and "rollout.prefix_sharing=false here" in text
