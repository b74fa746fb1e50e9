"""SamplingParams: MII's defaults, normalisation, and a clear error for every bad value."""

import dataclasses

import re

import pytest

from fastgen.sampling_params import MAX_LOGPROBS, MAX_N, SamplingParams


def test_defaults_are_mii_defaults():
    p = SamplingParams()
    assert p.max_length is None and p.max_new_tokens is None
    assert p.min_new_tokens == 0
    assert p.ignore_eos is False and p.return_full_text is False
    assert p.do_sample is True
    assert p.temperature == 1.0 and p.top_k == 0 and p.top_p == 0.9
    assert p.stop == ()
    assert p.seed is None and p.stop_token_ids == ()
    assert p.repetition_penalty == 1.0
    assert p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
    assert p.logprobs is None and p.n == 1
    assert p.greedy is False


def test_is_slotted():
    p = SamplingParams()
    assert not hasattr(p, "__dict__")
    with pytest.raises(AttributeError):
        p.not_a_field = 1


@pytest.mark.parametrize("kwargs, greedy", [
    ({}, False),
    ({"do_sample": False}, True),
    ({"temperature": 0}, True),
    ({"temperature": 0.0, "do_sample": True}, True),
    ({"temperature": 1e-3}, False),
])
def test_greedy_property(kwargs, greedy):
    assert SamplingParams(**kwargs).greedy is greedy


def test_mii_none_inputs_mean_off():
    p = SamplingParams(top_k=None, temperature=None, stop=None, stop_token_ids=None)
    assert p.top_k == 0 and p.temperature == 1.0
    assert p.stop == () and p.stop_token_ids == ()


def test_normalisation():
    p = SamplingParams(stop="###", stop_token_ids=[3, 7], temperature=1, top_p=1,
                       max_new_tokens=16.0, repetition_penalty=2)
    assert p.stop == ("###",)
    assert p.stop_token_ids == (3, 7)
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float)
    assert isinstance(p.repetition_penalty, float)
    assert p.max_new_tokens == 16 and type(p.max_new_tokens) is int
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(stop=("a",)).stop == ("a",)


