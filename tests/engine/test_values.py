"""engine.values: the one string/JSON -> typed value converter, load time and request time."""
from __future__ import annotations

import numpy as np
import pytest

from backend.config_params import split_parameters
from backend.request_parsing import InvalidRequest, parse_sampling_parameters
from engine.config import EngineConfig
from engine.values import convert, to_bool, to_float, to_int, to_str, to_str_list

WORDS = [("true", True), ("1", True), ("yes", True), ("on", True),
         ("false", False), ("0", False), ("no", False), ("off", False)]


@pytest.mark.parametrize("word,expected", WORDS)
def test_one_words_table_in_every_case_and_padding(word, expected):
    for text in (word, word.upper(), word.capitalize(), f"  {word}\n"):
        assert to_bool("flag", text) is expected


@pytest.mark.parametrize("word,expected", WORDS)
def test_config_and_requests_read_booleans_alike(word, expected):
    config = EngineConfig.from_dict({"enable_prefix_caching": word})
    _, options = split_parameters({"REPORT_CUSTOM_METRICS": word})
    params = parse_sampling_parameters({"ignore_eos": word})
    assert config.cache.enable_prefix_caching is options.report_custom_metrics is expected
    assert params.ignore_eos is expected


def test_typed_booleans_pass_and_others_are_refused():
    assert to_bool("b", True) is True and to_bool("b", np.bool_(False)) is False
    assert to_bool("b", 1) is True and to_bool("b", np.int32(0)) is False
    for bad in ("maybe", "", "t", "y", "2", 2, -1, 0.5, 1.0, None, [True]):
        with pytest.raises(ValueError, match=r"^flag must be a boolean"):
            to_bool("flag", bad)


def test_integers():
    assert to_int("n", " 7 ") == 7 and to_int("n", "-3") == -3 and to_int("n", "+2") == 2
    assert to_int("n", 3.0) == 3 and to_int("n", np.int64(5)) == 5 and to_int("n", 10**30) == 10**30
    for bad in ("1.5", "1.0", "1e3", "1_000", "٣", "", "seven", 1.5, float("nan"), float("inf"),
                True, np.bool_(True), "9" * 5000, None, [1]):
        with pytest.raises(ValueError, match=r"^n must be an integer"):
            to_int("n", bad)


def test_floats_are_finite_only():
    assert to_float("x", " 0.5 ") == 0.5 and to_float("x", "1e-3") == 1e-3 and to_float("x", 2) == 2.0
    assert to_float("x", np.float32(0.25)) == 0.25 and to_float("x", "1e300") == 1e300
    for bad in ("nan", "NaN", "inf", "-Infinity", "1e999", float("nan"), float("-inf")):
        with pytest.raises(ValueError, match=r"^x must be a finite number"):
            to_float("x", bad)
    with pytest.raises(ValueError, match="too large"):
        to_float("x", 10**400)
    for bad in ("", "abc", "1_0", True, None, [1.0]):
        with pytest.raises(ValueError, match=r"^x must be a number"):
            to_float("x", bad)


def test_strings_and_lists():
    from pathlib import Path

    assert to_str("s", "  a/b ") == "a/b" and to_str("s", Path("/m")) == "/m"
    with pytest.raises(ValueError, match=r"^s must be a string"):
        to_str("s", 3)
    assert to_str_list("stop", "\n") == ["\n"] and to_str_list("stop", "") == []
    assert to_str_list("stop", ' ["a", "b"] ') == ["a", "b"]
    assert convert("ids", "[2, 3]", "list[int]") == [2, 3] and convert("ids", "4", "list[int]") == [4]
    with pytest.raises(ValueError, match="invalid JSON list"):
        to_str_list("stop", "[oops")
    with pytest.raises(ValueError, match="list of strings"):
        to_str_list("stop", [1])
    with pytest.raises(ValueError, match="must be a list"):
        to_str_list("stop", {"a": 1})


def test_optional_kinds_take_null_words_and_others_refuse_null():
    for null in (None, "", " none ", "NULL"):
        assert convert("seed", null, "int | None") is None
    assert convert("seed", "7", "int | None") == 7
    with pytest.raises(ValueError, match="^top_k must not be null"):
        convert("top_k", None, "int")
    with pytest.raises(ValueError, match="^top_k must be an integer"):
        convert("top_k", "none", "int")
    with pytest.raises(TypeError):
        convert("x", "1", "dict[str, int]")


def test_errors_name_the_field_and_stay_short():
    with pytest.raises(ValueError, match="^engine argument 'max_num_seqs' must be an integer"):
        EngineConfig.from_dict({"max_num_seqs": "1.5"})
    with pytest.raises(ValueError, match="^engine argument 'watermark' must be a finite number"):
        EngineConfig.from_dict({"watermark": "nan"})
    with pytest.raises(InvalidRequest, match="^temperature must be a finite number"):
        parse_sampling_parameters({"temperature": "inf"})
    with pytest.raises(ValueError) as failure:
        to_bool("flag", "x" * 10_000)
    assert len(str(failure.value)) < 200
    with pytest.raises(ValueError, match="too large to print"):
        to_bool("flag", 10**5000)
