"""Samples (what the model generates) in every sink, and evaluation that fits the task:
scoring by the stage's reward (math_verify by value), pass@k / maj@k, eval_every=0, batched
evaluation."""

import dataclasses
import glob
import io
import json
import os

import jax
import numpy as np
import pytest

from jaxrlhf import metrics, tracking
from jaxrlhf.config import (ConfigError, GRPOConfig, LoggingConfig, RewardConfig, SFTConfig,
                            validate)
from jaxrlhf.data import DataSource
from jaxrlhf.train import evaluate as E
from jaxrlhf.train import pipeline
from jaxrlhf.train.spec import build_stage
from test_train import OPT, config as tiny_config

ROWS = [{"kind": "eval", "prompt": "what is 2+3?", "response": "2+3 is\n5 | five",
         "reward": np.float32(1.0), "answer": "5"},
        {"kind": "eval", "prompt": "7*6=", "response": "x" * 500, "reward": 0.0, "answer": "42"},
        {"kind": "eval", "prompt": "é?", "response": "", "reward": float("nan")},
        {"kind": "eval", "prompt": "1+1=", "response": "2", "reward": 1.0, "answer": "2"}]


# ----------------------------------------------------------------------------- the sinks


def _tb_texts(logdir):
  """TensorBoard's own reading of the text summaries: run -> tag -> [(step, text)]."""
  from tensorboard.backend.event_processing import event_multiplexer
  mux = event_multiplexer.EventMultiplexer().AddRunsFromDirectory(str(logdir))
  mux.Reload()
  return {run: {tag: [(e.step, e.tensor_proto.string_val[0].decode()) for e in
                      mux.Tensors(run, tag)] for tag in tags["tensors"]}
          for run, tags in mux.Runs().items()}


def test_samples_reach_the_jsonl_the_console_and_tensorboard(tmp_path):
  stream = io.StringIO()
  w = metrics.MetricsWriter(str(tmp_path), LoggingConfig(), {"sft": 4}, primary=True,
                            stream=stream, tty=False)
  w.write("sft", 2, {"loss": 1.0})
  w.write_samples("sft", 2, ROWS)
  w.write_samples("sft", 3, [])  # nothing to write: no record, no line
  w.close()
  # A resumed run appends.
  w = metrics.MetricsWriter(str(tmp_path), LoggingConfig(console=False), primary=True)
  w.write_samples("sft", 4, ROWS[:1])
  w.close()

  rows = metrics.read_jsonl(str(tmp_path / "samples.jsonl"))
  assert [(r["stage"], r["step"]) for r in rows] == [("sft", 2)] * 4 + [("sft", 4)]
  assert rows[0]["prompt"] == "what is 2+3?" and rows[0]["response"] == "2+3 is\n5 | five"
  assert rows[0]["reward"] == 1.0 and rows[0]["answer"] == "5" and rows[0]["kind"] == "eval"
  assert np.isnan(rows[2]["reward"]) and rows[2]["prompt"] == "é?" and "answer" not in rows[2]
  # Readable text in the file itself (not escaped unicode).
  assert "é?" in (tmp_path / "samples.jsonl").read_text(encoding="utf-8")

  out = stream.getvalue()
  assert ("sft step 2: eval samples (3 of 4; all in "
          f"{tmp_path / 'samples.jsonl'})") in out
  lines = out.splitlines()
  first = lines.index(next(l for l in lines if l.startswith("sft step 2: eval samples")))
  shown = lines[first + 1:first + 4]
  assert shown[0] == "  [1] what is 2+3? -> 2+3 is\\n5 | five  (answer: 5)"
  assert shown[1].startswith("  [0] 7*6= -> xxx") and "...  (answer: 42)" in shown[1]
  assert len(shown[1]) < 200  # a 500-character response is cut to one line
  assert shown[2] == "  [nan] é? -> "

  texts = _tb_texts(tmp_path / "tensorboard")
  points = texts["sft"]["samples/eval/text_summary"]
  assert [step for step, _ in points] == [2, 4]  # the resumed run's too
  table = points[0][1]
  assert table.splitlines()[0] == "| kind | prompt | response | reward | answer |"
  assert "| eval | what is 2+3? | 2+3 is\\n5 \\| five | 1 | 5 |" in table


