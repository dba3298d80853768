"""Multi-turn environments on the host: resolving env.name, the runner (order, failures,
timeouts, step_batch), the built-in calculator and guess environments against their SFT
demonstrations, the char_tools tokenizer, and append-only chat rendering."""

import os
import threading
import time

import numpy as np
import pytest

from byo_helpers import FAMILIES, FAMILY_TEMPLATE
from jaxrlhf.config import ConfigError, DataConfig
from jaxrlhf.data import CharTokenizer, CharToolsTokenizer, DataSource, HFTokenizer
from jaxrlhf.data.tasks import CalculatorTask, GuessTask, calc_result
from jaxrlhf.envs import (ENVS, ChatFormat, Env, EnvError, EnvRunner, EnvSpec, TextFormat,
                          evaluate, make_format, register_env, resolve_env)


# ------------------------------------------------------------------ resolve_env

ENV_FILE = '''
from jaxrlhf.envs import Env

class Echo(Env):
  stop_strings = ("!",)
  def reset(self, example):
    return example["prompt"]
  def step(self, action):
    return action, 1.0, True

class NeedsArg:
  def __init__(self, size):
    pass
  def reset(self, example):
    return ""
  def step(self, action):
    return "", 0.0, True

class NoStep:
  def reset(self, example):
    return ""

class BadStops(Echo):
  stop_strings = "!"

class EmptyStop(Echo):
  stop_strings = ("",)

not_a_class = 3
'''


@pytest.fixture(scope="module")
def env_file(tmp_path_factory):
  path = tmp_path_factory.mktemp("envs") / "my_envs.py"
  path.write_text(ENV_FILE)
  return str(path)


def test_resolve_env_spellings(env_file):
  spec = resolve_env("calculator")
  assert spec.cls is ENVS["calculator"] and spec.stop_strings == ("</calc>",)
  assert "calculator" in spec.where
  assert resolve_env("guess").stop_strings == ("?",)
  spec = resolve_env(f"{env_file}:Echo")
  assert spec.cls.__name__ == "Echo" and spec.stop_strings == ("!",)
  assert spec.where == f"{env_file}:Echo"
  spec = resolve_env("jaxrlhf.envs.builtin:GuessEnv")
  assert spec.cls is ENVS["guess"] and spec.where == "jaxrlhf.envs.builtin:GuessEnv"


@pytest.mark.parametrize("name, words", [
    ("nope", ["env.name", "no environment 'nope'", "calculator", "path/to/file.py:Class"]),
    ("", ["env.name is empty"]),
    ("missing_dir/x.py:Env", ["env.name", "missing_dir/x.py", "file not found"]),
    ("{file}:Nope", ["env.name", "defines no 'Nope'", "Echo", "fix the name"]),
    ("{file}:not_a_class", ["not_a_class is a int, not a class"]),
    ("{file}:NoStep", ["NoStep has no step() method"]),
    ("{file}:NeedsArg", ["NeedsArg(size)", "cannot be constructed with no arguments",
                         "defaults"]),
    ("{file}:BadStops", ["BadStops.stop_strings is '!'", "tuple of strings"]),
    ("{file}:EmptyStop", ["EmptyStop.stop_strings holds ''", "non-empty str"]),
    ("{file}:3x", ["'3x' is not a class name"]),
    ("no_such_pkg_xyz.mod:Env", ["env.name", "no module named 'no_such_pkg_xyz'",
                                 "give a file: path/to/file.py:Class"]),
    ("some/dir:Env", ["not a .py file nor a module name"]),
])
def test_resolve_env_failures(env_file, name, words):
  with pytest.raises(ConfigError) as e:
    resolve_env(name.format(file=env_file))
  msg = str(e.value)
  assert "\n" not in msg
  for w in words:
    assert w in msg, (w, msg)


def test_resolve_env_names_the_setting():
  with pytest.raises(ConfigError, match=r"^my\.setting=nope"):
    resolve_env("nope", setting="my.setting")


def test_register_env_twice():
  with pytest.raises(ValueError, match="twice"):
    register_env("calculator")(type("Again", (Env,), {}))


