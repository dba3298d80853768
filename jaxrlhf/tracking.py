"""The experiment trackers behind ``logging.sinks``: TensorBoard (written by tensorboardX),
Weights & Biases and MLflow.

Each sink has the interface of :class:`jaxrlhf.metrics.JsonlSink`: ``write(stage, step,
metrics, wall_time)``, ``write_samples(stage, step, rows, wall_time)`` (rows of generated
samples: TensorBoard text, a W&B table, an MLflow JSONL artifact), then ``finish(summary)``
when the run completed, and ``close()``.
TensorBoard keeps one run (folder) per stage; W&B and MLflow keep one run per workdir (a pool
process has its own workdir, so its own run) with each key prefixed by its stage
(``grpo/reward/mean``).

A resumed run rewrites the steps after its checkpoint.  TensorBoard is told to hide the earlier
files' points from the first rewritten step on (``purge_step``); W&B and MLflow histories cannot
be rewritten, so steps they already hold are not sent again (each sink's ``WORKDIR/*_run.json``
keeps its run id and the last step it sent per stage).

Nothing secret reaches a tracker: settings that may hold credentials (``pools.redis_url``, any
``*password*``/``*secret*`` field) are left out of the config they receive, and W&B is told not
to record the command line or the environment.

wandb and mlflow are optional extras, imported when their sink is created.
"""

from __future__ import annotations

import json
import logging
import netrc
import os
import secrets
from typing import Mapping, Optional
from urllib.parse import urlparse

import tensorboardX

# Fields left out of every tracker's copy of the config: a Redis URL can carry a password.
SECRET_FIELDS = ("redis_url",)
SECRET_WORDS = ("password", "secret", "api_key", "credential")
# TensorBoard files reach the disk at least this often (tensorboardX writes from a thread).
TENSORBOARD_FLUSH_S = 10
# MLflow's limits per request and per parameter value.
MLFLOW_MAX_METRICS, MLFLOW_MAX_PARAMS, MLFLOW_MAX_VALUE = 1000, 100, 6000


def is_secret(field: str) -> bool:
  name = field.rsplit(".", 1)[-1].lower()
  return name in SECRET_FIELDS or any(w in name for w in SECRET_WORDS)


def redact(tree):
  """A copy of a config dict without the fields :func:`is_secret` names, at any depth."""
  if isinstance(tree, Mapping):
    return {k: redact(v) for k, v in tree.items() if not is_secret(str(k))}
  return tree


def param_text(value) -> str:
  """A config value as ``--set`` takes it: ``sft,grpo`` for a tuple."""
  if isinstance(value, (tuple, list)):
    return ",".join(map(str, value))
  return str(value)


def flatten(tree: Mapping, prefix: str = "", sep: str = ".") -> dict:
  """``{"ppo": {"kl": {"coef": 0.1}}}`` -> ``{"ppo.kl.coef": 0.1}``."""
  out = {}
  for k, v in tree.items():
    key = f"{prefix}{sep}{k}" if prefix else str(k)
    if isinstance(v, Mapping) and v:
      out.update(flatten(v, key, sep))
    else:
      out[key] = v
  return out


# ------------------------------------------------------------------------------ run state


class RunState:
  """``WORKDIR/<sink>_run.json``: the tracker's run id (what a resumed run continues) and, per
  stage, the last step sent and the keys sent at that step.  Rewritten (atomically) after each
  write, so a crash leaves the last step the tracker received."""

  def __init__(self, path: str, data: dict):
    self.path, self.data = path, data
    self.data.setdefault("steps", {})

  @classmethod
  def load(cls, path: str) -> Optional["RunState"]:
    try:
      with open(path, encoding="utf-8") as f:
        return cls(path, json.load(f))
    except (FileNotFoundError, json.JSONDecodeError):
      return None

  def unsent(self, stage: str, step: int, metrics: Mapping[str, float]) -> dict:
    """The metrics of ``(stage, step)`` the tracker does not hold yet: none of a step before
    the last one sent, the new keys of that step (an evaluation record arriving apart)."""
    last = self.data["steps"].get(stage)
    if last is None or step > last["step"]:
      return dict(metrics)
    if step < last["step"]:
      return {}
    return {k: v for k, v in metrics.items() if k not in last["keys"]}

  def sent(self, stage: str, step: int, keys) -> None:
    last = self.data["steps"].get(stage)
    if last is not None and last["step"] == step:
      keys = sorted(set(last["keys"]) | set(keys))
    self.data["steps"][stage] = {"step": int(step), "keys": sorted(keys)}
    self.save()

  def save(self) -> None:
    tmp = self.path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      json.dump(self.data, f)
    os.replace(tmp, self.path)


