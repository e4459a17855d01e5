import functools
import math
import textwrap
import uuid

import numpy as np
import pytest
import torch

from preftune.errors import UserError
from preftune.rewards.functions import (
    RewardState,
    as_completions,
    compute_rewards,
    load_reward_function,
    reward_name,
)


def write(path, body):
    path.write_text(textwrap.dedent(body))
    return path


def unique_module(tmp_path, body):
    """A module file in tmp_path with a fresh name, so sys.modules caching can't mask a test."""
    name = f"user_rewards_{uuid.uuid4().hex[:8]}"
    write(tmp_path / f"{name}.py", body)
    return name


def rows(n):
    return dict(prompts=[f"p{i}" for i in range(n)], completions=[f"c{i}" for i in range(n)],
                completion_ids=[[1] * (i + 1) for i in range(n)])


# --- loading ------------------------------------------------------------------------------------


def test_load_builtin_with_options():
    f = load_reward_function("soft_overlong", max_completion_length=10, overlong_buffer_len=2, beta=0.1)
    assert reward_name(f) == "soft_overlong"
    assert f(prompts=[""], completions=[""], completion_ids=[[0] * 9]) == [-0.5]


def test_unknown_builtin_suggests_nearest():
    with pytest.raises(UserError, match=r"reward 'acuracy'.*did you mean 'accuracy'"):
        load_reward_function("acuracy")


def test_load_module_function_importable_and_from_base_dir(tmp_path):
    f = load_reward_function("preftune.rewards.builtin:format")
    assert reward_name(f) == "format"
    name = unique_module(tmp_path, "def ones(completions, **kw):\n    return [1.0] * len(completions)\n")
    g = load_reward_function(f"{name}:ones", base_dir=tmp_path)
    assert g(completions=["a", "b"]) == [1.0, 1.0]
    assert str(tmp_path) not in __import__("sys").path  # base_dir only on sys.path during the import


def test_load_file_function_relative_and_absolute(tmp_path):
    (tmp_path / "cfg").mkdir()
    write(tmp_path / "cfg" / "helper_mod_for_file_test.py", "SCALE = 3.0\n")
    write(tmp_path / "cfg" / "my_rewards.py", """
        from helper_mod_for_file_test import SCALE  # a sibling import must work

        def scaled_len(completions, completion_ids, **kwargs):
            return [SCALE * len(ids) for ids in completion_ids]
    """)
    rel = load_reward_function("my_rewards.py:scaled_len", base_dir=tmp_path / "cfg")
    absolute = load_reward_function(f"{tmp_path / 'cfg' / 'my_rewards.py'}:scaled_len")
    assert rel(completions=["x"], completion_ids=[[1, 2]]) == [6.0]
    assert reward_name(rel) == reward_name(absolute) == "scaled_len"


def test_two_files_with_same_name_do_not_collide(tmp_path):
    for sub, value in (("a", 1.0), ("b", 2.0)):
        (tmp_path / sub).mkdir()
        write(tmp_path / sub / "rewards.py", f"def r(completions, **kw):\n    return [{value}] * len(completions)\n")
    fa = load_reward_function("a/rewards.py:r", base_dir=tmp_path)
    fb = load_reward_function("b/rewards.py:r", base_dir=tmp_path)
    assert fa(completions=["x"]) == [1.0] and fb(completions=["x"]) == [2.0]


def test_load_errors_name_the_spec(tmp_path):
    write(tmp_path / "broken.py", "import definitely_not_a_module_xyz\n")
    write(tmp_path / "ok.py", "VALUE = 3\ndef reward_fn(completions, **kw):\n    return [0.0] * len(completions)\n")
    cases = [
        ("missing.py:f", r"reward 'missing.py:f'.*file not found"),
        ("broken.py:f", r"reward 'broken.py:f'.*ModuleNotFoundError.*definitely_not_a_module_xyz"),
        ("ok.py:reward_fm", r"reward 'ok.py:reward_fm'.*no attribute 'reward_fm'.*did you mean 'reward_fn'"),
        ("ok.py:VALUE", r"reward 'ok.py:VALUE'.*int, not a callable"),
        ("no_such_module_qq:f", r"reward 'no_such_module_qq:f'.*cannot import module 'no_such_module_qq'"),
        ("math:pi", r"reward 'math:pi'.*float, not a callable"),
        ("math:nope", r"reward 'math:nope'.*has no attribute 'nope'"),
        ("ok.py:", r"expected 'module:function'"),
        ("", r"empty reward spec"),
    ]
    for spec, match in cases:
        with pytest.raises(UserError, match=match) as info:
            load_reward_function(spec, base_dir=tmp_path)
        assert "\n" not in str(info.value)


