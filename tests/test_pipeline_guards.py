"""What a run must not do with bad input: train a stage past a smaller step cap into a
mislabelled result, overwrite the folder's config.json when the run is refused, call a stage
cut short by ``--steps`` one that reached its target, reward responses against missing answers,
or score held-out prompts that have none.

The pipeline runs in this process on the tiny config of test_train (SFT only, a few steps).
"""

import dataclasses
import json
import os
import shutil

import jax
import pytest

from jaxrlhf import checkpoint as C
from jaxrlhf.config import CheckpointConfig, ConfigError, MeshConfig
from jaxrlhf.metrics import read_jsonl
from jaxrlhf.train import pipeline
from test_train import config as tiny_config


@pytest.fixture(autouse=True)
def no_process_settings(monkeypatch):
  monkeypatch.setattr(pipeline.perf, "configure_process", lambda: None)


def _cfg(steps, **changes):
  cfg = tiny_config()
  return dataclasses.replace(
      cfg, **{"name": "guards", "stages": ("sft",), "mesh": MeshConfig(dp=-1),
              "sft": dataclasses.replace(cfg.sft, steps=steps),
              "checkpoint": CheckpointConfig(every_steps=2, keep=3, async_save=False),
              **changes})


def _config_steps(workdir):
  with open(os.path.join(workdir, "config.json")) as f:
    return json.load(f)["sft"]["steps"]


def test_resume_beyond_a_smaller_step_cap_is_refused_and_loses_nothing(tmp_path):
  wd = str(tmp_path)
  assert pipeline.run(_cfg(6), wd) == 0
  # As if killed after the checkpoint of step 6, before the stage's result was written.
  shutil.rmtree(C.stage_result_dir(wd, "sft"))
  with pytest.raises(ConfigError) as info:
    pipeline.run(_cfg(2), wd)  # e.g. the same command with --steps=2
  msg = str(info.value)
  assert "is at step 6, beyond this run's sft.steps=2" in msg
  assert "--set=sft.steps=6" in msg and "steps kept: 2, 4, 6" in msg
  # Nothing was trained, saved or deleted, and config.json still describes the checkpoints.
  assert not C.stage_result_exists(wd, "sft")
  with C.Checkpointer(C.checkpoint_dir(wd, "sft"), _cfg(6).checkpoint, {}) as ck:
    assert ck.all_steps() == [2, 4, 6]
  assert _config_steps(wd) == 6
  steps = [r["step"] for r in read_jsonl(os.path.join(wd, "metrics.jsonl")) if "loss" in r]
  assert steps == list(range(1, 7))
  # The original command finishes the stage from its checkpoint.
  assert pipeline.run(_cfg(6), wd) == 0
  assert C.stage_result_info(wd, "sft")["metrics"]["steps"] == 6


def test_a_run_refused_before_training_keeps_the_folders_config(tmp_path):
  wd = str(tmp_path)
  assert pipeline.run(_cfg(2), wd) == 0
  with pytest.raises(ConfigError, match="mesh"):
    pipeline.run(_cfg(4, mesh=MeshConfig(dp=3)), wd)  # 8 devices: dp=3 cannot be formed
  assert _config_steps(wd) == 2
  fresh = str(tmp_path / "fresh")
  os.makedirs(fresh)
  with pytest.raises(ConfigError, match="mesh"):
    pipeline.run(_cfg(4, mesh=MeshConfig(dp=3)), fresh)
  assert not os.path.exists(os.path.join(fresh, "config.json"))


def test_the_summary_does_not_call_a_capped_stage_one_that_reached_its_target(tmp_path, capsys):
  wd = str(tmp_path)
  assert pipeline.run(_cfg(2), wd) == 0  # e.g. a smoke run with --steps=2
  capsys.readouterr()
  assert pipeline.run(_cfg(4), wd) == 0  # the full command: the stage finished earlier
  out = capsys.readouterr().out
  assert "sft: finished earlier" in out
  assert "target reached" not in out
  assert "sft: steps (of 4 now configured)" in out


def _prompts(tmp_path, lines):
  path = tmp_path / "prompts.jsonl"
  path.write_text("".join(json.dumps(x) + "\n" for x in lines))
  return str(path)


def test_grpo_on_prompts_without_answers_is_refused_before_sft_trains(tmp_path):
  """The exact-match rule would reward empty responses: refused before SFT's first step."""
  path = _prompts(tmp_path, [{"prompt": "1+2="}, {"prompt": "3+4=", "answer": "7"}])
  cfg = _cfg(2)
  cfg = dataclasses.replace(
      cfg, stages=("sft", "grpo"),
      data=dataclasses.replace(cfg.data, task="jsonl", prompts_path=path, sft_path=path))
  wd = str(tmp_path / "run")
  with pytest.raises(ConfigError) as info:
    pipeline.run(cfg, wd)
  assert (f"{path}:1: 1 of the 2 prompts in {path} lack \"answer\"" in str(info.value)
          and "grpo.reward.sources uses rule:exact_match" in str(info.value))
  assert not os.path.exists(os.path.join(wd, "sft"))


