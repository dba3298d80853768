"""Issue 23's end-to-end test, on the command line as a user outside the repository would run
it: a tiny random Qwen3 checkpoint whose tokenizer has a chat template, a Parquet file of chat
prompts with answers and extra fields, and the user's own reward in my_reward.py, trained with
GRPO; then Gemma 3 with DPO on chat ``messages`` pairs alone (no prompts file).  Each run is a
few steps on one CPU device (sharded loading is test_hf_families.py's); the trained policy is exported and
transformers reads the export's config and tokenizer back."""

import json
import os
import textwrap

import jax
import numpy as np

from byo_helpers import run_main, family_model, write_jsonl, write_parquet
from helpers import mesh


REWARD = textwrap.dedent("""
    import json, os

    def score(responses, examples):
      with open(os.path.join(os.path.dirname(__file__), "calls.jsonl"), "a") as f:
        f.write(json.dumps({"responses": responses, "examples": examples}) + "\\n")
      if any(e["level"] == 2 for e in examples):
        raise ValueError("level 2 is not supported yet")  # masked and counted, not fatal
      # + a term on the first character, so that a random model's samples differ in reward
      return [float(r.strip() == e["answer"]) + 0.01 * e["level"] + ord(r[:1] or " ") / 1000
              for r, e in zip(responses, examples)]
    """)

SMALL = ["--steps=2", "--set=data.max_response_len=8",
         "--set=rollout.max_new_tokens=8", "--set=model.compute_dtype=float32",
         "--set=model.remat=none", "--set=logging.sinks=jsonl", "--set=checkpoint.enabled=false"]


def _export_and_reload(work, model, stage, model_type):
  """The stage's trained policy exported as a HF folder: transformers reads its config and
  tokenizer (chat template included), jaxrlhf reads back the same weights, which training
  changed.  Returns the model's config."""
  import transformers
  from jaxrlhf import checkpoint as C
  from jaxrlhf import model as M
  from jaxrlhf.model import hf
  cfg = hf.config_from_hf(model)
  m = mesh()
  abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          M.abstract_params(cfg), M.param_shardings(cfg, m))
  trained = C.load_stage_result(work, stage, {"policy": abstract})["policy"]
  out = hf.export_hf(trained, cfg, os.path.join(os.path.dirname(work), "exported"),
                     tokenizer_path=model)
  config = transformers.AutoConfig.from_pretrained(out, local_files_only=True)
  tok = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
  assert config.model_type == model_type and config.vocab_size == 100
  rendered = tok.apply_chat_template([{"role": "user", "content": "1+1="}], tokenize=False,
                                     add_generation_prompt=True)
  assert rendered == "<bos>user\n1+1=<eos>\n<bos>assistant\n"
  back = hf.load_hf(out, hf.config_from_hf(out, cfg), m)
  for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(trained)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  start = hf.load_hf(model, cfg, m)
  assert any(not np.array_equal(np.asarray(a), np.asarray(b))  # it trained
             for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(start)))
  return cfg


