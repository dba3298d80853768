"""Runs an experiment's stages in order (e.g. SFT -> RM -> PPO): each stage starts from the
roles earlier stages produced, checkpoints as it goes, resumes where a stopped run left off,
and the run ends with a summary table.

On disk (see docs/checkpointing.md): ``WORKDIR/STAGE/checkpoints/STEP`` while a stage trains,
``WORKDIR/STAGE/final`` once it has finished.  Rerunning the same command continues the first
unfinished stage from its latest checkpoint and loads the results of the finished ones instead
of training them again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from typing import Optional

import jax
from absl import flags
from absl import logging as absl_logging

from jaxrlhf import checkpoint as ckpt
from jaxrlhf import hardware, perf, report
from jaxrlhf.config import ConfigError, ExperimentConfig, to_dict, to_json, validate
from jaxrlhf.data import DataSource
from jaxrlhf.mesh import make_mesh, resolve_mesh_shape
from jaxrlhf.model import hf
from jaxrlhf.metrics import MetricsWriter, run_files
from jaxrlhf.preemption import PreemptionHandler
from jaxrlhf.train import evaluate, spec
from jaxrlhf.train.driver import TrainingError
from jaxrlhf.train.loop import run_stage
from jaxrlhf.train.preflight import preflight
from jaxrlhf.train.work import step_work

@dataclasses.dataclass(frozen=True)
class StageOutcome:
  """What a stage hands on: its roles' parameters, its summary rows and its result's id."""

  outputs: dict  # role -> params
  summary: dict  # {"NAME": {...}, "NAME/start": {...}}
  result_id: Optional[str]  # None when the stage stopped early
  stopped: bool = False


def run(cfg: ExperimentConfig, workdir: str, resume: str = "latest", profile_steps=None) -> int:
  """Trains every stage of ``cfg`` in ``workdir``; returns the process exit status (0 also
  when a signal stopped the run after writing a checkpoint, 1 when training failed)."""
  quiet_library_logs()  # before jax's backends start (a missing-TPU line at INFO is noise)
  # Before jax starts its threads: the host allocator ($JAXRLHF_MALLOC), and compiled programs
  # kept on disk ($JAXRLHF_COMPILATION_CACHE, "off" to disable): every run of a configuration
  # after the first skips compilation.
  perf.configure_process()
  # The checkpoints' architectures (model.hf_path ...), padded for this mesh, before any check
  # sees the config: what config.json records is what trains.
  cfg = resolve_for_devices(cfg)
  validate(cfg)  # every stage's settings, before the first stage trains
  preflight(cfg)  # the wrong-machine guard: fail in seconds, before allocating anything
  policy = ckpt.parse_resume(resume)
  profiler = perf.ProfileWindow(profile_steps, workdir)  # a bad flag fails before any work
  os.makedirs(workdir, exist_ok=True)
  with config_file(workdir, cfg) as written:
    return train_all(cfg, workdir, policy, profiler, written)


def resolve_for_devices(cfg: ExperimentConfig) -> ExperimentConfig:
  """``cfg`` with every role's architecture read from its ``hf_path`` and the vocabulary padded
  for the tensor-parallel size of the mesh the devices present form (``mesh.tp=-1`` is only
  known here; a mesh that does not fit them pads for ``mesh.tp``, and make_mesh says why
  later)."""
  try:
    tp = resolve_mesh_shape(cfg.mesh, jax.device_count())["tp"]
  except ConfigError:
    tp = None
  return hf.resolve_models(cfg, tp)


@contextlib.contextmanager
def config_file(workdir: str, cfg: ExperimentConfig):
  """``WORKDIR/config.json`` is this run's config while it runs; a run refused for its settings
  (a mesh the devices cannot form, checkpoints it cannot resume) before any stage trained puts
  back the file that describes the folder's checkpoints.  Yields a dict whose ``"trained"`` the
  run sets once a stage starts training under this config."""
  path = os.path.join(workdir, "config.json")
  previous = None
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      previous = f.read()
  with open(path, "w", encoding="utf-8") as f:
    f.write(to_json(cfg))
  written = {"trained": False}
  try:
    yield written
  except ConfigError:
    if written["trained"]:
      raise
    if previous is None:
      os.remove(path)
    else:
      with open(path, "w", encoding="utf-8") as f:
        f.write(previous)
    raise


def train_all(cfg: ExperimentConfig, workdir: str, policy, profiler, written: dict) -> int:
  """The stages of :func:`run`, in order, each resumed or skipped as its folder says."""
  mesh = make_mesh(cfg.mesh)  # cfg's vocabularies are padded for it (resolve_for_devices)
  data = DataSource(cfg.data, cfg.seed)
  # Every stage is built and checked against the data up front (construction allocates
  # nothing): reward sources and answers, tokenizer against vocabulary, stop rules of a late
  # stage stop the run before the first stage trains.
  stages = [spec.build_stage(name, cfg, mesh, data) for name in cfg.stages]
  for stage in stages:
    stage.spec.validate(cfg, data)
  spec.check_packing(cfg)
  print(f"{cfg.name}: stages {' -> '.join(cfg.stages)} on mesh {dict(mesh.shape)} "
        f"({mesh.devices.size} {mesh.devices.flat[0].platform} devices); outputs in {workdir}")
  if policy == "none":
    start_over(workdir, cfg.stages)
  accelerator = hardware.detect_accelerator()
  if accelerator is None:
    print(f"perf/mfu: {jax.devices()[0].device_kind} is not in jaxrlhf.hardware.ACCELERATORS; "
          "utilisation metrics are left out")
  else:
    print(f"perf/mfu is measured against {accelerator.describe()}")
  writer = MetricsWriter(workdir, cfg.logging, {s: getattr(cfg, s).steps for s in cfg.stages},
                         config=to_dict(cfg))
  roles: dict = {}  # role -> params, from the stages so far
  sources: dict = {}  # role -> the stage whose result it is
  inputs: dict = {}  # finished stage -> its result's id
  summary: dict = {}
  key = jax.random.key(cfg.seed)
  pending = policy  # --resume applies to the first stage that has not finished
  try:
    with PreemptionHandler() as stop:
      for i, (name, stage) in enumerate(zip(cfg.stages, stages)):
        if ckpt.stage_result_exists(workdir, name):
          outcome = load_finished(stage, workdir)
        else:
          outcome = train_stage(stage, jax.random.fold_in(key, i), roles, sources, inputs,
                                workdir=workdir, policy=pending, writer=writer,
                                profiler=profiler, stop=stop, accelerator=accelerator,
                                on_start=lambda: written.update(trained=True))
          pending = "latest"
        if outcome.stopped:
          return 0
        summary.update(outcome.summary)
        roles.update(outcome.outputs)
        sources.update({r: name for r in outcome.outputs})
        inputs[name] = outcome.result_id
        if stop.should_stop() and i + 1 < len(cfg.stages):
          print(f"stopped by {stop.signal_name or 'a stop signal'} after stage {name} finished; "
                "rerun the same command to continue with the next stage")
          return 0
    writer.finish(summary, lambda: report.report_files(workdir))
  except TrainingError as e:
    print(f"error: {e}")
    return 1
  finally:
    profiler.close()
    writer.close()
  if isinstance(pending, int):
    print(f"--resume={pending}: every stage had already finished; nothing was resumed")
  print_summary(cfg, summary, data)
  if accelerator is not None:
    summary["accelerator"] = {"name": accelerator.name, "peak_flops": accelerator.peak_flops,
                              "hbm_bandwidth": accelerator.hbm_bandwidth,
                              "measured": accelerator.measured}
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  return 0


# ---------------------------------------------------------------------------- one stage


def train_stage(stage, key, roles: dict, sources: dict, inputs: dict, *, workdir: str, policy,
                writer, profiler, stop, accelerator, on_start=lambda: None) -> StageOutcome:
  """Trains one stage, from its latest checkpoint when there is one (per ``policy``), and
  saves its result."""
  name, cfg = stage.name, stage.cfg
  t0 = time.perf_counter()
  ck = ckpt.Checkpointer(ckpt.checkpoint_dir(workdir, name), cfg.checkpoint, to_dict(cfg),
                         frozen=frozen_manifest(stage, workdir, sources))
  # Closing ck waits for the checkpoints still being written, whatever happens; the stage
  # and its evaluation release what they hold (an environment's worker threads) first.
  with ck, contextlib.ExitStack() as release:
    release.callback(stage.close)
    state, frozen, ev, start, start_eval, reached = _starting_point(
        stage, ck, key, roles, inputs, policy, writer, t0)
    release.callback(ev.close)

    def extra_fn(done: int) -> dict:
      # Batches are a pure function of the step, so the data position is the step.
      return {"data_position": done, "stage": name, "inputs": dict(inputs),
              "start_eval": start_eval}

    perf.release_host_memory()  # what set-up (and a restore) allocated and freed
    work = None
    if accelerator is not None:
      work = step_work(stage, accelerator, tp=dict(stage.mesh.shape)["tp"],
                       n_devices=stage.mesh.devices.size, n_processes=jax.process_count())
    on_start()  # from here on the stage's folder holds what this config produces
    if reached:  # the run stopped after the stage had finished early, before its result
      print(f"{name}: {reached} at step {start}; the stage ended there")
      last, end = {}, start
    else:
      state, last, stopped, end = run_stage(stage, state, frozen, writer=writer,
                                            start_step=start, checkpointer=ck,
                                            should_stop=stop.should_stop, extra_fn=extra_fn,
                                            profiler=profiler, work=work, evaluation=ev)
      if stopped:
        ck.wait()
        print(stop.message(int(jax.device_get(state.step)), ck.directory,
                           saved=cfg.checkpoint.enabled), flush=True)
        return StageOutcome({}, {}, None, stopped=True)
    ck.save_now(end, state, extra_fn(end), last)  # no-op if already saved
    final = {k: v for k, v in last.items() if k.startswith("eval/")}
    if not final and stage.eval_every:
      final = ev(state)
      if final:
        writer.write(name, end, final)
      writer.write_samples(name, end, ev.take_samples())
  summary = _summary(stage, final, last, end, start_eval, time.perf_counter() - t0)
  outputs = stage.outputs(state, frozen)
  info = ckpt.save_stage_result(workdir, name, outputs,
                                {"summary": summary, "steps": end,
                                 "config": to_dict(cfg)})
  for role, path in stage.export_adapters(state, adapter_dir(workdir, name)).items():
    print(f"{name}: {role}'s LoRA adapter (PEFT layout) in {path}; the stage's result holds "
          "the merged weights")
  return StageOutcome(outputs, summary, info["id"])


def _starting_point(stage, ck, key, roles, inputs, policy, writer, t0):
  """``(state, frozen, evaluation, start step, start evaluation, reached)``: the stage's
  latest checkpoint (per ``policy``) restored, or a fresh state evaluated before training
  (when its spec asks); ``evaluation`` is the run's :class:`Evaluation` (one per run: its
  programs compile once, for the start and for training); ``reached`` is why a restored
  stage had already ended early ("" if it had not)."""
  name, cfg = stage.name, stage.cfg
  restoring = policy != "none" and bool(ck.all_steps())
  # Restoring: the frozen roles alone, the state restored into its abstract shape (no fresh
  # state allocated to be thrown away).
  state, frozen = stage.init(key, roles, frozen_only=restoring)
  point = ck.resume(stage.abstract_init()[0] if restoring else None, policy, cfg)
  if point is None:
    if state is None:  # no complete checkpoint after all: a fresh start
      state, frozen = stage.init(key, roles)
    start_eval = {}
    ev = stage.evaluation(frozen)
    if stage.spec.eval_at_start and stage.eval_every:  # eval_every=0: no evaluation at all
      start_eval = ev(state)
      writer.write_samples(name, 0, ev.take_samples())
    return state, frozen, ev, 0, start_eval, ""
  check_inputs(point.extra, inputs, f"{ck.directory}/{point.step}")
  state, start = point.state, int(point.extra.get("data_position", point.step))
  if start > stage.steps:
    # Training on from here would do nothing and save this state as the stage's result
    # labelled with fewer steps: refuse, before anything is written.
    raise ConfigError(
        f"{name}: the checkpoint to resume, {ck.directory}/{point.step}, is at step "
        f"{start}, beyond this run's {name}.steps={stage.steps} (e.g. capped by --steps). Rerun "
        f"without --steps (or with --steps >= {start}) to finish the stage, set "
        f"--set={name}.steps={start} to end it at that checkpoint, or pass --resume=STEP "
        f"(steps kept: {', '.join(map(str, ck.all_steps()))}), or --resume=none to train "
        "every stage again")
  print(f"{name}: continuing after step {start} of {stage.steps} "
        f"(set up and restored in {time.perf_counter() - t0:.1f}s)")
  return (state, frozen, stage.evaluation(frozen), start, point.extra.get("start_eval", {}),
          point.extra.get("target_reached", ""))


def _summary(stage, final: dict, last: dict, end: int, start_eval: dict, seconds: float):
  """The stage's lines of the run's summary (and its result's metrics)."""
  name = stage.name
  summary = {name: {**final, "time_s": seconds, "steps": end,
                    # only for a stage that ended at its target (stop rule), before its steps
                    **({"target_reached": stage.stop_rule()} if end < stage.steps else {}),
                    **({"kl/mean": last["kl/mean"]} if "kl/mean" in last else {})}}
  if start_eval:
    summary[f"{name}/start"] = start_eval
  return summary


def adapter_dir(workdir: str, stage: str) -> str:
  """``WORKDIR/STAGE/adapters``: a LoRA stage's adapters in PEFT's layout, one folder per role."""
  return os.path.join(os.path.abspath(workdir), stage, "adapters")


RUN_ONLY_SECTIONS = ("mesh", "logging", "checkpoint", "plan", "distributed", "kernels", "pools",
                     "name", "description", "required")


def load_finished(stage, workdir: str) -> StageOutcome:
  """A finished stage's result, loaded onto the current mesh instead of training again."""
  name, cfg = stage.name, stage.cfg
  info = ckpt.stage_result_info(workdir, name)
  where = ckpt.stage_result_dir(workdir, name)
  saved = info["metrics"].get("config")
  changes = []
  if saved:
    # Only this stage's own settings and what it shares (model, data, seed) matter here:
    # adding a later stage, or changing another stage's settings, leaves its result valid.
    saved = {**saved, "stages": list(cfg.stages),
             **{s: to_dict(getattr(cfg, s)) for s in spec.names() if s != name}}
    changes = ckpt.check_resume_config(saved, cfg, where)
    # How a run is laid out, logged or checkpointed does not change a finished result: only
    # settings that would have trained it differently are worth a "not applied".
    changes = [c for c in changes if c[0].split(".")[0] not in RUN_ONLY_SECTIONS]
  abstract = stage.abstract_outputs()
  outputs = ckpt.load_stage_result(workdir, name, {r: abstract[r] for r in info["roles"]})
  note = ""
  if changes:
    note = (" (not applied to it: " + "; ".join(f"{f}: {a!r} -> {b!r}" for f, a, b in changes)
            + "; --resume=none trains every stage again)")
  print(f"{name}: finished earlier ({where}); skipped{note}")
  return StageOutcome(outputs, info["metrics"].get("summary", {}), info["id"])


def frozen_manifest(stage, workdir: str, sources: dict) -> dict:
  """Frozen role (and LoRA role's own frozen base) -> where its parameters come from, as the
  stage's layout says (:meth:`jaxrlhf.train.layout.RoleLayout.origin`): an earlier stage's
  result (by reference, with that result's id), a Hugging Face directory, or a seeded random
  init.  ``sources``: role -> the earlier stage whose result holds it."""
  def entry(row, **tag) -> dict:
    kind, where = row.origin(sources)
    if kind == "stage":
      return {**ckpt.frozen_source(workdir, sources[where], where), **tag}
    if kind == "hf":
      return {"hf_path": where, **tag}
    return {"init": "random", "seed": stage.cfg.seed, **tag}

  layout = stage.layout
  out = {r.name: entry(r, head=r.head) for r in layout.frozen.values()}
  # A LoRA role's own frozen base: the adapters in the stage's checkpoints are only
  # meaningful on top of it.
  out.update({r.base: entry(r, lora_base=r.name) for r in layout.trained.values()
              if r.owns_base})
  return out


def check_inputs(extra: dict, inputs: dict, where: str) -> None:
  """A checkpoint continues from the earlier stages' results it started from; refuses one
  whose inputs were rewritten since (e.g. SFT rerun), which would mix two runs."""
  saved = extra.get("inputs", {})
  changed = sorted(s for s in set(saved) | set(inputs) if saved.get(s) != inputs.get(s))
  if changed:
    raise ConfigError(
        f"cannot resume from {where}: it was trained on the results of stage(s) "
        f"{', '.join(changed)} as they were then, and they have been rewritten since. Use "
        "--resume=none to train every stage again, or a new --workdir")


def start_over(workdir: str, stages) -> None:
  """``--resume=none``: moves every stage's checkpoints and result aside (never deletes), and
  the run's metrics, so the new run's metrics.jsonl, TensorBoard files and W&B / MLflow runs
  hold only its own."""
  paths = [path for name in stages
           for path in (ckpt.checkpoint_dir(workdir, name), ckpt.stage_result_dir(workdir, name))]
  paths += run_files(workdir)
  # The actor and critic pools' folders of an RL stage (--role, docs/pools.md).
  paths += [os.path.join(os.path.abspath(workdir), f"{s}.{r}") for s in stages
            if spec.get(s).generates for r in ("actor", "critic")]
  moved = [ckpt._move_aside(path, "replaced") for path in paths]
  moved = [os.path.relpath(m, workdir) for m in moved if m]
  if moved:
    print(f"--resume=none: starting over; earlier checkpoints and results moved aside in "
          f"{workdir}: {', '.join(moved)}")


# ------------------------------------------------------------------------------ helpers


def quiet_library_logs() -> None:
  """orbax logs every file of every checkpoint at INFO through absl; the console is for the
  progress lines.  An explicit ``--verbosity`` still wins."""
  if "verbosity" in flags.FLAGS and flags.FLAGS["verbosity"].present:
    return
  absl_logging.set_verbosity(absl_logging.WARNING)


def print_summary(cfg: ExperimentConfig, summary: dict, data: DataSource) -> None:
  rows = []
  for name in cfg.stages:
    if name not in summary:
      continue
    s = summary[name]
    start = summary.get(f"{name}/start", {})
    # Held out or not, as the console said when the set was read (DataSource.eval_source).
    named = data.eval_name
    if "eval/accuracy" in s:
      what = ("solved (greedy episodes)" if cfg.env.name
              else evaluate.metric_label(getattr(cfg, name)))
      rows.append((f"{name}: {named('prompts', what)}", start.get("eval/accuracy"),
                   s["eval/accuracy"]))
    if "eval/loss" in s:  # SFT: the token-mean NLL of its targets (lower is better)
      per = "response token" if getattr(getattr(cfg, name), "response_only", True) else "token"
      rows.append((f"{name}: {named('sft', f'loss (per {per})')}",
                   start.get("eval/loss"), s["eval/loss"]))
    if "eval/pair_accuracy" in s:
      rows.append((f"{name}: {named('pairs', 'pair accuracy')}",
                   start.get("eval/pair_accuracy"), s["eval/pair_accuracy"]))
    if "kl/mean" in s:
      rows.append((f"{name}: KL to reference (last step)", None, s["kl/mean"]))
    configured = getattr(cfg, name).steps
    if s.get("target_reached"):
      rows.append((f"{name}: steps (target reached; of {configured})", None, s["steps"]))
    elif s.get("steps", configured) != configured:  # e.g. finished earlier under --steps
      rows.append((f"{name}: steps (of {configured} now configured)", None, s["steps"]))
    rows.append((f"{name}: wall time (s)", None, s["time_s"]))
  if not rows:
    return
  fmt = lambda v: "" if v is None else (f"{v:d}" if isinstance(v, int) else f"{v:.3f}")
  width = max(len(r[0]) for r in rows)
  print(f"\n{'summary':<{width}}  {'start':>8}  {'end':>8}")
  for label, a, b in rows:
    print(f"{label:<{width}}  {fmt(a):>8}  {fmt(b):>8}")
