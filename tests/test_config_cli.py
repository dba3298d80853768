"""Config overrides and the command line: valid changes apply, mistakes exit 2 in one line."""

import json
import subprocess
import sys

import pytest

from jaxrlhf import registry
from jaxrlhf.config import (STAGE_NAMES, ConfigError, ExperimentConfig, apply_overrides, diff, from_dict,
                            to_dict, validate)


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


@pytest.mark.parametrize("override, message", [
    ("sft.batch_size=0", "sft.batch_size=0: must be >= 1"),
    ("sft.steps=-5", "sft.steps=-5: must be >= 1"),
    ("sft.optim.lr=nan", "sft.optim.lr=nan: must be a number >= 0"),
    ("ppo.value_optim.lr=-1", "ppo.value_optim.lr=-1.0: must be a number >= 0"),
    ("model.n_heads=3", "model.n_heads=3 is not a multiple of model.n_kv_heads=4"),
    ("data.max_response_len=0", "data.max_response_len=0: must be >= 1"),
    # A setting of the last stage: refused before SFT and the reward model train.
    ("rollout.temperature=-1", "rollout.temperature=-1.0: must be a number >= 0"),
    ("ppo.batch_size=0", "ppo.batch_size=0: must be >= 1"),
])
def test_values_no_run_can_use_are_refused_up_front(override, message):
  cfg = apply_overrides(registry.get("tiny_ppo"), [override])
  with pytest.raises(ConfigError) as info:
    validate(cfg)
  assert message in str(info.value)


def test_validation_checks_only_the_stages_that_run():
  # GRPO compares the samples of one prompt: one sample is refused, but only where GRPO runs.
  grpo = apply_overrides(registry.get("tiny_grpo"), ["grpo.num_samples=1"])
  with pytest.raises(ConfigError, match="grpo.num_samples=1: must be >= 2"):
    validate(grpo)
  assert validate(apply_overrides(registry.get("tiny_ppo"), ["grpo.num_samples=1"]))
  for name in registry.names():  # every shipped experiment passes, templates once filled in
    cfg = registry.get(name)
    validate(apply_overrides(cfg, [f"{f}=x" for f in cfg.required]))


def test_templates_refuse_to_run_without_your_model_and_data():
  with pytest.raises(ConfigError) as info:
    validate(apply_overrides(registry.get("grpo_jsonl"), ["data.prompts_path=p.jsonl"]))
  msg = str(info.value)
  assert ("grpo_jsonl: this experiment is a template for your model and data; set "
          "--set=model.hf_path=... "
          "--set=data.tokenizer=... (model.hf_path, data.tokenizer are not set)") in msg
  with pytest.raises(ConfigError, match=r"--set=data.pairs_path=\.\.\."):
    validate(registry.get("dpo_jsonl"))
  validate(registry.get("dpo_jsonl"), required=False)  # what --print_config shows
  res = _main("--experiment=grpo_jsonl", "--print_config")
  assert res.returncode == 0 and '"required"' in res.stdout, res.stderr


def _main(*args):
  return subprocess.run([sys.executable, "-m", "jaxrlhf.main", *args], capture_output=True,
                        text=True, timeout=120)


@pytest.mark.parametrize("args, message", [
    (["--experiment=nope"], "unknown experiment 'nope'; valid: "),
    (["--set=ppo.kl.coeff=1"], "unknown config field"),
    (["--set=ppo.kl.coef=abc"], "is not a float"),
    (["--mesh=dp2"], "use AXIS=SIZE pairs"),
    (["--set=sft.batch_size=0"], "sft.batch_size=0: must be >= 1"),
    (["--steps=abc"], "flag --steps=abc: invalid literal"),  # absl's own parse: exit 1 before
    (["--sett=x=1"], "Unknown command line flag 'sett'. Did you mean: set ?"),
])
def test_cli_errors_exit_2_without_traceback(args, message):
  res = _main(*args, "--print_config")
  assert res.returncode == 2, res.stderr
  assert message in res.stderr
  assert "Traceback" not in res.stderr
  assert res.stderr.strip().splitlines()[-1].startswith("error: ")


def test_cli_checks_the_role_before_planning():
  res = _main("--experiment=ppo70b", "--plan", "--role=bogus")
  assert res.returncode == 2 and "--role='bogus': use one of actor, critic, all" in res.stderr