def new_run_id() -> str:
  return secrets.token_hex(4)


# -------------------------------------------------------------------------------- samples


def samples_tag(rows) -> str:
  """``samples/KIND`` (``samples/eval``, ``samples/rollout``): where a batch of samples goes."""
  kind = next((r.get("kind") for r in rows if r.get("kind")), "") or "samples"
  return f"samples/{kind}"


def sample_text(value, width: int = 0) -> str:
  """A sample value on one line: floats as ``%.4g``, newlines as ``\\n``, and at most
  ``width`` characters (0: all) with "..." where it was cut."""
  if value is None:
    return ""
  text = f"{value:.4g}" if isinstance(value, float) else str(value)
  text = text.replace("\r", "").replace("\n", "\\n")
  if width and len(text) > width:
    text = text[:max(width - 3, 1)] + "..."
  return text


def columns_of(rows) -> list[str]:
  return list(dict.fromkeys(k for row in rows for k in row))


def markdown_table(rows) -> str:
  """Rows of samples as a Markdown table (TensorBoard's text tab renders it): one line per
  row, newlines shown as ``\\n`` and ``|`` escaped."""
  cols = columns_of(rows)
  cell = lambda v: sample_text(v).replace("|", "\\|")  # noqa: E731
  lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
  lines += ["| " + " | ".join(cell(row.get(c)) for c in cols) + " |" for row in rows]
  return "\n".join(lines)


# ---------------------------------------------------------------------------- TensorBoard


class TensorBoardSink:
  """One run per stage, ``root/<stage>/``, so TensorBoard shows stages side by side."""

  _files = 0  # event files this process opened

  def __init__(self, root: str):
    self.root = root
    self._writers: dict[str, tensorboardX.SummaryWriter] = {}

  def write(self, stage: str, step: int, metrics: Mapping[str, float], wall_time: float):
    writer = self._writer(stage, step)
    for key, value in metrics.items():
      writer.add_scalar(key, value, step, walltime=wall_time)

  def write_samples(self, stage: str, step: int, rows, wall_time: float):
    """The rows as a Markdown table under the text tag ``samples/KIND``."""
    self._writer(stage, step).add_text(samples_tag(rows), markdown_table(rows), step,
                                       walltime=wall_time)

  def _writer(self, stage: str, step: int):
    writer = self._writers.get(stage)
    if writer is None:
      logdir = os.path.join(self.root, stage)
      earlier = os.path.isdir(logdir) and any("tfevents" in n for n in os.listdir(logdir))
      # A resumed stage starts again after its checkpoint: the earlier files' points from this
      # step on are hidden, as metrics.jsonl readers keep the later record.
      # tensorboardX names a file by the second and the host only: two files opened in one
      # second (a quick resume) would be one, the later overwriting the earlier.  TensorBoard
      # reads a run's files in name order, so the count is zero-padded: ".10" after ".9".
      TensorBoardSink._files += 1
      writer = tensorboardX.SummaryWriter(logdir, purge_step=step if earlier else None,
                                          flush_secs=TENSORBOARD_FLUSH_S,
                                          filename_suffix=f".{os.getpid()}.{self._files:06d}")
      self._writers[stage] = writer
    return writer

  def finish(self, summary: Mapping, artifacts=lambda: ()):
    pass

  def close(self):
    for w in self._writers.values():
      w.close()
    self._writers = {}


# ------------------------------------------------------------------------ Weights & Biases


