"""Host rewards from the user's own files and modules, their failure handling, and the
built-in math verifier, on real-looking strings."""

import sys
import textwrap

import numpy as np
import pytest

from jaxrlhf import rewards as R
from jaxrlhf.config import ConfigError


def _file(tmp_path, body, name="my_reward.py"):
  path = tmp_path / name
  path.write_text(textwrap.dedent(body))
  return str(path)


ROWS = [{"prompt": "2+2=", "answer": "4", "tests": ["assert f() == 4"], "meta": {"id": 7}},
        {"prompt": "3+3=", "answer": "6", "tests": [], "meta": {"id": 8}}]


def test_a_function_from_a_file_gets_every_field_of_each_example(tmp_path):
  path = _file(tmp_path, """
      SEEN = []
      def score(responses, examples):
        SEEN.append((list(responses), [dict(e) for e in examples]))
        return [float(r.strip() == e["answer"]) + 0.1 * len(e["tests"])
                for r, e in zip(responses, examples)]
      """)
  reward = R.resolve_host_reward(f"host:{path}:score")
  assert reward.where == f"{path}:score"
  got = R.score_host(reward, ["4", "5", "6", " 6 "], ROWS, num_samples=2)
  np.testing.assert_allclose(got.scores, [1.1, 0.1, 1.0, 1.0], rtol=1e-6)
  assert got.scores.dtype == np.float32 and (got.errors, got.invalid) == (0, 0)
  module = sys.modules[reward.fn.__module__]
  responses, examples = module.SEEN[-1]
  # Each prompt's example once per sample, with every field of its row.
  assert responses == ["4", "5", "6", " 6 "]
  assert [e["meta"]["id"] for e in examples] == [7, 7, 8, 8]
  assert examples[0]["tests"] == ["assert f() == 4"] and examples[2]["prompt"] == "3+3="
  # The same file is loaded once, whichever source names it.
  assert R.resolve_host_reward(f"host:{path}:score").fn is reward.fn
  # The user's function reads what it wants: no answer check for it.
  assert not R.reads_answer(f"host:{path}:score") and R.reads_answer("host:math_verify")


def test_a_function_from_a_module(tmp_path, monkeypatch):
  _file(tmp_path, "def length(responses, examples):\n  return [len(r) for r in responses]\n",
        "byo_reward_mod.py")
  monkeypatch.syspath_prepend(str(tmp_path))
  reward = R.resolve_host_reward("host:byo_reward_mod:length")
  np.testing.assert_array_equal(R.score_host(reward, ["ab", "c"], ROWS).scores, [2, 1])
  _file(tmp_path, "import numpy as np\n"
                  "def passed(responses, examples):\n"
                  "  return np.array([r == e['answer'] for r, e in zip(responses, examples)])\n",
        "byo_reward_bool.py")
  passed = R.resolve_host_reward("host:byo_reward_bool:passed")
  np.testing.assert_array_equal(R.score_host(passed, ["4", "5"], ROWS).scores, [1.0, 0.0])
  with pytest.raises(ConfigError, match=r"no module named 'no_such_pkg'; install the package"):
    R.resolve_host_reward("host:no_such_pkg.mod:f")


TRL_REWARDS = """
    import re
    SEEN = []

    def accuracy(completions, answer, **kwargs):
      # A reward written for TRL's GRPOTrainer: completions (strings, or one-message lists for
      # chat prompts), the dataset's columns as keyword lists, and whatever else TRL passes.
      SEEN.append({"completions": completions, "answer": answer, **kwargs})
      texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
      return [float(t.strip() == a) for t, a in zip(texts, answer)]

    def only_named(prompts, completions, meta):
      # No **kwargs: called with exactly the arguments it names.
      return [float(len(c)) + m["id"] / 100 for c, m in zip(completions, meta)]

    def anything(**kwargs):
      return [len(kwargs["completion_ids"][i]) for i in range(len(kwargs["completions"]))]

    def needs_solution(completions, solution, **kwargs):
      return [0.0] * len(completions)
    """


