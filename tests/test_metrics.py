"""Metric sinks (console, metrics.jsonl, TensorBoard files read back by TensorBoard, a failing
tracker, the config trackers receive), the accelerator table, and the
performance tools (cost analysis, MFU, phase timer, profiler window, memory)."""

import dataclasses
import io
import json
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf import hardware, metrics, perf, tracking
from jaxrlhf.config import (ConfigError, ExperimentConfig, LoggingConfig, ModelConfig, set_field,
                            validate)

# ------------------------------------------------------------------------------ sinks


def _writer(tmp_path, cfg=LoggingConfig(), totals=None, stream=None, tty=False):
  return metrics.MetricsWriter(str(tmp_path), cfg, totals or {"sft": 4, "ppo": 2}, primary=True,
                               stream=stream if stream is not None else io.StringIO(), tty=tty)


def test_jsonl_records_round_trip_and_resume_appends(tmp_path):
  w = _writer(tmp_path)
  w.write("sft", 1, {"loss": jnp.float32(2.5), "eval/accuracy": np.float64(0.25)})
  w.write("sft", 2, {"loss": float("nan"), "kl/mean": float("inf"), "x": -math.inf, "n": 3})
  w.close()
  # A resumed run opens a new writer on the same workdir: the file continues.
  w = _writer(tmp_path)
  w.write("ppo", 1, {"reward/mean": jnp.array([0.75])})
  w.close()

  path = tmp_path / "metrics.jsonl"
  lines = path.read_text().splitlines()
  assert len(lines) == 3
  # Strict JSON: no bare NaN / Infinity tokens that other tools reject.
  raw = [json.loads(l, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
         for l in lines]
  assert raw[1]["loss"] == "nan" and raw[1]["kl/mean"] == "inf" and raw[1]["x"] == "-inf"
  assert all(isinstance(r["wall_time"], float) for r in raw)

  recs = metrics.read_jsonl(str(path))
  assert [(r["stage"], r["step"]) for r in recs] == [("sft", 1), ("sft", 2), ("ppo", 1)]
  assert recs[0]["loss"] == 2.5 and recs[0]["eval/accuracy"] == 0.25
  assert math.isnan(recs[1]["loss"]) and recs[1]["kl/mean"] == math.inf
  assert recs[1]["x"] == -math.inf and recs[1]["n"] == 3.0
  assert recs[2]["reward/mean"] == 0.75


def test_jsonl_reader_skips_a_torn_last_line_but_not_a_bad_middle_one(tmp_path):
  path = tmp_path / "metrics.jsonl"
  good = json.dumps({"stage": "sft", "step": 1, "loss": 1.0})
  path.write_text(good + "\n" + '{"stage": "sft", "st')
  assert [r["step"] for r in metrics.read_jsonl(str(path))] == [1]
  path.write_text(good + "\n" + "{oops\n" + good + "\n")
  with pytest.raises(ValueError, match=r"metrics.jsonl:2"):
    metrics.read_jsonl(str(path))


def test_a_resumed_writer_drops_a_torn_last_line_instead_of_appending_to_it(tmp_path):
  path = tmp_path / "metrics.jsonl"
  good = json.dumps({"stage": "sft", "step": 1, "loss": 1.0})
  path.write_text(good + "\n" + '{"stage": "sft", "step": 2, "lo')  # killed mid-write
  w = _writer(tmp_path)
  w.write("sft", 2, {"loss": 0.5})
  w.close()
  assert [(r["step"], r["loss"]) for r in metrics.read_jsonl(str(path))] == [(1, 1.0), (2, 0.5)]


def test_writer_rejects_non_scalars_and_reserved_names(tmp_path):
  w = _writer(tmp_path)
  with pytest.raises(ValueError, match=r"'reward/mean' must be a scalar.*shape \(3,\)"):
    w.write("ppo", 1, {"reward/mean": np.zeros(3)})
  with pytest.raises(ValueError, match="'step' is reserved"):
    w.write("ppo", 1, {"step": 1.0})
  w.close()


def tb_scalars(logdir):
  """TensorBoard's own reading of ``logdir``: run (folder) -> tag -> [(step, value, wall_time)],
  as its UI shows them (a resumed run's purged points left out)."""
  from tensorboard.backend.event_processing import event_multiplexer
  mux = event_multiplexer.EventMultiplexer().AddRunsFromDirectory(str(logdir))
  mux.Reload()
  return {run: {tag: [(e.step, e.value, e.wall_time) for e in mux.Scalars(run, tag)]
                for tag in tags["scalars"]}
          for run, tags in mux.Runs().items()}


def test_tensorboard_reads_the_event_files_back(tmp_path):
  w = _writer(tmp_path)
  w.write("sft", 1, {"loss": 2.0, "eval/accuracy": 0.125})
  w.write("sft", 2, {"loss": 1.5})
  w.write("ppo", 7, {"reward/mean": -0.3, "kl/mean": float("nan")})
  w.close()

  runs = tb_scalars(tmp_path / "tensorboard")
  assert set(runs) == {"sft", "ppo"}  # one TensorBoard run per stage
  assert set(runs["sft"]) == {"loss", "eval/accuracy"} and set(runs["ppo"]) == {"reward/mean",
                                                                                "kl/mean"}
  assert [(s, v) for s, v, _ in runs["sft"]["loss"]] == [(1, 2.0), (2, 1.5)]
  assert [(s, v) for s, v, _ in runs["sft"]["eval/accuracy"]] == [(1, 0.125)]
  assert runs["ppo"]["reward/mean"][0][:2] == (7, pytest.approx(-0.3, abs=1e-7))  # float32
  assert math.isnan(runs["ppo"]["kl/mean"][0][1])
  recs = metrics.read_jsonl(str(tmp_path / "metrics.jsonl"))
  # The same wall time as the JSONL record of the step.
  assert runs["sft"]["loss"][0][2] == pytest.approx(recs[0]["wall_time"], abs=1e-3)


@pytest.mark.parametrize("opened", [0, 8], ids=["first-files", "ninth-and-tenth"])
def test_a_resumed_stage_replaces_its_rewritten_steps_in_tensorboard(tmp_path, monkeypatch,
                                                                      opened):
  """The resumed run's file is read after the earlier one, also when the process had opened
  8 event files before (the two are its 9th and 10th: the suite's CI once read ".10" before
  ".9" and lost the resumed points)."""
  from jaxrlhf.tracking import TensorBoardSink
  monkeypatch.setattr(TensorBoardSink, "_files", opened)
  w = _writer(tmp_path)
  for step in (1, 2, 3):
    w.write("ppo", step, {"reward/mean": step / 10})
  w.close()
  # Resumed from the checkpoint of step 2: step 3 runs again, with its own value.
  w = _writer(tmp_path)
  for step in (3, 4):
    w.write("ppo", step, {"reward/mean": 1 + step / 10})
  w.close()
  points = tb_scalars(tmp_path / "tensorboard")["ppo"]["reward/mean"]
  assert [(s, round(v, 5)) for s, v, _ in points] == [(1, 0.1), (2, 0.2), (3, 1.3), (4, 1.4)]


def test_sinks_can_be_turned_off_and_non_primary_writes_nothing(tmp_path):
  out = io.StringIO()
  w = _writer(tmp_path / "a", LoggingConfig(console=False, sinks=("jsonl",)), stream=out)
  w.write("sft", 1, {"loss": 1.0})
  w.close()
  assert (tmp_path / "a" / "metrics.jsonl").exists()
  assert not (tmp_path / "a" / "tensorboard").exists() and out.getvalue() == ""

  w = metrics.MetricsWriter(str(tmp_path / "b"), LoggingConfig(), {"sft": 2}, primary=False)
  w.write("sft", 1, {"loss": 1.0})
  w.message("hello")
  w.close()
  assert not (tmp_path / "b").exists()


def test_a_tracker_missing_its_package_is_one_line_naming_the_extra(tmp_path, monkeypatch):
  import importlib.util
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name == "mlflow" else real(name, *a))
  cfg = dataclasses.replace(ExperimentConfig(), logging=LoggingConfig(sinks=("mlflow",)))
  want = (r"^unnamed: logging.sinks has 'mlflow' but the mlflow package is not installed: "
          r"pip install -e '\.\[mlflow\]' \(or drop mlflow from logging.sinks\)$")
  with pytest.raises(ConfigError, match=want):
    validate(cfg)
  # The writer, made before any training, says the same.
  with pytest.raises(ConfigError, match="pip install -e '.\\[mlflow\\]'"):
    _writer(tmp_path, LoggingConfig(sinks=("mlflow",)))
  with pytest.raises(ConfigError, match=r"logging.sinks: 'tb' is not valid; choose one of "
                     r"'jsonl', 'tensorboard', 'wandb', 'mlflow'"):
    set_field(ExperimentConfig(), "logging.sinks", "jsonl,tb")