def wandb_has_key() -> bool:
  """Whether W&B can log in: ``WANDB_API_KEY``, or a ``wandb login`` entry in ~/.netrc."""
  if os.environ.get("WANDB_API_KEY"):
    return True
  host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
  try:
    return netrc.netrc().authenticators(host or "") is not None
  except (OSError, netrc.NetrcParseError):
    return False


class WandbSink:
  """A W&B run in ``WORKDIR/wandb``: the config, each stage's metrics against its own step
  (``STAGE/step``) and, at the end, the summary (``summary/...``).  Offline, unless
  ``WANDB_MODE`` says otherwise or an API key is set; ``wandb sync WORKDIR/wandb`` uploads."""

  def __init__(self, workdir: str, config: Mapping, run_name: str):
    import wandb  # an optional extra (config.SINK_PACKAGES)
    self.state = RunState.load(os.path.join(workdir, "wandb_run.json")) or RunState(
        os.path.join(workdir, "wandb_run.json"), {"run_id": new_run_id()})
    self.mode = os.environ.get("WANDB_MODE") or ("online" if wandb_has_key() else "offline")
    self.run = wandb.init(
        project=os.environ.get("WANDB_PROJECT") or str(config.get("name") or "jaxrlhf"),
        name=run_name, id=self.state.data["run_id"], resume="allow", dir=workdir,
        mode=self.mode, config=redact(config), allow_val_change=True,
        # No command line, environment, code or git state: a --redis_url flag stays out.
        settings=wandb.Settings(silent=True, console="off", x_disable_meta=True,
                                save_code=False, disable_git=True, disable_code=True))
    self.state.save()
    self._stages: set[str] = set()
    self._finished = False

  def _define(self, stage: str):
    if stage not in self._stages:
      self.run.define_metric(f"{stage}/step")
      self.run.define_metric(f"{stage}/*", step_metric=f"{stage}/step")
      self._stages.add(stage)

  def write_samples(self, stage: str, step: int, rows, wall_time: float):
    """The rows as a W&B table, ``STAGE/samples/KIND``, at the stage's step."""
    import wandb
    self._define(stage)
    cols = columns_of(rows)
    table = wandb.Table(columns=cols, data=[[row.get(c) for c in cols] for row in rows])
    self.run.log({f"{stage}/step": step, f"{stage}/{samples_tag(rows)}": table})

  def write(self, stage: str, step: int, metrics: Mapping[str, float], wall_time: float):
    self._define(stage)
    unsent = self.state.unsent(stage, step, metrics)
    if not unsent:
      return
    self.run.log({f"{stage}/step": step, **{f"{stage}/{k}": v for k, v in unsent.items()}})
    self.state.sent(stage, step, unsent)

  def finish(self, summary: Mapping, artifacts=lambda: ()):
    self.run.summary.update({f"summary/{k}": v for k, v in flatten(summary, sep="/").items()
                             if isinstance(v, (int, float, str))})
    self._finished = True

  def close(self):
    self.run.finish(exit_code=0 if self._finished else 1)


# --------------------------------------------------------------------------------- MLflow


def mlflow_store(workdir: str) -> tuple[str, Optional[str]]:
  """``(tracking URI, artifact folder)``: ``$MLFLOW_TRACKING_URI`` and its own artifact store,
  else a SQLite store in the workdir with artifacts beside it."""
  uri = os.environ.get("MLFLOW_TRACKING_URI")
  if uri:
    return uri, None
  where = os.path.abspath(workdir)
  return f"sqlite:///{os.path.join(where, 'mlflow.db')}", os.path.join(where, "mlflow-artifacts")


