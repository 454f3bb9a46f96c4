"""`asyncpage bench --settings`: each setting's spelling maps to from_pretrained's options, and a bad one
is refused by the CLI before any model loads."""

from __future__ import annotations

import pytest

from asyncpage.bench.quant import parse_setting
from asyncpage.cli import main
from asyncpage.errors import InvalidRequestError


def test_settings_spell_dtype_quantization_kv_and_compile() -> None:
    assert parse_setting("float32") == {"kv_cache_dtype": "auto", "quantization": None, "dtype": "float32"}
    assert parse_setting("int8") == {"kv_cache_dtype": "auto", "quantization": "int8", "dtype": "auto"}
    assert parse_setting("int4:float32+compile+kv=int8") == {
        "kv_cache_dtype": "int8", "compile": True, "quantization": "int4", "dtype": "float32"}


@pytest.mark.parametrize("bad", ["float32:int8", "INT8", "int8:float64", "int8:int4", "+compile", "int4+kv=bogus",
                                 "int4+compiled"])
def test_a_misspelled_setting_is_refused_not_run_under_its_label(bad: str) -> None:
    with pytest.raises(InvalidRequestError):
        parse_setting(bad)


def test_the_bench_cli_refuses_a_bad_setting_before_loading_a_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--workload", "single", "--settings", "float32,float32:int8"]) == 2
    assert "float32:int8" in capsys.readouterr().err
