"""The GRPO workload of issue 11 on Hugging Face TRL (PyTorch), for a side-by-side figure.

    pip install trl              # in a separate environment that has torch; not a dependency
    python -m benchmarks.peer_trl [--steps=20] [--threads=2] [--out=FILE]
    python -m benchmarks.peer_trl --workload=smol_grpo --steps=4   # the real model

``--workload=smol_grpo`` (issue 43) is ``python -m benchmarks.suite --workloads=smol_grpo`` on
TRL: SmolLM2-135M-Instruct from the folder ``jaxrlhf prepare-model smollm2-135m-instruct``
wrote (float32, tied embeddings), GSM8K questions from ``../shared/data`` in the same
instruction and chat template (prompts over 192 tokens skipped, as ``data.overlong=skip``),
4 prompts x 4 samples, at most 128 new tokens at temperature 0.8, KL beta 0.04, one update,
AdamW at lr 1e-5, a format reward (one non-empty ``\boxed{}``: 0.5) and a value reward (the
boxed number equals the answer: 1.0).

The same workload as ``python -m benchmarks.suite --workloads=grpo``: a Llama-shaped policy (4
layers, d_model 256, 4 heads of 64, SwiGLU 1024, vocab 512, untied, float32, N(0, 0.02) init,
4,458,752 parameters, asserted), 8 ``a+b=`` prompts (two-digit operands, this repo's character
tokens with BOS) x 4 samples per step, at most 32 new tokens at temperature 1 and top-p 1, KL
beta 0.04 (TRL then keeps a frozen reference copy and scores every batch with it), clip 0.2,
one update per batch, AdamW at lr 1e-5, exact-match reward.  TRL's trainer runs the phases one
after another in eager PyTorch (``model.generate`` with its KV cache, the reference forward,
then the loss and backward).

It prints the steady seconds per step (median, min, max over the steps after two warm-up
steps), generated tokens per second, and the step's model FLOPs over the fp32 matmul rate of
a ``[1024, 1024] @ [1024, 1024]`` torch matmul measured in the same process: the same floor
the suite reports, so the two fractions compare directly.  Figures: benchmarks/NOTES.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time


def _check_imports():
  import importlib.util
  missing = [m for m in ("torch", "trl", "datasets") if importlib.util.find_spec(m) is None]
  if missing:
    sys.exit(f"benchmarks.peer_trl needs {', '.join(missing)}, which jaxrlhf does not depend on; "
             "install them in a separate environment: pip install torch trl datasets")


def char_tokenizer():
  """A ``PreTrainedTokenizerFast`` with this repo's character ids (pad 0, bos 1, eos 2, then
  :class:`jaxrlhf.data.CharTokenizer`'s characters), padded to the left for generation."""
  from tokenizers import Tokenizer, models, pre_tokenizers
  from transformers import PreTrainedTokenizerFast

  from jaxrlhf.data import CharTokenizer
  chars = CharTokenizer.chars
  vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
  tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
  tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
  fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                 eos_token="</s>", padding_side="left")
  assert fast("07+45=")["input_ids"] == CharTokenizer().encode("07+45="), "char ids differ"
  return fast


def policy_model(vocab_size: int = 512):
  import torch
  from transformers import LlamaConfig, LlamaForCausalLM
  cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=256, intermediate_size=1024,
                    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                    max_position_embeddings=128, tie_word_embeddings=False,
                    initializer_range=0.02, rms_norm_eps=1e-6, pad_token_id=0, bos_token_id=1,
                    eos_token_id=2, torch_dtype="float32")
  torch.manual_seed(0)
  model = LlamaForCausalLM(cfg).float()
  n = sum(p.numel() for p in model.parameters())
  assert n == 4_458_752, f"{n} parameters, expected the workload's 4,458,752"
  return model


def matmul_rate(n: int = 1024, reps: int = 5) -> float:
  import torch
  a, b = torch.randn(n, n), torch.randn(n, n)
  best = float("inf")
  for _ in range(reps):
    t0 = time.perf_counter()
    torch.mm(a, b)
    best = min(best, time.perf_counter() - t0)
  return 2 * n ** 3 / best