def test_samples_reach_wandb_as_a_table_and_mlflow_as_an_artifact(tmp_path, monkeypatch):
  pytest.importorskip("wandb")
  pytest.importorskip("mlflow")
  for k in list(os.environ):
    if k.startswith(("WANDB_", "MLFLOW_")):
      monkeypatch.delenv(k)
  monkeypatch.setenv("HOME", str(tmp_path))  # no `wandb login` key: offline
  w = metrics.MetricsWriter(str(tmp_path), LoggingConfig(
      console=False, sinks=("jsonl", "wandb", "mlflow")), config={"name": "samples_test"},
      primary=True)
  w.write("grpo", 5, {"reward/mean": 0.5})
  w.write_samples("grpo", 5, ROWS)
  w.write_samples("grpo", 5, [{"kind": "rollout", "prompt": "p", "response": "r",
                               "reward": 0.25}])
  assert w.sinks == ["wandb", "mlflow"]  # neither failed
  w.close()

  tables = sorted(glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "files" / "media" /
                                "table" / "**" / "*.table.json"), recursive=True))
  assert len(tables) == 2
  by_kind = {}
  for path in tables:
    with open(path) as f:
      t = json.load(f)
    by_kind["rollout" if "rollout" in path else "eval"] = t
  assert by_kind["eval"]["columns"] == ["kind", "prompt", "response", "reward", "answer"]
  assert by_kind["eval"]["data"][0] == ["eval", "what is 2+3?", "2+3 is\n5 | five", 1.0, "5"]
  assert by_kind["rollout"]["data"] == [["rollout", "p", "r", 0.25]]

  from mlflow.tracking import MlflowClient
  client = MlflowClient(tracking_uri=tracking.mlflow_store(str(tmp_path))[0])
  with open(tmp_path / "mlflow_run.json") as f:
    run_id = json.load(f)["run_id"]
  names = sorted(os.path.basename(a.path)
                 for a in client.list_artifacts(run_id, "samples/grpo"))
  assert names == ["eval_step0000005.jsonl", "rollout_step0000005.jsonl"]
  path = client.download_artifacts(run_id, "samples/grpo/eval_step0000005.jsonl",
                                   str(tmp_path / "dl"))
  with open(path, encoding="utf-8") as f:
    got = [json.loads(line) for line in f]
  assert got[0] == {"step": 5, "kind": "eval", "prompt": "what is 2+3?",
                    "response": "2+3 is\n5 | five", "reward": 1.0, "answer": "5"}
  assert got[2]["prompt"] == "é?"


def test_samples_settings_are_checked():
  with pytest.raises(ConfigError, match=r"logging.samples_every=-1: must be >= 0"):
    validate(dataclasses.replace(tiny_config(), logging=LoggingConfig(samples_every=-1)))
  with pytest.raises(ConfigError, match=r"data.eval_batch_size=0: must be >= 1"):
    validate(dataclasses.replace(tiny_config(), data=dataclasses.replace(
        tiny_config().data, eval_batch_size=0)))


# ---------------------------------------------------------------------- pass@k and maj@k


def test_pass_and_maj_at_k_by_hand():
  # Three prompts, k = 3.
  responses = [["so \\boxed{4}", "the answer is 5", "it is 4"],  # 4 twice (right), 5 once
               ["1,000 apples", "1000", "999"],  # 1000 twice (wrong); 999 right
               ["a", "b", "c"]]  # all different: the first given wins the tie
  scores = np.array([[1.0, 0.0, 1.0],
                     [0.0, 0.0, 1.0],
                     [np.nan, 1.0, 0.0]], np.float32)
  passed, maj = E.pass_maj_at_k(responses, scores)
  # pass@3: prompts 0, 1, 2 each have a correct response -> 3/3; maj@3: prompt 0 only
  # (prompt 1's majority 1000 is wrong; prompt 2's tie goes to "a", unscorable).
  assert passed == 1.0 and maj == pytest.approx(1 / 3)
  assert E.pass_maj_at_k(responses[:2], np.array([[0, 0, 0], [0, 0, 0.5]])) == (0.0, 0.0)
  assert E.final_answer("first 3, then \\boxed{\\frac{1}{2}} and 7") == "\\frac{1}{2}"
  assert E.final_answer("we get 1,234.5 eggs") == "1234.5" and E.final_answer(" hi ") == "hi"


# ------------------------------------------------------------------- evaluation metrics


def _prompts(tmp_path, rows):
  path = tmp_path / "prompts.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def _grpo_stage(tmp_path, **grpo):
  cfg = tiny_config()
  path = _prompts(tmp_path, [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(6)])
  cfg = dataclasses.replace(
      cfg, data=dataclasses.replace(cfg.data, task="jsonl", prompts_path=path, sft_path=path,
                                    eval_batch_size=4),
      grpo=dataclasses.replace(cfg.grpo, **grpo))
  return build_stage("grpo", cfg, pipeline.make_mesh(cfg.mesh), DataSource(cfg.data, cfg.seed))