# ------------------------------------------------------------------ the runner

class Counter(Env):
  """Observation = prompt + number of steps; done at step ``example['steps']``."""

  closed = []

  def reset(self, example):
    if example.get("reset") == "raise":
      raise KeyError("no such row")
    self.row, self.n, self.steps = example["prompt"], 0, example.get("steps", 2)
    return example["prompt"]

  def step(self, action):
    if action == "raise":
      raise ValueError("boom")
    if action == "timeout-raise":
      raise TimeoutError("my own")
    if action.startswith("sleep"):
      time.sleep(float(action[5:]))
    if action == "nan":
      return "x", float("nan"), False
    if action == "notstr":
      return 7, 0.0, False
    if action == "str-reward":
      return "x", "1", False
    self.n += 1
    return f"{self.row}{self.n}", float(self.n), self.n >= self.steps

  def close(self):
    Counter.closed.append(self.row)


def _spec(cls):
  return EnvSpec(cls, f"test:{cls.__name__}", tuple(cls.stop_strings))


def _rows(n, **extra):
  return [{"prompt": f"p{i}", **extra} for i in range(n)]


@pytest.mark.parametrize("workers", [0, 3])
def test_runner_order_and_episodes(workers):
  runner = EnvRunner(_spec(Counter), workers=workers, timeout_s=5.0, errors="mask")
  assert runner.reset(_rows(5)) == [f"p{i}" for i in range(5)]
  out = runner.step([4, 0, 2], ["a", "b", "c"])
  assert out == [("p41", 1.0, False, False), ("p01", 1.0, False, False),
                 ("p21", 1.0, False, False)]
  out = runner.step([0, 4], ["a", "b"])
  assert out == [("", 2.0, True, False), ("", 2.0, True, False)]  # done: observation ignored
  with pytest.raises(ValueError, match="row 0 has no live environment"):
    runner.step([0], ["a"])
  Counter.closed.clear()
  runner.reset(_rows(2))  # closes the previous five
  assert sorted(Counter.closed) == [f"p{i}" for i in range(5)]
  assert runner.metrics() == {"env/errors": 0.0, "env/timeouts": 0.0}
  runner.close()


def test_runner_masks_and_counts_failures(capsys):
  runner = EnvRunner(_spec(Counter), workers=0, timeout_s=1.0, errors="mask")
  rows = _rows(7)
  rows[1]["reset"] = "raise"
  obs = runner.reset(rows)
  assert obs[1] is None and obs[0] == "p0"
  actions = ["raise", "nan", "notstr", "str-reward", "timeout-raise", "ok"]
  out = runner.step([0, 2, 3, 4, 5, 6], actions)
  assert [o[3] for o in out] == [True] * 5 + [False]
  assert all(o[:3] == ("", 0.0, True) for o in out[:5])
  assert out[5] == ("p61", 1.0, False, False)
  assert runner.metrics() == {"env/errors": 6.0, "env/timeouts": 0.0}  # 1 reset + 5 steps
  printed = capsys.readouterr().out
  # Once per kind of failure (raised, wrong result), naming the class, the row and the cause.
  assert printed.count("warning:") == 2
  assert "test:Counter: reset() raised KeyError: 'no such row' on row 1" in printed
  assert "step() returned a wrong result: reward=nan is not finite on row 2" in printed
  runner.reset(_rows(1))
  assert runner.metrics()["env/errors"] == 0.0  # since the last reset
  runner.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_runner_timeouts_are_masked_and_do_not_block(workers):
  runner = EnvRunner(_spec(Counter), workers=workers, timeout_s=0.2, errors="mask")
  runner.reset(_rows(5))
  t0 = time.monotonic()
  out = runner.step([0, 1, 2, 3, 4], ["sleep0.6", "sleep0.6", "a", "sleep0.05", "timeout-raise"])
  took = time.monotonic() - t0
  assert [o[3] for o in out] == [True, True, False, False, True]
  assert out[2] == ("p21", 1.0, False, False) and out[3] == ("p31", 1.0, False, False)
  # The call's own TimeoutError is an error, not a timeout.
  assert runner.metrics() == {"env/errors": 1.0, "env/timeouts": 2.0}
  # Every thread was stuck: the queued rows moved to a fresh pool and ran.  With workers=0
  # the rows run one after another, each stuck one for its 0.2 s.
  assert took < (0.55 if workers else 0.75), took
  assert all(t.daemon for t in threading.enumerate() if t.name.startswith("jaxrlhf-env"))
  runner.close()


