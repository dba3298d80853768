"""The trackers on real runs: a short tiny_grpo run of the entry point with every sink
(TensorBoard, W&B offline, MLflow's SQLite store in the workdir), resumed after a simulated
crash, read back with each tool's own reader (TensorBoard's EventMultiplexer, ``wandb leet
inspect``, ``MlflowClient``); no credential reaches any of them; and a tracker failing mid-run
costs neither the run nor a checkpoint (SFT in this process).
"""

import dataclasses
import glob
import json
import os
import shutil
import subprocess
import sys

import pytest

from jaxrlhf import checkpoint as C
from jaxrlhf import tracking
from jaxrlhf.config import CheckpointConfig, LoggingConfig, MeshConfig
from jaxrlhf.metrics import SinkError, read_jsonl
from jaxrlhf.train import pipeline
from test_metrics import tb_scalars
from test_train import config as tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 3
# Credentials a run may be given: the Redis password in the environment (a URL carrying one is
# refused before anything runs: tests/test_pools_safety.py), and a Redis address. Neither the
# password nor the address may reach a tracker.
ENV_PASSWORD = "hunter2env"
REDIS_HOST = "redis-for-tracking-test.invalid"
FLAGS = ["--experiment=tiny_grpo", f"--steps={STEPS}",
         "--set=logging.sinks=jsonl,tensorboard,wandb,mlflow", "--set=logging.console=false",
         "--set=checkpoint.every_steps=1", "--set=checkpoint.async_save=false",
         f"--set=pools.redis_url=rediss://{REDIS_HOST}:6379/0"]