def test_trl_style_reward_functions_run_unchanged(tmp_path):
  """TRL GRPOTrainer's convention (fn(completions, **kwargs)), chosen by the signature: the
  arguments by keyword, one entry per response, every data column but the prompt as a list."""
  path = _file(tmp_path, TRL_REWARDS, "trl_rewards.py")
  acc = R.resolve_host_reward(f"host:{path}:accuracy")
  assert acc.style == "trl"
  ids = [[5, 2], [6, 2], [7], [8, 9, 2]]
  got = R.score_host(acc, ["4", "5", "6", " 6 "], ROWS, num_samples=2, completion_ids=ids)
  np.testing.assert_array_equal(got.scores, [1.0, 0.0, 1.0, 1.0])
  seen = sys.modules[acc.fn.__module__].SEEN[-1]
  assert seen["completions"] == ["4", "5", "6", " 6 "]  # strings for plain-text prompts
  assert seen["answer"] == ["4", "4", "6", "6"]
  assert seen["prompts"] == ["2+2=", "2+2=", "3+3=", "3+3="] and "prompt" not in seen
  assert [m["id"] for m in seen["meta"]] == [7, 7, 8, 8] and seen["tests"][0] == ROWS[0]["tests"]
  assert seen["completion_ids"] == ids and seen["trainer_state"] is None
  # Chat prompts: TRL's conversational format, each completion a one-message list.
  chat = [{"prompt": [{"role": "user", "content": "2+2="}], "answer": "4"}]
  np.testing.assert_array_equal(R.score_host(acc, ["4"], chat).scores, [1.0])
  seen = sys.modules[acc.fn.__module__].SEEN[-1]
  assert seen["completions"] == [[{"role": "assistant", "content": "4"}]]
  assert seen["prompts"] == [chat[0]["prompt"]] and seen["completion_ids"] is None
  # Without **kwargs only the named arguments come; with only **kwargs, all of them.
  named = R.resolve_host_reward(f"host:{path}:only_named")
  np.testing.assert_allclose(R.score_host(named, ["ab", "c"], ROWS).scores, [2.07, 1.08])
  anything = R.resolve_host_reward(f"host:{path}:anything")
  assert anything.style == "trl"
  np.testing.assert_array_equal(R.score_host(anything, ["a", "b"], ROWS,
                                             completion_ids=[[1], [1, 2]]).scores, [1, 2])
  # A column the function requires and the data lacks: one line naming it and the fix.
  needs = R.resolve_host_reward(f"host:{path}:needs_solution")
  with pytest.raises(ConfigError, match=r"trl_rewards.py:needs_solution requires 'solution', "
                                        r"which the data rows do not have \(their columns: "
                                        r"answer, tests, meta;.*data.fields=SOURCE:solution"):
    R.score_host(needs, ["a", "b"], ROWS)
  # The (responses, examples) convention is still what a two-argument function gets.
  two = _file(tmp_path, "def f(responses, examples, **kw):\n  return [1.0] * len(responses)\n",
              "two.py")
  assert R.resolve_host_reward(f"host:{two}:f").style == "examples"


def test_completion_ids_end_at_the_first_eos():
  """What an RL step passes a TRL-style function as ``completion_ids`` (a whole GRPO run with
  one: tests/test_real_models.py)."""
  from jaxrlhf.train.rl import completion_ids
  assert completion_ids(np.array([4, 5, 2, 0, 0]), 2) == [4, 5, 2]
  assert completion_ids([4, 5, 6], 2) == [4, 5, 6]