def test_held_out_prompts_without_answers_are_left_out_of_the_accuracy(tmp_path, capsys):
  from jaxrlhf.data import DataSource
  from jaxrlhf.train.evaluate import GenerationEval
  from jaxrlhf.train.sft import SFTStage
  cfg = _cfg(2)
  for lines, expect in ((([{"prompt": "1+2="}] * 3) + [{"prompt": "3+4=", "answer": "7"}],
                         "3 of the 4 training-set prompts (not held out) have no \"answer\"; "
                         "eval/accuracy is measured on the other 1"),
                        ([{"prompt": "1+2="}] * 2,
                         "exact match is not evaluated (no eval/accuracy): none of the 2 "
                         "training-set prompts (not held out) from data.prompts_path=")):
    path = _prompts(tmp_path, lines)
    c = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, task="jsonl",
                                                          prompts_path=path, sft_path=path))
    mesh = pipeline.make_mesh(c.mesh)
    stage = SFTStage(c, mesh, DataSource(c.data, c.seed))
    state, _ = stage.init(jax.random.key(0), {})
    out = GenerationEval(stage)(state.params["policy"])
    assert expect in capsys.readouterr().out
    if "not evaluated" in expect:
      assert out == {}
    else:
      assert set(out) == {"eval/accuracy", "eval/response_length"}


def test_a_damaged_checkpoint_is_one_error_naming_an_earlier_step(tmp_path):
  wd = str(tmp_path)
  assert pipeline.run(_cfg(6), wd) == 0
  shutil.rmtree(C.stage_result_dir(wd, "sft"))  # as if killed before the result
  state = os.path.join(C.checkpoint_dir(wd, "sft"), "6", "state")
  for root, _, names in os.walk(state):  # every file cut short, as a full disk leaves them
    for n in names:
      path = os.path.join(root, n)
      with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
  with pytest.raises(ConfigError) as info:
    pipeline.run(_cfg(6), wd)
  msg = str(info.value)
  assert "sft/checkpoints/6" in msg and "--resume=4 (kept: 2, 4, 6)" in msg, msg
  assert pipeline.run(_cfg(6), wd, resume="4") == 0  # the fix it names works
  assert C.stage_result_info(wd, "sft")["metrics"]["steps"] == 6


def test_resume_none_moves_the_old_metrics_aside(tmp_path):
  wd = str(tmp_path)
  assert pipeline.run(_cfg(4), wd) == 0
  assert pipeline.run(_cfg(2), wd, resume="none") == 0
  steps = [r["step"] for r in read_jsonl(os.path.join(wd, "metrics.jsonl")) if "loss" in r]
  assert steps == [1, 2]  # only the new run's
  assert any(n.startswith("metrics.jsonl.replaced-") for n in os.listdir(wd))


def test_a_stop_signal_on_the_last_step_lets_the_stage_finish(tmp_path):
  import io
  from jaxrlhf.data import DataSource
  from jaxrlhf.metrics import MetricsWriter
  from jaxrlhf.train.loop import run_stage
  from jaxrlhf.train.sft import SFTStage
  cfg = _cfg(2)
  stage = SFTStage(cfg, pipeline.make_mesh(cfg.mesh), DataSource(cfg.data, cfg.seed))
  state, frozen = stage.init(jax.random.key(0), {})
  writer = MetricsWriter(str(tmp_path), cfg.logging, {"sft": 2}, stream=io.StringIO(), tty=False)
  # A signal during step 1 stops after it; one during step 2, the last, does not.
  state, _, stopped, done = run_stage(stage, state, frozen, writer=writer,
                                      should_stop=lambda: True)
  assert (stopped, done) == (True, 1)
  state, _, stopped, done = run_stage(stage, state, frozen, writer=writer, start_step=1,
                                      should_stop=lambda: True)
  assert (stopped, done) == (False, 2)
  writer.close()


def test_a_skipped_stage_lists_only_changes_that_would_have_trained_it_differently(tmp_path,
                                                                                  capsys):
  wd = str(tmp_path)
  assert pipeline.run(_cfg(2), wd) == 0
  cfg = _cfg(2)
  cfg = dataclasses.replace(
      cfg, sft=dataclasses.replace(cfg.sft, optim=dataclasses.replace(cfg.sft.optim, lr=0.5)),
      logging=dataclasses.replace(cfg.logging, console_every_s=1.0),
      checkpoint=dataclasses.replace(cfg.checkpoint, keep=5))
  capsys.readouterr()
  assert pipeline.run(cfg, wd) == 0
  line = next(l for l in capsys.readouterr().out.splitlines() if "finished earlier" in l)
  assert "not applied to it: sft.optim.lr" in line
  assert "logging" not in line and "checkpoint.keep" not in line