BAD_VALUES = [
    # (field, value, error type, words the message must contain)
    ("max_length", 0, ValueError, "[1, inf)"),
    ("max_length", -5, ValueError, "[1, inf)"),
    ("max_length", 2.5, TypeError, "int"),
    ("max_length", "10", TypeError, "int"),
    ("max_new_tokens", 0, ValueError, "[1, inf)"),
    ("max_new_tokens", True, TypeError, "int"),
    ("min_new_tokens", -1, ValueError, "[0, inf)"),
    ("min_new_tokens", None, TypeError, "int"),
    ("ignore_eos", 1, TypeError, "bool"),
    ("ignore_eos", "false", TypeError, "bool"),
    ("do_sample", "yes", TypeError, "bool"),
    ("do_sample", None, TypeError, "bool"),
    ("return_full_text", 0, TypeError, "bool"),
    ("temperature", -0.1, ValueError, "[0, inf)"),
    ("temperature", float("nan"), ValueError, "[0, inf)"),
    ("temperature", float("inf"), ValueError, "[0, inf)"),
    ("temperature", "hot", TypeError, "float"),
    ("temperature", True, TypeError, "float"),
    ("top_k", -1, ValueError, "[0, inf)"),
    ("top_k", 2.5, TypeError, "int"),
    ("top_k", False, TypeError, "int"),
    ("top_p", 0.0, ValueError, "(0, 1]"),
    ("top_p", 1.01, ValueError, "(0, 1]"),
    ("top_p", -0.5, ValueError, "(0, 1]"),
    ("top_p", float("nan"), ValueError, "(0, 1]"),
    ("top_p", None, TypeError, "float"),
    ("stop", 5, TypeError, "list of str"),
    ("stop", b"x", TypeError, "list of str"),
    ("stop", [""], ValueError, "non-empty"),
    ("stop", "", ValueError, "non-empty"),
    ("stop", ["ok", 3], TypeError, "stop[1]"),
    ("stop", {"a"}, TypeError, "list of str"),
    ("seed", -1, ValueError, "[0, 18446744073709551615]"),
    ("seed", 2**64, ValueError, "[0, 18446744073709551615]"),
    ("seed", 1.5, TypeError, "int"),
    ("stop_token_ids", 5, TypeError, "list of int"),
    ("stop_token_ids", [1, -2], ValueError, "stop_token_ids[1]"),
    ("stop_token_ids", [1, "2"], TypeError, "stop_token_ids[1]"),
    ("stop_token_ids", [True], TypeError, "stop_token_ids[0]"),
    ("repetition_penalty", 0.0, ValueError, "(0, inf)"),
    ("repetition_penalty", -1.0, ValueError, "(0, inf)"),
    ("repetition_penalty", "1", TypeError, "float"),
    ("presence_penalty", 2.5, ValueError, "[-2, 2]"),
    ("presence_penalty", -2.01, ValueError, "[-2, 2]"),
    ("frequency_penalty", 3, ValueError, "[-2, 2]"),
    ("frequency_penalty", -2.5, ValueError, "[-2, 2]"),
    ("logprobs", -1, ValueError, f"[0, {MAX_LOGPROBS}]"),
    ("logprobs", MAX_LOGPROBS + 1, ValueError, f"[0, {MAX_LOGPROBS}]"),
    ("logprobs", 1.5, TypeError, "int"),
    ("logprobs", True, TypeError, "int"),
    ("n", 0, ValueError, f"[1, {MAX_N}]"),
    ("n", MAX_N + 1, ValueError, f"[1, {MAX_N}]"),
    ("n", 2.5, TypeError, "int"),
    ("prompt_logprobs", -1, ValueError, f"[0, {MAX_LOGPROBS}]"),
    ("prompt_logprobs", 1.5, TypeError, "int"),
    ("min_p", 1.5, ValueError, "[0, 1]"),
    ("min_p", "0.1", TypeError, "float"),
    ("logit_bias", [1, 2], TypeError, "dict"),
    ("logit_bias", {"a": 1.0}, TypeError, "logit_bias key 'a'"),
    ("logit_bias", {5: "x"}, TypeError, "logit_bias[5]"),
    ("allowed_token_ids", [], ValueError, "must not be empty"),
    ("allowed_token_ids", [1, -1], ValueError, "allowed_token_ids[1]"),
    ("allowed_token_ids", 3, TypeError, "list of int"),
    ("bad_words", [""], ValueError, "non-empty"),
    ("bad_words", ["ok", 1], TypeError, "bad_words[1]"),
    ("skip_special_tokens", 1, TypeError, "bool"),
    ("spaces_between_special_tokens", "no", TypeError, "bool"),
    ("include_stop_str_in_output", None, TypeError, "bool"),
    ("truncate_prompt_tokens", 0, ValueError, "[1, inf)"),
    ("priority", 1.5, TypeError, "int"),
    ("priority", 2**40, ValueError, "[-2147483648, 2147483647]"),
    ("structured_outputs", {"regex": "a", "choice": ["b"]}, ValueError, "exactly one of"),
    ("structured_outputs", "json", TypeError, "must be a dict"),
]


@pytest.mark.parametrize("bias, words", [({5: 101.0}, "logit_bias[5] must be in [-100, 100]"),
                                         ({-1: 1.0}, "logit_bias token id must be in [0, inf)")])
