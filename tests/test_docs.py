"""The front door: the docs site builds in strict mode, the configuration reference is the
code's, the README stays short and holds what CI runs, and the ``jaxrlhf`` command maps onto
the modules."""

import importlib.util
import os
import subprocess
import sys

import pytest

from jaxrlhf.console import SUBCOMMANDS, console
from jaxrlhf.config import reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(*parts) -> str:
  with open(os.path.join(ROOT, *parts), encoding="utf-8") as f:
    return f.read()


def test_every_config_field_has_a_comment():
  missing = reference.missing_comments()
  assert not missing, ("config fields with no comment directly above them (the configuration "
                       f"reference shows it): {', '.join(sorted(set(missing)))}")


def test_the_configuration_reference_is_the_codes():
  page = "\n".join(reference.markdown()).rstrip() + "\n"
  assert _read("docs", "reference", "config.md") == page, (
      "docs/reference/config.md is stale: run `python -m jaxrlhf.config.reference > "
      "docs/reference/config.md`")


def test_the_reference_lists_every_field_of_every_section():
  from jaxrlhf.config import ExperimentConfig, OptimizerConfig, PPOConfig
  page = _read("docs", "reference", "config.md")
  for cls, paths in reference.sections():
    assert f"## {cls.__name__}" in page
    for f in reference.fields_of(cls):
      assert f"| `{f.name}` |" in page
  # nested sections are found where they are used, inherited fields listed with each stage
  where = dict(reference.sections())
  assert "ppo.value_optim" in where[OptimizerConfig] and "sft.optim" in where[OptimizerConfig]
  assert {"steps", "batch_size", "eval_every"} <= {f.name for f in reference.fields_of(PPOConfig)}
  assert where[ExperimentConfig] == [""]


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None,
                    reason="the docs extra is not installed (pip install -e '.[docs]')")
def test_the_docs_site_builds_in_strict_mode(tmp_path):
  """Broken links, missing anchors, missing included files and API references all fail the
  build (mkdocs.yml: strict, anchors and unrecognised links as warnings)."""
  run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                        str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, timeout=300)
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
  api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
  assert "num_samples" in api and "logprob_entropy" in api  # docstrings were rendered
  config = (tmp_path / "site" / "reference" / "config" / "index.html").read_text()
  assert "value_optim" in config


def test_the_readme_is_short_and_starts_what_ci_runs():
  readme = _read("README.md")
  assert len(readme.splitlines()) <= 160, "the README should fit on three screens"
  test_command = "pip install -e '.[test]' && pytest -q"
  assert test_command in readme
  ci = _read(".ci", "run")
  assert "pip install -q -e '.[test]'" in ci and "\npytest -q" in ci
  assert "pip install -e . && python -m jaxrlhf.main" in readme
  assert _read("docs", "_features.md").strip() in readme  # one feature table, two places


def test_the_console_command_lists_its_subcommands(capsys):
  assert console([]) == 0
  out = capsys.readouterr().out
  for name in ("train", "plan", "report", "export", "prepare-model"):
    assert name in out and name in SUBCOMMANDS


def test_an_unknown_subcommand_is_one_line(capsys):
  assert console(["trian"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "unknown command 'trian'" in err and "train" in err


def test_a_subcommand_names_itself_in_its_usage(capsys):
  with pytest.raises(SystemExit) as e:
    console(["export", "--help"])
  assert e.value.code == 0
  assert capsys.readouterr().out.startswith("usage: jaxrlhf export")


def _script():
  path = os.path.join(os.path.dirname(sys.executable), "jaxrlhf")
  if not os.path.exists(path):
    pytest.skip("the jaxrlhf console script is not installed (pip install -e .)")
  return path


@pytest.mark.parametrize("argv", [["train", "--list"], ["--list"]])
def test_the_console_script_runs_main(argv):
  """``jaxrlhf train FLAGS`` and ``jaxrlhf FLAGS`` are ``python -m jaxrlhf.main FLAGS``."""
  run = subprocess.run([_script()] + argv, capture_output=True, text=True, timeout=120)
  want = subprocess.run([sys.executable, "-m", "jaxrlhf.main", "--list"], capture_output=True,
                        text=True, timeout=120)
  assert run.returncode == 0, run.stderr[-2000:]
  assert run.stdout == want.stdout and "tiny_ppo" in run.stdout


def test_plan_adds_the_plan_flag(tmp_path):
  """``jaxrlhf plan`` runs main with ``--plan``: a tiny experiment planned, nothing trained."""
  run = subprocess.run([_script(), "plan", "--experiment=tiny_dpo", "--devices=2",
                        f"--workdir={tmp_path}", "--steps=1"], capture_output=True, text=True,
                       timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
  assert (tmp_path / "plan.json").exists()
  assert not (tmp_path / "metrics.jsonl").exists()
