"""Checkpoints and resume, on orbax: nothing lost, bit-identical, reshardable.

A training run writes its checkpoints with a :class:`Checkpointer`, one per stage, under
``WORKDIR/STAGE/checkpoints/STEP/``.  Each checkpoint holds four items:

``state``   any pytree of ``jax.Array`` (step, RNG key, params and optimizer states of the
            trainable roles, KL controller, running reward statistics), saved sharded;
``extra``   JSON: everything else that decides the future of the run (data position, policy
            version, ...);
``config``  the resolved run config, as JSON, so a resume can check it still fits;
``frozen``  JSON manifest of the frozen roles, by reference to where their parameters live
            (an earlier stage's result, a Hugging Face directory, a seeded init) rather than
            a copy per save.

So a checkpoint's size is the trainable state's: with AdamW, three times the trained
parameters (the weights and two moments, in their dtypes), whatever the frozen roles weigh.
:meth:`Checkpointer.save_bytes` is what a save hands to the writer (the loop logs it and
reports it as ``checkpoint/bytes``); ``keep`` (default 2) bounds the disk to that many.

Saving is asynchronous: :meth:`Checkpointer.maybe_save` copies the arrays to host memory and
returns, and a background thread writes them, so the step that follows may donate the state.
orbax writes into ``STEP.orbax-checkpoint-tmp`` and renames it when complete, so a process
killed mid-write leaves the previous checkpoints intact and the partial one invisible (it is
removed when the next run opens the directory).

Restoring goes into an *abstract* state (``jax.ShapeDtypeStruct`` leaves with shardings), so a
run saved on one mesh resumes on another: each device reads just its own shard.

A finished stage saves its result (the parameters of its trainable roles plus its metrics) under
``WORKDIR/STAGE/final``; later stages start from it, and the pipeline skips a stage whose result
exists (:func:`stage_result_exists`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
import uuid
from collections import Counter
from typing import Any, Optional, Union

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxrlhf.config import CheckpointConfig, ConfigError, ExperimentConfig, diff, from_dict

STATE, EXTRA, CONFIG, FROZEN = "state", "extra", "config", "frozen"
_ITEMS = (STATE, EXTRA, CONFIG, FROZEN)
_RESULT = "result"
_ROLE_PREFIX = "role_"


# ------------------------------------------------------------------------------ helpers


def _say(msg: str) -> None:
  # One line per run, not one per host.
  if jax.process_index() == 0:
    print(msg, flush=True)


def _sync(name: str) -> None:
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(name)


def _to_json(value, what: str):
  """A JSON-clean copy of ``value`` (numpy / jax scalars become Python numbers); a clear
  error naming ``what`` and the key otherwise.  Checked before an async save starts, so a bad
  value fails in the training loop rather than in a background thread."""
  def clean(x, path):
    if isinstance(x, dict):
      return {str(k): clean(v, f"{path}.{k}") for k, v in x.items()}
    if isinstance(x, (list, tuple)):
      return [clean(v, f"{path}[{i}]") for i, v in enumerate(x)]
    if isinstance(x, (bool, int, float, str)) or x is None:
      return x
    if isinstance(x, (np.generic, np.ndarray, jax.Array)) and np.ndim(x) == 0:
      return np.asarray(x).item()
    raise TypeError(f"{what}{path}: {type(x).__name__} is not JSON; use numbers, strings, "
                    "lists and dicts (arrays belong in the state pytree)")
  out = clean(value, "")
  json.dumps(out)
  return out


def tree_bytes(tree) -> int:
  """The bytes of a pytree's arrays (global sizes, not per process)."""
  return int(sum(x.nbytes if hasattr(x, "nbytes") else np.asarray(x).nbytes
                 for x in jax.tree.leaves(tree)))


def checkpoint_dir(workdir: str, stage: str) -> str:
  """Where a stage's checkpoints live: ``WORKDIR/STAGE/checkpoints``."""
  return os.path.join(os.path.abspath(workdir), stage, "checkpoints")


