"""``sft.stop_accuracy``: SFT ends at the first evaluation that reaches the target, the stage
counts as finished (its result, the summary, the next stage), and a run stopped between that
checkpoint and the stage's result resumes without training further.

The pipeline runs in this process on the tiny config of test_train; the held-out evaluation
is replaced by one whose accuracy is a known function of the step, so the stopping step is
known (the real evaluation is covered by the learning tests and the tiny experiments).
"""

import dataclasses
import json
import os
import shutil

import pytest

from jaxrlhf import checkpoint as C
from jaxrlhf.config import ConfigError, MeshConfig, to_dict, validate
from jaxrlhf.data import DataSource
from jaxrlhf.metrics import read_jsonl
from jaxrlhf.train import pipeline
from jaxrlhf.train import spec
from jaxrlhf.train.sft import SFTStage
from test_train import config as tiny_config


@pytest.fixture(autouse=True)
def fake_eval(monkeypatch):
  """Held-out accuracy = step / 8, and no process-wide settings (allocator, disk cache)."""
  monkeypatch.setattr(pipeline.perf, "configure_process", lambda: None)
  monkeypatch.setattr(SFTStage, "evaluate",
                      lambda self, state, frozen: {"eval/accuracy": int(state.step) / 8})


def _cfg(stop=0.5, **sft):
  cfg = tiny_config()
  return dataclasses.replace(
      cfg, name="stop_accuracy", stages=("sft", "grpo"), mesh=MeshConfig(dp=-1),
      sft=dataclasses.replace(cfg.sft, **{"steps": 8, "eval_every": 2, "stop_accuracy": stop,
                                          **sft}),
      grpo=dataclasses.replace(cfg.grpo, steps=1))


def _sft_steps_logged(workdir):
  return sorted({r["step"] for r in read_jsonl(os.path.join(workdir, "metrics.jsonl"))
                 if r["stage"] == "sft" and "loss" in r})


def test_sft_stops_at_the_first_evaluation_reaching_the_target(tmp_path, capsys):
  wd = str(tmp_path)
  assert pipeline.run(_cfg(stop=0.5), wd) == 0
  out = capsys.readouterr().out
  # Evaluations at steps 2 (0.25) and 4 (0.5): it stops after step 4 of 8.
  assert "reached sft.stop_accuracy=0.5 at step 4 of 8" in out
  assert "sft  4/4 [####################] 100%  done in" in out  # the bar ends as done
  assert "4/8" not in out
  assert _sft_steps_logged(wd) == [1, 2, 3, 4]
  summary = json.load(open(os.path.join(wd, "summary.json")))
  assert summary["sft"]["steps"] == 4 and summary["sft"]["eval/accuracy"] == 0.5
  assert "sft: steps (target reached; of 8)" in out
  assert C.stage_result_info(wd, "sft")["metrics"]["steps"] == 4
  assert "grpo" in summary  # the next stage ran from the stopped SFT's policy
  cfg = _cfg(stop=0.5)
  stage = SFTStage(cfg, pipeline.make_mesh(cfg.mesh), DataSource(cfg.data, cfg.seed))
  with C.Checkpointer(C.checkpoint_dir(wd, "sft"), cfg.checkpoint, to_dict(cfg)) as ck:
    assert ck.all_steps()[-1] == 4
    _, extra = ck.restore(stage.abstract_init()[0], 4)
  assert extra["target_reached"].startswith("held-out exact match 0.500")


def test_near_the_target_sft_evaluates_every_stop_eval_every_steps(tmp_path, capsys):
  """Evaluated every 4 steps, a target of 0.625 (step 5) is passed between evaluations 4 and 8;
  from 0.4 x the target (0.25) on, every step is evaluated, and SFT stops at step 5."""
  wd = str(tmp_path / "dense")
  assert pipeline.run(_cfg(stop=0.625, eval_every=4, stop_eval_every=1, stop_eval_from=0.4),
                      wd) == 0
  assert "reached sft.stop_accuracy=0.625 at step 5 of 8" in capsys.readouterr().out
  assert _sft_steps_logged(wd) == [1, 2, 3, 4, 5]
  evals = [r["step"] for r in read_jsonl(os.path.join(wd, "metrics.jsonl"))
           if r["stage"] == "sft" and "eval/accuracy" in r]
  assert evals == [4, 5], evals  # step 4 (0.5) is past 0.25: dense from there
  # The same target checked every 4 steps only: no evaluation before the end reaches it.
  wd = str(tmp_path / "coarse")
  assert pipeline.run(_cfg(stop=0.625, eval_every=4), wd) == 0
  assert _sft_steps_logged(wd) == list(range(1, 9))


