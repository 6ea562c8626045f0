"""GenerationConfig's validation: each numeric setting accepts its whole range, edges included or
not as stated, refuses the values just outside it, a boolean, a string and NaN, and every error
names its field in ``param`` and in its first words."""

import math

import numpy as np
import pytest

from cactus_edge.checks import is_int, is_number
from cactus_edge.engine.config import GenerationConfig
from cactus_edge.errors import InvalidSettingError

# field: (accepted values, refused values); written from the documented ranges, not the table.
RANGES = {
    "delta": ([0, 0.0, 1e-9, 3.5], [-1e-9, math.inf]),
    "draft_p_min": ([None, 0.0, 0.5, 0.999], [-0.01, 1.0]),
    "temperature": ([0, 0.0, 1e-6, 2.0, 100], [-1e-6, math.inf]),
    "top_k": ([0, 1, 40, np.int64(5)], [-1, 2.0, 2.5]),
    "top_p": ([1e-9, 0.5, 1.0, 1], [0.0, 1.0001]),
    "min_p": ([0.0, 0.5, 0.999], [-0.1, 1.0]),
    "max_tokens": ([1, 4096], [0, -3, 1.0]),
    "seed": ([None, 0, 2**40], [-1, 1.5]),
    "kl_budget": ([None, 0.0, 0.5, math.inf], [-0.1]),
    "posterior_threshold": ([0.0, 0.09, 1.0], [-0.01, 1.01]),
    "posterior_alpha": ([0.0, 0.3, 1.0], [-0.01, 1.01]),
    "presence_penalty": ([-2.0, 0.0, 2.0], [-2.01, 2.01]),
    "frequency_penalty": ([-2, 0.5, 2], [-2.01, 2.01]),
    "repeat_penalty": ([1e-6, 1.0, 10.0], [0.0, -1.0, 10.01]),
    "repeat_last_n": ([-1, 0, 64], [-2, 8.0]),
    "top_logprobs": ([0, 20], [-1, 21, 1.0]),
    "n_draft": (["auto", 0, 4, 64], [-1, 65, "4", 4.0, "Auto"]),
}


@pytest.mark.parametrize("name", list(RANGES))
def test_each_setting_accepts_its_range_and_refuses_what_lies_outside(name):
    accepted, refused = RANGES[name]
    for value in accepted:
        assert getattr(GenerationConfig(**{name: value}), name) == value
    not_numbers = [True, False, "1"]
    optional = None in accepted
    for value in refused + not_numbers + [math.nan] + ([] if optional else [None]):
        with pytest.raises(InvalidSettingError) as raised:
            GenerationConfig(**{name: value})
        assert raised.value.param == name, (value, raised.value.param)
        assert str(raised.value).startswith(f"{name} must be "), str(raised.value)


def test_an_out_of_range_message_states_the_range_and_the_value():
    with pytest.raises(InvalidSettingError, match=r"^top_p must be in \(0, 1\] \(1 = disabled\), got 1.5$"):
        GenerationConfig(top_p=1.5)
    with pytest.raises(InvalidSettingError, match=r"^temperature must be a number, got True$"):
        GenerationConfig(temperature=True)
    with pytest.raises(InvalidSettingError, match=r"^max_tokens must be an integer >= 1, got True$"):
        GenerationConfig(max_tokens=True)


@pytest.mark.parametrize(("name", "value"), [("method", "greedy"), ("drafter", "ngram")])
def test_names_outside_their_choices_are_refused_by_field(name, value):
    with pytest.raises(InvalidSettingError, match=f"^{name} must be one of ") as raised:
        GenerationConfig(**{name: value})
    assert raised.value.param == name


def test_the_type_checks_refuse_booleans_and_accept_numpy_scalars():
    assert is_int(3) and is_int(np.int32(3)) and not is_int(True) and not is_int(np.bool_(True))
    assert not is_int(3.0) and not is_int("3")
    assert is_number(1) and is_number(0.5) and is_number(np.float32(0.5)) and is_number(math.inf)
    assert not is_number(False) and not is_number(np.bool_(False)) and not is_number("0.5")
    assert not is_number(None) and not is_number(1j)