def test_runner_raise_policy():
  runner = EnvRunner(_spec(Counter), workers=0, timeout_s=1.0, errors="raise")
  runner.reset(_rows(3))
  with pytest.raises(EnvError, match=r"test:Counter\.step\(\) raised ValueError: boom on row 2; "
                     r".*env\.errors=mask") as e:
    runner.step([0, 2], ["a", "raise"])
  assert isinstance(e.value.__cause__, ValueError)
  with pytest.raises(EnvError, match=r"reset\(\) raised KeyError"):
    runner.reset([{"prompt": "p", "reset": "raise"}])
  threaded = EnvRunner(_spec(Counter), workers=1, timeout_s=0.1, errors="raise")
  threaded.reset(_rows(1))
  with pytest.raises(EnvError, match=r"did not return within env\.timeout_s=0\.1 s on row 0"):
    threaded.step([0], ["sleep0.3"])
  threaded.close()


class Batched(Env):
  calls = []

  def reset(self, example):
    self.p = example["prompt"]
    return self.p

  def step(self, action):
    raise AssertionError("step_batch is used instead")

  @classmethod
  def step_batch(cls, envs, actions):
    cls.calls.append(len(envs))
    return [(e.p + a, 0.5, a == "end") for e, a in zip(envs, actions)]


@pytest.mark.parametrize("workers", [0, 2])
def test_runner_uses_step_batch(workers):
  Batched.calls.clear()
  runner = EnvRunner(_spec(Batched), workers=workers, timeout_s=5.0, errors="mask")
  runner.reset(_rows(4))
  out = runner.step([3, 1, 0], ["x", "end", "y"])
  assert out == [("p3x", 0.5, False, False), ("", 0.5, True, False), ("p0y", 0.5, False, False)]
  assert Batched.calls == [3]
  runner.close()


def test_runner_step_batch_wrong_length_stops():
  class Short(Batched):
    @classmethod
    def step_batch(cls, envs, actions):
      return [("o", 0.0, False)]

  runner = EnvRunner(_spec(Short), workers=0, timeout_s=5.0, errors="mask")
  runner.reset(_rows(2))
  with pytest.raises(EnvError, match="returned 1 results for 2 rows"):
    runner.step([0, 1], ["a", "b"])


def test_runner_rows_do_not_share_example_dicts():
  class Mutating(Counter):
    def reset(self, example):
      example["prompt"] += "!"
      return example["prompt"]

  shared = {"prompt": "p"}
  runner = EnvRunner(_spec(Mutating), workers=0, timeout_s=1.0, errors="mask")
  assert runner.reset([shared, shared]) == ["p!", "p!"]
  assert shared == {"prompt": "p"}


# ------------------------------------------------------------------ built-in environments

def _replay(env_cls, example):
  """Plays the demonstration's actions through the environment: (return, transcript)."""
  env = env_cls()
  text = env.reset(example.record())
  assert text == example.prompt
  rest, transcript, total = example.response, "", 0.0
  stops = env_cls.stop_strings
  while True:
    ends = [rest.find(s) + len(s) for s in stops if s in rest]
    cut = min(ends) if ends else len(rest)
    action, rest = rest[:cut], rest[cut:]
    obs, reward, done = env.step(action)
    total += reward
    transcript += action
    if done:
      assert rest == "", (rest, example.response)
      return total, transcript
    assert rest.startswith(obs), (obs, rest)
    transcript += obs
    rest = rest[len(obs):]


