"""Issue 40: files and code that real users produce by accident, fed to the real entry point
(``python -m jaxrlhf.main`` in a subprocess).  A mistake ends with one ``error:`` line naming
the file or field, exit status 2 and no traceback; a stuck host reward or environment is
abandoned at its time limit and the run ends in seconds; degenerate data is counted on the
console.  Each run is a tiny model on CPU: a few seconds past start-up."""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from byo_helpers import family_model, write_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One step of a 1-layer model: what each training run needs to reach the code under test.
TINY = ["--steps=1", "--set=model.n_layers=1", "--set=model.d_model=32", "--set=model.head_dim=8",
        "--set=model.mlp_dim=64", "--set=logging.sinks=jsonl", "--set=checkpoint.enabled=false"]
GRPO = ["--experiment=tiny_grpo", "--set=stages=grpo", "--set=grpo.batch_size=2",
        "--set=grpo.num_samples=2", "--set=grpo.eval_every=0", "--set=data.eval_size=4", *TINY]
CALC = ["--experiment=tiny_grpo_calc", "--set=stages=grpo", "--set=grpo.batch_size=2",
        "--set=grpo.num_samples=2", "--set=data.eval_size=2", *TINY]
SFT = ["--experiment=tiny_grpo", "--set=stages=sft", "--set=sft.batch_size=2",
       "--set=sft.eval_every=0", "--set=sft.stop_accuracy=0", "--set=data.task=jsonl", *TINY]
HF_SFT = ["--experiment=sft_jsonl", "--steps=1", "--set=sft.batch_size=2",
          "--set=data.max_prompt_len=16", "--set=data.max_response_len=8",
          "--set=model.compute_dtype=float32", "--set=model.remat=none",
          "--set=logging.sinks=jsonl", "--set=checkpoint.enabled=false"]

ENVS = textwrap.dedent("""
    import time

    class Boom:
      def reset(self, example):
        return example["prompt"]

      def step(self, action):
        raise ValueError("boom")

    class Short:  # step_batch returns one result, whatever the batch
      def reset(self, example):
        return example["prompt"]

      def step(self, action):
        return "", 1.0, True

      @classmethod
      def step_batch(cls, envs, actions):
        return [("", 1.0, True)]

    class Stuck:
      def reset(self, example):
        return example["prompt"]

      def step(self, action):
        time.sleep(3600)
        return "", 1.0, True
    """)

STUCK_REWARD = textwrap.dedent("""
    import time

    def stuck(responses, examples):
      time.sleep(3600)
      return [0.0] * len(responses)
    """)


def _main(cwd, *args, timeout=240):
  env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
  t0 = time.monotonic()
  try:
    p = subprocess.run([sys.executable, "-m", "jaxrlhf.main", f"--workdir={cwd}/work", *args],
                       capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)
  except subprocess.TimeoutExpired as e:
    pytest.fail(f"the run hung: still running after {timeout} s\n{e.stdout}\n{e.stderr}")
  p.seconds = time.monotonic() - t0
  print(p.stdout[-3000:], p.stderr[-3000:], f"({p.seconds:.1f} s)")  # shown when a check fails
  return p


def _refused(p, *named):
  """Exit status 2, one ``error:`` line (last, few lines in all, no traceback) naming each of
  ``named``; returns the line."""
  assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
  assert "Traceback" not in p.stderr
  lines = [line for line in p.stderr.splitlines() if line.strip()]
  assert 1 <= len(lines) <= 3, lines
  error = lines[-1]
  assert error.startswith("error: "), error
  for name in named:
    assert name in error, (name, error)
  return error


def _ran(p):
  assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
  assert "Traceback" not in p.stderr
  return p.stdout


def _metrics(cwd):
  return [json.loads(line) for line in open(os.path.join(cwd, "work", "metrics.jsonl"))]


# ------------------------------------------------------------------ user files