def _failing_tensorboard(monkeypatch, at_step):
  """TensorBoard's sink raising at ``at_step`` (a full disk, a lost server)."""
  real = tracking.TensorBoardSink.write
  calls = []

  def write(self, stage, step, metrics, wall_time):
    calls.append(step)
    if step == at_step:
      raise OSError(28, "No space left on device")
    real(self, stage, step, metrics, wall_time)

  monkeypatch.setattr(tracking.TensorBoardSink, "write", write)
  return calls


def test_a_failing_tracker_is_reported_once_and_left_out(tmp_path, monkeypatch):
  calls = _failing_tensorboard(monkeypatch, at_step=2)
  out = io.StringIO()
  w = _writer(tmp_path, LoggingConfig(console_keys=()), stream=out)
  for step in (1, 2, 3, 4):
    w.write("sft", step, {"loss": 1.0 / step})
  assert w.sinks == []
  w.close()
  warnings = [l for l in out.getvalue().splitlines() if "warning" in l]
  assert warnings == ["warning: the tensorboard sink failed writing sft step 2 (OSError: [Errno "
                      "28] No space left on device); it is off for the rest of this run "
                      "(metrics.jsonl keeps every record; logging.sink_errors=stop ends the run "
                      "instead)"]
  assert calls == [1, 2]  # never called again
  assert [r["step"] for r in metrics.read_jsonl(str(tmp_path / "metrics.jsonl"))] == [1, 2, 3, 4]
  assert [s for s, _, _ in tb_scalars(tmp_path / "tensorboard")["sft"]["loss"]] == [1]


