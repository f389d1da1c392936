"""Name resolution, option checking, column naming and per-sample scoring."""

import doctest
import math
import re
import textwrap

import numpy as np
import pytest

from rlpipe.rewards import registry
from rlpipe.rewards.functions import REWARD_FUNCTIONS, Sample, exact_answer
from rlpipe.rewards.registry import (
    RewardSpec,
    check_reward_options,
    component_column,
    component_columns,
    prepare_rewards,
    resolve_reward,
    score_sample,
)

VALID = ("code_tests, digit_match, environment_reward, exact_answer, format_regex, length_penalty, reward_model, "
         "or 'package.module:function'")

USER_MODULE = '''
def has_two_lines(sample, *, min_lines):
    return 1.0 if sample.completion.count("\\n") + 1 >= min_lines else 0.0

def returns(sample, *, value):
    return value

def boom(sample):
    raise ZeroDivisionError("bad row")

class Scorers:
    @staticmethod
    def shout(sample):
        return float(sample.completion.isupper())

NOT_CALLABLE = 3
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent(USER_MODULE))
    (tmp_path / "broken_rewards.py").write_text("import package_that_does_not_exist\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_rewards"


def make(completion="", answer=None, tokens=1):
    return Sample(
        prompt="Q", completion=completion, answer=answer, metadata={},
        completion_tokens=tokens, truncated=False,
    )


def test_doctests_pass():
    result = doctest.testmod(registry)
    assert result.attempted >= 5
    assert result.failed == 0


# ---------------------------------------------------------------- resolve_reward


def test_resolve_builtin():
    assert resolve_reward("exact_answer") is exact_answer
    for name, fn in REWARD_FUNCTIONS.items():
        assert resolve_reward(name) is fn


def test_resolve_user_function(user_module):
    fn = resolve_reward("my_rewards:has_two_lines")
    assert fn.__name__ == "has_two_lines"
    assert fn(make("a\nb"), min_lines=2) == 1.0


def test_resolve_dotted_attribute(user_module):
    fn = resolve_reward("my_rewards:Scorers.shout")
    assert fn(make("HI")) == 1.0


def test_resolve_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match=re.escape(f"unknown reward 'exact_anwser'; valid names: {VALID}")):
        resolve_reward("exact_anwser")


@pytest.mark.parametrize("name", [":f", "my_rewards:", "a:b:c"])
def test_resolve_malformed_import_path(name):
    with pytest.raises(ValueError, match=re.escape(f"reward {name!r} is not of the form 'package.module:function'")):
        resolve_reward(name)


def test_resolve_missing_module():
    with pytest.raises(ValueError, match="reward 'no_such_module:f': cannot import module 'no_such_module'"):
        resolve_reward("no_such_module:f")


def test_resolve_module_whose_own_import_fails(user_module):
    with pytest.raises(
        ValueError, match="cannot import module 'broken_rewards': No module named 'package_that_does_not_exist'"
    ):
        resolve_reward("broken_rewards:f")


def test_resolve_missing_attribute(user_module):
    with pytest.raises(ValueError, match="reward 'my_rewards:nope': module 'my_rewards' has no attribute 'nope'"):
        resolve_reward("my_rewards:nope")
    with pytest.raises(ValueError, match="module 'my_rewards' has no attribute 'Scorers.nope'"):
        resolve_reward("my_rewards:Scorers.nope")


def test_resolve_not_callable(user_module):
    with pytest.raises(TypeError, match="reward 'my_rewards:NOT_CALLABLE': 'NOT_CALLABLE' in module 'my_rewards' is a int, not callable"):
        resolve_reward("my_rewards:NOT_CALLABLE")


# ---------------------------------------------------------------- check_reward_options

EXACT_OPTIONS = {"answer_prefix": None, "tolerance": 0.0, "case_sensitive": True}


def test_check_options_accepts_complete_options():
    check_reward_options(exact_answer, EXACT_OPTIONS, "exact_answer")  # no error


def test_check_options_unknown_option_names_reward_and_option():
    options = {**EXACT_OPTIONS, "tolerence": 0.1}
    with pytest.raises(
        ValueError,
        match="reward 'exact_answer' has no option 'tolerence'; its options are: answer_prefix, case_sensitive, tolerance",
    ):
        check_reward_options(exact_answer, options, "exact_answer")


def test_check_options_missing_required_option():
    options = {"answer_prefix": None}
    with pytest.raises(ValueError, match="reward 'exact_answer' is missing required option\\(s\\): tolerance, case_sensitive"):
        check_reward_options(exact_answer, options, "exact_answer")


def test_check_options_of_function_without_options():
    def no_options(sample):
        return 0.0

    check_reward_options(no_options, {}, "no_options")
    with pytest.raises(ValueError, match="reward 'no_options' has no option 'x'; its options are: \\(none\\)"):
        check_reward_options(no_options, {"x": 1}, "no_options")


def test_check_options_defaults_and_kwargs():
    def with_default(sample, scale=1.0):
        return scale

    def any_kwargs(sample, *, needed, **rest):
        return needed

    check_reward_options(with_default, {}, "with_default")
    check_reward_options(with_default, {"scale": 2.0}, "with_default")
    check_reward_options(any_kwargs, {"needed": 1, "anything": 2}, "any_kwargs")
    with pytest.raises(ValueError, match="reward 'any_kwargs' is missing required option\\(s\\): needed"):
        check_reward_options(any_kwargs, {"anything": 2}, "any_kwargs")
    with pytest.raises(ValueError, match="reward 'any_kwargs' has no option 'sample'"):
        check_reward_options(any_kwargs, {"needed": 1, "sample": 2}, "any_kwargs")


def test_check_options_rejects_function_without_sample_parameter():
    def keyword_only(*, sample):
        return 0.0

    with pytest.raises(TypeError, match="reward 'kw': the function must take the sample as its first positional parameter"):
        check_reward_options(keyword_only, {}, "kw")
    with pytest.raises(TypeError, match="reward 'none': the function must take the sample"):
        check_reward_options(lambda: 0.0, {}, "none")


def test_check_options_rejects_required_positional_only_option():
    def positional(sample, extra, /):
        return 0.0

    with pytest.raises(TypeError, match="reward 'pos': required positional-only parameter\\(s\\) extra cannot be given as options"):
        check_reward_options(positional, {}, "pos")


def test_check_options_rejects_non_mapping():
    with pytest.raises(TypeError, match="reward 'exact_answer': options must be a mapping, got NoneType"):
        check_reward_options(exact_answer, None, "exact_answer")


def test_check_options_unreadable_signature():
    class Opaque:
        __signature__ = "not a signature"

        def __call__(self, sample):
            return 0.0

    with pytest.raises(TypeError, match="reward 'opaque': cannot read the signature of"):
        check_reward_options(Opaque(), {}, "opaque")


# ---------------------------------------------------------------- component columns


@pytest.mark.parametrize(
    "name, column",
    [
        ("exact_answer", "reward_exact_answer"),
        ("my_rewards:has_two_lines", "reward_has_two_lines"),
        ("pkg.sub.mod:Scorers.shout", "reward_shout"),
        ("pkg:Unit-Tests Pass", "reward_unit_tests_pass"),
        ("pkg:f2", "reward_f2"),
    ],
)
def test_component_column(name, column):
    assert component_column(name) == column
    assert re.fullmatch(r"[a-z0-9_]+", column)


def test_component_column_rejects_names_without_letters_or_digits():
    with pytest.raises(ValueError, match="reward 'pkg:___' gives no usable column name"):
        component_column("pkg:___")


def test_component_columns_maps_each_spec():
    specs = [RewardSpec("exact_answer", 1.0, {}), RewardSpec("my_rewards:has_two_lines", 0.1, {})]
    assert component_columns(specs) == {
        "exact_answer": "reward_exact_answer",
        "my_rewards:has_two_lines": "reward_has_two_lines",
    }


@pytest.mark.parametrize(
    "first, second",
    [("format_regex", "format_regex"), ("exact_answer", "my_rewards:exact_answer"), ("a:Score", "b:score")],
)
def test_component_columns_rejects_collisions(first, second):
    specs = [RewardSpec(first, 1.0, {}), RewardSpec(second, 1.0, {})]
    with pytest.raises(ValueError, match=re.escape(f"rewards {first!r} and {second!r} both map to column")):
        component_columns(specs)


# ---------------------------------------------------------------- prepare_rewards


def test_prepare_rewards_resolves_and_checks(user_module):
    specs = [
        RewardSpec("exact_answer", 1.0, EXACT_OPTIONS),
        RewardSpec("my_rewards:has_two_lines", 0.5, {"min_lines": 2}),
    ]
    fns = prepare_rewards(specs)
    assert fns["exact_answer"] is exact_answer
    assert fns["my_rewards:has_two_lines"].__name__ == "has_two_lines"


def test_prepare_rewards_fails_on_option_typo_before_scoring():
    specs = [RewardSpec("length_penalty", 1.0, {"max_tokens": 10, "bufer_tokens": 2})]
    with pytest.raises(ValueError, match="reward 'length_penalty' has no option 'bufer_tokens'"):
        prepare_rewards(specs)


def test_prepare_rewards_rejects_empty_list():
    with pytest.raises(ValueError, match="no rewards configured"):
        prepare_rewards([])


@pytest.mark.parametrize("weight", [float("nan"), float("inf"), True, "1.0", None])
def test_prepare_rewards_rejects_bad_weight(weight):
    specs = [RewardSpec("digit_match", weight, {"answer_prefix": None})]
    with pytest.raises(ValueError, match=re.escape(f"reward 'digit_match': weight must be a finite number, got {weight!r}")):
        prepare_rewards(specs)


def test_prepare_rewards_unknown_name():
    with pytest.raises(ValueError, match=re.escape(f"unknown reward 'lenght_penalty'; valid names: {VALID}")):
        prepare_rewards([RewardSpec("lenght_penalty", 1.0, {})])


# ---------------------------------------------------------------- score_sample


def test_score_sample_components_and_weighted_total():
    specs = [
        RewardSpec("exact_answer", 1.0, EXACT_OPTIONS),
        RewardSpec("digit_match", 0.5, {"answer_prefix": None}),
        RewardSpec("length_penalty", 2.0, {"max_tokens": 10, "buffer_tokens": 4}),
    ]
    sample = make("so 1284", "1234", tokens=7)
    components, total = score_sample(sample, specs, prepare_rewards(specs))
    # exact 0; digits 3/4; length (6 - 7) / 4 = -0.25
    assert components == {"exact_answer": 0.0, "digit_match": 0.75, "length_penalty": -0.25}
    assert total == pytest.approx(1.0 * 0.0 + 0.5 * 0.75 + 2.0 * -0.25)  # = -0.125


@pytest.mark.parametrize("value", [1, np.float32(0.5), np.int64(2)])
def test_score_sample_accepts_real_numbers(user_module, value):
    specs = [RewardSpec("my_rewards:returns", 2.0, {"value": value})]
    components, total = score_sample(make(), specs, prepare_rewards(specs))
    assert components == {"my_rewards:returns": float(value)}
    assert type(components["my_rewards:returns"]) is float
    assert total == 2.0 * float(value)


@pytest.mark.parametrize(
    "value, error, message",
    [
        (None, TypeError, "reward 'my_rewards:returns' returned None; a reward must return a finite float"),
        (True, TypeError, "reward 'my_rewards:returns' returned a bool \\(True\\); a reward must return a finite float"),
        (np.bool_(False), TypeError, "reward 'my_rewards:returns' returned a bool \\(np.False_\\); a reward must"),
        ("1.0", TypeError, "reward 'my_rewards:returns' returned a str \\('1.0'\\); a reward must return a finite float"),
        ([1.0], TypeError, "returned a list \\(\\[1.0\\]\\)"),
        (1 + 0j, TypeError, "returned a complex"),
        (math.nan, ValueError, "reward 'my_rewards:returns' returned nan; a reward must return a finite float"),
        (-math.inf, ValueError, "reward 'my_rewards:returns' returned -inf"),
    ],
)
def test_score_sample_rejects_bad_values(user_module, value, error, message):
    specs = [RewardSpec("my_rewards:returns", 1.0, {"value": value})]
    with pytest.raises(error, match=message):
        score_sample(make(), specs, prepare_rewards(specs))


def test_score_sample_keeps_exception_type_and_names_the_reward(user_module):
    specs = [RewardSpec("my_rewards:boom", 1.0, {})]
    with pytest.raises(ZeroDivisionError, match="bad row") as info:
        score_sample(make(), specs, prepare_rewards(specs))
    assert "raised by reward 'my_rewards:boom'" in info.value.__notes__


def test_score_sample_missing_truth_is_a_per_row_value_error():
    specs = [RewardSpec("exact_answer", 1.0, EXACT_OPTIONS)]
    with pytest.raises(ValueError, match="answer is None"):
        score_sample(make("42", None), specs, prepare_rewards(specs))


def test_score_sample_requires_prepared_functions():
    specs = [RewardSpec("exact_answer", 1.0, EXACT_OPTIONS)]
    with pytest.raises(ValueError, match="reward 'exact_answer' was not prepared; call prepare_rewards"):
        score_sample(make("42", "42"), specs, {})
