"""One phase list, every program of the RL step.

An RL algorithm's step is a list of :class:`Phase` s, each a pure function
``fn(stage, frozen, batch, carry) -> carry`` over a :class:`~jaxrlhf.train.types.StepCarry`.
:func:`compose` chains a slice of the list into one function, and every program the trainer,
the pools and the planner run is such a slice:

- the default step: every phase in one jitted program (:func:`step_fn`, jitted by the stage
  with explicit shardings and the state donated);
- ``logging.phase_timing``: each timing group (generate, reference, reward, values, update)
  its own jitted, timed program (:class:`PhasedProgram`);
- a host (Python) reward: the programs before and after :data:`HOST`, the decoded rollout
  scored on the host in between (:class:`PhasedProgram`);
- ``rollout.length_buckets``: the programs before and after :data:`HOST` too, the rollout cut
  in between to its longest response rounded up to a bucket (:func:`trim_rollout`), so the
  phases after generation run (and are compiled once per bucket) on fewer response slots;
- ``rollout.pack``: the same cut, the packed layouts of the model passes after generation
  made in between from the rollout's mask (:func:`jaxrlhf.train.packed.plan`);
- the disaggregated pools: the actor's and the critic's phases (:func:`pool_phases`), with the
  pool's own exchange phases added around them;
- ``--plan``: the same programs lowered on abstract arrays (:func:`programs`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.data.examples import as_text
from jaxrlhf.distributed import to_host
from jaxrlhf.perf import PhaseTimer
from jaxrlhf.train import packed
from jaxrlhf.train.common import put_global, shardings_of
from jaxrlhf.train.types import HostInputs, Rollout, StepCarry

# The split point of a step with host rewards: the phases before it form one program, the
# decoded rollout is scored in Python, the phases after it form the second program.
HOST = "host_reward"


@dataclasses.dataclass(frozen=True)
class Phase:
  """One pure piece of the step.  ``group`` names the timed program it belongs to (phases of
  one group run as one program under ``logging.phase_timing``); ``pool`` is where it runs in
  a disaggregated run (``actor``, ``critic``, or ``both``)."""

  name: str
  fn: Callable  # (statics: StepStatics, frozen, batch, carry) -> carry
  pool: str = "actor"
  group: str = ""

  @property
  def timing_group(self) -> str:
    return self.group or self.name


def compose(stage, phases: Sequence[Phase]) -> Callable:
  """``(frozen, batch, carry) -> carry``: the phases one after another, each given the
  stage's :class:`~jaxrlhf.train.statics.StepStatics` (never the stage itself)."""
  phases = tuple(p for p in phases if p.name != HOST)
  statics = stage.statics

  def run(frozen, batch, carry: StepCarry) -> StepCarry:
    for p in phases:
      carry = p.fn(statics, frozen, batch, carry)
    return carry

  return run


def split(phases: Sequence[Phase], *, at_host: bool, timed: bool) -> list[tuple[str, list]]:
  """The programs of a phased step, in order: ``(label, phases)``; with ``timed`` each timing
  group is a program, else the host split alone cuts the list."""
  out: list[tuple[str, list]] = []
  for p in phases:
    if p.name == HOST:
      if at_host:
        out.append((HOST, []))
      continue
    label = p.timing_group if timed else ("before_host" if not any(
        lab == HOST for lab, _ in out) else "after_host")
    if out and out[-1][0] == label:
      out[-1][1].append(p)
    else:
      out.append((label, [p]))
  return out


def jit_phases(stage, phases: Sequence[Phase], state) -> Callable:
  """``(frozen, batch, carry) -> carry`` of ``phases`` as one jitted program: the carry's state
  donated (updated in place) and kept in ``state``'s shardings; the rest of the carry flows on.
  What a phased step and each pool compile."""
  return jax.jit(compose(stage, phases), donate_argnums=(2,),
                 out_shardings=StepCarry(state=shardings_of(state), metrics=None))


