"""Evaluation on the set :meth:`DataSource.eval_source` names (held out, or said not to be):
greedy answers scored by the stage's evaluation metric (``STAGE.eval_reward``: exact match, the
math verifier, any rule or host reward, or the stage's own reward), optionally k sampled
answers per prompt (mean reward, pass@k, maj@k), in batches of ``data.eval_batch_size``; and
preference-pair accuracy.  Each evaluation keeps a few of its answers as samples
(:attr:`GenerationEval.samples`) for the metrics writer."""

from __future__ import annotations

import collections
import dataclasses
import re
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf import rewards as RW
from jaxrlhf.config import ConfigError, RewardConfig
from jaxrlhf.data.examples import as_text
from jaxrlhf.rollout import generate
from jaxrlhf.train.common import put_batch
from jaxrlhf.train.episodes import EnvEval
from jaxrlhf.train.program import bucket_widths, trim_prompts

# Reward sources that check an answer's correctness, in the order "auto" prefers them among a
# stage's reward sources (token_accuracy gives partial credit: not a correctness check).
CORRECTNESS_SOURCES = ("host:math_verify", "rule:exact_match", "host:exact_match")
# An evaluation with several batches prints its progress at most this often (seconds).
PROGRESS_EVERY_S = 10.0


def make_evaluator(stage, role: str = "policy"):
  """How a stage that generates is evaluated: greedy episodes against the environment when
  ``env.name`` is set (success rate), else greedy answers scored by the evaluation metric."""
  if stage.cfg.env.name:
    return EnvEval(stage, role)
  return GenerationEval(stage, role)


# ------------------------------------------------------------------------------ the metric


@dataclasses.dataclass(frozen=True)
class EvalMetric:
  """What scores an evaluation's responses: a weighted sum of jittable rules (on the token
  arrays) and host rewards (on the decoded text)."""

  name: str  # as STAGE.eval_reward resolved it, e.g. "rule:exact_match", "host:math_verify"
  rules: tuple = ()  # ((rule fn, weight), ...)
  hosts: tuple = ()  # ((HostReward, weight), ...)
  reads_answer: bool = True  # evaluated on the prompts with an "answer" only


def metric_source(scfg) -> str:
  """What ``STAGE.eval_reward`` names for a stage's settings ``scfg``: "auto" resolved to the
  first correctness check among the stage's reward sources (else "rule:exact_match"),
  "exact_match" as "rule:exact_match", anything else as written."""
  value = scfg.eval_reward
  if value == "auto":
    reward = getattr(scfg, "reward", None)  # an RL stage's reward sources
    own = [s for s, w in zip(reward.sources, reward.weights) if w != 0] if reward else []
    return next((s for s in own if s in CORRECTNESS_SOURCES), "rule:exact_match")
  return "rule:exact_match" if value == "exact_match" else value


def metric_label(scfg) -> str:
  """The evaluation metric in words, for the console and the summary: "exact match", or
  e.g. "correct by host:math_verify"."""
  source = metric_source(scfg)
  return "exact match" if source == "rule:exact_match" else f"correct by {source}"


def eval_metric(stage) -> EvalMetric:
  """``STAGE.eval_reward`` resolved for ``stage`` (ConfigError naming the setting and the
  choices when it names nothing usable)."""
  scfg = stage.scfg
  setting = f"{stage.name}.eval_reward"
  value = scfg.eval_reward
  reward = getattr(scfg, "reward", None)  # an RL stage's reward sources
  own = [(s, w) for s, w in zip(reward.sources, reward.weights) if w != 0] if reward else []
  if value == "auto":
    source = metric_source(scfg)
    return _metric(source, [(source, 1.0)], setting)
  if value == "exact_match":
    return _metric("rule:exact_match", [("rule:exact_match", 1.0)], setting)
  if value == "reward":
    if reward is None:
      raise ConfigError(f"{setting}=reward: {stage.name} has no reward sources; use auto, "
                        f"exact_match, rule:NAME or host:...")
    return _metric("reward", own, setting)
  return _metric(value, [(value, 1.0)], setting)