def test_grpo_on_qwen3_with_chat_parquet_and_the_users_reward(tmp_path):
  model = family_model(tmp_path / "qwen3", "qwen3")
  rows = [{"question": [{"role": "user", "content": f"{a}+{b}="}], "solution": str(a + b),
           "level": a % 3} for a in range(4) for b in range(4)]
  write_parquet(tmp_path / "prompts.parquet", rows)
  (tmp_path / "my_reward.py").write_text(REWARD)
  out = run_main(str(tmp_path), "--experiment=grpo_jsonl", f"--workdir={tmp_path / 'work'}",
              f"--set=model.hf_path={model}", f"--set=data.tokenizer={model}",
              "--set=data.prompts_path=prompts.parquet", "--set=data.max_prompt_len=24",
              "--set=data.fields=question:prompt,solution:answer", "--set=data.eval_split=0.25",
              "--set=grpo.reward.sources=host:my_reward.py:score,host:math_verify,"
              "host:math_format", "--set=grpo.reward.weights=1,1,0.1", "--set=grpo.batch_size=4",
              "--set=grpo.num_samples=2", "--set=grpo.num_minibatches=1", *SMALL)
  assert "4 examples held out of data.prompts_path=prompts.parquet by data.eval_split=0.25" in out
  # The summary says what the console said, and by what metric (auto: math_verify here).
  assert "grpo: held-out correct by host:math_verify" in out
  calls = [json.loads(l) for l in open(tmp_path / "calls.jsonl")]
  batches = [c for c in calls if len(c["responses"]) > 1]
  assert len(batches) == 2  # one call per step (then one per response where it raised)
  for call in batches:
    assert len(call["responses"]) == len(call["examples"]) == 8
    ex = call["examples"][0]
    # Every field of the row, renamed by data.fields, once per sample of its prompt.
    assert set(ex) == {"prompt", "answer", "level"} and ex == call["examples"][1]
    assert ex["prompt"][0]["role"] == "user" and ex["answer"] == str(eval(ex["prompt"][0]
                                                                          ["content"][:-1]))
  # The responses whose scoring raised were masked and counted, step by step.
  records = [json.loads(l) for l in open(tmp_path / "work" / "metrics.jsonl")]
  steps = [r for r in records if "reward/host_errors" in r]
  raised = [sum(e["level"] == 2 for e in c["examples"]) for c in batches]
  assert [r["reward/host_errors"] for r in steps] == raised and sum(raised) > 0
  assert all(np.isfinite(r["loss"]) for r in steps)
  assert "my_reward.py:score: " in out and "ValueError: level 2 is not supported yet" in out
  cfg = _export_and_reload(str(tmp_path / "work"), model, "grpo", "qwen3")
  assert cfg.qk_norm and not cfg.post_norms  # Qwen3's own layout, not Llama's
  # The run's saved config reads back as --config, the host source and renames included.
  saved = tmp_path / "work" / "config.json"
  again = json.loads(run_main(str(tmp_path), f"--config={saved}", "--print_config"))
  assert again == json.loads(saved.read_text())
  assert again["grpo"]["reward"]["sources"] == ["host:my_reward.py:score", "host:math_verify",
                                                "host:math_format"]


def test_dpo_on_gemma3_with_chat_pairs_alone(tmp_path):
  """No data.prompts_path: pair accuracy on the held-out pairs, and exact match on their
  prompts against the rows' "answer"."""
  model = family_model(tmp_path / "gemma3", "gemma3")
  pairs = []
  for a in range(6):
    user = [{"role": "system", "content": "add"}, {"role": "user", "content": f"{a}+1="}]
    pairs.append({"chosen": user + [{"role": "assistant", "content": str(a + 1)}],
                  "rejected": user + [{"role": "assistant", "content": str(a + 2)}],
                  "answer": str(a + 1)})
  write_jsonl(tmp_path / "pairs.jsonl", pairs[:4])
  write_jsonl(tmp_path / "held.jsonl", pairs[4:])
  out = run_main(str(tmp_path), "--experiment=dpo_jsonl", f"--workdir={tmp_path / 'work'}",
              f"--set=model.hf_path={model}", f"--set=data.tokenizer={model}",
              "--set=data.pairs_path=pairs.jsonl", "--set=data.pairs_eval_path=held.jsonl",
              "--set=data.max_prompt_len=40", "--set=dpo.batch_size=4",
              "--set=dpo.optim.lr=0.01", *SMALL)
  for what in ("pair accuracy, pairs", "greedy answers, prompts"):
    assert f"evaluation ({what}): 2 held-out examples from data.pairs_eval_path" in out
  assert "dpo: held-out pair accuracy" in out and "dpo: held-out exact match" in out
  evals = [r for r in map(json.loads, open(tmp_path / "work" / "metrics.jsonl"))
           if "eval/pair_accuracy" in r]
  assert evals and all("eval/accuracy" in r for r in evals)
  cfg = _export_and_reload(str(tmp_path / "work"), model, "dpo", "gemma3_text")
  assert cfg.layer_types == ("sliding", "sliding", "full", "sliding")