@contextlib.contextmanager
def _read_errors(where: str, hint: str, annotate: bool = True):
  """Reading checkpoint ``where``: a file missing or cut short surfaces as whatever orbax or
  tensorstore raise; turn it into one ConfigError with ``hint`` (the fix: an earlier step).  A
  ConfigError of our own (a structure mismatch) gets the hint added when ``annotate``, since a
  damaged checkpoint can look like a changed config."""
  try:
    yield
  except ConfigError as e:
    if not annotate:
      raise
    raise ConfigError(f"{e} (if the config did not change, the checkpoint may be damaged: "
                      f"{hint})") from None
  except Exception as e:  # noqa: BLE001 - any reader failure: the file is unreadable
    reason = " ".join(str(e).split())[:200]
    raise ConfigError(f"checkpoint {where} could not be read, so it is damaged or incomplete "
                      f"(a crash or a full disk mid-write): {hint}. The reader said: "
                      f"{type(e).__name__}: {reason}") from None


def _move_aside(path: str, why: str) -> Optional[str]:
  """Renames ``path`` to ``path.WHY-TIMESTAMP`` (process 0; everyone waits); returns the new
  name.  Used instead of deleting, so a mistaken flag never destroys a run."""
  if not os.path.exists(path):
    return None
  target = f"{path}.{why}-{time.strftime('%Y%m%d-%H%M%S')}"
  if jax.process_index() == 0:
    n = 1
    while os.path.exists(target):
      n += 1
      target = f"{path}.{why}-{time.strftime('%Y%m%d-%H%M%S')}-{n}"
    os.rename(path, target)
  _sync(f"jaxrlhf_move_aside_{os.path.basename(path)}")
  return target


# ------------------------------------------------------------------------ resume policy


ResumePolicy = Union[str, int]  # "none" | "latest" | a step


def parse_resume(text: Union[str, int]) -> ResumePolicy:
  """``--resume`` as ``"none"``, ``"latest"`` or a step number; ConfigError otherwise."""
  if isinstance(text, int) and not isinstance(text, bool):
    policy = text
  else:
    low = str(text).strip().lower()
    if low in ("none", "latest"):
      return low
    try:
      policy = int(low)
    except ValueError:
      raise ConfigError(f"--resume={text!r}: use none, latest or a step number, "
                        "e.g. --resume=200") from None
  if policy < 0:
    raise ConfigError(f"--resume={text!r}: a step number must be >= 0")
  return policy


def resolve_resume(policy: ResumePolicy, available: list[int], where: str = "") -> Optional[int]:
  """The step to restore (None: start from scratch) for ``policy`` given the saved steps."""
  policy = parse_resume(policy)
  if policy == "none":
    return None
  if policy == "latest":
    return max(available) if available else None
  if policy not in available:
    listed = ", ".join(map(str, sorted(available))) if available else "none"
    raise ConfigError(f"--resume={policy}: no complete checkpoint for step {policy} in "
                      f"{where or 'the checkpoint folder'}; available steps: {listed}")
  return policy


# ------------------------------------------------------------------ config compatibility


# Model fields that do not change the saved arrays or what they mean: how the forward pass
# is computed (remat, scan, compute dtype) and how parameters were first created.
HARMLESS_MODEL_FIELDS = frozenset({"remat", "scan_layers", "compute_dtype", "init_std", "hf_path"})
_MODEL_SECTIONS = ("model", "reward_model", "value_model", "guard_model")

# Outside the model sections: fields that change the state's structure, the meaning of the
# saved data position, or the identity of the run.
BREAKING_FIELDS = frozenset({
    "stages", "seed",
    "sft.batch_size", "rm.batch_size", "ppo.batch_size", "ppo.num_samples", "grpo.batch_size",
    "grpo.num_samples", "dpo.batch_size", "ppo.shared_backbone",
    "sft.optim.grad_accum", "rm.optim.grad_accum", "ppo.optim.grad_accum",
    "ppo.value_optim.grad_accum", "grpo.optim.grad_accum", "dpo.optim.grad_accum",
    "data.task", "data.digits", "data.seed", "data.tokenizer", "data.prompts_path",
    "data.sft_path", "data.pairs_path", "data.max_prompt_len", "data.max_response_len",
    "data.overlong",
    # Which rows train: renamed columns, another reader, another held-out part.
    "data.fields", "data.format", "data.eval_split",
})

Change = tuple[str, Any, Any]  # (dotted field, saved value, current value)