@pytest.mark.parametrize("task, name", [(CalculatorTask(), "calculator"), (GuessTask(), "guess")])
def test_demonstrations_earn_full_reward(task, name):
  examples = task.sample(np.random.default_rng(0), 300, "train")
  examples += task.sample(np.random.default_rng(1), 50, "eval")
  for ex in examples:
    total, transcript = _replay(ENVS[name], ex)
    assert total == 1.0 and transcript == ex.response
    assert len(ex.prompt) <= task.max_prompt_chars
    assert len(ex.response) <= task.max_response_chars


def test_demonstration_lengths():
  calc = CalculatorTask().sample(np.random.default_rng(0), 2000, "train")
  assert max(len(e.prompt) for e in calc) == 9 and max(len(e.response) for e in calc) == 46
  guess = GuessTask()
  assert (guess.max_prompt_chars, guess.max_response_chars, guess.max_guesses) == (11, 43, 5)
  responses = [guess.demonstration(s) for s in range(1, 32)]
  assert max(r.count("?") for r in responses) == 5
  assert guess.demonstration(16) == "16?"
  assert guess.demonstration(13) == "16?lower 8?higher 12?higher 14?lower 13?"


def test_calculator_env():
  env = ENVS["calculator"]()
  assert env.reset({"prompt": "12*7+5=", "answer": "89"}) == "12*7+5="
  assert env.step("<calc>12*7</calc>") == ("<result>84</result>", 0.0, False)
  assert env.step("x<calc>(2+3)*-4</calc>") == ("<result>-20</result>", 0.0, False)
  for bad in ["<calc></calc>", "<calc>1+</calc>", "<calc>2**8</calc>", "<calc>abc</calc>",
              "<calc>__import__('os')</calc>", "</calc>", "<calc>(1+2</calc>",
              "<calc>" + "9" * 10 + "</calc>", "<calc>" + "1+" * 20 + "1</calc>",
              "<calc>99999999*99999999*99999</calc>", "<calc>1/2</calc>"]:
    assert env.step(bad) == (calc_result(None), 0.0, False), bad
  assert env.step(" 89") == ("", 1.0, True)
  for wrong in ["88", "<calc>12*7+5", "89 89", ""]:  # a cut tool call is a final answer too
    env.reset({"prompt": "12*7+5=", "answer": "89"})
    assert env.step(wrong) == ("", 0.0, True), wrong


def test_evaluate():
  assert evaluate("37*46+58") == 1760
  assert evaluate("2 * (3 + 4) - -1") == 15
  assert evaluate("1-2-3") == -4 and evaluate("2*3*4") == 24 and evaluate("-(5)") == -5
  for bad in ["", "1+", "(", ")", "2**3", "1.5", "1e5", "a", "1 2", "()", "-" * 40 + "1",
              "(" * 20 + "1" + ")" * 20]:
    assert evaluate(bad) is None, bad


def test_guess_env():
  env = ENVS["guess"]()
  assert env.reset({"prompt": "guess 1-31:", "answer": "13", "high": 31}) == "guess 1-31:"
  assert env.step("16?") == ("lower ", 0.0, False)
  assert env.step("8?") == ("higher ", 0.0, False)
  assert env.step("what?") == ("invalid ", 0.0, False)
  assert env.step("13?") == ("", 1.0, True)
  env.reset({"prompt": "guess 1-31:", "answer": "13"})
  out = [env.step("1?") for _ in range(env.max_guesses)]
  assert out[-1] == ("", 0.0, True) and all(not o[2] for o in out[:-1])


def test_tasks_held_out_split_is_fixed():
  calc = CalculatorTask()
  train = calc.sample(np.random.default_rng(0), 3000, "train")
  held = calc.sample(np.random.default_rng(5), 300, "eval")
  assert not {e.prompt for e in train} & {e.prompt for e in held}
  assert held == calc.sample(np.random.default_rng(5), 300, "eval")  # deterministic
  # The guessing game hides its secret in the environment: training and evaluation play every
  # secret, the evaluation each in turn.
  guess = GuessTask()
  train = {e.answer for e in guess.sample(np.random.default_rng(0), 500, "train")}
  held = [e.answer for e in guess.sample(np.random.default_rng(0), 62, "eval")]
  assert len(train) == 31 and held == [str(i % 31 + 1) for i in range(62)]
  ex = guess.sample(np.random.default_rng(0), 1, "train")[0]
  assert ex.record()["high"] == 31 and ex.rejected != ex.chosen == ex.response


