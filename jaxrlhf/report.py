"""``python -m jaxrlhf.report --workdir=DIR``: plots and a short summary of a run.

Reads ``DIR/metrics.jsonl`` and writes, per stage, PNG plots of reward, KL, evaluation
accuracy, response length, loss and the step-time breakdown over steps, into ``DIR/report/``,
plus ``summary.txt`` (also printed): the final and best values of the key metrics per stage
and, for a finished run of a tiny experiment, where its learning results fall against the
documented range (``jaxrlhf/results.py``) and whether it meets the documented claims.
A plot whose metrics a stage never logged is skipped.  Records of the same stage and step are
merged, later values winning, so a resumed run (which rewrites the steps after its checkpoint)
plots once.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from typing import Optional

from jaxrlhf.cli import argument_parser, guarded
from jaxrlhf.config import ConfigError
from jaxrlhf.metrics import read_jsonl

# ------------------------------------------------------------------------------ data


@dataclasses.dataclass(frozen=True)
class Series:
  steps: tuple[int, ...]
  values: tuple[float, ...]


def load_stages(path: str) -> dict[str, dict[int, dict[str, float]]]:
  """stage -> step -> merged metrics, stages in the order they first appear."""
  stages: dict[str, dict[int, dict[str, float]]] = {}
  for rec in read_jsonl(path):
    by_step = stages.setdefault(str(rec["stage"]), {})
    metrics = {k: v for k, v in rec.items() if k not in ("stage", "step")
               and isinstance(v, float)}
    by_step.setdefault(rec["step"], {}).update(metrics)
  return stages


def series(by_step: dict[int, dict[str, float]], key: str) -> Optional[Series]:
  """The finite values of ``key`` over steps, or None if it was never logged."""
  points = [(s, m[key]) for s, m in sorted(by_step.items())
            if key in m and math.isfinite(m[key])]
  if not points:
    return None
  steps, values = zip(*points)
  return Series(steps, values)


# ------------------------------------------------------------------------------ plots

# (file name, title, y label, lines); a "band" entry shades between two keys.
PLOTS = (
    ("reward", "Reward", "reward", ("reward/mean",), ("reward/min", "reward/max")),
    ("kl", "KL divergence", "nats / token", ("kl/mean", "policy/approx_kl"), None),
    ("accuracy", "Evaluation accuracy", "accuracy", ("eval/accuracy", "eval/pair_accuracy"),
     None),
    ("response_length", "Response length", "tokens", ("response_length/mean",), None),
    ("loss", "Loss", "loss", ("loss", "value/loss"), None),
)

PHASE_PREFIX, PHASE_SUFFIX = "time/phase/", "_s"


def _figure(title: str, ylabel: str):
  import matplotlib
  matplotlib.use("Agg")  # files only; no display needed
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
  ax.set_title(title)
  ax.set_xlabel("step")
  ax.set_ylabel(ylabel)
  ax.grid(alpha=0.3)
  return plt, fig, ax


def _save(plt, fig, ax, path: str, legend: bool = True):
  if legend:
    ax.legend(loc="best", fontsize="small")
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)


def plot_lines(by_step, stage: str, name: str, title: str, ylabel: str, keys, band,
               out_dir: str) -> Optional[str]:
  lines = [(k, s) for k in keys if (s := series(by_step, k)) is not None]
  if not lines:
    return None
  plt, fig, ax = _figure(f"{title} ({stage})", ylabel)
  if band is not None:
    lo, hi = series(by_step, band[0]), series(by_step, band[1])
    if lo is not None and hi is not None and lo.steps == hi.steps:
      ax.fill_between(lo.steps, lo.values, hi.values, alpha=0.2, label=f"{band[0]}..{band[1]}")
  for key, s in lines:
    ax.plot(s.steps, s.values, marker="." if len(s.steps) < 30 else None, label=key)
  path = os.path.join(out_dir, f"{stage}_{name}.png")
  _save(plt, fig, ax, path)
  return path


def phase_names(by_step) -> list[str]:
  names = []
  for m in by_step.values():
    for k in m:
      if k.startswith(PHASE_PREFIX) and k.endswith(PHASE_SUFFIX):
        name = k[len(PHASE_PREFIX):-len(PHASE_SUFFIX)]
        if name not in names:
          names.append(name)
  # "other" (host time between phases) last, on top of the stack.
  return sorted(names, key=lambda n: n == "other")


def plot_step_time(by_step, stage: str, out_dir: str) -> Optional[str]:
  """Stacked phase times when the run timed phases, else the total step time."""
  names = phase_names(by_step)
  if names:
    steps = sorted(s for s, m in by_step.items()
                   if any(PHASE_PREFIX + n + PHASE_SUFFIX in m for n in names))
    stacks = [[by_step[s].get(PHASE_PREFIX + n + PHASE_SUFFIX, 0.0) for s in steps]
              for n in names]
    stacks = [[v if math.isfinite(v) else 0.0 for v in row] for row in stacks]
    plt, fig, ax = _figure(f"Step time by phase ({stage})", "seconds")
    ax.stackplot(steps, stacks, labels=names, alpha=0.8)
    total = series(by_step, "time/step_s")
    if total is not None:
      ax.plot(total.steps, total.values, color="black", linewidth=1, label="step")
  else:
    total = series(by_step, "time/step_s")
    if total is None:
      return None
    plt, fig, ax = _figure(f"Step time ({stage})", "seconds")
    ax.plot(total.steps, total.values, label="time/step_s")
  path = os.path.join(out_dir, f"{stage}_step_time.png")
  _save(plt, fig, ax, path)
  return path


# ---------------------------------------------------------------------------- summary

# Metrics summarised per stage: key -> which direction is "best" (None: no best).
SUMMARY_KEYS = (
    ("loss", "min"), ("reward/mean", "max"), ("kl/mean", None), ("eval/accuracy", "max"),
    ("eval/pair_accuracy", "max"), ("response_length/mean", None), ("value/loss", "min"),
    ("guard/flag_rate", None), ("throughput/tokens_per_s", "max"), ("perf/mfu", "max"),
)


def _fmt(x: float) -> str:
  return f"{x:.4g}"


def phase_shares(by_step) -> dict[str, float]:
  """Each phase's share of the total step time, over the steps that timed phases."""
  names = phase_names(by_step)
  rows = [m for m in by_step.values()
          if "time/step_s" in m and any(PHASE_PREFIX + n + PHASE_SUFFIX in m for n in names)]
  total = sum(m["time/step_s"] for m in rows if math.isfinite(m["time/step_s"]))
  if not rows or not total > 0:
    return {}
  out = {}
  for n in names:
    vals = [m.get(PHASE_PREFIX + n + PHASE_SUFFIX, 0.0) for m in rows]
    out[n] = sum(v for v in vals if math.isfinite(v)) / total
  return out