def _resolved_roles(cfg: ExperimentConfig) -> ExperimentConfig:
  """Unset role models mean "same as model"; make that explicit so a change to ``model``
  shows up for every role that follows it, and ``None`` vs an equal copy is no change."""
  return dataclasses.replace(cfg, **{s: cfg.role_model(r) for s, r in
                                     (("reward_model", "reward"), ("value_model", "value"),
                                      ("guard_model", "guard"))})


def is_breaking(field: str) -> bool:
  """Whether a change to ``field`` makes a checkpoint unusable for the current run."""
  section, _, name = field.partition(".")
  if section in _MODEL_SECTIONS:
    return name not in HARMLESS_MODEL_FIELDS
  return field in BREAKING_FIELDS


def check_resume_config(saved: dict, current: ExperimentConfig, where: str = "") -> list[Change]:
  """Compares a checkpoint's saved config with the current one.

  Raises ConfigError naming every field whose change breaks resume (model shapes, batch
  sizes, stages, data, seed); returns the harmless changes (logging, checkpoint cadence,
  steps, mesh, hyper-parameters) for the caller to report.
  """
  old = _resolved_roles(from_dict(ExperimentConfig, saved))
  changes = diff(old, _resolved_roles(current))
  breaking = [c for c in changes if is_breaking(c[0])]
  if breaking:
    listed = "; ".join(f"{f}: {a!r} -> {b!r}" for f, a, b in breaking)
    raise ConfigError(
        f"cannot resume from {where or 'the checkpoint'}: the config differs in ways that change "
        f"the saved state or data order ({listed}). Use a new --workdir for the new config, or "
        "--resume=none to start over in this one (its checkpoints are moved aside, not deleted)")
  return changes


def format_changes(changes: list[Change]) -> str:
  """The allowed config changes as one printable line per field."""
  return "\n".join(f"  {f}: {a!r} -> {b!r}" for f, a, b in changes)


# --------------------------------------------------------------------------- checkpointer


@dataclasses.dataclass(frozen=True)
class ResumePoint:
  """What :meth:`Checkpointer.resume` restored."""

  step: int
  state: Any
  extra: dict
  frozen: dict
  changes: list  # harmless config changes since the checkpoint, as (field, old, new)


