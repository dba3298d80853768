"""`python -m jaxrlhf.export`: a run's trained model written as a Hugging Face folder that
transformers reads back (config, chat tokenizer), its errors, and the rotary fields that make
the written config.json load the same in transformers 4.x and 5.x."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from byo_helpers import family_model, write_jsonl
from helpers import mesh
from jaxrlhf import export
from jaxrlhf.model import hf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA31 = os.path.join(ROOT, "tests", "assets", "hf", "llama31")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """One SFT step on the tiny Qwen3 checkpoint (chat tokenizer), as a user runs it."""
  tmp = tmp_path_factory.mktemp("export")
  model = family_model(tmp / "qwen3", "qwen3")
  write_jsonl(tmp / "sft.jsonl", [
      {"messages": [{"role": "user", "content": f"{a}+1="},
                    {"role": "assistant", "content": str(a + 1)}]} for a in range(8)])
  env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
  p = subprocess.run(
      [sys.executable, "-m", "jaxrlhf.main", "--experiment=sft_jsonl", f"--workdir={tmp / 'work'}",
       f"--set=model.hf_path={model}", f"--set=data.tokenizer={model}",
       f"--set=data.sft_path={tmp / 'sft.jsonl'}", "--steps=1", "--set=sft.batch_size=4",
       "--set=sft.eval_every=0", "--set=data.max_prompt_len=16",
       "--set=data.max_response_len=8", "--set=logging.sinks=jsonl",
       "--set=checkpoint.enabled=false"],
      capture_output=True, text=True, cwd=str(tmp), env=env, timeout=300)
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  return tmp, model


def test_export_writes_a_folder_transformers_reads(run, capsys):
  import transformers
  tmp, model = run
  out = tmp / "exported"
  assert export.main([f"--workdir={tmp / 'work'}", f"--out={out}"]) == 0  # stage: the last
  assert f"exported policy of stage sft to {out}" in capsys.readouterr().out
  config = transformers.AutoConfig.from_pretrained(str(out), local_files_only=True)
  source = json.load(open(os.path.join(model, "config.json")))
  assert config.model_type == "qwen3" and config.architectures == ["Qwen3ForCausalLM"]
  assert config.vocab_size == source["vocab_size"]
  raw = json.load(open(out / "config.json"))
  theta = source["rope_parameters"]["rope_theta"] if "rope_parameters" in source else \
      source["rope_theta"]
  assert raw["rope_theta"] == raw["rope_parameters"]["rope_theta"] == theta
  tok = transformers.AutoTokenizer.from_pretrained(str(out), local_files_only=True)
  assert tok.apply_chat_template([{"role": "user", "content": "1+1="}], tokenize=False,
                                 add_generation_prompt=True) == \
      "<bos>user\n1+1=<eos>\n<bos>assistant\n"
  # jaxrlhf reads the export back.
  cfg = hf.config_from_hf(str(out))
  hf.load_hf(str(out), cfg, mesh())
  # --dtype and an explicit --stage.
  assert export.main([f"--workdir={tmp / 'work'}", f"--out={tmp / 'bf16'}", "--stage=sft",
                      "--dtype=bfloat16"]) == 0
  assert json.load(open(tmp / "bf16" / "config.json"))["torch_dtype"] == "bfloat16"


@pytest.mark.parametrize("args,message", [
    (["--workdir={tmp}/nowhere"], "is not a directory"),
    (["--workdir={tmp}"], "has no config.json: not the folder of a jaxrlhf run"),
    (["--workdir={tmp}/work", "--stage=dpo"], "--stage=dpo: the run in"),
    (["--workdir={tmp}/work", "--role=value"], "--role=value: stage 'sft' of"),
    (["--workdir={tmp}/work", "--dtype=int8"], "--dtype=int8: use float32"),
])
def test_errors_are_one_line(run, capsys, args, message):
  tmp, _ = run
  argv = [a.format(tmp=tmp) for a in args] + [f"--out={tmp / 'never'}"]
  assert export.main(argv) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
  assert not os.path.exists(tmp / "never")


def test_an_unfinished_stage_is_named(tmp_path, run, capsys):
  tmp, _ = run
  os.makedirs(tmp_path / "work")
  saved = json.load(open(tmp / "work" / "config.json"))
  json.dump(saved, open(tmp_path / "work" / "config.json", "w"))
  assert export.main([f"--workdir={tmp_path / 'work'}", f"--out={tmp_path / 'o'}"]) == 2
  assert "no stage of the run in" in capsys.readouterr().err
  assert export.main([f"--workdir={tmp_path / 'work'}", f"--out={tmp_path / 'o'}",
                      "--stage=sft"]) == 2
  assert "--stage=sft has not finished in" in capsys.readouterr().err


def _theta_read_by(config_dict, tmp_path, keep):
  """transformers' reading of ``config_dict`` with only one convention's fields kept: "v4"
  (rope_theta / rope_scaling, what 4.x reads) or "v5" (rope_parameters)."""
  import transformers
  d = dict(config_dict)
  for k in (("rope_parameters",) if keep == "v4" else ("rope_theta", "rope_scaling")):
    d.pop(k, None)
  folder = tmp_path / keep
  folder.mkdir()
  json.dump(d, open(folder / "config.json", "w"))
  c = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
  params = getattr(c, "rope_parameters", None) or {}
  return params.get("rope_theta", getattr(c, "rope_theta", None)), params, \
      getattr(c, "rope_scaling", None)


def test_the_written_config_has_both_rotary_conventions(tmp_path):
  """rope theta 1e5 (SmolLM2's) with Llama 3 scaling: both fields are written, and each alone
  reads back as the same rotary settings."""
  cfg = hf.config_from_hf(LLAMA31)
  params = hf.load_hf(LLAMA31, cfg, mesh())
  cfg = dataclasses.replace(cfg, rope_theta=1e5)
  out = hf.export_hf(params, cfg, str(tmp_path / "out"))
  raw = json.load(open(os.path.join(out, "config.json")))
  assert raw["rope_theta"] == raw["rope_parameters"]["rope_theta"] == 1e5
  assert raw["rope_scaling"] == {k: v for k, v in raw["rope_parameters"].items()
                                 if k != "rope_theta"}
  assert raw["rope_scaling"]["rope_type"] == "llama3" and raw["rope_scaling"]["factor"] == 8.0
  for keep in ("v4", "v5"):
    theta, params5, _ = _theta_read_by(raw, tmp_path, keep)
    assert theta == 1e5, keep
    assert params5.get("rope_type") == "llama3" and params5.get("factor") == 8.0, keep
  back = hf.config_from_hf(out)
  assert (back.rope_theta, back.rope_scaling, back.rope_factor) == (1e5, "llama3", 8.0)


def test_gemma3_writes_both_conventions_per_layer_type(tmp_path):
  src = os.path.join(ROOT, "tests", "assets", "hf_families", "gemma3")
  cfg = hf.config_from_hf(src)
  out = hf.export_hf(hf.load_hf(src, cfg, mesh()), cfg, str(tmp_path / "out"))
  raw = json.load(open(os.path.join(out, "config.json")))
  assert raw["rope_theta"] == raw["rope_parameters"]["full_attention"]["rope_theta"] == \
      cfg.rope_theta
  assert raw["rope_local_base_freq"] == \
      raw["rope_parameters"]["sliding_attention"]["rope_theta"] == cfg.rope_local_theta
  assert raw["rope_scaling"]["rope_type"] == cfg.rope_scaling
