"""The `model: "auto"` policy: which model answers, and which settings are refused."""

import pytest

from meridian.errors import UserError
from meridian.gateway.auto_model import AUTO, AutoModel, parse_auto_model, pick

POLICY = AutoModel("small", "large", max_small_prompt_tokens=100, max_small_output_tokens=50)


@pytest.mark.parametrize(
    ("prompt_tokens", "max_tokens", "expected"),
    [
        (10, 10, "small"),
        (100, 50, "small"),  # both limits are inclusive
        (0, 1, "small"),
        (101, 50, "large"),  # prompt one token too long
        (100, 51, "large"),  # answer may run one token too long
        (10, None, "large"),  # unset max_tokens may run to the context window
        (5000, 5000, "large"),
    ],
)
def test_short_prompt_with_short_answer_goes_to_the_small_model(
    prompt_tokens, max_tokens, expected
):
    assert pick(POLICY, prompt_tokens, max_tokens) == expected


def test_defaults_route_a_typical_chat_turn_to_the_small_model():
    policy = AutoModel("s", "l")
    assert pick(policy, 512, 256) == "s"
    assert pick(policy, 513, 256) == "l"
    assert pick(policy, 512, 257) == "l"


def test_flag_value_names_small_then_large():
    assert parse_auto_model("llama-1b,llama-70b") == AutoModel("llama-1b", "llama-70b")
    assert parse_auto_model(" a , b ") == AutoModel("a", "b")


@pytest.mark.parametrize("value", ["", "a", "a,", ",b", "a,b,c", "a,,b"])
def test_flag_value_without_exactly_two_names_is_refused(value):
    with pytest.raises(UserError, match="SMALL,LARGE"):
        parse_auto_model(value)


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        (dict(small="a", large="a"), "twice"),
        (dict(small="", large="b"), "two model names"),
        (dict(small=AUTO, large="b"), "cannot be one of"),
        (dict(small="a", large="b", max_small_prompt_tokens=0), "positive"),
        (dict(small="a", large="b", max_small_output_tokens=-1), "positive"),
    ],
)
def test_policy_refuses_nonsense_with_a_reason(kwargs, says):
    with pytest.raises(UserError, match=says):
        AutoModel(**kwargs)
