import pickle
import random

import pytest

from preftune.errors import UserError
from preftune.rewards.builtin import BUILTINS, accuracy, completion_text, format, soft_overlong_penalty


def chat(text):
    return [{"role": "assistant", "content": text}]


# --- accuracy -----------------------------------------------------------------------------------


def test_accuracy_numeric_string_and_answer_block():
    completions = ["19.0", " 19 ", "20", "Paris", "paris", "I think <answer> 42 </answer>", "<answer>41</answer>"]
    answers = ["19", "19", "19", "Paris", "Paris", "42", 42]
    got = accuracy(prompts=[""] * 7, completions=completions, completion_ids=[[]] * 7, answer=answers)
    assert got == [1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0]


def test_accuracy_last_answer_block_wins_and_chat_messages():
    blocks = [{"type": "text", "text": "<answer>7"}, {"type": "text", "text": "</answer>"}]  # multimodal content
    completions = [
        chat("<think>first 3</think><answer>3</answer> wait, <answer>4</answer>"),
        chat("<answer>3</answer>"),
        [{"role": "assistant", "content": blocks}],
    ]
    got = accuracy(prompts=[[{"role": "user", "content": "q"}]] * 3, completions=completions, answer=["4", "4", "7"])
    assert got == [1.0, 0.0, 1.0]


def test_accuracy_none_answer_is_not_applicable():
    got = accuracy(prompts=["a", "b"], completions=["1", "1"], answer=[None, "1"])
    assert got == [None, 1.0]


def test_accuracy_without_answer_column_is_user_error():
    with pytest.raises(UserError, match="accuracy.*needs an `answer` column"):
        accuracy(prompts=["a"], completions=["1"], completion_ids=[[1]], solution=["1"])


def test_completion_text_prefers_last_assistant_message():
    msgs = [
        {"role": "assistant", "content": "call"},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "done"},
    ]
    assert completion_text(msgs) == "done"
    assert completion_text("plain") == "plain"


# --- format -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<think>reason</think><answer>5</answer>", 1.0),
        ("  <think>\nmulti\nline\n</think>\n\n<answer>\n5\n</answer>\n", 1.0),
        ("<think></think> <answer></answer>", 1.0),
        ("<answer>5</answer>", 0.0),
        ("<think>reason</think>", 0.0),
        ("prefix <think>r</think><answer>5</answer>", 0.0),
        ("<think>r</think><answer>5</answer> trailing", 0.0),
        ("<think>r</think>text<answer>5</answer>", 0.0),
        ("<think>r</think><answer>5</answer><answer>6</answer>", 0.0),
        ("<think>a<think>b</think><answer>5</answer>", 0.0),
    ],
)
def test_format(text, expected):
    assert format(prompts=["p", "p"], completions=[text, chat(text)], completion_ids=[[], []]) == [expected, expected]


# --- soft_overlong ------------------------------------------------------------------------------


def test_soft_overlong_hand_values():
    f = BUILTINS["soft_overlong"]({"max_completion_length": 10, "overlong_buffer_len": 4})
    lengths = [0, 6, 7, 8, 10, 11]
    got = f(prompts=[""] * 6, completions=[""] * 6, completion_ids=[[1] * n for n in lengths])
    assert got == pytest.approx([0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    assert f.__name__ == "soft_overlong"


@pytest.mark.parametrize("max_len, cache", [(100, 20), (16, 16), (8, 0), (33, 7)])
def test_soft_overlong_matches_trl(max_len, cache):
    from trl.rewards import get_soft_overlong_punishment

    rng = random.Random(max_len * 31 + cache)
    ids = [[0] * rng.randint(0, max_len + 10) for _ in range(200)] + [[0] * n for n in range(max_len + 3)]
    ours = BUILTINS["soft_overlong"]({"max_completion_length": max_len, "overlong_buffer_len": cache})
    theirs = get_soft_overlong_punishment(max_completion_len=max_len, soft_punish_cache=cache)
    n = len(ids)
    assert ours(prompts=[""] * n, completions=[""] * n, completion_ids=ids) == pytest.approx(theirs(ids))


def test_soft_overlong_penalty_monotone_and_bounded():
    values = [soft_overlong_penalty(n, 50, 10) for n in range(70)]
    assert all(b <= a for a, b in zip(values, values[1:]))
    assert min(values) == -1.0 and max(values) == 0.0


@pytest.mark.parametrize(
    "options, match",
    [
        ({"overlong_buffer_len": 4}, "needs the `max_completion_length` option"),
        ({"max_completion_length": 10}, "needs the `overlong_buffer_len` option"),
        ({"max_completion_length": 10, "overlong_buffer_len": 11}, "must be <= `max_completion_length`"),
        ({"max_completion_length": "10", "overlong_buffer_len": 2}, "must be an integer"),
        ({"max_completion_length": 10, "overlong_buffer_len": -1}, "must be an integer >= 0"),
    ],
)
def test_soft_overlong_bad_options(options, match):
    with pytest.raises(UserError, match=match) as info:
        BUILTINS["soft_overlong"](options)
    assert "soft_overlong" in str(info.value)


# --- length -------------------------------------------------------------------------------------


def test_length_reward_plain_and_target():
    ids = [[1] * n for n in (0, 5, 10, 30)]
    plain = BUILTINS["length"]({"max_completion_length": 10})
    assert plain(prompts=[""] * 4, completions=[""] * 4, completion_ids=ids) == pytest.approx([0.0, -0.5, -1.0, -1.0])
    target = BUILTINS["length"]({"max_completion_length": 10, "length_target": 5})
    assert target(prompts=[""] * 4, completions=[""] * 4, completion_ids=ids) == pytest.approx([-0.5, 0.0, -0.5, -1.0])
    assert plain.__name__ == target.__name__ == "length"


def test_length_needs_max_completion_length():
    with pytest.raises(UserError, match="length.*max_completion_length"):
        BUILTINS["length"]({})


# --- registry of builtins -----------------------------------------------------------------------


def test_builtins_named_ignore_unused_options_and_pickle():
    options = {"max_completion_length": 8, "overlong_buffer_len": 2, "unrelated": object()}
    for name, factory in BUILTINS.items():
        func = factory(options)
        assert func.__name__ == name
        assert func.__doc__
        clone = pickle.loads(pickle.dumps(func))
        args = dict(prompts=["p"], completions=["<answer>1</answer>"], completion_ids=[[1] * 7], answer=["1"])
        assert clone(**args) == func(**args)