class Checkpointer:
  """Periodic, asynchronous checkpoints of one training stage, and their restore.

  ``directory``: the stage's checkpoint folder (see :func:`checkpoint_dir`).
  ``run_config``: the resolved run config as a dict (``config.to_dict``); saved with every
  checkpoint.  ``frozen``: manifest of frozen roles -> source (see :func:`frozen_source`).

  Every process of a multi-process run must make the same calls (orbax saves collectively).
  """

  def __init__(self, directory: str, cfg: CheckpointConfig, run_config: dict,
               frozen: Optional[dict] = None, clock=time.monotonic):
    if cfg.keep < 1:
      raise ConfigError(f"checkpoint.keep={cfg.keep}: keep at least 1 checkpoint")
    if cfg.every_steps < 0 or cfg.every_seconds < 0:
      raise ConfigError("checkpoint.every_steps and checkpoint.every_seconds must be >= 0 "
                        "(0 turns that trigger off)")
    self.directory = os.path.abspath(directory)
    self.cfg = cfg
    self._run_config = _to_json(run_config, "run_config")
    self._frozen = _to_json(frozen or {}, "frozen")
    self._clock = clock  # injectable so tests can drive every_seconds
    self._last_save_time = clock()
    self._manager = self._open()

  def _open(self) -> ocp.CheckpointManager:
    cfg = self.cfg
    keep_latest = ocp.checkpoint_managers.LatestN(n=cfg.keep)
    best_fn = None
    policy = keep_latest
    if cfg.best_metric:
      name = cfg.best_metric
      best_fn = lambda m: float(m[name])  # noqa: E731
      # The last K plus the single best: orbax's own best_fn + max_to_keep would keep the top K
      # by the metric instead, dropping the newest checkpoints of a run whose metric dipped.
      policy = ocp.checkpoint_managers.AnyPreservationPolicy([
          keep_latest,
          ocp.checkpoint_managers.BestN(get_metric_fn=best_fn, reverse=cfg.best_mode == "min",
                                        n=1, keep_checkpoints_without_metrics=False)])
    options = ocp.CheckpointManagerOptions(
        preservation_policy=policy, best_fn=best_fn, best_mode=cfg.best_mode,
        enable_async_checkpointing=cfg.async_save, cleanup_tmp_directories=True,
        create=True)
    return ocp.CheckpointManager(self.directory, options=options, item_names=_ITEMS)

  # ----------------------------------------------------------------------------- queries

  def all_steps(self) -> list[int]:
    """Steps with a complete checkpoint, ascending."""
    return sorted(self._manager.all_steps())

  def latest_step(self) -> Optional[int]:
    return self._manager.latest_step()

  def best_step(self) -> Optional[int]:
    """The step with the best ``best_metric`` (the latest step when none is tracked)."""
    return self._manager.best_step()

  # ------------------------------------------------------------------------------- save

  def due(self, step: int, *, force: bool = False) -> bool:
    """Whether :meth:`maybe_save` of ``step`` would save now (``force``: whatever the
    cadence); a caller that asks first then saves with :meth:`save_now`."""
    return (self.cfg.enabled and (force or self._due(step))
            and step not in self._manager.all_steps())

  def save_bytes(self, state, extra: Optional[dict] = None) -> int:
    """What a save of ``state`` and ``extra`` writes: the arrays and the JSON items."""
    return tree_bytes(state) + sum(len(json.dumps(x)) for x in (
        _to_json(extra or {}, "extra"), self._run_config, self._frozen))

  def _due(self, step: int) -> bool:
    by_steps = self.cfg.every_steps > 0 and step % self.cfg.every_steps == 0
    by_time = (self.cfg.every_seconds > 0 and
               self._clock() - self._last_save_time >= self.cfg.every_seconds)
    if self.cfg.every_seconds > 0 and jax.process_count() > 1:
      # Clocks differ between hosts; process 0 decides so every host saves the same steps.
      from jax.experimental import multihost_utils
      by_time = bool(multihost_utils.broadcast_one_to_all(np.asarray(by_time)))
    return by_steps or by_time

  def maybe_save(self, step: int, state, extra: Optional[dict] = None,
                 metrics: Optional[dict] = None, *, force: bool = False) -> bool:
    """Saves ``state`` and ``extra`` as checkpoint ``step`` when one is due (every
    ``every_steps`` steps and/or ``every_seconds`` seconds) or ``force``; returns whether it
    started a save.

    ``step`` counts the updates already applied to ``state``; resuming from it runs step + 1
    next.  ``extra`` is JSON (data position, policy version, ...).  ``metrics`` (host numbers)
    are used only for ``best_metric``: pass this step's metrics, eval results included, so
    the checkpoint can be ranked.  Asynchronous with ``async_save``: on return the arrays are
    copied and ``state`` may be donated; call :meth:`wait` before reading the files.
    """
    if not self.due(step, force=force):  # a step already saved: e.g. the final forced one
      return False
    extra = _to_json(extra or {}, "extra")
    ranked = None
    if self.cfg.best_metric and metrics is not None and self.cfg.best_metric in metrics:
      value = float(np.asarray(metrics[self.cfg.best_metric]))
      # A NaN would sort arbitrarily; such a checkpoint is kept as one of the latest only.
      ranked = {self.cfg.best_metric: value} if np.isfinite(value) else None
    args = ocp.args.Composite(**{
        STATE: ocp.args.StandardSave(state), EXTRA: ocp.args.JsonSave(extra),
        CONFIG: ocp.args.JsonSave(self._run_config), FROZEN: ocp.args.JsonSave(self._frozen)})
    self._manager.save(step, args=args, metrics=ranked, force=True)
    self._last_save_time = self._clock()
    return True

  def save_now(self, step: int, state, extra: Optional[dict] = None,
               metrics: Optional[dict] = None) -> bool:
    """A save regardless of the cadence (preemption, the end of a stage, a failing run);
    still asynchronous: :meth:`wait` or :meth:`close` before exiting."""
    return self.maybe_save(step, state, extra, metrics, force=True)

  def wait(self) -> None:
    """Blocks until every started save is complete on disk."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for pending saves and releases orbax's threads."""
    self._manager.wait_until_finished()
    # orbax starts clearing earlier runs' temporary folders in a thread when the manager is
    # made, and waits for it only at the first save: a run refused before saving (a bad
    # weights file) exited under it, and the interpreter's shutdown printed its traceback.
    await_cleanup = getattr(self._manager, "_maybe_await_cleanup_tmp_directory", None)
    if await_cleanup is not None:
      await_cleanup()
    self._manager.close()

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # ---------------------------------------------------------------------------- restore

  def _pick(self, step: Optional[int]) -> int:
    steps = self.all_steps()
    if step is None:
      if not steps:
        raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
      return steps[-1]
    return resolve_resume(step, steps, self.directory)

  def _read_json(self, step: int, item: str) -> dict:
    if not os.path.isdir(os.path.join(self.directory, str(step), item)):
      return {}  # written by an older version without this item
    out = self._manager.restore(step, args=ocp.args.Composite(**{item: ocp.args.JsonRestore()}))
    return dict(out[item] or {})

  def saved_config(self, step: Optional[int] = None) -> dict:
    """The run config saved with a checkpoint (default: the latest)."""
    return self._read_json(self._pick(step), CONFIG)

  def saved_frozen(self, step: Optional[int] = None) -> dict:
    """The frozen-roles manifest saved with a checkpoint (default: the latest)."""
    return self._read_json(self._pick(step), FROZEN)

  def restore(self, abstract_state, step: Optional[int] = None) -> tuple[Any, dict]:
    """``(state, extra)`` of checkpoint ``step`` (default: the latest).

    ``abstract_state`` is a pytree of ``jax.ShapeDtypeStruct`` with ``sharding=`` set, the
    same structure the state was saved with; every leaf comes back on its sharding, whatever
    mesh the checkpoint was written from.
    """
    step = self._pick(step)
    self._say_conversions(step, abstract_state)
    legacy = self._legacy_extras(step, abstract_state)
    target = abstract_state.replace(extras=abstract_state.extras.legacy_layout()) if (
        legacy) else abstract_state
    args = ocp.args.Composite(**{STATE: ocp.args.StandardRestore(target),
                                 EXTRA: ocp.args.JsonRestore()})
    try:
      out = self._manager.restore(step, args=args)
    except ValueError as e:
      # orbax lists the mismatching leaves; keep that, and say what to do.
      raise ConfigError(
          f"checkpoint {self.directory}/{step} does not fit the training state built from the "
          f"current config: {str(e).strip()[:2000]}\nUse a new --workdir for this config, or "
          "--resume=none to start over") from e
    state = out[STATE]
    if legacy:
      state = state.replace(extras=type(abstract_state.extras).from_legacy(state.extras))
    return _checked(state, abstract_state, f"{self.directory}/{step}"), dict(out[EXTRA] or {})

  def _legacy_extras(self, step: int, abstract_state) -> bool:
    """Whether checkpoint ``step`` keeps the train state's extras in the dict layout of
    jaxrlhf before the typed extras (``Extras.legacy_layout``): read, then typed."""
    legacy = getattr(getattr(abstract_state, "extras", None), "LEGACY_SKIPS", None)
    if legacy is None:
      return False
    saved = (self._saved_tree(step) or {}).get("extras")
    return isinstance(saved, dict) and legacy[0] in saved

  def _saved_tree(self, step: int) -> Optional[dict]:
    """The metadata tree (shapes, dtypes) of checkpoint ``step``'s train state, read from its
    files (the manager knows the item's handler only after a save or restore in this
    process), or None when there is none to read: restore then reports what it finds."""
    try:
      meta = ocp.StandardCheckpointer().metadata(os.path.join(self.directory, str(step), STATE))
    except Exception:  # noqa: BLE001
      return None
    tree = getattr(getattr(meta, "item_metadata", meta), "tree", None)
    return tree if isinstance(tree, dict) else None

  def _say_conversions(self, step: int, abstract_state) -> None:
    """One line when arrays are restored in another dtype than they were saved in: a
    checkpoint of bfloat16 weights and moments (``optim.precision=pure_bf16``, or any run
    before mixed precision existed) resumed with float32 masters, or the other way round."""
    tree = self._saved_tree(step)
    if tree is None:
      return
    saved = Counter(str(x.dtype) for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))
    wanted = Counter("uint32" if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key)  # as saved
                     else str(a.dtype) for a in jax.tree.leaves(abstract_state))
    gone, new = saved - wanted, wanted - saved
    if gone:
      _say(f"checkpoint {self.directory}/{step}: {sum(gone.values())} arrays saved in "
           f"{', '.join(sorted(gone))} are restored in {', '.join(sorted(new))}, as the current "
           "config keeps them (optim.precision or moment_dtype differs from the saved run's; "
           "float32 masters from bfloat16 are exact, the other way rounds)")

  def resume(self, abstract_state, policy: ResumePolicy,
             current: ExperimentConfig) -> Optional[ResumePoint]:
    """What a training loop calls at start: applies ``--resume`` and returns the restored
    point, or None to start from scratch.

    ``latest`` continues from the newest complete checkpoint (None if there is none).  A step
    number continues from that step; newer checkpoints (the abandoned continuation) are moved
    to ``DIR.abandoned-TIME``.  ``none`` starts over; existing checkpoints are moved to
    ``DIR.replaced-TIME``.  The saved config is checked against ``current`` first.
    """
    steps = self.all_steps()
    step = resolve_resume(policy, steps, self.directory)
    if step is None:
      if steps and parse_resume(policy) == "none":
        self._manager.close()
        moved = _move_aside(self.directory, "replaced")
        self._manager = self._open()
        _say(f"--resume=none: starting over; the previous checkpoints are in {moved}")
      return None
    where = f"{self.directory}/{step}"
    older = [s for s in steps if s < step]
    damaged = (f"resume from an earlier checkpoint with --resume={older[-1]} (kept: "
               f"{', '.join(map(str, steps))})" if older else
               "it is the only checkpoint: --resume=none starts the stage over")
    with _read_errors(where, damaged, annotate=False):
      changes = check_resume_config(self.saved_config(step), current, where)
    if changes:
      _say(f"resuming from {where} with config changes:\n{format_changes(changes)}")
    newer = [s for s in steps if s > step]
    if newer:
      self._abandon(newer)
    with _read_errors(where, damaged):
      state, extra = self.restore(abstract_state, step)
      frozen = self.saved_frozen(step)
    _say(f"resumed from {where}")
    return ResumePoint(step=step, state=state, extra=extra, frozen=frozen, changes=changes)

  def _abandon(self, steps: list[int]) -> None:
    # Continuing from an older step would collide with these; keep them, out of the way.
    target = f"{self.directory}.abandoned-{time.strftime('%Y%m%d-%H%M%S')}"
    if jax.process_index() == 0:
      os.makedirs(target, exist_ok=True)
      for s in steps:
        os.rename(os.path.join(self.directory, str(s)), os.path.join(target, str(s)))
    _sync("jaxrlhf_abandon_steps")
    self._manager.reload()
    _say(f"checkpoints after the resumed step ({', '.join(map(str, steps))}) moved to {target}")


