"""SamplingParams: vLLM-compatible defaults, normalization, typed validation errors."""

import pytest

from pagedkv.core.request import StopParams
from pagedkv.errors import InvalidRequestError
from pagedkv.sampling import SamplingParams
from pagedkv.sampling.params import MAX_LOGPROBS


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert p.seed is None and p.max_tokens == 16 and p.min_tokens == 0
    assert p.stop == [] and p.stop_token_ids == []
    assert p.ignore_eos is False and p.logprobs is None
    assert p.include_stop_str_in_output is False and p.skip_special_tokens is True
    assert not p.is_greedy


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"n": 0}, "n must be at least 1"),
        ({"n": 2}, "n must be 1"),
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"temperature": float("inf")}, "temperature must be a finite number"),
        ({"temperature": "hot"}, "temperature must be a finite number"),
        ({"top_p": 0.0}, "top_p must be in (0, 1]"),
        ({"top_p": 1.5}, "top_p must be in (0, 1]"),
        ({"top_p": -0.2}, "top_p must be in (0, 1]"),
        ({"top_k": -2}, "top_k must be 0 or -1 (disabled) or at least 1"),
        ({"top_k": 2.5}, "top_k must be an int"),
        ({"top_k": True}, "top_k must be an int"),
        ({"min_p": -0.01}, "min_p must be in [0, 1]"),
        ({"min_p": 1.01}, "min_p must be in [0, 1]"),
        ({"max_tokens": 0}, "max_tokens must be at least 1"),
        ({"max_tokens": 3.0}, "max_tokens must be an int"),
        ({"min_tokens": -1}, "min_tokens must be >= 0"),
        ({"min_tokens": 17}, "min_tokens must be <= max_tokens"),
        ({"seed": 2**64}, "seed must be in"),
        ({"seed": 1.5}, "seed must be an int"),
        ({"stop": 5}, "stop must be a string or a list of strings"),
        ({"stop": ["ok", ""]}, "stop strings must be non-empty"),
        ({"stop": ["ok", 3]}, "stop strings must be str"),
        ({"stop_token_ids": [1, -1]}, "stop_token_ids must be ints >= 0"),
        ({"stop_token_ids": "12"}, "stop_token_ids must be a list of ints"),
        ({"logprobs": -1}, f"logprobs must be in [0, {MAX_LOGPROBS}]"),
        ({"logprobs": MAX_LOGPROBS + 1}, f"logprobs must be in [0, {MAX_LOGPROBS}]"),
        ({"ignore_eos": 1}, "ignore_eos must be True or False"),
        ({"include_stop_str_in_output": None}, "include_stop_str_in_output must be True or False"),
        ({"skip_special_tokens": "yes"}, "skip_special_tokens must be True or False"),
    ],
)
def test_out_of_range_values_raise_typed_errors_naming_the_range(kwargs, fragment):
    with pytest.raises(InvalidRequestError) as exc:
        SamplingParams(**kwargs)
    assert fragment in str(exc.value)
    assert isinstance(exc.value, ValueError)  # vLLM raises ValueError here


def test_boundary_values_are_accepted():
    SamplingParams(top_p=1.0, min_p=0.0, top_k=1, max_tokens=1)
    SamplingParams(min_p=1.0, top_p=1e-9, logprobs=0)
    SamplingParams(logprobs=MAX_LOGPROBS, seed=2**64 - 1)
    SamplingParams(seed=-(2**63), min_tokens=16, max_tokens=16)


def test_greedy_normalization():
    for t in (0, 0.0, 9e-6):
        p = SamplingParams(temperature=t, top_p=0.3, top_k=5, min_p=0.2)
        assert p.is_greedy
        assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)


def test_tiny_positive_temperature_is_raised_like_vllm():
    p = SamplingParams(temperature=1e-3)
    assert p.temperature == 1e-2 and not p.is_greedy
    assert SamplingParams(temperature=0.5).temperature == 0.5


def test_normalized_spellings():
    p = SamplingParams(top_k=-1, seed=-1, logprobs=True, stop="###", stop_token_ids=(7, 9))
    assert p.top_k == 0 and p.seed is None and p.logprobs == 1
    assert p.stop == ["###"] and p.stop_token_ids == [7, 9]
    assert SamplingParams(stop=("a", "bc")).stop == ["a", "bc"]


def test_stop_buffer_length():
    assert SamplingParams().stop_buffer_length == 0
    assert SamplingParams(stop=["ab", "wxyz"]).stop_buffer_length == 3
    included = SamplingParams(stop=["ab", "wxyz"], include_stop_str_in_output=True)
    assert included.stop_buffer_length == 0


def test_to_stop_params():
    p = SamplingParams(max_tokens=40, min_tokens=3, ignore_eos=True, stop_token_ids=[5, 6])
    sp = p.to_stop_params()
    assert isinstance(sp, StopParams)
    assert (sp.max_tokens, sp.min_tokens, sp.ignore_eos, sp.stop_token_ids) == (40, 3, True, (5, 6))


def test_max_tokens_none_needs_max_model_len():
    p = SamplingParams(max_tokens=None, min_tokens=4)
    assert p.to_stop_params(max_model_len=128).max_tokens == 128
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        p.to_stop_params()


def test_check_vocab():
    p = SamplingParams(stop_token_ids=[3, 100, 250])
    p.check_vocab(251)
    with pytest.raises(InvalidRequestError, match=r"\[250\] are outside the vocabulary \[0, 250\)"):
        p.check_vocab(250)


def test_eos_resolved_once_per_request_into_a_copy():
    """pagedkv.core.stop: the engine resolves the model's EOS ids into a per-request copy; the
    first EOS id is the request's eos_token_id, the others join stop_token_ids (unless
    ignore_eos); all_stop_token_ids is what min_tokens bans."""
    p = SamplingParams(max_tokens=8, stop_token_ids=[5, 9])
    r = p.resolved((2, 7, 9))
    assert p._eos_token_ids is None and p.all_stop_token_ids == (5, 9)  # caller's unchanged
    assert r.all_stop_token_ids == (5, 9, 2, 7)
    assert r.to_stop_params().stop_token_ids == (5, 9, 7)
    assert p.to_stop_params().stop_token_ids == (5, 9)
    q = SamplingParams(max_tokens=8, stop_token_ids=[5], ignore_eos=True).resolved((2, 7))
    assert q.all_stop_token_ids == (5,) and q.to_stop_params().stop_token_ids == (5,)
    r.stop_token_ids.append(11)
    assert p.stop_token_ids == [5, 9]  # the copy owns its lists