def test_cli_print_config_and_list():
  res = _main("--experiment=ppo70b", "--set=ppo.kl.coef=0.07", "--print_config")
  assert res.returncode == 0, res.stderr
  assert '"coef": 0.07' in res.stdout
  res = _main("--list")
  assert res.returncode == 0 and "ppo70b" in res.stdout
  res = _main("--help")
  assert res.returncode == 0 and "--experiment" in res.stdout and "ppo70b" in res.stdout


def test_experiments_from_a_users_file(tmp_path):
  from jaxrlhf.main import resolve_config
  one = tmp_path / "my_experiment.py"
  one.write_text(
      "import dataclasses\n"
      "from jaxrlhf import registry\n"
      "@registry.register('byo_one')\n"
      "def build():\n"
      "  return dataclasses.replace(registry.get('tiny_grpo'), description='mine', seed=5)\n")
  cfg = resolve_config(str(one), ["grpo.steps=3"])
  assert (cfg.name, cfg.seed, cfg.description, cfg.grpo.steps) == ("byo_one", 5, "mine", 3)
  assert resolve_config(str(one), []).name == "byo_one"  # a second use loads it once
  res = _main(f"--experiment={one}", "--set=grpo.steps=4", "--print_config")
  assert res.returncode == 0, res.stderr
  assert json.loads(res.stdout)["name"] == "byo_one" and json.loads(res.stdout)["seed"] == 5
  two = tmp_path / "two.py"
  two.write_text("from jaxrlhf import registry\n"
                 "registry.register('byo_a')(lambda: registry.get('tiny_ppo'))\n"
                 "registry.register('byo_b')(lambda: registry.get('tiny_dpo'))\n")
  with pytest.raises(ConfigError, match=r"registers 2 experiments \(byo_a, byo_b\); pick one "
                                        r"with --experiment=.*two.py:NAME"):
    resolve_config(str(two), [])
  assert resolve_config(f"{two}:byo_b", []).stages == registry.get("tiny_dpo").stages
  empty = tmp_path / "empty.py"
  empty.write_text("x = 1\n")
  with pytest.raises(ConfigError, match=r"empty.py: the file registers no experiment; decorate"):
    resolve_config(str(empty), [])
  with pytest.raises(ConfigError, match=r"--experiment: .*nope.py: file not found"):
    resolve_config(str(tmp_path / "nope.py"), [])
  clash = tmp_path / "clash.py"
  clash.write_text("from jaxrlhf import registry\n"
                   "registry.register('tiny_ppo')(lambda: None)\n")
  with pytest.raises(ConfigError, match=r"clash.py failed to load at .*clash.py:2 in <module>: "
                                        r"ValueError: experiment 'tiny_ppo' is registered twice"):
    resolve_config(str(clash), [])


def test_config_file_reads_print_config_back_with_set_on_top(tmp_path):
  res = _main("--experiment=tiny_grpo", "--set=grpo.kl.coef=0.02", "--print_config")
  assert res.returncode == 0, res.stderr
  path = tmp_path / "run.json"
  path.write_text(res.stdout)
  again = _main(f"--config={path}", "--set=grpo.steps=7", "--steps=5", "--print_config")
  assert again.returncode == 0, again.stderr
  want = json.loads(res.stdout)
  for stage in STAGE_NAMES:  # --steps caps every stage
    want[stage]["steps"] = min(want[stage]["steps"], 5)
  assert json.loads(again.stdout) == want
  both = _main(f"--config={path}", "--experiment=tiny_ppo", "--print_config")
  assert both.returncode == 2 and "holds the whole experiment; drop --experiment" in both.stderr


def test_config_files_are_checked_field_by_field(tmp_path):
  from jaxrlhf.config import load_config_file, to_dict
  good = to_dict(registry.get("tiny_grpo"))
  path = tmp_path / "run.json"
  for change, message in [
      (lambda d: d["grpo"].update(kl_coef=1), r"unknown config field grpo.kl_coef; valid"),
      (lambda d: d["grpo"]["kl"].update(estimator="k9"), r"grpo.kl.estimator is \"k9\", not one "
                                                         r"of 'k1', 'k2', 'k3'"),
      (lambda d: d["grpo"].update(steps="10"), r"grpo.steps is \"10\", not an int"),
      (lambda d: d["logging"].update(console_keys="loss"), r"logging.console_keys is \"loss\""),
  ]:
    data = json.loads(json.dumps(good))
    change(data)
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=message):
      load_config_file(str(path))
  path.write_text("{\n  \"name\": 1,,\n}")
  with pytest.raises(ConfigError, match=r"--config=.*run.json:2: not valid JSON"):
    load_config_file(str(path))