def _main(wd):
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("WANDB_", "MLFLOW_"))}  # offline, and the store in the workdir
  env.update(PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", JAXRLHF_REDIS_PASSWORD=ENV_PASSWORD,
             XLA_FLAGS="--xla_force_host_platform_device_count=1",
             # A home without a `wandb login` key (~/.netrc), keeping the compilation cache.
             HOME=wd, JAXRLHF_COMPILATION_CACHE=os.path.expanduser(os.environ.get(
                 "JAXRLHF_COMPILATION_CACHE", "~/.cache/jaxrlhf/xla")))
  p = subprocess.run([sys.executable, "-m", "jaxrlhf.main", f"--workdir={wd}", *FLAGS],
                     capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  return p.stdout + p.stderr


def _run_state(wd, sink):
  with open(os.path.join(wd, f"{sink}_run.json")) as f:
    return json.load(f)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """The run, then the same command again after a crash that lost GRPO's last checkpoint and
  its result: the second run continues after step 2 and logs step 3 again."""
  wd = str(tmp_path_factory.mktemp("tracked"))
  first_out = _main(wd)
  first = {"mlflow": _run_state(wd, "mlflow"), "wandb": _run_state(wd, "wandb"),
           "wandb_dirs": sorted(glob.glob(os.path.join(wd, "wandb", "offline-run-*")))}
  shutil.rmtree(C.stage_result_dir(wd, "grpo"))
  shutil.rmtree(os.path.join(C.checkpoint_dir(wd, "grpo"), str(STEPS)))
  second_out = _main(wd)
  assert f"grpo: continuing after step {STEPS - 1} of {STEPS}" in second_out
  return wd, first, first_out + second_out


def _mlflow(wd):
  from mlflow.tracking import MlflowClient
  uri, _ = tracking.mlflow_store(wd)
  return MlflowClient(tracking_uri=uri)


def test_mlflow_run_holds_params_metrics_and_artifacts_and_resume_continues_it(runs):
  wd, first, _ = runs
  client = _mlflow(wd)
  experiment = client.get_experiment_by_name("tiny_grpo")
  found = client.search_runs([experiment.experiment_id])
  assert [r.info.run_id for r in found] == [first["mlflow"]["run_id"]]  # one run, continued
  run = found[0]
  assert run.info.status == "FINISHED" and run.info.run_name == os.path.basename(wd)
  params = run.data.params
  assert params["grpo.num_samples"] == "8" and params["stages"] == "sft,grpo"
  assert params["logging.sinks"] == "jsonl,tensorboard,wandb,mlflow"
  # --steps capped each stage, and a resume with the same flags changes nothing.
  assert params["grpo.steps"] == str(STEPS)
  assert not [t for t in run.data.tags if t.startswith("resumed.")]
  # One point per step, step 3 (logged by both runs) once, and the values of metrics.jsonl.
  history = client.get_metric_history(run.info.run_id, "grpo/reward/mean")
  assert [m.step for m in history] == list(range(1, STEPS + 1))
  records = {r["step"]: r for r in read_jsonl(os.path.join(wd, "metrics.jsonl"))
             if r["stage"] == "grpo"}
  assert [m.value for m in history] == pytest.approx([records[s]["reward/mean"]
                                                      for s in range(1, STEPS + 1)])
  assert [m.step for m in client.get_metric_history(run.info.run_id, "sft/loss")] == [1, 2, 3]
  assert [m.step for m in client.get_metric_history(run.info.run_id, "grpo/eval/accuracy")] \
      == [STEPS]
  artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
  assert artifacts == {"summary.json", "report", "samples"}
  # The evaluations' samples: before each stage trained (step 0) and at its last step.
  samples = {os.path.basename(a.path)
             for a in client.list_artifacts(run.info.run_id, "samples/grpo")}
  assert samples == {"eval_step0000000.jsonl", f"eval_step{STEPS:07d}.jsonl"}
  path = client.download_artifacts(run.info.run_id, f"samples/grpo/eval_step{STEPS:07d}.jsonl",
                                   wd + "/dl")
  rows = [json.loads(line) for line in open(path)]
  assert len(rows) == 8 and all(r["prompt"].endswith("=") and r["answer"] for r in rows)
  report = {os.path.basename(a.path) for a in client.list_artifacts(run.info.run_id, "report")}
  assert {"grpo_reward.png", "grpo_kl.png", "sft_loss.png", "summary.txt"} <= report
  summary = client.download_artifacts(run.info.run_id, "summary.json", wd + "/dl")
  with open(summary) as f:
    assert f.read().startswith("{") and "eval/accuracy" in open(summary).read()


def _wandb_records(run_dir):
  """The records of an offline run, read by wandb's own reader."""
  p = subprocess.run(["wandb", "leet", "inspect", "--json", run_dir], capture_output=True,
                     text=True, timeout=120, stdin=subprocess.DEVNULL,
                     env={**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep
                          + os.environ.get("PATH", "")})
  assert p.returncode == 0, p.stderr[-2000:]
  return [json.loads(line) for line in p.stdout.splitlines() if line.strip()]


def test_wandb_offline_runs_hold_config_metrics_and_summary_under_one_id(runs):
  wd, first, _ = runs
  run_id = first["wandb"]["run_id"]
  assert _run_state(wd, "wandb")["run_id"] == run_id
  dirs = sorted(glob.glob(os.path.join(wd, "wandb", "offline-run-*")))
  assert len(first["wandb_dirs"]) == 1 and len(dirs) == 2  # the resumed run's own directory
  assert all(d.endswith(f"-{run_id}") for d in dirs)  # `wandb sync` uploads them as one run
  steps, history = [], []
  for d in dirs:
    records = _wandb_records(d)
    run = next(r["run"] for r in records if r["type"] == "run")
    assert run["run_id"] == run_id and run["project"] == "tiny_grpo"
    config = run["config"]["update"]
    assert config["grpo"]["num_samples"] == 8 and config["logging"]["sinks"][-1] == "mlflow"
    items = [r["history"]["item"] for r in records if r["type"] == "history"]
    history += items
    steps += [i["grpo/step"] for i in items if "grpo/reward/mean" in i]
  assert steps == list(range(1, STEPS + 1))  # step 3, logged by both runs, sent once
  assert all("grpo/kl/mean" in i for i in history if "grpo/reward/mean" in i)
  summary = {}
  for r in _wandb_records(dirs[-1]):
    if r["type"] == "summary":
      summary.update(r["summary"].get("update", {}))
  assert "summary/grpo/eval/accuracy" in summary and "summary/sft/time_s" in summary
  # The evaluations' samples as tables, logged against the stage's step.
  assert any(i.get("grpo/samples/eval._type") == "table-file" and i["grpo/step"] == STEPS
             for i in history)
  tables = glob.glob(os.path.join(dirs[0], "files", "media", "table", "**", "*.table.json"),
                     recursive=True)
  assert tables and all(json.load(open(t))["columns"][:3] == ["kind", "prompt", "response"]
                        for t in tables)


def test_tensorboard_has_a_run_per_stage_and_each_step_once_after_the_resume(runs):
  wd, _, _ = runs
  scalars = tb_scalars(os.path.join(wd, "tensorboard"))
  assert set(scalars) == {"sft", "grpo"}
  assert [s for s, _, _ in scalars["grpo"]["reward/mean"]] == list(range(1, STEPS + 1))
  assert "eval/accuracy" in scalars["grpo"] and "loss" in scalars["sft"]
  from test_samples import _tb_texts
  texts = _tb_texts(os.path.join(wd, "tensorboard"))
  # The evaluations' samples: before GRPO trained and at its last step (TensorBoard's purge of
  # a resumed stage's later points covers scalars: the text of step 3, written by both runs,
  # shows twice).
  assert sorted({s for s, _ in texts["grpo"]["samples/eval/text_summary"]}) == [0, STEPS]


def test_no_credential_reaches_any_tracker(runs):
  wd, _, out = runs
  tracked = [os.path.join(wd, p) for p in ("tensorboard", "wandb", "mlflow.db",
                                           "mlflow-artifacts", "wandb_run.json",
                                           "mlflow_run.json")]
  files = [os.path.join(r, n) for p in tracked for r, _, ns in os.walk(p) for n in ns]
  files += [p for p in tracked if os.path.isfile(p)]
  assert len(files) > 10
  for path in files:
    with open(path, "rb") as f:
      data = f.read()
    assert ENV_PASSWORD.encode() not in data and REDIS_HOST.encode() not in data, path
  params = _mlflow(wd).search_runs(
      [_mlflow(wd).get_experiment_by_name("tiny_grpo").experiment_id])[0].data.params
  assert "pools.redis_url" not in params and "pools.mode" in params
  assert "sink failed" not in out  # every tracker worked throughout


# ---------------------------------------------------------------- a tracker failing mid-run


@pytest.fixture
def failing_tensorboard(monkeypatch):
  monkeypatch.setattr(pipeline.perf, "configure_process", lambda: None)
  real = tracking.TensorBoardSink.write

  def write(self, stage, step, metrics, wall_time):
    if step == 2:
      raise ConnectionError("the tracking server went away")
    real(self, stage, step, metrics, wall_time)

  monkeypatch.setattr(tracking.TensorBoardSink, "write", write)


def _sft(sink_errors):
  cfg = tiny_config()
  return dataclasses.replace(
      cfg, name="failing", stages=("sft",), mesh=MeshConfig(dp=-1),
      sft=dataclasses.replace(cfg.sft, steps=3),
      checkpoint=CheckpointConfig(every_steps=1, keep=3, async_save=False),
      logging=LoggingConfig(console=False, sink_errors=sink_errors))


def test_a_tracker_failing_mid_run_costs_no_step_and_no_checkpoint(tmp_path, capsys,
                                                                  failing_tensorboard):
  wd = str(tmp_path)
  assert pipeline.run(_sft("disable"), wd) == 0
  out = capsys.readouterr().out
  assert out.count("warning: the tensorboard sink failed writing sft step 2 (ConnectionError: "
                   "the tracking server went away); it is off for the rest of this run") == 1
  assert C.stage_result_exists(wd, "sft")
  assert sorted(os.listdir(C.checkpoint_dir(wd, "sft"))) == ["1", "2", "3"]
  # Every step in metrics.jsonl (and no evaluation record: sft.eval_every=0 evaluates nothing).
  assert [r["step"] for r in read_jsonl(os.path.join(wd, "metrics.jsonl"))] == [1, 2, 3]


def test_sink_errors_stop_ends_the_run_keeping_the_checkpoints(tmp_path, failing_tensorboard):
  wd = str(tmp_path)
  with pytest.raises(SinkError, match="logging.sink_errors=stop ends the run here"):
    pipeline.run(_sft("stop"), wd)
  assert os.listdir(C.checkpoint_dir(wd, "sft")) == ["1"]
  assert not C.stage_result_exists(wd, "sft")


def test_resume_none_starts_new_tracker_runs(tmp_path):
  wd = str(tmp_path)
  for name in ("metrics.jsonl", "wandb_run.json", "mlflow_run.json"):
    (tmp_path / name).write_text("{}")
  (tmp_path / "tensorboard").mkdir()
  pipeline.start_over(wd, ("sft",))
  left = sorted(os.listdir(wd))
  assert [n.split(".replaced-")[0] for n in left] == ["metrics.jsonl", "mlflow_run.json",
                                                      "tensorboard", "wandb_run.json"]
  assert all(".replaced-" in n for n in left)  # moved aside, so the next run starts new runs