def test_without_a_target_sft_trains_every_step(tmp_path):
  wd = str(tmp_path)
  assert pipeline.run(_cfg(stop=0.0), wd) == 0
  assert _sft_steps_logged(wd) == list(range(1, 9))
  assert json.load(open(os.path.join(wd, "summary.json")))["sft"]["steps"] == 8


def test_a_run_stopped_after_the_target_checkpoint_does_not_train_on(tmp_path, capsys):
  """Killed between the checkpoint of the stopping step and the stage's result: the rerun
  finishes the stage at that step (it does not train steps 5-8), then runs the next one."""
  wd = str(tmp_path)
  assert pipeline.run(_cfg(stop=0.5), wd) == 0
  for path in (C.stage_result_dir(wd, "sft"), C.stage_result_dir(wd, "grpo"),
               C.checkpoint_dir(wd, "grpo")):
    shutil.rmtree(path)
  capsys.readouterr()
  assert pipeline.run(_cfg(stop=0.5), wd) == 0
  out = capsys.readouterr().out
  assert "sft: held-out exact match 0.500 reached sft.stop_accuracy=0.5 at step 4; the stage " \
         "ended there" in out
  assert _sft_steps_logged(wd) == [1, 2, 3, 4]
  assert C.stage_result_info(wd, "sft")["metrics"]["steps"] == 4
  assert "grpo" in json.load(open(os.path.join(wd, "summary.json")))


@pytest.mark.parametrize("changes, message", [
    ({"stop": 1.5}, "sft.stop_accuracy=1.5: must be in [0, 1]"),
    ({"stop": 0.5, "eval_every": 0}, "sft.eval_every=0; set --set=sft.eval_every=10"),
    ({"stop_eval_from": 2.0}, "sft.stop_eval_from=2.0: must be in [0, 1]"),
    ({"stop_eval_every": -1}, "sft.stop_eval_every=-1: must be >= 0"),
])
def test_bad_settings_name_the_field_and_the_fix(changes, message):
  cfg = _cfg(**changes)
  with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
    validate(cfg)


def test_a_target_without_answers_to_check_is_refused(tmp_path):
  """Your own data: held-out prompts without answers could never reach the target."""
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text('{"prompt": "1+1="}\n{"prompt": "2+2=", "answer": "4"}\n')
  sft = tmp_path / "sft.jsonl"
  sft.write_text('{"prompt": "1+1=", "response": "2"}\n')
  cfg = _cfg(stop=0.5)
  cfg = dataclasses.replace(cfg, data=dataclasses.replace(
      cfg.data, task="jsonl", prompts_path=str(prompts), sft_path=str(sft)))
  with pytest.raises(ConfigError, match=r"1 of the 2 evaluation prompts in .*prompts.jsonl "
                                        r"have no \"answer\""):
    spec.get("sft").validate(cfg, DataSource(cfg.data, cfg.seed))
  prompts.write_text('{"prompt": "1+1=", "answer": "2"}\n')  # answers: accepted
  spec.get("sft").validate(cfg, DataSource(cfg.data, cfg.seed))


def test_the_tiny_experiments_stop_sft_at_an_accuracy():
  from jaxrlhf import registry
  for name, target in (("tiny_ppo", 0.8), ("tiny_grpo", 0.5), ("tiny_dpo", 0.5)):
    sft = registry.get(name).sft
    assert (sft.stop_accuracy, sft.eval_every > 0) == (target, True), name
    # ... checked every step near it (the rise is sharp: 13% -> 63% in 10 steps).
    assert sft.stop_eval_every == 1 and 0 < sft.stop_eval_from < 1, name
