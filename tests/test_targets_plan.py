"""The planner's overlapped time, read from XLA:GPU's scheduled program (jaxrlhf.plan.hlo.schedule):
small sharded programs compiled for 8 compile-only H100s, where an all-gather either has an
independent matmul to hide behind or is needed at once, and a small SFT plan on them.

Skipped exactly as tests/test_targets.py is, where the ``aot`` extra is not installed (its
``needs_gpu_compiler``).  About 15 s on 2 cores.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxrlhf import hardware, targets
from jaxrlhf.config import MeshConfig
from jaxrlhf.plan import hlo as plan_hlo
from test_targets import needs_gpu_compiler

H100 = hardware.get_accelerator("h100")
RATES = plan_hlo.Rates(H100.peak_flops, H100.hbm_bandwidth, H100.interconnect_bandwidth / 2,
                       50e9)
N = 8
bf16 = jnp.bfloat16


def _compiled(f, *shapes_specs):
  """``f`` compiled by XLA:GPU for 8 H100s on an fsdp mesh, read as HLO."""
  mesh = targets.mesh("h100", MeshConfig(dp=1, fsdp=N, tp=1), N)
  args = [jax.ShapeDtypeStruct(shape, bf16, sharding=NamedSharding(mesh, spec))
          for shape, spec in shapes_specs]
  with jax.set_mesh(mesh):
    return plan_hlo.parse_hlo(jax.jit(f).lower(*args).compile().as_text())


def _schedule(module):
  return plan_hlo.schedule(module, N, 8, RATES)


def _comm_seconds(module) -> float:
  """The collectives' time from collective_traffic: the schedule must cost the same bytes."""
  return plan_hlo.collective_traffic(module, N, 8).total_bytes / RATES.intra


D = 8192
ROWS = ((D, D), P("fsdp", None))


@needs_gpu_compiler
def test_an_all_gather_hides_behind_an_independent_matmul():
  """``y``'s rows are gathered for the last matmul; the first two (on ``x``, whose weight is
  gathered first) do not need it, so XLA:GPU schedules them between its start and done."""
  def f(x, w, y):
    return (x @ w) @ w.T, x @ y
  module = _compiled(f, ROWS, ROWS, ROWS)
  s = _schedule(module)
  assert s.async_collectives >= 1
  assert s.comm_seconds == pytest.approx(_comm_seconds(module))
  assert 0 < max(s.ops_seconds, s.comm_seconds) <= s.seconds <= s.ops_seconds + s.comm_seconds
  # About a third of the gathers' time is hidden (the matmuls are ~140 us each at 989 TFLOP/s).
  assert s.hidden_seconds > 0.2 * s.comm_seconds


@needs_gpu_compiler
def test_a_collective_needed_at_once_hides_nothing():
  """``x @ gather(w)``: nothing can run while ``w`` is gathered; XLA marks the pair is_sync."""
  module = _compiled(lambda x, w: x @ w, ROWS, ROWS)
  s = _schedule(module)
  assert s.comm_seconds == pytest.approx(_comm_seconds(module)) and s.comm_seconds > 0
  assert s.ops_seconds > 0
  assert s.hidden_seconds <= 0.01 * s.comm_seconds
  assert s.seconds == pytest.approx(s.ops_seconds + s.comm_seconds)


@needs_gpu_compiler
def test_a_loop_counts_its_collectives_and_compute_per_trip():
  """A scan over 4 stacked weights gathers each inside the body: the schedule multiplies the
  body by the trip count, as collective_traffic does."""
  def f(ws, x):
    return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]
  stacked = ((4, D // 2, D // 2), P(None, "fsdp", None))
  module = _compiled(f, stacked, ((D // 2, D // 2), P("fsdp", None)))
  s = _schedule(module)
  assert s.comm_seconds == pytest.approx(_comm_seconds(module))
  one = 2 * (D // 2) ** 3 / N / RATES.flops  # one trip's matmul at the peak rate
  assert 4 * one <= s.ops_seconds <= 8 * one


@needs_gpu_compiler
def test_the_plan_reports_the_overlapped_and_unoverlapped_time():
  """SMALL_SFT planned on 8 compile-only H100s: the roofline (perfect overlap) <= as
  scheduled <= nothing overlapped, and the step's figures are its program's."""
  from jaxrlhf import plan
  from test_plan import SMALL_SFT
  mesh = targets.mesh("h100", MeshConfig(dp=1, fsdp=4, tp=2), 8)
  sp = plan.plan_stage(SMALL_SFT, "sft", mesh, H100)
  (step,) = sp.programs
  assert step.async_collectives + step.sync_collectives > 0 and step.hlo_ops_seconds > 0
  assert step.est_seconds <= step.t_overlapped <= step.t_unoverlapped
  assert step.t_unoverlapped == pytest.approx(max(step.t_compute, step.t_memory) + step.t_comm)
  assert step.t_overlapped == pytest.approx(step.t_unoverlapped - step.t_hidden)
  assert (sp.overlapped_step_seconds, sp.unoverlapped_step_seconds) == (
      step.t_overlapped, step.t_unoverlapped)
