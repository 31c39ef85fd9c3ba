"""backend.tokenizer_source.read_config_parameters on real and tricky config.pbtxt text."""
from __future__ import annotations

import pytest

from backend.tokenizer_source import read_config_parameters
from backend.triton_server import REPO_ROOT

TRICKY = r'''
# a comment with "quotes", { braces } and key: "model"
name: "m" backend: 'python'
parameters {
  key: "model"   # the path
  value: { string_value: "/a b/#not a comment/\"q\"/\\" }
}
parameters: < key: 'tokenizer' value < string_value: 'x' "y" > >;
input [ { name: "x" data_type: TYPE_INT32 dims: [ -1, 2 ] } ]
'''


def test_tricky_text_reads_as_triton_reads_it(tmp_path):
    path = tmp_path / "config.pbtxt"
    path.write_text(TRICKY)
    assert read_config_parameters(path) == {"model": '/a b/#not a comment/"q"/\\', "tokenizer": "xy"}


def test_repository_configs_read_and_bad_text_names_the_file(tmp_path):
    for config in sorted((REPO_ROOT / "model_repository").glob("*/config.pbtxt")):
        assert isinstance(read_config_parameters(config), dict)
    bad = tmp_path / "config.pbtxt"
    bad.write_text("parameters { key: ")
    with pytest.raises(ValueError, match="config.pbtxt"):
        read_config_parameters(bad)
