"""SamplingParams: vLLM defaults, validation and the dict round trip used by the IPC layer."""

import pytest

from folio.runtime.common.sampling_params import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert p.max_tokens == 16 and p.min_tokens == 0 and p.seed is None
    assert p.stop == [] and p.stop_token_ids == [] and p.logprobs is None
    assert p.skip_special_tokens and not p.ignore_eos and not p.include_stop_str_in_output


def test_stop_string_normalised_to_list():
    assert SamplingParams(stop="\n").stop == ["\n"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]


def test_greedy_flag():
    assert SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=0.5).greedy


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(n=0), "n"),
    (dict(n=1.5), "n"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p=1.1), "min_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(max_tokens=-1), "max_tokens"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens"),
    (dict(logprobs=-1), "logprobs"),
    (dict(stop=["ok", 3]), "stop"),
    (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(seed="x"), "seed"),
    (dict(ignore_eos="yes"), "ignore_eos"),
])
def test_invalid_values_raise_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs", [
    dict(temperature=0.0), dict(top_p=1.0), dict(top_k=-1), dict(top_k=0), dict(top_k=1),
    dict(min_p=1.0), dict(max_tokens=0), dict(max_tokens=None, min_tokens=100), dict(logprobs=0),
])
def test_boundary_values_accepted(kwargs):
    p = SamplingParams(**kwargs)
    for name, value in kwargs.items():           # kept as given, not clamped or replaced
        assert getattr(p, name) == value, name
    assert SamplingParams.from_dict(p.to_dict()) == p


def test_dict_round_trip():
    p = SamplingParams(n=3, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=7,
                       presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2,
                       max_tokens=33, min_tokens=2, stop=["</s>", "\n\n"], stop_token_ids=[2, 3],
                       ignore_eos=True, include_stop_str_in_output=True,
                       skip_special_tokens=False, logprobs=5)
    d = p.to_dict()
    assert SamplingParams.from_dict(d) == p
    assert d["stop"] == ["</s>", "\n\n"] and d["logprobs"] == 5


def test_from_dict_rejects_unknown_keys():
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams.from_dict({"temperature": 0.0, "best_of": 2})


def test_from_dict_validates():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams.from_dict({"temperature": -1.0})


@pytest.mark.parametrize("kwargs", [
    {"temperature": float("nan")}, {"temperature": float("inf")}, {"repetition_penalty": float("inf")},
    {"top_p": float("nan")}, {"logprobs": 21}, {"logprobs": 10**6}, {"seed": 2**70}, {"seed": -1},
    {"stop": 5}, {"stop": [5]}, {"stop_token_ids": 7},
])
def test_non_finite_oversized_and_mistyped_values_are_value_errors(kwargs):
    # found by a fresh-clone trial: NaN temperature sampled garbage, logprobs=10**6 slowed the server,
    # seed=2**70 broke msgpack on the client, stop=5 raised TypeError
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_largest_allowed_values_still_work():
    sp = SamplingParams(logprobs=20, seed=2**63 - 1, stop=("a", "b"), stop_token_ids=(1, 2))
    assert sp.stop == ["a", "b"] and sp.stop_token_ids == [1, 2]
