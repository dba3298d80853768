"""How rows are read before they become examples: HH transcripts, plain text as chat, a prompt
template and an answer pattern (``data.transcripts``, ``data.chat``, ``data.prompt_template``,
``data.answer_pattern``), the shapes of GSM8K and Anthropic HH-RLHF files."""

import json

import pytest

from jaxrlhf.config import ConfigError, DataConfig
from jaxrlhf.data.files import RowShape, hh_messages, read_examples


def write(tmp_path, rows, name="d.jsonl"):
  path = tmp_path / name
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


GSM = {"question": "Ann has 3 apples and buys 4. How many?",
       "answer": "She has 3+4 = <<3+4=7>>7 apples.\n#### 7"}
GSM_PATTERN = r"####\s*(\S+)\s*$"


def test_hh_transcript_becomes_turns():
  msgs = hh_messages("\n\nHuman: hi there\n\nAssistant: hello\n\nHuman: why?\n\nAssistant: ok",
                     "f:1", "chosen")
  assert msgs == [{"role": "user", "content": "hi there"},
                  {"role": "assistant", "content": "hello"},
                  {"role": "user", "content": "why?"},
                  {"role": "assistant", "content": "ok"}]


def test_hh_pairs_share_their_prompt_turns(tmp_path):
  shared = "\n\nHuman: a question\n\nAssistant: an answer\n\nHuman: and then?"
  path = write(tmp_path, [{"chosen": shared + "\n\nAssistant: good", "rejected":
                           shared + "\n\nAssistant: bad"}])
  (ex,) = read_examples(path, "pairs", shape=RowShape(transcripts="hh"))
  assert [m["role"] for m in ex.prompt.messages] == ["user", "assistant", "user"]
  assert ex.chosen.messages == [{"role": "assistant", "content": "good"}]
  assert ex.rejected.messages == [{"role": "assistant", "content": "bad"}]


def test_hh_pairs_that_part_early_are_skipped_and_reported(tmp_path, capsys):
  good = {"chosen": "\n\nHuman: q\n\nAssistant: yes", "rejected": "\n\nHuman: q\n\nAssistant: no"}
  # A turn pasted into a reply: the chosen side has one more exchange than the rejected one.
  bad = {"chosen": "\n\nHuman: q\n\nAssistant: a\n\nHuman: r\n\nAssistant: b",
         "rejected": "\n\nHuman: q\n\nAssistant: c"}
  path = write(tmp_path, [good, bad, good])
  out = read_examples(path, "pairs", shape=RowShape(transcripts="hh"))
  assert len(out) == 2 and [e.line for e in out] == [1, 3]
  said = capsys.readouterr().out
  assert "1 row(s)" in said and "rows 2" in said and path in said


def test_not_a_transcript_is_one_line_naming_the_row(tmp_path):
  path = write(tmp_path, [{"chosen": "just text", "rejected": "\n\nHuman: q\n\nAssistant: n"}])
  with pytest.raises(ConfigError, match=r"d\.jsonl:1: \"chosen\" is not an HH transcript"):
    read_examples(path, "pairs", shape=RowShape(transcripts="hh"))


def test_answer_pattern_takes_the_final_value(tmp_path):
  path = write(tmp_path, [GSM])
  (ex,) = read_examples(path, "prompts", fields=("question:prompt",),
                        shape=RowShape(answer_pattern=GSM_PATTERN))
  assert ex.answer == "7"
  # SFT: the worked solution is the response, and the answer still comes out of it.
  (ex,) = read_examples(path, "sft", fields=("question:prompt", "answer:response"),
                        shape=RowShape(answer_pattern=GSM_PATTERN))
  assert ex.answer == "7" and ex.response.endswith("#### 7")


def test_answer_pattern_that_finds_nothing_names_file_line_and_field(tmp_path):
  path = write(tmp_path, [GSM, {"question": "q", "answer": "no marker here"}])
  with pytest.raises(ConfigError, match=r"d\.jsonl:2: data\.answer_pattern=.* finds no answer "
                     r"in \"answer\""):
    read_examples(path, "prompts", fields=("question:prompt",),
                  shape=RowShape(answer_pattern=GSM_PATTERN))