def test_sink_errors_stop_ends_the_run_at_the_failure(tmp_path, monkeypatch):
  _failing_tensorboard(monkeypatch, at_step=2)
  w = _writer(tmp_path, LoggingConfig(sink_errors="stop"))
  w.write("sft", 1, {"loss": 1.0})
  with pytest.raises(metrics.SinkError, match=r"the tensorboard sink failed writing sft step 2 "
                     r"\(OSError.*logging.sink_errors=stop ends the run here. The checkpoints "
                     r"written so far are kept"):
    w.write("sft", 2, {"loss": 0.5})
  w.close()
  # metrics.jsonl is written before the trackers: the failing step is in it.
  assert [r["step"] for r in metrics.read_jsonl(str(tmp_path / "metrics.jsonl"))] == [1, 2]


def test_a_tracker_that_cannot_start_is_reported_or_stops_the_run(tmp_path, monkeypatch):
  monkeypatch.setenv("MLFLOW_TRACKING_URI", "nosuchscheme://tracking")
  out = io.StringIO()
  w = _writer(tmp_path, LoggingConfig(sinks=("mlflow", "tensorboard")), stream=out)
  assert w.sinks == ["tensorboard"]
  assert out.getvalue().startswith("warning: the mlflow sink failed starting (")
  w.write("sft", 1, {"loss": 1.0})
  w.close()
  with pytest.raises(metrics.SinkError, match="the mlflow sink failed starting"):
    _writer(tmp_path, LoggingConfig(sinks=("tensorboard", "mlflow"), sink_errors="stop"))