@pytest.mark.parametrize("what", ["model", "adapter"])
def test_a_weights_file_cut_short(tmp_path, what):
  if what == "model":
    model = family_model(tmp_path / "qwen3", "qwen3")
    path = os.path.join(model, "model.safetensors")
    with open(path, "r+b") as f:
      f.truncate(os.path.getsize(path) // 2)  # an interrupted download
    write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "1+1=", "response": "2"}] * 4)
    args = [*HF_SFT, f"--set=model.hf_path={model}", f"--set=data.tokenizer={model}",
            "--set=data.sft_path=sft.jsonl"]
  else:
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": [
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}))
    # What a clone without git-lfs leaves in place of the weights.
    (adapter / "adapter_model.safetensors").write_text(
        "version https://git-lfs.github.com/spec/v1\noid sha256:0123\nsize 1234\n")
    path = str(adapter / "adapter_model.safetensors")
    write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "1+1=", "response": "2"}] * 4)
    args = [*SFT, "--set=data.sft_path=sft.jsonl", "--set=sft.lora.rank=4",
            "--set=sft.lora.alpha=8", f"--set=sft.lora.init_from={adapter}"]
  error = _refused(_main(tmp_path, *args), path, "cut short")
  assert "download or copy" in error


@pytest.mark.parametrize("edit, named", [
    ({"max_position_embeddings": "128"}, '"max_position_embeddings": 128'),
    ({"rope_scaling": {"rope_type": "linear"}}, "factor"),
])
def test_a_mistyped_config_value(tmp_path, edit, named):
  model = family_model(tmp_path / "qwen3", "qwen3")
  config = json.load(open(os.path.join(model, "config.json")))
  config.update(edit)
  json.dump(config, open(os.path.join(model, "config.json"), "w"))
  # The architecture is read before any check: --print_config already stops.
  _refused(_main(tmp_path, "--experiment=sft_jsonl", f"--set=model.hf_path={model}",
                 "--print_config"), os.path.join(model, "config.json"), named)


@pytest.mark.parametrize("body, named", [
    ("cfg = get('tiny_grpo')\n  cfg.grpo.num_samples = 4\n  return cfg",
     ["my_exp.py:7 in build", "dataclasses.replace(cfg"]),
    ("return {'name': 'mine'}", ["my_exp.py:build", "returned dict", "not an ExperimentConfig"]),
])
def test_an_experiment_builder_that_mutates_or_returns_the_wrong_type(tmp_path, body, named):
  (tmp_path / "my_exp.py").write_text(
      "from jaxrlhf.registry import get, register\n\n\n@register('mine')\ndef build():\n  "
      + body + "\n")
  _refused(_main(tmp_path, "--experiment=my_exp.py", "--print_config"), *named)


# ------------------------------------------------------------------ environments

def test_env_errors_raise_stops_with_one_line(tmp_path):
  (tmp_path / "my_env.py").write_text(ENVS)
  error = _refused(_main(tmp_path, *CALC, "--set=grpo.eval_every=0",
                         "--set=env.name=my_env.py:Boom", "--set=env.errors=raise"),
                   "my_env.py:Boom.step()", "ValueError: boom", "env.errors=mask")
  assert "row 0" in error


def test_a_wrong_length_step_batch(tmp_path):
  (tmp_path / "my_env.py").write_text(ENVS)
  _refused(_main(tmp_path, *CALC, "--set=grpo.eval_every=0", "--set=env.name=my_env.py:Short"),
           "my_env.py:Short.step_batch returned 1 results for 4 rows")


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stuck_environment_times_out_and_the_run_exits(tmp_path, workers):
  """env.timeout_s holds with any worker count (0 had none), and the stuck threads do not
  keep the finished process alive (a thread pool's threads did).  With workers=0 the
  evaluation episodes (at the start and at the end) time out too: the warning is said once,
  not once per runner."""
  (tmp_path / "my_env.py").write_text(ENVS)
  evals = ["--set=grpo.eval_every=1"] if workers == 0 else ["--set=grpo.eval_every=0"]
  out = _ran(_main(tmp_path, *CALC, *evals, "--set=env.name=my_env.py:Stuck",
                   "--set=env.timeout_s=0.5", f"--set=env.workers={workers}"))
  assert out.count("warning: environment my_env.py:Stuck: step() did not return within "
                   "env.timeout_s=0.5 s") == 1
  steps = [r for r in _metrics(tmp_path) if "env/timeouts" in r]
  assert [r["env/timeouts"] for r in steps] == [4.0]  # 2 prompts x 2 samples, all masked