@pytest.mark.parametrize("body, source, message", [
    (None, "host:{dir}/missing.py:f", r"missing.py: file not found"),
    ("def f(responses, examples):\n  return []\n", "host:{path}:g",
     r"my_reward.py defines no 'g' \(its functions: f\); define fn\(responses"),
    ("f = 3\n", "host:{path}:f", r"my_reward.py:f is a int, not a function"),
    ("def f(responses):\n  return []\n", "host:{path}:f",
     r"my_reward.py:f\(responses\) fits neither host reward signature: write fn\(responses: "
     r"list\[str\], examples: list\[dict\]\).*or TRL's fn\(completions, \*\*kwargs\)"),
    ("import no_such_module_here\n", "host:{path}:f",
     r"my_reward.py failed to load at .*my_reward.py:1 in <module>: ModuleNotFoundError"),
    ("def f(responses, examples)\n  return []\n", "host:{path}:f",
     r"my_reward.py failed to load at .*my_reward.py:1: SyntaxError"),
])
def test_bad_reward_files_name_the_file_the_function_and_the_fix(tmp_path, body, source, message):
  path = _file(tmp_path, body) if body else ""
  src = source.format(dir=tmp_path, path=path)
  with pytest.raises(ConfigError, match=message) as info:
    R.resolve_host_reward(src, "grpo.reward.sources")
  assert str(info.value).startswith("grpo.reward.sources: ")


def test_wrong_lengths_and_types_stop_with_the_function_named(tmp_path):
  path = _file(tmp_path, """
      def one(responses, examples):
        return [1.0]
      def scalar(responses, examples):
        return 1.0
      """)
  with pytest.raises(ConfigError, match=r"my_reward.py:one returned 1 score\(s\) for 2 responses"):
    R.score_host(R.resolve_host_reward(f"host:{path}:one"), ["a", "b"], ROWS[:2])
  with pytest.raises(ConfigError, match=r"my_reward.py:scalar returned float .*returns a list"):
    R.score_host(R.resolve_host_reward(f"host:{path}:scalar"), ["a", "b"], ROWS[:2])


def test_a_stuck_call_is_abandoned_at_the_limit_the_retry_shares(tmp_path, capsys):
  """A batch call that raises is retried one response at a time, all of them within the
  batch's own reward.timeout_s: a response whose call hangs is abandoned at that limit, and
  the responses after it (no time left) are masked as timeouts too."""
  import time
  path = _file(tmp_path, """
      import time
      def hangs(responses, examples):
        if len(responses) > 1:
          raise ValueError("one at a time, please")
        if responses[0] == "hang":
          time.sleep(3600)
        return [1.0]
      """)
  reward = R.resolve_host_reward(f"host:{path}:hangs")
  assert not reward.bounded and R.resolve_host_reward("host:math_verify").bounded
  t0 = time.monotonic()
  got = R.score_host(reward, ["a", "hang", "b"], [{"answer": ""}] * 3, timeout_s=0.5)
  assert time.monotonic() - t0 < 5
  np.testing.assert_array_equal(got.scores, [1.0, np.nan, np.nan])
  assert (got.errors, got.timeouts) == (0, 2) and got.metrics()["reward/host_timeouts"] == 2.0
  assert "responses 1 to 2 did not return within reward.timeout_s=0.5 s" in capsys.readouterr().out
  with pytest.raises(ConfigError, match=r"hangs did not return within reward.timeout_s=0.2 s on a "
                                        r"batch of 1 responses"):
    R.score_host(reward, ["hang"], [{"answer": ""}], on_error="raise", timeout_s=0.2)


def test_timeout_zero_runs_the_function_on_the_calling_thread(tmp_path):
  """reward.timeout_s=0: no limit, and the function runs where the step does (code that sets
  signal handlers needs the main thread); otherwise it runs on a daemon thread."""
  path = _file(tmp_path, """
      import signal, threading
      def main_only(responses, examples):
        signal.signal(signal.SIGALRM, signal.getsignal(signal.SIGALRM))  # main thread only
        return [float(threading.current_thread().daemon) for _ in responses]
      """)
  reward = R.resolve_host_reward(f"host:{path}:main_only")
  assert R.score_host(reward, ["a"], [{"answer": ""}], timeout_s=0).scores.tolist() == [0.0]
  got = R.score_host(reward, ["a"], [{"answer": ""}], timeout_s=5)
  assert got.errors == 1 and np.isnan(got.scores[0])  # signal only works in the main thread