def test_module_import_error_message_is_one_line(tmp_path):
    name = unique_module(tmp_path, "raise RuntimeError('bad config\\nsecond line')\n")
    with pytest.raises(UserError, match=r"RuntimeError: bad config second line$") as info:
        load_reward_function(f"{name}:f", base_dir=tmp_path)
    assert "\n" not in str(info.value)


def test_reward_name_fallbacks():
    def base(completions, **kw):
        return [0.0] * len(completions)

    class Scorer:
        def __call__(self, completions, **kw):
            return [0.0] * len(completions)

    named = functools.partial(base)
    named.__name__ = "custom"
    assert reward_name(base) == "base"
    assert reward_name(functools.partial(functools.partial(base))) == "base"
    assert reward_name(named) == "custom"
    assert reward_name(Scorer()) == "Scorer"


# --- compute_rewards ----------------------------------------------------------------------------


def test_weighted_nansum_and_all_none_rows():
    def a(completions, **kw):
        return [1.0, None, None, 0.5]

    def b(completions, **kw):
        return [2.0, 3.0, None, None]

    res = compute_rewards([a, b], **rows(4), columns={}, weights=[0.5, 2.0])
    nan = math.nan
    expected_per = torch.tensor([[1.0, 2.0], [nan, 3.0], [nan, nan], [0.5, nan]])
    torch.testing.assert_close(res.per_func, expected_per, equal_nan=True)
    # Hand values: row 0 = 0.5*1 + 2*2, row 1 = 2*3 (None skipped), row 2 unscorable, row 3 = 0.5*0.5
    torch.testing.assert_close(res.total, torch.tensor([4.5, 6.0, nan, 0.25]), equal_nan=True)
    assert res.per_func.dtype == res.total.dtype == torch.float32
    assert res.names == ["a", "b"]


def test_total_matches_trl_aggregation_formula():
    # TRL 1.16 GRPOTrainer: (rewards_per_func * weights.unsqueeze(0)).nansum(1), rows all-NaN -> NaN.
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(12, 3, generator=gen)
    table[torch.rand(12, 3, generator=gen) < 0.3] = torch.nan
    table[5] = torch.nan  # at least one unscorable row
    weights = [0.3, -1.0, 2.5]
    funcs = []
    for k in range(3):
        col = [None if math.isnan(v) else v for v in table[:, k].tolist()]
        funcs.append(functools.partial(lambda completions, col, **kw: col, col=col))
    res = compute_rewards(funcs, **rows(12), columns={}, weights=weights)
    ref = (table * torch.tensor(weights).unsqueeze(0)).nansum(dim=1)
    ref[torch.isnan(table).all(dim=1)] = torch.nan
    torch.testing.assert_close(res.total, ref, equal_nan=True)
    assert res.names == ["<lambda>", "<lambda>_2", "<lambda>_3"]  # duplicate metric names are suffixed


def test_contract_arguments_columns_and_chat_completions():
    seen = {}

    def spy(prompts, completions, completion_ids, answer, trainer_state, log_extra, log_metric, **kwargs):
        seen.update(prompts=prompts, completions=completions, ids=completion_ids, answer=answer,
                    step=trainer_state.global_step, extra=kwargs)
        log_metric("m", 1.0)
        log_extra("col", [1, 2])
        return [0.0, 1.0]

    prompts = [[{"role": "user", "content": "2+2?"}]] * 2
    completions = as_completions(prompts, ["4", "5"])
    res = compute_rewards([spy], prompts, completions, [[7], [8, 9]],
                          columns={"answer": ["4", "4"], "prompt": ["x", "x"], "level": [1, 2]},
                          extra_kwargs={"trainer_state": RewardState(global_step=5)})
    assert seen["completions"] == [[{"role": "assistant", "content": "4"}], [{"role": "assistant", "content": "5"}]]
    assert seen["answer"] == ["4", "4"] and seen["ids"] == [[7], [8, 9]] and seen["step"] == 5
    assert seen["extra"] == {"level": [1, 2]}  # `prompt` is dropped like TRL does
    assert res.total.tolist() == [0.0, 1.0]
    assert res.log.record() == {"m": 1.0, "extra/col": [1, 2]}  # what the function logged comes back
    assert as_completions(["plain"], ["t"]) == ["t"]