class MlflowSink:
  """An MLflow run: the flattened config as parameters, each stage's metrics with their steps,
  and at the end the summary (``summary.json``) and the report (``report/``: PNGs and
  summary.txt) as artifacts.  A resumed run continues the run in ``WORKDIR/mlflow_run.json``."""

  def __init__(self, workdir: str, config: Mapping, run_name: str):
    # An optional extra (config.SINK_PACKAGES).
    from mlflow.entities import Metric, Param, RunTag
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient
    for name in ("mlflow", "alembic"):  # creating the SQLite store logs each migration at INFO
      logging.getLogger(name).setLevel(logging.WARNING)
    self._Metric = Metric
    self.workdir = workdir
    self.uri, artifacts = mlflow_store(workdir)
    self.client = MlflowClient(tracking_uri=self.uri)
    path = os.path.join(workdir, "mlflow_run.json")
    state = RunState.load(path)
    run = None
    if state is not None and state.data.get("tracking_uri") == self.uri:
      try:
        run = self.client.get_run(state.data["run_id"])
      except MlflowException:
        run = None
      if run is not None and run.info.lifecycle_stage == "deleted":
        run = None
    params = {k: param_text(v)[:MLFLOW_MAX_VALUE] for k, v in flatten(redact(config)).items()}
    if run is None:
      name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or str(config.get("name") or "jaxrlhf")
      experiment = self.client.get_experiment_by_name(name)
      experiment_id = (experiment.experiment_id if experiment is not None else
                       self.client.create_experiment(name, artifact_location=artifacts))
      run = self.client.create_run(experiment_id, run_name=run_name)
      self.state = RunState(path, {"run_id": run.info.run_id, "tracking_uri": self.uri})
      new, tags = params, []
    else:
      self.state = state
      self.client.update_run(run.info.run_id, status="RUNNING")
      # Parameters cannot change once logged: a setting changed on resume (e.g. --steps)
      # is kept as a tag.
      old = run.data.params
      new = {k: v for k, v in params.items() if k not in old}
      tags = [RunTag(f"resumed.{k}", v) for k, v in params.items() if k in old and old[k] != v]
    self.run_id = run.info.run_id
    items = [Param(k, v) for k, v in new.items()]
    for i in range(0, len(items), MLFLOW_MAX_PARAMS):
      self.client.log_batch(self.run_id, params=items[i:i + MLFLOW_MAX_PARAMS])
    if tags:
      self.client.log_batch(self.run_id, tags=tags)
    self.state.save()
    self._finished = False

  def write(self, stage: str, step: int, metrics: Mapping[str, float], wall_time: float):
    unsent = self.state.unsent(stage, step, metrics)
    ms = int(wall_time * 1000)
    batch = [self._Metric(f"{stage}/{k}", v, ms, int(step)) for k, v in unsent.items()]
    for i in range(0, len(batch), MLFLOW_MAX_METRICS):
      self.client.log_batch(self.run_id, metrics=batch[i:i + MLFLOW_MAX_METRICS])
    if unsent:
      self.state.sent(stage, step, unsent)

  def write_samples(self, stage: str, step: int, rows, wall_time: float):
    """The rows as one JSONL artifact per batch: ``samples/STAGE/KIND_stepSTEP.jsonl``."""
    kind = samples_tag(rows).split("/", 1)[1]
    text = "".join(json.dumps({"step": int(step), **row}, ensure_ascii=False) + "\n"
                   for row in rows)
    self.client.log_text(self.run_id, text, f"samples/{stage}/{kind}_step{int(step):07d}.jsonl")

  def finish(self, summary: Mapping, artifacts=lambda: ()):
    """``artifacts()``: the report's files (made only when a sink asks for them)."""
    self.client.log_dict(self.run_id, dict(summary), "summary.json")
    for path in artifacts():
      self.client.log_artifact(self.run_id, path, "report")
    self._finished = True

  def close(self):
    self.client.set_terminated(self.run_id, "FINISHED" if self._finished else "KILLED")


def make_sink(name: str, workdir: str, config: Mapping, run_name: str):
  """The sink ``name`` of ``logging.sinks`` (not "jsonl", which the writer keeps itself)."""
  if name == "tensorboard":
    return TensorBoardSink(os.path.join(workdir, "tensorboard"))
  if name == "wandb":
    return WandbSink(workdir, config, run_name)
  if name == "mlflow":
    return MlflowSink(workdir, config, run_name)
  raise ValueError(f"unknown sink {name!r}")


# Files a run's sinks keep in its workdir (``--resume=none`` moves them aside with
# metrics.jsonl, so the new run starts new tracker runs).
RUN_FILES = ("tensorboard", "wandb_run.json", "mlflow_run.json")