def smol_dataset(steps: int, tok, max_prompt: int = 192):
  """GSM8K questions as chat prompts in the smol_gsm8k_grpo experiment's instruction, those
  whose rendered prompt fits ``max_prompt`` tokens, in file order; and their answers."""
  from datasets import Dataset

  from experiments.smol import BOXED, _shared
  path = _shared("gsm8k", "train.jsonl")
  if not path:
    sys.exit("benchmarks.peer_trl: ../shared/data/gsm8k/train.jsonl was not found")
  rows = []
  with open(path) as f:
    for line in f:
      ex = json.loads(line)
      prompt = [{"role": "user", "content": BOXED.replace("{prompt}", ex["question"])}]
      ids = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
      if len(ids) <= max_prompt:
        rows.append({"prompt": prompt, "answer": ex["answer"].split("####")[-1].strip()})
      if len(rows) >= 4 * steps:
        break
  return Dataset.from_list(rows)


def smol_rewards(completions, answer, **_):
  """0.5 for exactly one non-empty ``\boxed{}``, plus 1.0 when its number is the answer."""
  import re
  out = []
  for c, a in zip(completions, answer):
    text = c[0]["content"] if isinstance(c, list) else c
    boxes = re.findall(r"\\boxed\{([^{}]*)\}", text)
    ok = len(boxes) == 1 and boxes[0].strip() != ""
    value = ok and boxes[0].strip().replace(",", "") == a.replace(",", "")
    out.append(0.5 * ok + 1.0 * value)
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--workload", default="grpo", choices=("grpo", "smol_grpo"),
                 help="the suite's tiny GRPO workload, or the real model's (issue 43)")
  p.add_argument("--steps", type=int, default=20, help="steps in all (2 of them warm-up)")
  p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
  p.add_argument("--out", default="", help="write the results as JSON here")
  args = p.parse_args(argv)
  if args.steps < (3 if args.workload == "smol_grpo" else 5):
    p.error(f"--steps={args.steps}: use at least 5 (3 for smol_grpo): warm-up steps, then "
            f"the timed ones")
  _check_imports()

  import numpy as np
  import torch
  from datasets import Dataset
  from transformers import TrainerCallback
  import trl
  from trl import GRPOConfig, GRPOTrainer

  from jaxrlhf.data import AdditionTask
  torch.set_num_threads(args.threads)
  if args.workload == "smol_grpo":
    return smol_main(args)
  tok = char_tokenizer()
  task = AdditionTask(digits=2)
  examples = task.sample(np.random.default_rng(0), 8 * args.steps, "train")
  data = Dataset.from_list([{"prompt": tok.bos_token + e.prompt, "answer": e.answer}
                            for e in examples])

  def exact_match(completions, answer, **_):
    return [1.0 if c.split(tok.eos_token)[0].strip() == a else 0.0
            for c, a in zip(completions, answer)]

  stamps, tokens = [], []

  class Clock(TrainerCallback):
    def on_step_end(self, _args, state, control, **kw):
      stamps.append(time.perf_counter())

    def on_log(self, _args, state, control, logs=None, **kw):
      if logs and "completions/mean_length" in logs:
        tokens.append(logs["completions/mean_length"] * 32)

  # TRL builds its frozen reference from the policy's checkpoint directory: save it there.
  work = tempfile.TemporaryDirectory(prefix="jaxrlhf_peer_trl_")
  model_dir = os.path.join(work.name, "policy")
  policy_model().save_pretrained(model_dir)
  tok.save_pretrained(model_dir)
  config = GRPOConfig(
      output_dir=os.path.join(work.name, "out"), max_steps=args.steps,
      per_device_train_batch_size=32, num_generations=4, gradient_accumulation_steps=1,
      num_iterations=1, max_completion_length=32, temperature=1.0, top_p=1.0, top_k=0,
      beta=0.04, epsilon=0.2,
      learning_rate=1e-5, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0,
      use_cpu=True, bf16=False, fp16=False, logging_steps=1, save_strategy="no", report_to=[],
      seed=0, dataloader_num_workers=0, shuffle_dataset=False,
      model_init_kwargs={"dtype": "float32"})
  trainer = GRPOTrainer(model=model_dir, reward_funcs=exact_match, args=config,
                        train_dataset=data, processing_class=tok, callbacks=[Clock()])
  t0 = time.perf_counter()
  try:
    trainer.train()
  finally:
    work.cleanup()
  steps = [b - a for a, b in zip(stamps[1:], stamps[2:])]  # after two warm-up steps
  med = statistics.median(steps)

  # The floor as the suite computes it: the workload's model FLOPs (jaxrlhf's count for the
  # same GRPO step) over the fp32 matmul rate measured here.
  from benchmarks.suite import workload_flops
  rate = matmul_rate()
  gen_tokens = statistics.median(tokens) if tokens else 32 * 32
  flops = sum(workload_flops("grpo").values())
  out = {"trainer": "trl", "trl_version": trl.__version__,
         "torch_version": torch.__version__, "threads": args.threads,
         "step_s": {"median": med, "min": min(steps), "max": max(steps), "n": len(steps)},
         "total_s": time.perf_counter() - t0, "generated_tokens_per_step": gen_tokens,
         "generated_tokens_per_s": gen_tokens / med, "matmul_flops_per_s": rate,
         "flops_per_step": flops, "floor_s": flops / rate, "floor_fraction": flops / rate / med}
  print(f"TRL {out['trl_version']} (torch {out['torch_version']}, {args.threads} threads): "
        f"steady step {med:.3f} s (min {min(steps):.3f}, max {max(steps):.3f}, "
        f"{len(steps)} steps); "
        f"{gen_tokens / med:.0f} generated tokens/s; floor {flops / rate:.3f} s at "
        f"{rate / 1e9:.0f} GFLOP/s: {100 * flops / rate / med:.0f}% of it")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(out, f, indent=1)
  return 0