def test_data_source_tasks():
  cfg = DataConfig(task="calculator", tokenizer="char_tools", max_prompt_len=10,
                   max_response_len=47)
  source = DataSource(cfg)
  assert isinstance(source.tokenizer, CharToolsTokenizer)
  ex = source.examples("sft", 0, 4)
  assert ex == source.examples("sft", 0, 4) and ex[0].response.startswith("<calc>")
  batch = source.encoder.encode  # every demonstration is spelled by char_tools
  for e in ex:
    batch(e.prompt), batch(e.response)
  with pytest.raises(ConfigError, match="data.tokenizer=char_tools"):
    DataSource(DataConfig(task="calculator"))
  assert DataSource(DataConfig(task="guess")).examples("prompts", 0, 2)[0].prompt == "guess 1-31:"
  with pytest.raises(ConfigError, match="'calculator', 'guess'"):
    DataSource(DataConfig(task="nope"))


def test_char_tools_tokenizer():
  char, tools = CharTokenizer(), CharToolsTokenizer()
  assert char.vocab_size == 48 and tools.vocab_size == 51
  assert tools.chars[:len(char.chars)] == char.chars
  assert tools.encode(char.chars) == char.encode(char.chars) == list(range(3, 48))
  assert tools.encode("<>/") == [48, 49, 50]
  text = "<calc>12*7</calc>"
  assert tools.decode(tools.encode(text) + [2, 5]) == text
  with pytest.raises(ConfigError, match="data.tokenizer=char_tools"):
    char.encode("<calc>")


# ------------------------------------------------------------------ rendering

def test_text_format():
  tok = CharToolsTokenizer()
  fmt = make_format(tok, "text")
  assert isinstance(fmt, TextFormat)
  assert fmt.prompt_ids("1+2=") == [tok.bos_id] + tok.encode("1+2=")
  assert fmt.observation_ids([], "<result>3</result>", True) == tok.encode("<result>3</result>")
  with pytest.raises(ConfigError, match="chat template"):
    make_format(tok, "chat")


def _hf(folder, template):
  from transformers import AutoTokenizer
  tok = AutoTokenizer.from_pretrained(os.path.join(FAMILIES, "qwen3"), local_files_only=True)
  tok.chat_template = template
  tok.save_pretrained(str(folder))
  return HFTokenizer(str(folder))


# A ChatML-like template over the char vocabulary whose closing is "<eos>" then a newline.
CHATML = ("{% for m in messages %}<bos>{{ m['role'] }}\n{{ m['content'] }}<eos>\n{% endfor %}"
          "{% if add_generation_prompt %}<bos>assistant\n{% endif %}")
# No EOS in the closing: an assistant turn ends with "|" and the next role line.
PIPES = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}|{% endfor %}"
         "{% if add_generation_prompt %}a:{% endif %}")


@pytest.mark.parametrize("template, ended_with_eos", [
    (FAMILY_TEMPLATE, True), (FAMILY_TEMPLATE, False), (CHATML, True), (PIPES, False)])
def test_chat_format_incremental_equals_full(tmp_path, template, ended_with_eos):
  tok = _hf(tmp_path / "tok", template)
  fmt = ChatFormat(tok, role="user")
  turns = [("what is 2+3?", "<calc>2+3</calc>"), ("<result>5</result>", "5 i think"),
           ("again?", "yes 5")]
  messages, ids = [], []
  for k, (obs, action) in enumerate(turns):
    if k == 0:
      ids = fmt.prompt_ids(obs)
    else:
      ids += fmt.observation_ids(messages, obs, ended_with_eos)
    messages += [{"role": "user", "content": obs}, {"role": "assistant", "content": action}]
    # The policy's tokens: the action, then EOS or (a stop string inside it) nothing.
    ids += tok.encode(action) + ([tok.eos_id] if ended_with_eos else [])
  full = tok.chat(messages, False)
  assert fmt.eos_first == (template != PIPES)
  closing = fmt.closing[1:] if ended_with_eos else fmt.closing
  assert ids + closing == full
  # And the next generation prompt follows on.
  nxt = ids + fmt.observation_ids(messages, "bye", ended_with_eos)
  assert nxt == tok.chat(messages + [{"role": "user", "content": "bye"}], True)