def test_builtins_and_trl_rewards_together():
    from trl.rewards import get_soft_overlong_punishment, think_format_reward

    funcs = [load_reward_function(n, max_completion_length=4, overlong_buffer_len=2) for n in ("accuracy", "format")]
    funcs.append(think_format_reward)  # a TRL reward runs unchanged
    funcs.append(get_soft_overlong_punishment(4, 2))
    prompts = [[{"role": "user", "content": "q"}]] * 3
    texts = ["<think>r</think><answer>4</answer>", "<answer>4</answer>", "<think>r</think><answer>5</answer>"]
    res = compute_rewards(funcs, prompts, as_completions(prompts, texts), [[1] * 2, [1] * 3, [1] * 9],
                          columns={"answer": ["4", "4", None]})
    torch.testing.assert_close(res.per_func, torch.tensor(
        [[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, -0.5], [math.nan, 1.0, 1.0, -1.0]]), equal_nan=True)
    assert res.names == ["accuracy", "format", "think_format_reward", "soft_overlong_punishment_reward"]


def test_numpy_and_tensor_outputs_accepted():
    res = compute_rewards([lambda completions, **kw: np.array([1.0, 2.0]),
                           lambda completions, **kw: [torch.tensor(0.5), np.float32(1.5)]],
                          **rows(2), columns={})
    assert res.total.tolist() == [1.5, 3.5]


@pytest.mark.parametrize(
    "output, match",
    [
        ({"a": 1.0}, r"reward 'bad'.*returned a dict, expected a list of 3 floats"),
        (3.0, r"reward 'bad'.*returned a float, expected a list"),
        ([1.0, 2.0], r"reward 'bad'.*returned 2 values, expected 3"),
        ([1.0, "x", 2.0], r"reward 'bad'.*non-numeric value 'x' at row 1"),
        ([1.0, 2.0, math.nan], r"reward 'bad'.*non-finite value nan at row 2"),
        ([math.inf, 2.0, 1.0], r"reward 'bad'.*non-finite value inf at row 0"),
    ],
)
def test_bad_outputs_name_function(output, match):
    def bad(completions, **kw):
        return output

    with pytest.raises(UserError, match=match):
        compute_rewards([bad], **rows(3), columns={})


def test_raising_function_is_user_error_with_type_and_message():
    def explode(completions, **kw):
        raise KeyError("missing field\nmore detail")

    with pytest.raises(UserError, match=r"reward 'explode'.*raised KeyError: 'missing field") as info:
        compute_rewards([explode], **rows(2), columns={})
    assert "\n" not in str(info.value)


def test_builtin_user_error_passes_through():
    with pytest.raises(UserError, match="accuracy.*needs an `answer` column"):
        compute_rewards([load_reward_function("accuracy")], **rows(2), columns={"solution": ["1", "2"]})


def test_weights_validation():
    f = load_reward_function("format")
    with pytest.raises(UserError, match="2 reward weights for 1 reward functions"):
        compute_rewards([f], **rows(2), columns={}, weights=[1.0, 2.0])
    with pytest.raises(UserError, match="finite"):
        compute_rewards([f], **rows(2), columns={}, weights=[math.nan])


def test_column_clashing_with_argument_is_user_error():
    with pytest.raises(UserError, match="column 'completions' clashes"):
        compute_rewards([load_reward_function("format")], **rows(2), columns={"completions": ["a", "b"]})


def test_async_reward_function():
    async def judge(completions, **kw):
        return [float(len(c)) for c in completions]

    res = compute_rewards([judge], **rows(2), columns={})
    assert res.total.tolist() == [2.0, 2.0]