def smol_main(args) -> int:
  """The real-model GRPO workload on TRL (see the module docstring)."""
  import torch
  from transformers import AutoTokenizer, TrainerCallback
  import trl
  from trl import GRPOConfig, GRPOTrainer

  from experiments.smol import _model_dir
  from jaxrlhf.hardware import measure_copy_bandwidth
  model_dir = _model_dir()
  if not model_dir:
    sys.exit("benchmarks.peer_trl: prepare the model first: jaxrlhf prepare-model "
             "smollm2-135m-instruct")
  tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
  data = smol_dataset(args.steps, tok)
  stamps, tokens = [], []

  class Clock(TrainerCallback):
    def on_step_end(self, _args, state, control, **kw):
      stamps.append(time.perf_counter())

    def on_log(self, _args, state, control, logs=None, **kw):
      if logs and "completions/mean_length" in logs:
        tokens.append(logs["completions/mean_length"] * 16)

  work = tempfile.TemporaryDirectory(prefix="jaxrlhf_peer_trl_smol_")
  config = GRPOConfig(
      output_dir=os.path.join(work.name, "out"), max_steps=args.steps,
      per_device_train_batch_size=16, num_generations=4, gradient_accumulation_steps=1,
      num_iterations=1, max_completion_length=128, temperature=0.8, top_p=1.0, top_k=0,
      beta=0.04, epsilon=0.2, learning_rate=1e-5, lr_scheduler_type="constant",
      warmup_steps=0, max_grad_norm=1.0, use_cpu=True, bf16=False, fp16=False,
      logging_steps=1, save_strategy="no", report_to=[], seed=0, dataloader_num_workers=0,
      shuffle_dataset=False, model_init_kwargs={"dtype": "float32"})
  trainer = GRPOTrainer(model=model_dir, reward_funcs=smol_rewards, args=config,
                        train_dataset=data, processing_class=tok, callbacks=[Clock()])
  t0 = time.perf_counter()
  try:
    trainer.train()
  finally:
    work.cleanup()
  steps = [b - a for a, b in zip(stamps[:-1], stamps[1:])]  # after the first
  med = statistics.median(steps)
  gen = statistics.median(tokens[1:] or tokens)
  import resource
  out = {"trainer": "trl", "workload": "smol_grpo", "trl_version": trl.__version__,
         "torch_version": torch.__version__, "threads": args.threads,
         "first_step_s": stamps[0] - t0,
         "step_s": {"median": med, "min": min(steps), "max": max(steps), "n": len(steps)},
         "generated_tokens_per_step": gen, "generated_tokens_per_s": gen / med,
         "matmul_flops_per_s": matmul_rate(), "copy_bandwidth_bytes_per_s":
         measure_copy_bandwidth(),
         "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
  print(f"TRL {out['trl_version']} (torch {out['torch_version']}, {args.threads} threads), "
        f"smol_grpo: first step {out['first_step_s']:.1f} s, steady step {med:.1f} s (min "
        f"{min(steps):.1f}, max {max(steps):.1f}, {len(steps)} steps); {gen / med:.1f} generated "
        f"tokens/s; peak RSS {out['peak_rss_bytes'] / 2**20:.0f} MiB")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(out, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