def step_fn(stage, phases: Sequence[Phase]) -> Callable:
  """``(state, frozen, batch) -> (state, metrics)`` of the whole phase list."""
  run = compose(stage, phases)

  def step(state, frozen, batch):
    carry = run(frozen, batch, StepCarry(state=state))
    return carry.state, carry.metrics

  return step


def bucket_widths(n: int, buckets: int) -> tuple[int, ...]:
  """The response widths of ``rollout.length_buckets``: ``ceil(n / buckets) x 1..buckets``,
  capped at ``n`` (``()`` when off)."""
  if buckets <= 0:
    return ()
  step = -(-n // buckets)
  return tuple(sorted({min(n, step * i) for i in range(1, buckets + 1)}))


@functools.partial(jax.jit, static_argnames=("n",))
def _extent(mask_BT, n: int):
  """The response slots any row still uses: its last real token's column after the prompt,
  + 1 (``mask_BT`` covers the actions and, in an episode, the observations between them)."""
  return jnp.max(jnp.where(mask_BT[:, -n:], jnp.arange(1, n + 1), 0))


@functools.partial(jax.jit, static_argnames=("width",))
def _cut(rollout: Rollout, width: int) -> Rollout:
  def cut(name, x):
    if x is None:
      return None
    if name.endswith("_BT"):
      return x[:, :x.shape[1] - rollout.response_mask_BN.shape[1] + width]
    if name.endswith("_BN"):
      return x[:, :width]
    return x
  return rollout.replace(**{f.name: cut(f.name, getattr(rollout, f.name))
                            for f in dataclasses.fields(rollout)})


def trim_rollout(rollout: Rollout, widths: Sequence[int]) -> tuple[Rollout, int]:
  """``rollout`` cut to the smallest of ``widths`` that holds every row's response (the
  columns cut are masked in every row), and that width.  Every later phase reads a response
  width from its arrays, so the step is the same up to float rounding; the sum-normalised
  loss aggregation keeps ``max_new_tokens`` as its constant."""
  need = int(jax.device_get(_extent(rollout.mask_BT, rollout.response_mask_BN.shape[1])))
  width = next((w for w in widths if w >= need), widths[-1])
  if width == rollout.response_mask_BN.shape[1]:
    return rollout, width
  return _cut(rollout, width), width


def trim_prompts(batch: dict, widths: Sequence[int]) -> dict:
  """A host batch of left-padded prompts (``prompt``, ``prompt_mask`` ``[b, P]``) cut to the
  smallest of ``widths`` that holds its longest prompt (only padding columns are cut; the
  positions come from the mask, so the model sees the same sequences)."""
  if not widths:
    return batch
  mask = np.asarray(batch["prompt_mask"], bool)
  P = mask.shape[1]
  used = mask.any(axis=0)
  need = P - int(np.argmax(used)) if used.any() else 1
  width = next((w for w in widths if w >= need), P)
  if width >= P:
    return batch
  return {**batch, "prompt": np.asarray(batch["prompt"])[:, P - width:],
          "prompt_mask": mask[:, P - width:]}


def cut_rollout(stage, carry: StepCarry, *, widths: Sequence[int],
                pack: bool) -> tuple[StepCarry, dict]:
  """The host's work where the step is cut after generation: the rollout trimmed to a length
  bucket (``widths``: :func:`trim_rollout`) and, with ``pack``, the packed layouts of the
  later model passes planned from its mask and the state's key (:func:`packed.plan`);
  ``(carry, metrics)``.  The colocated phased step and both pools run it."""
  metrics = {}
  if widths:
    ro, width = trim_rollout(carry.rollout, widths)
    carry = carry.replace(rollout=ro)
    metrics["rollout/update_width"] = float(width)
  if pack:
    packing, got = packed.plan(stage, to_host(carry.rollout.mask_BT), carry.state.rng)
    carry = carry.replace(packing=packing)
    metrics.update(got)
  return carry, metrics


def cuts_at_host(stage) -> bool:
  """Whether the step is cut after generation for the host's own work (length buckets or
  packing: :func:`cut_rollout`), host rewards aside."""
  ro = stage.cfg.rollout
  return bool(ro.length_buckets or ro.pack)


@dataclasses.dataclass(frozen=True)
class Part:
  """One device program of a step, in order: ``name`` is what its time is reported as
  (``time/phase/NAME_s``: ``step`` for the one-program step, a timing group, or ``generate``
  and ``score_and_update`` around a host split), ``fn`` the jitted program, ``host_scores``
  whether its carry holds the host reward's scores (it runs after the host split)."""

  name: str
  fn: Callable
  host_scores: bool = False


def parts(step_fn) -> list[Part]:
  """The device programs of a step the trainer runs (what ``Stage.make_step_fn`` returns),
  for the planner to lower on abstract arrays: the one-program step, or a
  :class:`PhasedProgram`'s programs."""
  if isinstance(step_fn, PhasedProgram):
    return step_fn.programs()
  return [Part("step", step_fn)]


class PhasedProgram:
  """The step as several jitted programs: around a host reward, or each timing group timed.

  ``timed=False`` with a host reward gives two programs (``time/phase/generate_s`` for the
  first, ``score_and_update_s`` for the second, as before); ``timed=True`` one per group.
  With ``rollout.length_buckets`` the step is cut after generation as around a host reward,
  and the rollout trimmed there (:func:`trim_rollout`); jit compiles the later programs once
  per width.  With ``rollout.pack`` the packed layouts are made there (after any trim), and
  the later programs compiled once per (width, row counts).
  """

  LABELS = {"before_host": "generate", "after_host": "score_and_update"}

  def __init__(self, stage, phases, state, *, host_fn=None, rollout_fn=None, timed: bool):
    """``rollout_fn(state, frozen, batch, carry) -> (carry, metrics)``, when given, runs the
    generate phase on the host instead (multi-turn episodes: jitted decode segments between
    environment steps); the step is then cut after it as around a host reward."""
    self.stage = stage
    self.timed = timed
    self.host_fn = host_fn
    self.rollout_fn = rollout_fn
    rcfg = stage.cfg.rollout
    self.widths = bucket_widths(rcfg.max_new_tokens, rcfg.length_buckets)
    self.pack = rcfg.pack
    self.parts = split(phases, at_host=host_fn is not None or rollout_fn is not None
                       or cuts_at_host(stage), timed=timed)
    self.on_host = {label for label, ps in self.parts
                    if rollout_fn is not None and [p.name for p in ps] == ["generate"]}
    self.jitted = {label: jit_phases(stage, ps, state)
                   for label, ps in self.parts if label != HOST and label not in self.on_host}
    self.timer = PhaseTimer()

  def __call__(self, state, frozen, batch):
    timer = self.timer
    timer.start_step()
    host = given = batch.get("host")
    batch = {k: v for k, v in batch.items() if k != "host"}  # the device arrays only
    carry = StepCarry(state=state)
    host_metrics: dict = {}
    for label, _ in self.parts:
      name = label if self.timed else self.LABELS.get(label, label)
      if label in self.on_host:
        with timer.phase(name):
          carry, got = self.rollout_fn(carry.state, frozen, batch, carry, host)
        host_metrics.update(got)
        continue
      if label == HOST:
        carry, got = cut_rollout(self.stage, carry, widths=self.widths, pack=self.pack)
        host_metrics.update(got)
        if self.host_fn is None:
          continue
        with timer.phase(HOST):
          carry, got = host_reward(self.stage, carry, host, self.host_fn)
        host_metrics.update(got)
        continue
      carry = timer.run(name, self.jitted[label], frozen, batch, carry)
    if given is not None and given.samples is not None:  # logging.samples_every
      given.samples.extend(rollout_samples(self.stage, carry, given))
    return carry.state, {**carry.metrics, **host_metrics, **timer.end_step()}

  def programs(self) -> list[Part]:
    """Each device program, in order (:class:`Part`: for the planner)."""
    labels = [lab for lab, _ in self.parts]
    host = HOST in labels and self.host_fn is not None
    return [Part(lab if self.timed else self.LABELS.get(lab, lab), self.jitted[lab],
                 host_scores=host and labels.index(lab) > labels.index(HOST))
            for lab in labels if lab in self.jitted]


def host_reward(stage, carry: StepCarry, host, host_fn) -> tuple[StepCarry, dict]:
  """The host reward between two programs: ``host_fn(responses, host)`` on the rollout's
  response tokens and the examples behind its prompts, added to any host scores already in
  the carry (an environment's returns); ``(carry with host_score_B, metrics)``.  Only the
  tokens come to the host (gathered from every process on a multi-process mesh; each scores
  the whole batch, and the scores go back as one global array)."""
  index = carry.rollout.prompt_index_B
  if index is not None:  # refill: the trained groups' prompts, in completion order
    host = host.take(to_host(index)[::stage.n])
  ro = carry.rollout
  scores, got = host_fn(to_host(ro.tokens_BT)[:, ro.prompt_len:], host)
  if carry.host_score_B is not None:  # an environment's returns are host scores too
    scores = to_host(carry.host_score_B) + scores
  scores = np.asarray(scores, np.float32)
  return carry.replace(host_score_B=put_global(scores, ro.lengths_B.sharding)), got


def pool_programs(phases: Sequence[Phase], pool: str, *,
                  cut_at_host: bool = False) -> list[list[Phase]]:
  """The programs a pool of a disaggregated run compiles: its phases (``both`` phases run in
  each pool), cut wherever it must exchange data with the other pool between them: before a
  phase that follows the other pool's work, and before a phase both pools run (the other pool
  needs what this one has computed so far); with ``cut_at_host``, also at :data:`HOST`
  (:func:`cut_rollout` runs there)."""
  phases = [p for p in phases if p.name != HOST or cut_at_host]
  out: list[list[Phase]] = []
  prev = None
  for i, p in enumerate(phases):
    if p.name == HOST or p.pool not in (pool, "both"):
      continue
    cut = prev is None or prev != i - 1 or (p.pool == "both" and phases[prev].pool != "both")
    if cut:
      out.append([])
    out[-1].append(p)
    prev = i
  return out


def samples_due(logging, done: int) -> bool:
  """Whether step ``done`` (1-based) records rollout samples (``logging.samples_every``)."""
  every = logging.samples_every if logging.samples else 0
  return bool(every) and done % every == 0


def rollout_samples(stage, carry, host: HostInputs) -> list[dict]:
  """The first ``logging.samples`` rows of a step's rollout as sample rows (kind "rollout"):
  the first response of each prompt first, then the others; the reward is the row's raw
  sequence score (weighted sources, missing-EOS handling, guard), NaN before scoring.  The
  colocated step and the critic pool (which holds the rollout and its scores) both call it."""
  ro, want, n = carry.rollout, stage.cfg.logging.samples, stage.n
  if ro is None or not want:
    return []
  if ro.prompt_index_B is not None:  # refill: the trained groups' prompts, in their order
    host = host.take(to_host(ro.prompt_index_B)[::n])
  tokens = np.asarray(to_host(ro.tokens_BT))
  scores = (np.asarray(to_host(carry.scored.score_B), np.float32)
            if carry.scored is not None else np.full(len(tokens), np.nan, np.float32))
  P = ro.prompt_len
  order = sorted(range(len(tokens)), key=lambda i: (i % n, i))[:want]
  rows = []
  for i in order:
    ex = host.examples[i // n]
    rows.append({"kind": "rollout", "prompt": as_text(ex.prompt),
                 "response": stage.tok.decode(tokens[i, P:]), "reward": float(scores[i]),
                 **({"answer": ex.answer} if ex.answer else {})})
  return rows