def test_logit_bias_ranges_name_the_entry(bias, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        SamplingParams(logit_bias=bias)


def test_logit_bias_accepts_json_string_keys():
    assert SamplingParams(logit_bias={"7": 2, 9: -1.5}).logit_bias == {7: 2.0, 9: -1.5}


@pytest.mark.parametrize("field, value, error, words", BAD_VALUES,
                         ids=[f"{f}={v!r}" for f, v, _, _ in BAD_VALUES])
def test_bad_value_names_field_value_and_range(field, value, error, words):
    with pytest.raises(error) as info:
        SamplingParams(**{field: value})
    message = str(info.value)
    assert field in message
    assert words in message
    if error is ValueError and not isinstance(value, (list, str, dict)):
        assert repr(float(value)) in message or repr(value) in message


def test_every_field_has_a_bad_value_case():
    covered = {field for field, _, _, _ in BAD_VALUES}
    assert covered == set(SamplingParams.field_names())


@pytest.mark.parametrize("field, value", [
    ("max_length", 1), ("max_new_tokens", 1), ("min_new_tokens", 0),
    ("temperature", 0.0), ("temperature", 5), ("top_k", 0), ("top_k", 100_000),
    ("top_p", 1.0), ("top_p", 1e-6), ("seed", 0), ("seed", 2**64 - 1),
    ("repetition_penalty", 1e-3), ("presence_penalty", -2), ("presence_penalty", 2.0),
    ("frequency_penalty", -2.0), ("logprobs", 0), ("logprobs", MAX_LOGPROBS), ("n", MAX_N),
])
def test_boundary_values_accepted(field, value):
    assert getattr(SamplingParams(**{field: value}), field) == value


def test_min_new_tokens_against_caps():
    with pytest.raises(ValueError, match=r"min_new_tokens \(5\) must be <= max_new_tokens \(4\)"):
        SamplingParams(min_new_tokens=5, max_new_tokens=4)
    with pytest.raises(ValueError, match=r"min_new_tokens \(8\) must be < max_length \(8\)"):
        SamplingParams(min_new_tokens=8, max_length=8)
    p = SamplingParams(min_new_tokens=4, max_new_tokens=4, max_length=100)
    assert p.min_new_tokens == p.max_new_tokens == 4


def test_from_kwargs_accepts_every_field():
    kwargs = dict(max_length=64, max_new_tokens=8, min_new_tokens=2, ignore_eos=True,
                  do_sample=False, temperature=0.5, top_k=4, top_p=0.5, stop=["\n"],
                  return_full_text=True, seed=7, stop_token_ids=[2], repetition_penalty=1.1,
                  presence_penalty=0.5, frequency_penalty=-0.5, logprobs=3, n=2, prompt_logprobs=1,
                  min_p=0.05, logit_bias={3: 1.5}, allowed_token_ids=[1, 2, 3], bad_words=["no"],
                  skip_special_tokens=False, spaces_between_special_tokens=False,
                  include_stop_str_in_output=True, truncate_prompt_tokens=5, priority=-1)
    # structured_outputs cannot join min_new_tokens (the constraint decides where the output ends).
    assert set(kwargs) | {"structured_outputs"} == set(SamplingParams.field_names())
    p = SamplingParams.from_kwargs(**kwargs)
    for key, value in kwargs.items():
        expected = tuple(value) if isinstance(value, list) else value
        assert getattr(p, key) == expected
    constrained = SamplingParams.from_kwargs(**{**kwargs, "min_new_tokens": 0,
                                                "structured_outputs": {"choice": ["a", "b"]}})
    assert constrained.structured_outputs.choice == ("a", "b")


def test_from_kwargs_unknown_keyword():
    with pytest.raises(TypeError) as info:
        SamplingParams.from_kwargs(max_new_token=8)
    message = str(info.value)
    assert "unknown generation parameter 'max_new_token'" in message
    assert "supported:" in message and "max_new_tokens" in message and "top_p" in message


def test_from_kwargs_validates():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams.from_kwargs(top_p=2.0)


def test_replace_revalidates():
    p = SamplingParams(top_p=0.5)
    assert dataclasses.replace(p, top_k=3).top_k == 3
    with pytest.raises(ValueError, match="top_k"):
        dataclasses.replace(p, top_k=-3)
