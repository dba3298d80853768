"""Config overrides and the command line: valid changes apply, mistakes exit 2 in one line."""

import subprocess
import sys

import pytest

from jaxrlhf import registry
from jaxrlhf.config import ConfigError, ExperimentConfig, apply_overrides, diff, from_dict, to_dict


def test_overrides_parse_by_type():
  cfg = apply_overrides(ExperimentConfig(), [
      "ppo.kl.coef=0.25", "ppo.kl.estimator=k3", "model.tie_embeddings=true",
      "rollout.stop_token_ids=3,5", "mesh.tp=2", "reward_model.d_model=64",
      'stages=("sft", "rm")'])
  assert cfg.ppo.kl.coef == 0.25 and cfg.ppo.kl.estimator == "k3"
  assert cfg.model.tie_embeddings is True
  assert cfg.rollout.stop_token_ids == (3, 5)
  assert cfg.mesh.tp == 2
  assert cfg.stages == ("sft", "rm")  # brackets and quotes as typed from habit
  # An unset optional model section starts from the main model's shape.
  assert cfg.reward_model.d_model == 64 and cfg.reward_model.n_layers == cfg.model.n_layers


@pytest.mark.parametrize("override, message", [
    ("ppo.kl.coeff=1", "unknown config field 'ppo.kl.coeff'; valid fields here: coef"),
    ("ppo.kl.coef=abc", "ppo.kl.coef: 'abc' is not a float"),
    ("ppo.kl.estimator=k9", "choose one of 'k1', 'k2', 'k3'"),
    ("model.n_layers=2.5", "model.n_layers: '2.5' is not an int"),
    ("ppo.kl=3", "'ppo.kl' is a section"),
    ("ppo", "needs the form FIELD=VALUE"),
    ("stages=sft,rl", "stages: 'rl' is not valid; choose one of 'sft', 'rm'"),
])
def test_override_errors_name_the_fix(override, message):
  with pytest.raises(ConfigError, match=None) as info:
    apply_overrides(ExperimentConfig(), [override])
  assert message in str(info.value)


def test_config_round_trips_through_dict():
  cfg = registry.get("ppo70b")
  assert from_dict(ExperimentConfig, to_dict(cfg)) == cfg
  other = apply_overrides(cfg, ["ppo.kl.coef=0.5"])
  assert diff(cfg, other) == [("ppo.kl.coef", cfg.ppo.kl.coef, 0.5)]


def test_registry_has_the_required_experiments():
  names = registry.names()
  for required in ("tiny_ppo", "sft70b", "dpo70b", "ppo70b", "grpo70b"):
    assert required in names
  m = registry.get("ppo70b").model
  assert (m.n_layers, m.d_model, m.n_heads, m.n_kv_heads, m.mlp_dim, m.vocab_size) == (
      80, 8192, 64, 8, 28672, 128256)


def _main(*args):
  return subprocess.run([sys.executable, "-m", "jaxrlhf.main", *args], capture_output=True,
                        text=True, timeout=120)


@pytest.mark.parametrize("args, message", [
    (["--experiment=nope"], "unknown experiment 'nope'; valid: "),
    (["--set=ppo.kl.coeff=1"], "unknown config field"),
    (["--set=ppo.kl.coef=abc"], "is not a float"),
    (["--mesh=dp2"], "use AXIS=SIZE pairs"),
])
def test_cli_errors_exit_2_without_traceback(args, message):
  res = _main(*args, "--print_config")
  assert res.returncode == 2, res.stderr
  assert message in res.stderr
  assert "Traceback" not in res.stderr
  assert res.stderr.strip().splitlines()[-1].startswith("error: ")


def test_cli_print_config_and_list():
  res = _main("--experiment=ppo70b", "--set=ppo.kl.coef=0.07", "--print_config")
  assert res.returncode == 0, res.stderr
  assert '"coef": 0.07' in res.stdout
  res = _main("--list")
  assert res.returncode == 0 and "ppo70b" in res.stdout
  res = _main("--help")
  assert res.returncode == 0 and "--experiment" in res.stdout and "ppo70b" in res.stdout