def _checked(restored, abstract, where: str):
  """``restored`` with every leaf checked against ``abstract``: orbax checks shapes of saved
  jax arrays, but hands numpy leaves back as stored, whatever was asked for.  Host leaves are
  placed on the requested sharding."""
  bad = []

  def one(path, x, a):
    dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype  # Python scalars
    if tuple(np.shape(x)) != tuple(a.shape) or dtype != a.dtype:
      bad.append(f"{jax.tree_util.keystr(path)}: saved {dtype}{list(np.shape(x))}, "
                 f"wanted {a.dtype}{list(a.shape)}")
      return x
    sharding = getattr(a, "sharding", None)
    if not isinstance(x, jax.Array) and sharding is not None:
      return jax.device_put(x, sharding)
    return x

  out = jax.tree_util.tree_map_with_path(one, restored, abstract)
  if bad:
    raise ConfigError(f"checkpoint {where} does not fit the training state built from the current "
                      f"config: {'; '.join(bad[:20])}. Use a new --workdir for this config, or "
                      "--resume=none to start over")
  return out


# --------------------------------------------------------------------------- stage results


def stage_result_dir(workdir: str, stage: str) -> str:
  """Where a finished stage's result lives: ``WORKDIR/STAGE/final``."""
  return os.path.join(os.path.abspath(workdir), stage, "final")