# ------------------------------------------------------------------ host rewards

@pytest.mark.parametrize("policy", ["mask", "raise"])
def test_a_stuck_host_reward_is_abandoned_at_its_limit(tmp_path, policy):
  (tmp_path / "my_reward.py").write_text(STUCK_REWARD)
  p = _main(tmp_path, *GRPO, "--set=grpo.reward.sources=host:my_reward.py:stuck",
            "--set=grpo.reward.timeout_s=1", f"--set=grpo.reward.host_errors={policy}")
  if policy == "raise":
    _refused(p, "my_reward.py:stuck did not return within reward.timeout_s=1 s",
             "reward.host_errors=mask")
    return
  out = _ran(p)
  assert out.count("warning: my_reward.py:stuck: the call on 4 responses did not return within "
                   "reward.timeout_s=1 s") == 1
  steps = [r for r in _metrics(tmp_path) if "reward/host_timeouts" in r]
  assert [r["reward/host_timeouts"] for r in steps] == [4.0]


# ------------------------------------------------------------------ degenerate data

def test_chat_data_whose_assistant_turns_are_all_empty(tmp_path):
  model = family_model(tmp_path / "qwen3", "qwen3")
  write_jsonl(tmp_path / "chat.jsonl", [
      {"messages": [{"role": "user", "content": f"{a}+1="},
                    {"role": "assistant", "content": " " if a % 2 else ""}]} for a in range(4)])
  error = _refused(_main(tmp_path, *HF_SFT, f"--set=model.hf_path={model}",
                         f"--set=data.tokenizer={model}", "--set=data.sft_path=chat.jsonl"),
                   "chat.jsonl: no example left", "data.sft_path")
  assert '4 with an empty assistant turn in "response" (rows 1, 2, 3, 4)' in error


def test_an_empty_prompt_is_skipped_and_counted(tmp_path):
  write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "1+1=", "response": "2"},
                                       {"prompt": "", "response": "3"},
                                       {"prompt": "2+2=", "response": ""},
                                       {"prompt": "3+3=", "response": "6"}])
  out = _ran(_main(tmp_path, *SFT, "--set=data.sft_path=sft.jsonl"))
  assert ("sft.jsonl: skipped 1 with an empty prompt (row 2); 1 with an empty assistant turn in "
          "\"response\" (row 3) (data.sft_path); 2 of 4 examples kept") in out


# ------------------------------------------------------------------ vocabularies

def test_a_tokenizer_larger_than_the_models_vocabulary(tmp_path):
  """The message names both folders, and its fix (the model's own tokenizer) fits."""
  import transformers
  from tokenizers import Tokenizer, models, pre_tokenizers
  names = ["<pad>", "<s>", "</s>", "<unk>"] + [chr(c) for c in range(32, 127)]
  names += [f"<x{i}>" for i in range(132 - len(names))]
  tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(names)}, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
  transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
      unk_token="<unk>").save_pretrained(str(tmp_path / "big_tok"))
  model = family_model(tmp_path / "qwen3", "qwen3")
  write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "1+1=", "response": "2"}] * 4)
  error = _refused(_main(tmp_path, *HF_SFT, f"--set=model.hf_path={model}",
                         "--set=data.tokenizer=big_tok", "--set=data.sft_path=sft.jsonl"),
                   "data.tokenizer='big_tok' has 132 tokens", f"model.hf_path='{model}'",
                   f"--set=data.tokenizer={model}")
  assert "model.vocab_size" not in error  # config.json would override it: no fix
  from jaxrlhf.data.tokenizers import HFTokenizer
  assert HFTokenizer(model).vocab_size <= json.load(open(f"{model}/config.json"))["vocab_size"]
