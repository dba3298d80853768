"""How rows are read before they become examples: HH transcripts, plain text as chat, a prompt
template and an answer pattern (``data.transcripts``, ``data.chat``, ``data.prompt_template``,
``data.answer_pattern``), the shapes of GSM8K and Anthropic HH-RLHF files."""

import json

import pytest

from jaxrlhf.config import ConfigError
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
  from jaxrlhf.config import DataConfig
  from jaxrlhf.data import DataSource
  path = write(tmp_path, [{"question": "what is 3+4?", "answer": "so 7\n#### 7"}] * 4)
  cfg = DataConfig(task="jsonl", prompts_path=path, fields=("question:prompt",),
                   answer_pattern=GSM_PATTERN, max_prompt_len=64, max_response_len=8)
  src = DataSource(cfg)
  assert src._file("prompts_path", "prompts")[0].answer == "7"