def stage_result_exists(workdir: str, stage: str) -> bool:
  """Whether ``stage`` finished in ``workdir`` (its result was completely written)."""
  path = stage_result_dir(workdir, stage)
  # orbax renames the folder into place only once everything is written.
  return os.path.isdir(os.path.join(path, _RESULT))


def save_stage_result(workdir: str, stage: str, params_by_role: dict, metrics: dict) -> dict:
  """Saves a finished stage's trainable parameters (role -> params pytree) and final metrics;
  returns the result's info (``stage``, ``roles``, ``metrics``, ``id``).  Overwrites an
  earlier result of the same stage (a rerun with ``--resume=none``)."""
  if not params_by_role:
    raise ValueError(f"save_stage_result({stage!r}): no roles to save")
  info = {"stage": stage, "roles": sorted(params_by_role), "metrics": _to_json(metrics, "metrics"),
          # A fresh id per save: a checkpoint that refers to this result can tell if the stage
          # was rerun since (and its frozen copy would silently differ).
          "id": uuid.uuid4().hex, "time": time.time()}
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    info["id"] = "".join(chr(c) for c in multihost_utils.broadcast_one_to_all(
        np.frombuffer(info["id"].encode(), np.uint8)).tolist())
  args = {_ROLE_PREFIX + role: ocp.args.StandardSave(p) for role, p in params_by_role.items()}
  args[_RESULT] = ocp.args.JsonSave(info)
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
    ckptr.save(stage_result_dir(workdir, stage), args=ocp.args.Composite(**args), force=True)
  return info