def test_trackers_get_the_config_without_credentials():
  cfg = {"name": "x", "pools": {"redis_url": "redis://:pw@host:6379/0", "mode": "sync"},
         "hub": {"api_key": "k", "hf_token_password": "p"}, "rollout": {"max_new_tokens": 8}}
  assert tracking.redact(cfg) == {"name": "x", "pools": {"mode": "sync"}, "hub": {},
                                  "rollout": {"max_new_tokens": 8}}
  assert tracking.flatten(tracking.redact(cfg)) == {"name": "x", "pools.mode": "sync",
                                                    "hub": {}, "rollout.max_new_tokens": 8}


def test_run_state_sends_each_step_once(tmp_path):
  path = str(tmp_path / "x_run.json")
  state = tracking.RunState(path, {"run_id": "abc"})
  assert state.unsent("ppo", 1, {"loss": 1.0}) == {"loss": 1.0}
  state.sent("ppo", 1, ["loss"])
  state.sent("ppo", 2, ["loss"])
  # A resumed run (read back from the file) rewrites steps 2 and 3; its evaluation record of
  # step 2 arrives apart.
  state = tracking.RunState.load(path)
  assert state.data["run_id"] == "abc"
  assert state.unsent("ppo", 1, {"loss": 1.0}) == {}
  assert state.unsent("ppo", 2, {"loss": 1.0, "eval/accuracy": 0.5}) == {"eval/accuracy": 0.5}
  assert state.unsent("ppo", 3, {"loss": 1.0}) == {"loss": 1.0}
  assert state.unsent("sft", 1, {"loss": 1.0}) == {"loss": 1.0}


class _Clock:
  def __init__(self):
    self.t = 100.0

  def __call__(self):
    return self.t


def test_console_plain_lines_are_periodic_with_eta_and_key_metrics():
  clock, out = _Clock(), io.StringIO()
  c = metrics.ConsoleSink({"ppo": 10}, keys=("reward/mean", "loss"), every_s=5.0, stream=out,
                          tty=False, clock=clock)
  for step in range(1, 11):
    clock.t += 1.0  # one second per step
    c.write("ppo", step, {"reward/mean": step / 10})
  c.close()
  lines = out.getvalue().splitlines()
  # First step, then at most every 5 s, then the last step.
  assert [l.split()[1] for l in lines] == ["1/10", "6/10", "10/10"]
  assert "ETA 4s" in lines[1]  # 5 s for 5 steps, 4 to go
  assert "reward/mean 0.6" in lines[1] and "loss" not in lines[1]
  assert "[" + "#" * 20 + "]" in lines[2] and "done in 9s" in lines[2]
  assert "\r" not in out.getvalue()


def _screen(text):
  """The lines a terminal shows after ``text``, for output whose every "\\r" redraw ends
  with ESC[K (clear to end of line), as the console sink's do."""
  return [line.split("\r")[-1].replace("\x1b[K", "") for line in text.split("\n")]


def test_console_on_a_terminal_redraws_in_place():
  clock, out = _Clock(), io.StringIO()
  c = metrics.ConsoleSink({"sft": 3, "rm": 2}, keys=("loss",), stream=out, tty=True,
                          clock=clock)
  for step in (1, 2, 3):
    clock.t += 1.0
    c.write("sft", step, {"loss": 1.0 / step})
  c.message("saved checkpoint 3")
  c.write("rm", 1, {"loss": 0.5})
  c.close()
  screen = _screen(out.getvalue())
  assert screen[-1] == ""  # closed with a newline
  assert screen[0] == "saved checkpoint 3"
  assert screen[1].startswith("sft  3/3 [" + "#" * 20 + "] 100%  done in 2s  loss 0.3333")
  assert screen[2].startswith("rm  1/2 [") and "ETA ?" in screen[2]
  assert len(screen) == 4