def summarize(stages) -> str:
  lines = []
  for stage, by_step in stages.items():
    steps = sorted(by_step)
    lines.append(f"{stage}: {len(steps)} logged steps ({steps[0]}..{steps[-1]})")
    for key, best in SUMMARY_KEYS:
      s = series(by_step, key)
      if s is None:
        continue
      text = f"  {key:24s} final {_fmt(s.values[-1])} (step {s.steps[-1]})"
      if best is not None and len(s.values) > 1:
        pick = max if best == "max" else min
        i = s.values.index(pick(s.values))
        text += f", {best} {_fmt(s.values[i])} (step {s.steps[i]})"
      lines.append(text)
    step_time = series(by_step, "time/step_s")
    if step_time is not None:
      # The first step is slower (first-call work); leave it out when there are others.
      rest = step_time.values[1:] or step_time.values
      text = f"  {'time/step_s':24s} mean {_fmt(sum(rest) / len(rest))}"
      if len(step_time.values) > 1:
        text += (f" over the logged steps after the first (the first took "
                 f"{_fmt(step_time.values[0])})")
      compile_s = series(by_step, "time/compile_s")
      if compile_s is not None:
        text += f"; compilation {_fmt(sum(compile_s.values))} s, not in the step times"
      lines.append(text)
    shares = phase_shares(by_step)
    if shares:
      parts = [f"{n} {100 * share:.0f}%" for n, share in shares.items()]
      lines.append(f"  {'time shares':24s} " + ", ".join(parts))
  return "\n".join(lines) + "\n"