def stage_result_info(workdir: str, stage: str) -> dict:
  """The info saved with a stage's result; ConfigError naming the folder if it is missing."""
  path = stage_result_dir(workdir, stage)
  if not stage_result_exists(workdir, stage):
    raise ConfigError(f"stage {stage!r} has no result in {path}; run that stage first "
                      f"(add it to stages) or point --workdir at the run that has it")
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
    return dict(ckptr.restore(path, args=ocp.args.Composite(
        **{_RESULT: ocp.args.JsonRestore()}))[_RESULT])


def load_stage_result(workdir: str, stage: str, abstract_params_by_role: dict) -> dict:
  """The parameters of the requested roles of a finished stage, restored into the given
  abstract trees (ShapeDtypeStructs with shardings, for the current mesh)."""
  info = stage_result_info(workdir, stage)
  missing = sorted(set(abstract_params_by_role) - set(info["roles"]))
  if missing:
    raise ConfigError(f"stage {stage!r} result in {stage_result_dir(workdir, stage)} has roles "
                      f"{info['roles']}, not {missing}")
  args = {_ROLE_PREFIX + r: ocp.args.StandardRestore(a) for r, a in abstract_params_by_role.items()}
  try:
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
      out = ckptr.restore(stage_result_dir(workdir, stage), args=ocp.args.Composite(**args))
  except ValueError as e:
    raise ConfigError(f"stage {stage!r} result in {stage_result_dir(workdir, stage)} does not fit "
                      f"the current model config: {str(e).strip()[:2000]}") from e
  return {r: _checked(out[_ROLE_PREFIX + r], a, f"{stage_result_dir(workdir, stage)} ({r})")
          for r, a in abstract_params_by_role.items()}


# --------------------------------------------------------------------------- frozen roles


def frozen_source(workdir: str, stage: str, role: str) -> dict:
  """A manifest entry for a frozen role whose parameters are ``role`` of ``stage``'s result,
  e.g. the PPO reference is ``frozen_source(workdir, "sft", "policy")``.  It records the
  result's id, so a resume notices when that stage was rerun since."""
  info = stage_result_info(workdir, stage)
  if role not in info["roles"]:
    raise ConfigError(f"stage {stage!r} result has roles {info['roles']}, not {role!r}")
  return {"stage": stage, "role": role, "id": info["id"]}


def load_frozen(workdir: str, source: dict, abstract_params) -> Any:
  """Loads a frozen role from its manifest entry (see :func:`frozen_source`)."""
  info = stage_result_info(workdir, source["stage"])
  if source.get("id") and info["id"] != source["id"]:
    raise ConfigError(
        f"the {source['stage']!r} result in {stage_result_dir(workdir, source['stage'])} was "
        "rewritten after this checkpoint was taken, so the frozen role it refers to has changed; "
        "use --resume=none to restart this stage from the new result")
  return load_stage_result(workdir, source["stage"], {source["role"]: abstract_params})[
      source["role"]]
