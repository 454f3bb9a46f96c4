"""`asyncpage bench --settings`: each setting's spelling maps to from_pretrained's options, and a bad one
is refused by the CLI before any model loads."""

from __future__ import annotations

import sys
from pathlib import Path

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


def test_gguf_spells_the_files_own_blocks() -> None:
    assert parse_setting("gguf") == {"kv_cache_dtype": "auto", "quantization": "auto", "dtype": "auto"}
    assert parse_setting("gguf:float32")["dtype"] == "float32"


def test_the_llama_bench_comparison_refuses_a_bad_setting_before_running_anything(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--llama-bench", "/nonexistent/llama-bench", "--settings", "defaults,int9"]) == 2
    assert "int9" in capsys.readouterr().err


def test_llama_bench_figures_are_read_from_its_json(tmp_path: Path) -> None:
    """A stand-in for the llama-bench binary that checks the arguments asyncpage passes and prints the two
    rows of `-o json` (fields as llama-bench 0.3.36's vendored build prints them)."""
    from asyncpage.bench.cpu_path import run_llama_bench

    fake = tmp_path / "llama-bench"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\na = sys.argv[1:]\n"
                    "assert a[a.index('-p') + 1] == '512' and a[a.index('-n') + 1] == '128', a\n"
                    "assert a[a.index('-t') + 1] == '2' and a[a.index('-o') + 1] == 'json', a\n"
                    "print(json.dumps([{'n_prompt': 512, 'n_gen': 0, 'avg_ts': 423.6, 'n_threads': 2},\n"
                    "                  {'n_prompt': 0, 'n_gen': 128, 'avg_ts': 62.1, 'n_threads': 2}]))\n")
    fake.chmod(0o755)
    assert run_llama_bench(str(fake), "m.gguf", 2) == {"prefill_tok_s": 423.6, "single_tok_s": 62.1}
    fake.write_text("#!/bin/sh\necho 'error: failed to load model' >&2\nexit 1\n")
    with pytest.raises(RuntimeError, match="failed to load model"):
        run_llama_bench(str(fake), "m.gguf", 2)