@pytest.mark.parametrize("template, match", [
    # Renders only the last user message: earlier turns change once a message follows.
    ("{% for m in messages %}{% if m['role'] == 'assistant' or loop.last %}"
     "{{ m['role'][0] }}:{{ m['content'] }}|{% endif %}{% endfor %}"
     "{% if add_generation_prompt %}a:{% endif %}", "cannot be rendered incrementally"),
    # Keeps only the last three messages.
    ("{% for m in messages[-3:] %}{{ m['role'][0] }}:{{ m['content'] }}|{% endfor %}"
     "{% if add_generation_prompt %}a:{% endif %}", "not append-only at turn 2"),
])
def test_chat_format_refuses_non_append_only(tmp_path, template, match):
  tok = _hf(tmp_path / "tok", template)
  history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
  with pytest.raises(ConfigError) as e:
    fmt = ChatFormat(tok)
    fmt.observation_ids(history, "more", True)
    history += [{"role": "user", "content": "more"}, {"role": "assistant", "content": "ok"}]
    fmt.observation_ids(history, "again", True)
  msg = str(e.value)
  assert match in msg and f"data.tokenizer={tmp_path / 'tok'}" in msg
  assert "env.format=text" in msg


def test_chat_format_refuses_a_generation_prompt_that_is_rewritten(tmp_path):
  tok = _hf(tmp_path / "tok", "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}|"
            "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}")
  with pytest.raises(ConfigError, match="data.tokenizer=.*cannot be rendered incrementally"
                     ".*env.format=text"):
    ChatFormat(tok)


@pytest.mark.parametrize("task, name, tokenizer", [("calculator", "calculator", "char_tools"),
                                                   ("guess", "guess", "char")])
def test_rollout_layout_equals_the_sft_layout(task, name, tokenizer):
  """A policy that plays the demonstration, laid out as the driver does (prompt ids, each
  action's tokens, each observation's ids), is token for token the SFT sequence."""
  source = DataSource(DataConfig(task=task, tokenizer=tokenizer, max_prompt_len=12,
                                 max_response_len=48))
  tok, enc = source.tokenizer, source.encoder
  fmt = TextFormat(tok)
  spec = resolve_env(name)
  examples = source.examples("sft", 0, 16)
  runner = EnvRunner(spec, workers=2, timeout_s=5.0, errors="mask")
  firsts = runner.reset([ex.record() for ex in examples])
  for row, (ex, first) in enumerate(zip(examples, firsts)):
    ids, rest, history = fmt.prompt_ids(first), ex.response, []
    while True:
      ends = [rest.find(s) + len(s) for s in spec.stop_strings if s in rest]
      action = rest[:min(ends)] if ends else rest
      rest = rest[len(action):]
      action_ids = tok.encode(action) + ([] if ends else [tok.eos_id])  # a stop string, or EOS
      ids += action_ids
      ((obs, reward, done, failed),) = runner.step([row], [tok.decode(action_ids)])
      if done:
        break
      history.append({"role": "assistant", "content": action})
      ids += fmt.observation_ids(history, obs, False)
      rest = rest[len(obs):]
    assert not failed and reward == 1.0
    if ends:  # the episode ended at a stop string ("13?"): SFT appends EOS after it
      ids += [tok.eos_id]
    assert ids == enc.prompt_ids(ex) + enc.response_ids(ex.response)
  runner.close()


def test_runner_reset_must_return_a_str(capsys):
  class Silent(Counter):
    def reset(self, example):
      return None

  runner = EnvRunner(_spec(Silent), workers=0, timeout_s=1.0, errors="mask")
  assert runner.reset(_rows(2)) == [None, None]
  assert runner.metrics()["env/errors"] == 2.0
  assert "reset() returned a wrong result: 'None' (NoneType) is not a str on row 0" in \
      capsys.readouterr().out
