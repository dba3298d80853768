"""``python -m jaxrlhf.report``: plots and a summary from a run's metrics.jsonl."""

import io
import json
import os
import subprocess
import sys


from jaxrlhf import report
from jaxrlhf.config import LoggingConfig
from jaxrlhf.metrics import MetricsWriter

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _short_run(workdir, sft_steps=6, ppo_steps=8):
  """Writes what a short SFT -> PPO run logs, through the real writer."""
  w = MetricsWriter(str(workdir), LoggingConfig(), {"sft": sft_steps, "ppo": ppo_steps},
                    primary=True, stream=io.StringIO(), tty=False)
  for step in range(1, sft_steps + 1):
    w.write("sft", step, {"loss": 2.0 / step, "time/step_s": 0.5 if step == 1 else 0.1})
    if step % 3 == 0:
      w.write("sft", step, {"eval/accuracy": step / 10})
  for step in range(1, ppo_steps + 1):
    r = 0.1 * step
    w.write("ppo", step, {
        "reward/mean": r, "reward/std": 0.2, "reward/min": r - 0.3, "reward/max": r + 0.3,
        "kl/mean": 0.01 * step, "policy/approx_kl": 0.001, "response_length/mean": 10 - step / 2,
        "loss": 1.0 / step, "value/loss": float("nan") if step == 2 else 0.5,
        "time/step_s": 0.3, "time/phase/generate_s": 0.2, "time/phase/update_s": 0.08,
        "time/phase/other_s": 0.02})
  w.close()


def _is_png(path):
  with open(path, "rb") as f:
    return f.read(8) == PNG_MAGIC and os.path.getsize(path) > 1000


def test_report_plots_and_summarises_a_short_run(tmp_path):
  _short_run(tmp_path)
  pngs, text = report.make_report(str(tmp_path))
  names = sorted(os.path.basename(p) for p in pngs)
  assert names == sorted([
      "sft_loss.png", "sft_accuracy.png", "sft_step_time.png",
      "ppo_reward.png", "ppo_kl.png", "ppo_response_length.png", "ppo_loss.png",
      "ppo_step_time.png"])
  assert all(_is_png(p) for p in pngs)
  assert os.path.dirname(pngs[0]) == str(tmp_path / "report")

  summary = (tmp_path / "report" / "summary.txt").read_text()
  assert summary == text
  sft, ppo = summary.split("ppo:")
  assert sft.startswith("sft: 6 logged steps (1..6)")
  assert "loss                     final 0.3333 (step 6), min 0.3333 (step 6)" in sft
  assert "eval/accuracy            final 0.6 (step 6), max 0.6 (step 6)" in sft
  assert ("time/step_s              mean 0.1 over the logged steps after the first (the first "
          "took 0.5)") in sft
  assert "reward/mean              final 0.8 (step 8), max 0.8 (step 8)" in ppo
  assert "kl/mean                  final 0.08 (step 8)" in ppo
  assert "time shares              generate 67%, update 27%, other 7%" in ppo


def test_records_of_one_step_merge_and_a_resume_overwrites(tmp_path):
  path = tmp_path / "metrics.jsonl"
  rows = [{"stage": "ppo", "step": 1, "reward/mean": 0.1},
          {"stage": "ppo", "step": 2, "reward/mean": 0.2},
          {"stage": "ppo", "step": 2, "eval/accuracy": 0.5},  # eval logged separately
          # resumed from the step-1 checkpoint: step 2 is run (and logged) again
          {"stage": "ppo", "step": 2, "reward/mean": 0.25}]
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  stages = report.load_stages(str(path))
  assert stages["ppo"][2] == {"reward/mean": 0.25, "eval/accuracy": 0.5}
  s = report.series(stages["ppo"], "reward/mean")
  assert (s.steps, s.values) == ((1, 2), (0.1, 0.25))


def test_missing_metrics_are_skipped_and_nonfinite_values_ignored(tmp_path):
  (tmp_path / "metrics.jsonl").write_text(
      json.dumps({"stage": "rm", "step": 1, "eval/pair_accuracy": "nan"}) + "\n" +
      json.dumps({"stage": "rm", "step": 2, "eval/pair_accuracy": 0.75}) + "\n")
  pngs, text = report.make_report(str(tmp_path))
  assert [os.path.basename(p) for p in pngs] == ["rm_accuracy.png"]
  assert "eval/pair_accuracy       final 0.75 (step 2)" in text
  # A stage with nothing plottable still gets its summary line, and no error.
  (tmp_path / "metrics.jsonl").write_text(json.dumps({"stage": "dpo", "step": 3, "x": 1}) + "\n")
  pngs, text = report.make_report(str(tmp_path))
  assert pngs == [] and text == "dpo: 1 logged steps (3..3)\n"


def test_missing_or_empty_metrics_give_one_clear_line(tmp_path, capsys):
  assert report.main([f"--workdir={tmp_path}"]) == 2
  err = capsys.readouterr().err.strip()
  assert err == (f"error: {tmp_path}/metrics.jsonl: not found; point --workdir at a run's "
                 f"output folder (the trainer writes metrics.jsonl there)")
  (tmp_path / "metrics.jsonl").write_text("")
  assert report.main([f"--workdir={tmp_path}"]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith(f"error: {tmp_path}/metrics.jsonl: no metrics recorded yet")
  assert "\n" not in err


def test_report_command_runs_as_a_module(tmp_path):
  _short_run(tmp_path, sft_steps=2, ppo_steps=2)
  out = tmp_path / "plots"
  proc = subprocess.run([sys.executable, "-m", "jaxrlhf.report", f"--workdir={tmp_path}",
                         f"--out={out}"], capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.startswith("sft: 2 logged steps")
  assert proc.stdout.rstrip().endswith(f"wrote 7 plots and summary.txt to {out}")
  assert (out / "summary.txt").exists() and _is_png(out / "ppo_reward.png")


def test_report_does_not_need_jax():
  # The report reads files only; it must start fast and work where jax is absent.
  code = "import sys, jaxrlhf.report; print('jax' in sys.modules)"
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        timeout=60)
  assert proc.stdout.strip() == "False", proc.stderr


def test_accuracy_plots_start_from_the_evaluation_before_training(tmp_path, monkeypatch):
  _short_run(tmp_path)
  (tmp_path / "summary.json").write_text(json.dumps({
      "sft": {"eval/accuracy": 0.6}, "ppo/start": {"eval/accuracy": 0.25, "time_s": 3.0}}))
  seen = {}
  real = report.plot_lines

  def spy(by_step, stage, name, *args):
    if name == "accuracy":
      seen[stage] = {s: m.get("eval/accuracy") for s, m in by_step.items()
                     if "eval/accuracy" in m}
    return real(by_step, stage, name, *args)

  monkeypatch.setattr(report, "plot_lines", spy)
  _, text = report.make_report(str(tmp_path))
  assert seen["ppo"] == {0: 0.25}  # the baseline at step 0 (PPO logged no eval here)
  assert 0 not in seen["sft"]  # no sft/start in the summary: nothing added
  assert "ppo: 8 logged steps (1..8)" in text  # the summary still counts logged steps only