def _metric(name: str, sources, setting: str) -> EvalMetric:
  rules, hosts = [], []
  for src, w in sources:
    kind, _, rest = src.partition(":")
    if kind == "rule" and rest in RW.RULES:
      rules.append((RW.RULES[rest], float(w)))
    elif kind == "host":
      hosts.append((RW.resolve_host_reward(src, setting), float(w)))
    elif src in ("model", "env"):
      raise ConfigError(f"{setting}: the {src!r} reward source cannot score an evaluation "
                        f"(greedy answers are scored on their own); use auto, exact_match, "
                        f"rule:NAME or host:... there")
    else:
      raise ConfigError(f"{setting}: {src!r} is not an evaluation metric; use auto, "
                        f"exact_match, reward (the stage's own reward sources), 'rule:NAME' "
                        f"({', '.join(sorted(RW.RULES))}) or 'host:NAME' "
                        f"({', '.join(sorted(RW.HOST_RULES))}) / host:path/to/file.py:function")
  if not rules and not hosts:
    raise ConfigError(f"{setting}: no reward source with a weight to score with")
  return EvalMetric(name, tuple(rules), tuple(hosts),
                    any(RW.reads_answer(s) for s, _ in sources))


# ----------------------------------------------------------------------- pass@k and maj@k

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")


def final_answer(response: str) -> str:
  """What majority voting compares: the last ``\\boxed{}`` answer, else the last number the
  response states (commas dropped), else the whole response, stripped."""
  boxed = RW.boxed_answers(response)
  if boxed:
    return boxed[-1].strip()
  numbers = _NUMBER.findall(response)
  if numbers:
    return numbers[-1].replace(",", "")
  return response.strip()


def correct(scores) -> np.ndarray:
  """A score that counts as a correct answer: at least 1 (a 0/1 check's pass; a weighted
  reward at least the check's weight); NaN (unscorable) never."""
  return np.nan_to_num(np.asarray(scores, np.float64), nan=-np.inf) >= 1.0


def pass_maj_at_k(responses: Sequence[Sequence[str]], scores) -> tuple[float, float]:
  """``(pass@k, maj@k)`` over prompts of k responses each: the fraction of prompts with at
  least one correct response, and with a correct most common final answer
  (:func:`final_answer`; a tie goes to the answer given first)."""
  ok = correct(scores)
  n = len(responses)
  if not n:
    return 0.0, 0.0
  passed = float(np.mean(np.any(ok, axis=1)))
  maj = 0
  for i, rs in enumerate(responses):
    answers = [final_answer(r) for r in rs]
    counts = collections.Counter(answers)
    top = max(counts.values())
    winner = next(a for a in answers if counts[a] == top)  # first given among the ties
    maj += int(ok[i][answers.index(winner)])
  return passed, maj / n


def mean32(x) -> float:
  """A float32 mean (``jnp.mean``'s figure for 0/1 scores and integer lengths: the sum exact,
  one division)."""
  x = np.asarray(x, np.float32)
  return float(np.float32(np.sum(x, dtype=np.float32)) / np.float32(len(x)))


def chunks(n: int, size: int) -> list[tuple[int, int]]:
  """``[start, stop)`` of each batch of at most ``size`` of ``n`` rows."""
  return [(i, min(i + size, n)) for i in range(0, n, size)]


# ------------------------------------------------------------------------- the evaluation


class Evaluation:
  """One run's evaluation of a stage, host side: what the stage's :meth:`evaluate
  <jaxrlhf.train.stage.Stage.evaluate>` makes once and reuses (evaluation pairs or held-out
  batches on the mesh, their compiled programs: :meth:`once`), its greedy-generation
  evaluator (:attr:`generation`, None for a stage that generates nothing), the sample rows
  of the last evaluation, and the cadence (:attr:`every`: ``STAGE.eval_every``, which a stop
  rule may make denser near its target).  The stage itself keeps nothing that changes while
  it trains; the training loop, the pipeline's start and end evaluations and the actor pool
  each hold one of these per stage run."""

  def __init__(self, stage, frozen: dict):
    self.stage, self.frozen = stage, frozen
    self.every = stage.eval_every
    self.generation = stage.generation_eval()
    self.rows: list[dict] = []  # the stage's own sample rows (DPO's evaluation pairs)
    self._made: dict = {}

  def once(self, name: str, make: Callable):
    """``make()``, called at the first use of ``name`` in this run and kept."""
    if name not in self._made:
      self._made[name] = make()
    return self._made[name]

  def __call__(self, state) -> dict:
    """The evaluation metrics of ``state`` (``eval/*``)."""
    return self.stage.evaluate(state, self)

  def after(self, metrics: dict) -> str:
    """After an evaluation: the cadence from here on (:meth:`Stage.eval_every_after`), and
    why the stage ends here although steps remain ("" to go on)."""
    self.every = self.stage.eval_every_after(metrics, self.every)
    return self.stage.target_reached(metrics)

  def close(self) -> None:
    """Releases what the evaluator holds outside the process's memory (an environment
    evaluator's worker threads); the evaluation still works after it (they restart)."""
    close = getattr(self.generation, "close", None)
    if close is not None:
      close()

  def take_samples(self) -> list[dict]:
    """The sample rows of the evaluations since the last call: the stage's own, then the
    generation evaluator's; empty when none."""
    rows, self.rows = self.rows, []
    if self.generation is not None and self.generation.samples:
      rows += self.generation.samples
      self.generation.samples = []
    return rows