def _fake_generation(stage, answer):
  """The stage's generation evaluator, its generation replaced by one answering ``answer(a)``
  to the prompt "a+a="."""
  tok = stage.tok

  def fn(params, batch, key):
    prompts = np.asarray(batch["prompt"])
    ids = np.full((len(prompts), 64), tok.pad_id, np.int32)
    for i, p in enumerate(prompts):
      t = tok.encode(answer(int(tok.decode([x for x in p if x != tok.pad_id]).split("+")[0])))
      ids[i, :len(t) + 1] = t + [tok.eos_id]
    return {"tokens": ids, "lengths": np.full(len(prompts), 3, np.int32)}

  ev = stage.generation_eval()
  ev._greedy = fn
  return ev


def test_math_verify_evaluates_worked_solutions_by_value(tmp_path):
  worked = "we add {a} and {a} to get {b} so the answer is {b}"
  stage = _grpo_stage(tmp_path, reward=RewardConfig(sources=("host:math_verify",
                                                             "host:math_format"),
                                                    weights=(1.0, 0.1)))
  texts = [worked.format(a=a, b=2 * a) for a in range(6)]
  ev = _fake_generation(stage, lambda a: texts[a])
  assert ev.metric.name == "host:math_verify"  # auto: the stage's correctness source
  out = ev(None)
  assert out["eval/accuracy"] == 1.0  # by value, though no response equals its answer
  assert ev.samples[1] == {"kind": "eval", "prompt": "1+1=", "response": texts[1],
                           "reward": 1.0, "answer": "2"}
  # Exact match on the same responses: none is right.
  stage = _grpo_stage(tmp_path, eval_reward="exact_match",
                      reward=RewardConfig(sources=("host:math_verify",)))
  assert _fake_generation(stage, lambda a: texts[a])(None)["eval/accuracy"] == 0.0
  # The stage's whole reward (1.0 x verify + 0.1 x format): no boxed answer, 1.0 each.
  stage = _grpo_stage(tmp_path, eval_reward="reward", reward=RewardConfig(
      sources=("host:math_verify", "host:math_format"), weights=(1.0, 0.1)))
  assert _fake_generation(stage, lambda a: texts[a])(None)["eval/accuracy"] == 1.0


def test_sampled_evaluation_reports_mean_reward_pass_and_maj_at_k(tmp_path):
  stage = _grpo_stage(tmp_path, eval_samples_k=3,
                      reward=RewardConfig(sources=("host:math_verify",)))
  # Each prompt's 3 samples answer 2a, 2a + 1, 2a + 1: one right in three, a wrong majority;
  # the greedy answer is 2a.
  tok = stage.tok

  def answers(k):
    def fn(params, batch, key):
      prompts = np.asarray(batch["prompt"])
      ids = np.full((len(prompts) * k, 16), tok.pad_id, np.int32)
      for i in range(len(prompts) * k):
        a = int(tok.decode([t for t in prompts[i // k] if t != tok.pad_id]).split("+")[0])
        t = tok.encode(str(2 * a + (i % k > 0))) + [tok.eos_id]
        ids[i, :len(t)] = t
      return {"tokens": ids, "lengths": np.full(len(ids), 2, np.int32)}
    return fn

  ev = stage.generation_eval()
  ev._greedy, ev._sampled = answers(1), answers(3)
  out = ev(None)
  assert out["eval/accuracy"] == 1.0  # the greedy (first) answer is right
  assert out["eval/sampled_reward"] == pytest.approx(1 / 3)
  assert out["eval/pass_at_k"] == 1.0 and out["eval/maj_at_k"] == 0.0


def test_an_eval_reward_that_cannot_score_is_one_line(tmp_path):
  with pytest.raises(ConfigError, match=r"grpo.eval_reward: 'rule:nope' is not an evaluation "
                                        r"metric; use auto, exact_match, reward"):
    _grpo_stage(tmp_path, eval_reward="rule:nope")
  with pytest.raises(ConfigError, match=r"grpo.eval_reward: the 'model' reward source cannot "
                                        r"score an evaluation"):
    _grpo_stage(tmp_path, eval_reward="model")


def test_batched_evaluation_equals_one_batch(capsys, monkeypatch):
  cfg = tiny_config()
  cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, eval_size=10),
                            logging=LoggingConfig(samples=10))
  got = {}
  monkeypatch.setattr(E, "PROGRESS_EVERY_S", 0.0)
  for size in (256, 4):
    c = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, eval_batch_size=size))
    stage = build_stage("sft", c, pipeline.make_mesh(c.mesh), DataSource(c.data, c.seed))
    state, frozen = stage.init(jax.random.key(0), {})
    ev = stage.evaluation(frozen)
    got[size] = (ev.generation(state.params["policy"]), ev.take_samples())
  assert got[4] == got[256]
  assert len(got[4][1]) == 10 and all(r["kind"] == "eval" for r in got[4][1])
  out = capsys.readouterr().out
  # Three batches of 4 (the last padded): progress after the first two, and at the end.
  assert "sft: evaluating 4/10 (40%" in out and "sft: evaluating 10/10 (100%" in out