def test_checkpoint_saves_are_a_note_on_the_progress_line_not_lines_of_their_own(tmp_path):
  """24 saves of a reward model used to print 24 lines; now the folder is said once and the
  latest save rides on the progress line."""
  import dataclasses
  from jaxrlhf.config import LoggingConfig
  out = io.StringIO()
  w = metrics.MetricsWriter(str(tmp_path), dataclasses.replace(LoggingConfig(), sinks=("jsonl",)),
                            {"rm": 24})
  w._console.stream, w._console.tty = out, False
  w.message("rm: checkpoints -> /runs/x/rm/checkpoints")
  for step in range(1, 25):
    w.note("rm", f"ckpt {step} (1.5 MiB)")
    w.write("rm", step, {"loss": 1.0})
  w.close()
  lines = out.getvalue().splitlines()
  assert lines[0] == "rm: checkpoints -> /runs/x/rm/checkpoints"
  assert all(l.startswith("rm  ") for l in lines[1:]) and len(lines) <= 4  # first, last, timed
  assert lines[-1].endswith("loss 1  ckpt 24 (1.5 MiB)")


def test_console_samples_are_throttled_per_stage_and_kind():
  """An SFT stop check evaluating every step printed four lines a step; the console shows a
  stage's samples of one kind at most every SAMPLES_EVERY_S (the jsonl keeps them all)."""
  clock, out = _Clock(), io.StringIO()
  c = metrics.ConsoleSink({"sft": 100}, stream=out, tty=False, clock=clock)
  for step in range(1, 101):
    clock.t += 1.0
    c.write_samples("sft", step, [{"kind": "eval", "prompt": "p", "response": "r"}])
  c.write_samples("sft", 100, [{"kind": "rollout", "prompt": "p", "response": "r"}])
  heads = [l for l in out.getvalue().splitlines() if " samples (" in l]
  assert [h.split()[2] for h in heads] == ["1:", "31:", "61:", "91:", "100:"]
  assert "rollout samples" in heads[-1]
  # The stage's last step, or where it ends early, always shows what it ended with.
  for stage, last in (("dpo", 20), ("rm", 12)):
    out.seek(0)
    out.truncate()
    c.total_steps[stage] = 20
    for step in range(1, last + 1):
      clock.t += 1.0
      c.write(stage, step, {})
      c.write_samples(stage, step, [{"kind": "eval", "prompt": "p", "response": f"{step}"}])
    if last < 20:
      c.end(stage)  # e.g. its target reached
    heads = [l for l in out.getvalue().splitlines() if " samples (" in l]
    assert [h.split()[2] for h in heads] == ["1:", f"{last}:"], heads


def test_writer_without_totals_shows_the_step():
  out = io.StringIO()
  c = metrics.ConsoleSink({}, keys=(), stream=out, tty=False)
  c.write("dpo", 5, {})
  assert out.getvalue().startswith("dpo  step 5")


# --------------------------------------------------------------------------- hardware


def test_accelerator_table_and_lookup():
  h100 = hardware.get_accelerator("H100")
  assert h100.peak_flops == 989e12 and h100.memory_bytes == 80e9 and not h100.measured
  assert set(hardware.ACCELERATORS) == {"h100", "h200", "b200", "tpu-v5p"}
  for acc in hardware.ACCELERATORS.values():
    assert acc.peak_flops > 1e14 and acc.hbm_bandwidth > 1e12 and acc.usd_per_hour > 0
  # Same compute as the H100, more and faster memory.
  h200 = hardware.get_accelerator("h200")
  assert h200.peak_flops == h100.peak_flops and h200.hbm_bandwidth > h100.hbm_bandwidth
  with pytest.raises(ConfigError, match=r"unknown accelerator 'a100'; choose one of 'h100', "
                     r"'h200', 'b200', 'tpu-v5p', 'cpu'"):
    hardware.get_accelerator("a100")


def test_cpu_ceilings_are_measured():
  flops = hardware.measure_cpu_peak_flops(n=512, repeats=2)
  bw = hardware.measure_copy_bandwidth(nbytes=16 * 2**20, repeats=2)
  # Any machine that runs the tests does 1 GFLOP/s and 1 GB/s; none does a PFLOP/s on CPU.
  assert 1e9 < flops < 1e15 and 1e9 < bw < 1e13
  acc = hardware.detect_accelerator(jax.devices()[0])
  assert acc.name == "cpu" and acc.measured and acc.peak_flops > 1e9
  assert "measured here" in acc.describe()


# ------------------------------------------------------------------------------- perf