# -------------------------------------------------------------------------------- main


class ReportError(ConfigError):
  """A user-facing error: one line naming the file and what to do."""


def _start_evals(workdir: str) -> dict[str, dict[str, float]]:
  """``{stage: {eval key: value}}`` measured before each stage trained, from the run's
  summary.json (written at its end; {} before that or when unreadable)."""
  try:
    with open(os.path.join(workdir, "summary.json"), encoding="utf-8") as f:
      summary = json.load(f)
  except (OSError, ValueError):
    return {}
  return {k[:-len("/start")]: {m: float(v) for m, v in d.items() if m.startswith("eval/")}
          for k, d in summary.items() if k.endswith("/start") and isinstance(d, dict)}


def learning_comparison(workdir: str) -> str:
  """Where a finished run of a tiny experiment falls against the documented results
  (jaxrlhf/results.py); "" for a run without summary.json or config.json (unfinished)."""
  from jaxrlhf import results
  try:
    with open(os.path.join(workdir, "summary.json"), encoding="utf-8") as f:
      summary = json.load(f)
    with open(os.path.join(workdir, "config.json"), encoding="utf-8") as f:
      config = json.load(f)
  except (OSError, ValueError):
    return ""
  if not isinstance(config, dict) or "name" not in config:
    return ""
  return "\n".join(results.compare(str(config["name"]), config, summary)) + "\n"


def make_report(workdir: str, out_dir: Optional[str] = None) -> tuple[list[str], str]:
  """Writes the plots and summary.txt; returns (PNG paths, summary text)."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    raise ReportError(f"{path}: not found; point --workdir at a run's output folder "
                      f"(the trainer writes metrics.jsonl there)")
  try:
    stages = load_stages(path)
  except ValueError as e:
    raise ReportError(str(e)) from None
  if not stages:
    raise ReportError(f"{path}: no metrics recorded yet; run training for at least one step")
  out_dir = out_dir or os.path.join(workdir, "report")
  os.makedirs(out_dir, exist_ok=True)
  start = _start_evals(workdir)
  pngs = []
  for stage, by_step in stages.items():
    # The evaluation before the stage trained (summary.json) is plotted at step 0, so a curve
    # starts from its baseline rather than from the first evaluation during training.
    plotted = {0: start[stage], **by_step} if start.get(stage) else by_step
    for name, title, ylabel, keys, band in PLOTS:
      p = plot_lines(plotted, stage, name, title, ylabel, keys, band, out_dir)
      if p:
        pngs.append(p)
    p = plot_step_time(by_step, stage, out_dir)
    if p:
      pngs.append(p)
  text = summarize(stages) + learning_comparison(workdir)
  with open(os.path.join(out_dir, "summary.txt"), "w", encoding="utf-8") as f:
    f.write(text)
  return pngs, text


def main(argv=None) -> int:
  parser = argument_parser("jaxrlhf.report", __doc__.split("\n\n")[0])
  parser.add_argument("--workdir", required=True, help="a run's output folder")
  parser.add_argument("--out", default=None, help="where plots go (default WORKDIR/report)")
  args = parser.parse_args(argv)

  def run() -> int:
    pngs, text = make_report(args.workdir, args.out)
    print(text, end="")
    out_dir = args.out or os.path.join(args.workdir, "report")
    print(f"wrote {len(pngs)} plots and summary.txt to {out_dir}")
    return 0

  return guarded(run)


if __name__ == "__main__":
  sys.exit(main())


def report_files(workdir: str) -> list[str]:
  """Draws the report of ``workdir`` and returns its files (PNGs and summary.txt): the
  artifacts a tracker keeps with the run."""
  pngs, _ = make_report(workdir)
  return [*pngs, os.path.join(workdir, "report", "summary.txt")]