# --------------------------------------------------------------------- through the loop


def _run(tmp_path, cfg):
  wd = str(tmp_path)
  assert pipeline.run(cfg, wd) == 0
  recs = metrics.read_jsonl(os.path.join(wd, "metrics.jsonl"))
  path = os.path.join(wd, "samples.jsonl")
  samples = metrics.read_jsonl(path) if os.path.exists(path) else []
  with open(os.path.join(wd, "summary.json")) as f:
    return recs, samples, json.load(f)


def test_eval_every_0_never_evaluates(tmp_path, monkeypatch):
  calls = []
  real = E.GenerationEval.__call__
  monkeypatch.setattr(E.GenerationEval, "__call__",
                      lambda self, p: calls.append(self) or real(self, p))
  cfg = dataclasses.replace(tiny_config(), stages=("sft",),
                            sft=SFTConfig(steps=2, batch_size=8, optim=OPT, eval_every=0))
  recs, samples, summary = _run(tmp_path / "off", cfg)
  assert calls == [] and samples == []
  assert not [k for r in recs for k in r if k.startswith("eval/")]
  assert not [k for k in summary["sft"] if k.startswith("eval/")] and "sft/start" not in summary
  # eval_every=2: at the start (summary) and at step 2, with their samples.
  cfg = dataclasses.replace(cfg, sft=dataclasses.replace(cfg.sft, eval_every=2))
  recs, samples, summary = _run(tmp_path / "on", cfg)
  assert len(calls) == 2 and "eval/accuracy" in summary["sft/start"]
  # One evaluator for the run: the start's and the training's evaluations share its
  # compiled programs (a second one would compile them again).
  assert calls[0] is calls[1]
  assert [r["step"] for r in recs if "eval/accuracy" in r] == [2]
  assert sorted({r["step"] for r in samples}) == [0, 2]
  assert len([r for r in samples if r["step"] == 2]) == 8  # logging.samples


def test_rl_rollout_samples_every_k_steps_with_decoded_text(tmp_path):
  cfg = tiny_config()
  cfg = dataclasses.replace(
      cfg, stages=("grpo",), logging=LoggingConfig(console=False, samples=3, samples_every=2),
      grpo=GRPOConfig(steps=4, batch_size=4, num_samples=4, optim=OPT, eval_every=4,
                      reward=RewardConfig(sources=("rule:exact_match",))))
  recs, samples, _ = _run(tmp_path, cfg)
  rollout = [r for r in samples if r["kind"] == "rollout"]
  assert [r["step"] for r in rollout] == [2, 2, 2, 4, 4, 4]
  for r in rollout:
    # Decoded text of the addition task: "a+b=" prompts, the reference sum, a 0/1 reward.
    assert r["prompt"].endswith("=") and "+" in r["prompt"] and r["answer"].isdigit()
    assert isinstance(r["response"], str) and r["reward"] in (0.0, 1.0)
  # The first response of each of the first prompts (rows 0, 4, 8 of the rollout).
  assert len({r["prompt"] for r in rollout if r["step"] == 2}) == 3
  evals = [r for r in samples if r["kind"] == "eval"]
  assert sorted({r["step"] for r in evals}) == [0, 4] and len(evals) == 6
  # The rewards recorded for step 4's rollout average like reward/mean over the sampled rows
  # only, so just check they are the step's: every metrics record exists.
  assert [r["step"] for r in recs] == [1, 2, 3, 4]


def test_dpo_samples_are_the_evaluation_pairs_with_their_margins():
  """DPO's sample rows come from the evaluation's own per-pair log-probs: a row per pair (up
  to logging.samples), its reward the implicit-reward margin, whose mean over every
  evaluation pair is eval/reward_margin."""
  from helpers import mesh
  from test_train import run_steps
  cfg = tiny_config(logging=LoggingConfig(samples=8))  # eval_size 8: every pair a row
  stage, state, frozen, _ = run_steps(cfg, "dpo", mesh(), steps=2)
  ev = stage.evaluation(frozen)
  out = ev(state)
  rows = [r for r in ev.take_samples() if r["kind"] == "eval_pairs"]
  assert len(rows) == len(stage.data.eval_examples("pairs")) == 8
  for r in rows:
    assert r["reward"] == pytest.approx(r["chosen_reward"] - r["rejected_reward"])
    assert r["prompt"] and r["chosen"] and r["rejected"]
  assert np.mean([r["reward"] for r in rows]) == pytest.approx(out["eval/reward_margin"],
                                                               rel=1e-4, abs=1e-6)
  assert out["eval/reward_margin"] != 0  # two steps moved the policy off the reference