def test_compiled_cost_counts_matmul_flops_per_device():
  x, w = jnp.ones((64, 32)), jnp.ones((32, 16))
  cost = perf.compiled_cost(jax.jit(lambda a, b: a @ b), x, w)
  assert cost["flops"] == 2 * 64 * 32 * 16 and cost["exact"] and cost["while_loops"] == []
  assert cost["bytes_accessed"] >= 4 * (64 * 32 + 32 * 16 + 64 * 16)

  # Sharded over 8 devices, XLA reports one device's share.
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  xs = jax.device_put(x, NamedSharding(mesh, P("d")))
  cost = perf.compiled_cost(jax.jit(lambda a, b: a @ b), xs, w)
  assert cost["flops"] == 2 * 64 * 32 * 16 / 8


def test_compiled_cost_flags_loops_whose_body_xla_counts_once():
  def f(x, ws):
    return jax.lax.scan(lambda c, w: (c @ w, None), x, ws)[0]

  x, ws = jnp.ones((16, 16)), jnp.ones((4, 16, 16))
  cost = perf.compiled_cost(jax.jit(f), x, ws)
  assert cost["while_loops"] == [4] and not cost["exact"]
  assert cost["flops"] < 2 * 2 * 16 ** 3  # about one iteration's, not four


def test_decoder_flops_agree_with_xla_on_an_unscanned_model():
  from jaxrlhf.model import transformer as T
  cfg = ModelConfig(vocab_size=512, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2,
                    head_dim=64, mlp_dim=1024, max_seq_len=64, scan_layers=False)
  # Abstract arguments: cost analysis needs shapes only, so nothing is initialised.
  params = jax.eval_shape(lambda: T.init_params(cfg, jax.random.key(0)))
  tokens = jax.ShapeDtypeStruct((2, 64), jnp.int32)
  mask = jnp.ones((2, 64), bool)

  def logits(p, t):
    h, _ = T.forward(p, t, T.positions_from_mask(mask), mask, cfg=cfg)
    return T.lm_logits(p, h, cfg)

  xla = perf.compiled_cost(jax.jit(logits), params, tokens)
  assert xla["exact"]
  assert perf.decoder_flops(cfg, 2, 64) == pytest.approx(xla["flops"], rel=0.03)
  # Training: forward + twice for backward; remat="full" recomputes the layers once more.
  fwd = perf.decoder_flops(cfg, 2, 64)
  assert perf.decoder_flops(cfg, 2, 64, train=True) == 3 * fwd
  remat = ModelConfig(**{**cfg.__dict__, "remat": "full"})
  assert fwd * 3 < perf.decoder_flops(remat, 2, 64, train=True) < fwd * 4
  # A decode step: one new token per row over a 64-slot cache, LM head on it.
  step = perf.decoder_flops(cfg, 2, 1, 64)
  assert step < fwd / 32


def test_mfu_and_utilisation():
  assert perf.mfu(1e12, 2.0, 1e12) == 0.5
  assert math.isnan(perf.mfu(1e12, 0.0, 1e12))
  acc = hardware.get_accelerator("h100")
  m = perf.utilisation(0.5, acc, flops=989e12 * 0.25, bytes_accessed=3.35e12 * 0.1)
  assert m["perf/mfu"] == pytest.approx(0.5) and m["perf/bandwidth_util"] == pytest.approx(0.2)
  assert perf.utilisation(1.0, acc) == {}


def _busy(n):
  """A jitted chain of matmuls that takes a noticeable time on the CPU."""
  x = jnp.full((n, n), 1.0 / n, jnp.float32)
  f = jax.jit(lambda a: jax.lax.fori_loop(0, 6, lambda i, c: jnp.tanh(c @ a), a))
  jax.block_until_ready(f(x))
  return f, x