# -------------------------------------------------------------------------- the evaluator


class GenerationEval:
  """Greedy answers to the evaluation prompts, scored by :func:`eval_metric`:
  ``eval/accuracy`` (the mean score: exact match's accuracy for a 0/1 check) and
  ``eval/response_length``; with ``STAGE.eval_samples_k=k``, k sampled answers per prompt
  (``rollout`` sampling settings) add ``eval/sampled_reward``, ``eval/pass_at_k`` and
  ``eval/maj_at_k``.  Prompts go ``data.eval_batch_size`` at a time.  After each call
  :attr:`samples` holds the first ``logging.samples`` greedy answers as sample rows."""

  def __init__(self, stage, role: str = "policy"):
    self.stage = stage
    self.examples = None  # the evaluation prompts scored, read on first use
    self.samples: list[dict] = []
    self.metric = eval_metric(stage)
    self.k = stage.scfg.eval_samples_k
    cfg = stage.cfg
    self.batch_size = cfg.data.eval_batch_size
    self.n_samples = cfg.logging.samples
    self.P = cfg.data.max_prompt_len
    self.widths = bucket_widths(self.P, cfg.rollout.prompt_buckets)  # each compiled once
    self.tok = stage.data.tokenizer
    model_cfg = cfg.role_model(role)
    eos, pad = self.tok.eos_id, self.tok.pad_id
    decode = stage.decode_layout_shardings(role)
    rules = self.metric.rules

    def run(params, batch, key, rollout, k):
      if decode is not None:  # generation in the decode layout too (docs/rollout.md)
        params = jax.lax.with_sharding_constraint(params, decode)
      out = generate(params, batch["prompt"], batch["prompt_mask"], key, cfg=model_cfg,
                     rollout=rollout, eos_id=eos, pad_id=pad, num_samples=k,
                     kernels=cfg.kernels)
      resp = out.tokens_BT[:, -rollout.max_new_tokens:]
      got = {"tokens": resp, "lengths": out.lengths_B}
      if rules:
        answer, answer_mask = batch["answer"], batch["answer_mask"]
        if k > 1:
          answer, answer_mask = (jnp.repeat(answer, k, axis=0),
                                 jnp.repeat(answer_mask, k, axis=0))
        got["score"] = sum(jnp.float32(w) * fn(resp, out.response_mask_BN, answer, answer_mask,
                                               eos_id=eos) for fn, w in rules)
      return got

    greedy = dataclasses.replace(cfg.rollout, temperature=0.0)
    self._greedy = jax.jit(lambda p, b, key: run(p, b, key, greedy, 1))
    self._sampled = jax.jit(lambda p, b, key: run(p, b, key, cfg.rollout, self.k))
    self._key = jax.random.key(cfg.seed)

  # -- the evaluation set -----------------------------------------------------------------
  def _examples(self) -> list:
    if self.examples is None:
      data = self.stage.data
      examples = data.eval_examples("prompts")
      if self.metric.reads_answer:
        # A prompt without a reference answer cannot be scored (an empty answer would count
        # an empty response as right): measure the others, and say so.
        scored = [ex for ex in examples if ex.answer]
        if len(scored) < len(examples):
          note = no_answer_note(data, len(examples) - len(scored), len(examples))
          print(f"{self.stage.name}: {note}", flush=True)
        examples = scored
      self.examples = examples
    return self.examples

  # -- generation and scoring -------------------------------------------------------------
  def _generate(self, fn: Callable, params, examples: list, rows_per_batch: int, k: int,
                progress: "_Progress", greedy: bool = False) -> dict:
    """``fn`` over ``examples`` in batches of ``rows_per_batch`` prompts (the last padded
    to it when there are several): host arrays of every row, prompt-major."""
    parts = []
    spans = chunks(len(examples), rows_per_batch)
    for b, (lo, hi) in enumerate(spans):
      chunk = examples[lo:hi]
      if len(spans) > 1 and len(chunk) < rows_per_batch:  # one compiled shape
        chunk = chunk + [chunk[-1]] * (rows_per_batch - len(chunk))
      batch = put_batch(self.stage.mesh, trim_prompts(self.stage.data.encoder.prompts(chunk),
                                                      self.widths))
      with jax.set_mesh(self.stage.mesh):
        # Greedy answers do not read the key; sampled ones get their own per batch.
        key = jax.random.key(0) if greedy else jax.random.fold_in(self._key, b)
        got = jax.device_get(fn(params, batch, key))
      parts.append({name: np.asarray(v)[:(hi - lo) * k] for name, v in got.items()})
      progress.done(hi - lo)
    return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}

  def _score(self, got: dict, examples: list, k: int) -> tuple[np.ndarray, list]:
    """float32 scores of every row (NaN: a host reward could not score it) and the decoded
    responses."""
    responses = [self.tok.decode(t) for t in got["tokens"]]
    scores = np.asarray(got["score"], np.float32) if "score" in got else np.zeros(
        len(responses), np.float32)
    if self.metric.hosts:
      records = [ex.record() for ex in examples]
      rcfg = getattr(self.stage.scfg, "reward", None) or RewardConfig()
      for reward, w in self.metric.hosts:
        scores = scores + np.float32(w) * RW.score_host(
            reward, responses, records, k, rcfg.host_errors, timeout_s=rcfg.timeout_s).scores
    return scores, responses

  def __call__(self, params) -> dict:
    examples = self._examples()
    self.samples = []
    if not examples:
      return {}
    total = len(examples) * (2 if self.k else 1)
    several = len(examples) > self.batch_size or (
        self.k > 0 and len(examples) > max(1, self.batch_size // self.k))
    progress = _Progress(self.stage.name, total, several)
    got = self._generate(self._greedy, params, examples, self.batch_size, 1, progress,
                         greedy=True)
    scores, responses = self._score(got, examples, 1)
    ok = np.isfinite(scores)
    out = {"eval/accuracy": mean32(scores[ok]) if ok.any() else float("nan"),
           "eval/response_length": mean32(got["lengths"])}
    if not ok.all():
      out["eval/unscored"] = float(np.sum(~ok))
    self.samples = [
        {"kind": "eval", "prompt": as_text(ex.prompt), "response": r, "reward": float(s),
         **({"answer": ex.answer} if ex.answer else {})}
        for ex, r, s in list(zip(examples, responses, scores))[:self.n_samples]]
    if self.k:
      got = self._generate(self._sampled, params, examples,
                           max(1, self.batch_size // self.k), self.k, progress)
      sampled, texts = self._score(got, examples, self.k)
      finite = np.isfinite(sampled)
      out["eval/sampled_reward"] = (float(np.mean(sampled[finite])) if finite.any()
                                    else float("nan"))
      k = self.k
      out["eval/pass_at_k"], out["eval/maj_at_k"] = pass_maj_at_k(
          [texts[i * k:(i + 1) * k] for i in range(len(examples))], sampled.reshape(-1, k))
    progress.end()
    return out


class _Progress:
  """``STAGE: evaluating 128/512 (25%, 41s)`` lines for an evaluation of several batches, at
  most every :data:`PROGRESS_EVERY_S` seconds."""

  def __init__(self, stage: str, total: int, on: bool):
    self.stage, self.total, self.on = stage, total, on
    self.count = 0
    self.t0 = self.last = time.perf_counter()
    self.printed = False

  def done(self, n: int):
    self.count += n
    now = time.perf_counter()
    if self.on and self.count < self.total and now - self.last >= PROGRESS_EVERY_S:
      self._print(now)

  def end(self):
    if self.printed:
      self._print(time.perf_counter())

  def _print(self, now: float):
    self.last, self.printed = now, True
    print(f"{self.stage}: evaluating {self.count}/{self.total} "
          f"({100 * self.count / self.total:.0f}%, {now - self.t0:.0f}s)", flush=True)


def no_answer_note(data, missing: int, total: int) -> str:
  """What exact match does when ``missing`` of the ``total`` evaluation prompts have no
  reference answer: scores the others, or (none has one: e.g. DPO on pairs without "answer")
  is left out, and how to get it."""
  field, _ = data.eval_source("prompts")
  where = f"data.{field}={getattr(data.cfg, field)}"
  prompts = data.eval_name("prompts", "prompts")
  if missing < total:
    return (f"{missing} of the {total} {prompts} have no \"answer\"; eval/accuracy is measured "
            f"on the other {total - missing}")
  return (f"exact match is not evaluated (no eval/accuracy): none of the {total} {prompts} "
          f"from {where} has an \"answer\" to compare the greedy response with; add "
          f"\"answer\" to its rows, or set data.prompts_eval_path=FILE (prompts with answers)")


def pair_batches(stage, n: int | None = None) -> dict:
  """The evaluation preference pairs (:meth:`DataSource.eval_source`), placed on the mesh."""
  examples = stage.data.eval_examples("pairs")
  if n is not None:
    examples = examples[:n]
  return put_batch(stage.mesh, stage.data.encoder.pairs(examples))

