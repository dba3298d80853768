"""What a rerun in the same folder must not do: train a stage past a smaller step cap into a
mislabelled result, overwrite the folder's config.json when the run is refused, or call a stage
cut short by ``--steps`` one that reached its target.

The pipeline runs in this process on the tiny config of test_train (SFT only, a few steps).
"""

import dataclasses
import json
import os
import shutil

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