def test_exceptions_and_bad_values_are_masked_and_counted_or_stop(tmp_path, capsys):
  path = _file(tmp_path, """
      def picky(responses, examples):
        out = []
        for r in responses:
          if r == "boom":
            raise ValueError("cannot parse " + r)
          out.append({"ok": 1.0, "str": "1.0", "none": None, "nan": float("nan")}[r])
        return out
      """)
  reward = R.resolve_host_reward(f"host:{path}:picky")
  rows = [{"answer": ""}] * 5
  got = R.score_host(reward, ["ok", "boom", "str", "none", "nan"], rows)
  np.testing.assert_array_equal(got.scores, [1.0, np.nan, np.nan, np.nan, np.nan])
  assert (got.errors, got.invalid, got.unscored) == (1, 1, 2)
  assert got.metrics() == {"reward/host_errors": 1.0, "reward/host_invalid": 1.0,
                           "reward/host_unscored": 2.0, "reward/host_timeouts": 0.0}
  out = capsys.readouterr().out
  assert "my_reward.py:picky: 2 of 5 responses could not be scored" in out
  assert "ValueError: cannot parse boom at " in out and "my_reward.py:6 in picky)" in out
  assert "reward.host_errors=raise" in out
  R.score_host(reward, ["boom"], rows[:1])
  assert capsys.readouterr().out == ""  # said once per source
  with pytest.raises(ConfigError, match=r"picky raised ValueError: cannot parse boom at .*"
                                        r"my_reward.py:6 in picky on a batch.*"
                                        r"reward.host_errors=mask"):
    R.score_host(reward, ["ok", "boom"], rows[:2], on_error="raise")
  with pytest.raises(ConfigError, match=r"returned '1.0' \(str\) for response 0; return a float"):
    R.score_host(reward, ["str"], rows[:1], on_error="raise")


@pytest.mark.parametrize("response, answer, want", [
    (r"So the probability is $\boxed{\frac{1}{2}}$.", "0.5", 1.0),
    (r"The answer is \boxed{0.5}", r"\frac{1}{2}", 1.0),
    (r"Each side is $\boxed{5\text{ cm}}$ long.", "5", 1.0),
    ("She has 42 apples left. Hope this helps!", "42", 1.0),
    (r"First 3+4=7, then doubling: \boxed{14}. Let me double-check... yes, 14.", "14", 1.0),
    (r"$\boxed{12}$ dollars in total", "12", 1.0),
    (r"The answer is \boxed{\frac{1}{3}}", "0.5", 0.0),
    ("I think it is 41.", "42", 0.0),
    ("I don't know.", "42", 0.0),
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}", 1.0),
])
def test_math_verify_compares_final_answers_by_value(response, answer, want):
  assert R.HOST_RULES["math_verify"]([response], [{"answer": answer}]) == [want]


def test_math_verify_masks_unparsable_references_and_the_format_reward():
  got = R.score_host(R.resolve_host_reward("host:math_verify"), ["4", "4"],
                     [{"answer": "4"}, {"answer": "??"}])
  np.testing.assert_array_equal(got.scores, [1.0, np.nan])
  assert got.unscored == 1
  fmt = R.HOST_RULES["math_format"]
  assert fmt([r"so \boxed{\frac{1}{2}}", r"\boxed{1} or \boxed{2}", "1/2", r"\boxed{}",
              r"\boxed{x"], [{}] * 5) == [1.0, 0.0, 0.0, 0.0, 0.0]
  assert R.boxed_answers(r"a \boxed{\frac{1}{2}} b \boxed {3}") == [r"\frac{1}{2}", "3"]
  assert not R.reads_answer("host:math_format")