def test_phase_times_add_up_to_the_measured_step():
  f, x = _busy(384)
  timer = perf.PhaseTimer()
  for _ in range(2):
    t0 = time.perf_counter()
    timer.start_step()
    with timer.phase("generate") as ready:
      y = ready(f(x))
    y = timer.run("score", f, y)
    for _ in range(2):  # a repeated phase accumulates
      y = timer.run("update", f, y)
    m = timer.end_step()
    jax.block_until_ready(y)
    wall = time.perf_counter() - t0

  phases = [m[f"time/phase/{n}_s"] for n in ("generate", "score", "update")]
  assert all(p > 0 for p in phases)
  # The phases waited for their work: together they are the step, to within a few percent.
  assert sum(phases) == pytest.approx(wall, rel=0.05)
  assert m["time/step_s"] == pytest.approx(wall, rel=0.05)
  shares = [m[f"time/share/{n}"] for n in ("generate", "score", "update")]
  assert sum(shares) == pytest.approx(1.0, abs=0.05)
  assert sum(shares) + m["time/share/other"] == pytest.approx(1.0)
  # A repeated phase accumulates: checked on a clock that only the phases advance (real times
  # of one run against two are at the mercy of whatever else shares the cores).
  now = [0.0]
  timer = perf.PhaseTimer(clock=lambda: now[0])
  timer.start_step()
  for name, secs in (("score", 1.0), ("update", 2.0), ("update", 3.0)):
    with timer.phase(name):
      now[0] += secs
  m = timer.end_step()
  assert (m["time/phase/score_s"], m["time/phase/update_s"], m["time/step_s"]) == (1.0, 5.0, 6.0)


def test_phase_timer_misuse_is_explained():
  timer = perf.PhaseTimer()
  with pytest.raises(RuntimeError, match="start_step"):
    with timer.phase("x"):
      pass
  timer.start_step()
  with pytest.raises(ValueError, match="'other'"):
    with timer.phase("other"):
      pass


def test_parse_profile_steps():
  assert perf.parse_profile_steps(None) is None and perf.parse_profile_steps("") is None
  assert perf.parse_profile_steps("3:5") == (None, 3, 5)
  assert perf.parse_profile_steps("ppo:10:10") == ("ppo", 10, 10)
  for bad in ("5", "5:3", "a:b", "-1:2", ":1:2", "1:2:3:4"):
    with pytest.raises(ConfigError, match=r"--profile_steps=.*use A:B"):
      perf.parse_profile_steps(bad)


def test_profile_window_writes_a_trace_of_the_chosen_steps(tmp_path, capsys):
  f = jax.jit(lambda a: jnp.sin(a @ a).sum())
  x = jnp.ones((32, 32))
  window = perf.ProfileWindow("ppo:2:3", str(tmp_path))
  for stage in ("sft", "ppo"):
    for step in range(1, 5):
      window.before_step(stage, step)
      assert window.active == (stage == "ppo" and step in (2, 3))
      with window.annotate(step):
        out = f(x)
      window.after_step(stage, step, out)
  window.close()
  assert window.done and not window.active
  files = [os.path.join(r, n) for r, _, ns in os.walk(tmp_path / "profile") for n in ns]
  assert any(p.endswith(".xplane.pb") and os.path.getsize(p) > 0 for p in files), files
  assert f"ppo: trace of steps 2-3 written to {tmp_path / 'profile'}" in capsys.readouterr().out


def test_a_profile_window_the_run_never_reaches_says_so(tmp_path, capsys):
  window = perf.ProfileWindow("ppo:10:12", str(tmp_path))
  for step in range(1, 4):
    window.before_step("ppo", step)
    window.after_step("ppo", step)
  window.close()
  assert "--profile_steps=ppo:10:12: this run never reached ppo step 10; no trace was " \
         "written" in capsys.readouterr().out
  assert not (tmp_path / "profile").exists()


def test_profile_window_off_does_nothing(tmp_path):
  window = perf.ProfileWindow(None, str(tmp_path))
  window.before_step("sft", 1)
  window.after_step("sft", 1)
  window.close()
  assert not window.enabled and not (tmp_path / "profile").exists()


def test_memory_in_use_falls_back_to_process_memory_on_cpu():
  m = perf.memory_in_use()
  assert m["memory/on_device"] == 0.0
  # A process that imported jax holds tens of MB at least.
  assert 10e6 < m["memory/bytes_in_use"] <= m["memory/peak_bytes_in_use"] * 1.01