def test_prompt_template_then_chat(tmp_path):
  path = write(tmp_path, [GSM])
  shape = RowShape(chat=True, prompt_template="{prompt}\nPut your final answer within \\boxed{}.")
  (ex,) = read_examples(path, "sft", fields=("question:prompt", "answer:response"), shape=shape)
  assert ex.prompt.messages == [{"role": "user", "content": GSM["question"] +
                                 "\nPut your final answer within \\boxed{}."}]
  assert ex.response.messages == [{"role": "assistant", "content": GSM["answer"]}]
  # Without data.chat the prompt stays a string, with the template applied.
  (ex,) = read_examples(path, "prompts", fields=("question:prompt",),
                        shape=RowShape(prompt_template="Q: {prompt}\nA:"))
  assert ex.prompt == "Q: " + GSM["question"] + "\nA:"


def test_the_settings_reach_the_reader(tmp_path):
  from jaxrlhf.data import DataSource
  path = write(tmp_path, [{"question": "what is 3+4?", "answer": "so 7\n#### 7"}] * 4)
  cfg = DataConfig(task="jsonl", prompts_path=path, fields=("question:prompt",),
                   answer_pattern=GSM_PATTERN, max_prompt_len=64, max_response_len=8)
  src = DataSource(cfg)
  assert src._file("prompts_path", "prompts")[0].answer == "7"


def test_sft_on_files_reports_the_held_out_loss(tmp_path):
  """``eval/loss`` is the training loss on the evaluation examples: batches of
  ``sft.batch_size`` with the last one padded by masked rows give the token mean over all of
  them, the same number one batch of all of them gives; with the responses' tokens or every
  token as the target (``sft.response_only``)."""
  for response_only in (True, False):
    _held_out_loss_equals_one_batch(tmp_path / str(response_only), response_only)


def _held_out_loss_equals_one_batch(tmp_path, response_only):
  import dataclasses

  import jax
  import numpy as np

  from byo_helpers import family_model
  from helpers import mesh
  from jaxrlhf.config import ExperimentConfig, SFTConfig
  from jaxrlhf.data import DataSource
  from jaxrlhf.model import hf
  from jaxrlhf.train import spec

  tmp_path.mkdir()
  model = family_model(tmp_path / "m", "qwen3")
  rows = [{"prompt": f"{i}+{i}=", "response": str(2 * i)} for i in range(10, 30)]
  path = write(tmp_path, rows)
  data = DataConfig(task="jsonl", tokenizer=model, sft_path=path, eval_path=path, eval_size=5,
                    max_prompt_len=8, max_response_len=4)
  cfg = ExperimentConfig(name="t", stages=("sft",), data=data,
                         model=dataclasses.replace(hf.config_from_hf(model), remat="none"),
                         sft=SFTConfig(batch_size=2, steps=1, response_only=response_only))
  m = mesh()
  src = DataSource(cfg.data, cfg.seed)
  stage = spec.build_stage("sft", cfg, m, src)
  state, frozen = stage.init(jax.random.key(0), {})
  params = stage.view(state.params, frozen, "policy")
  got = stage.held_out_loss(params, stage.evaluation(frozen))["eval/loss"]
  held = src.eval_examples("sft")
  assert len(held) == 5  # three batches of two, the last padded
  loss_fn, mb = stage.objective(src.encoder.sequences(held, "response"))
  with jax.set_mesh(m):
    want = float(jax.jit(loss_fn)(params, mb)[0])
  np.testing.assert_allclose(got, want, rtol=1e-5)
  assert "eval/loss" in stage.evaluation(frozen)(state)



def test_a_row_without_the_field_names_the_rename_to_make(tmp_path):
  """GSM8K as it ships ({"question", "answer"}) read as prompts with no data.fields: the error
  names the row's fields and the data.fields setting that maps one."""
  path = write(tmp_path, [GSM])
  with pytest.raises(ConfigError, match=r"d\.jsonl:1: missing string field\(s\) prompt; .* this "
                     r"row has 'question', 'answer': name the one to use with "
                     r"data\.fields=question:prompt"):
    read_examples(path, "prompts")
