"""The command line's own surface: `nmt --version`, and help that shows what a user types, with examples
in one format that run as written."""

from __future__ import annotations

import re

import pytest
import torch
import typer.main
from typer.testing import CliRunner

import nmt
from nmt.cli import app

COMMANDS = sorted(typer.main.get_command(app).commands)
# What an example line may start with: nmt itself, or the shell around it
PROGRAMS = ("nmt ", "cat ", "echo ", "curl ", "torchrun ", "huggingface-cli ")


def help_of(*command: str) -> str:
    result = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return result.stdout


def test_version_prints_the_package_version():
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout == f"nmt {nmt.__version__}\n"


def test_help_shows_no_python_types():
    for command in [(), *((c,) for c in COMMANDS)]:
        text = help_of(*command)
        for python_type in re.findall(r"<(?:list\[\w+\]|bool|str)>", text):
            raise AssertionError(f"nmt {' '.join(command)} --help shows {python_type}")


def test_every_command_ends_its_help_with_examples_in_one_format():
    for command in COMMANDS:
        text = help_of(command)
        block = text[text.index(" Examples") : text.index("╭")].splitlines()[1:]
        lines = [line.rstrip() for line in block if line.strip()]
        assert lines, f"nmt {command}: no examples"
        for before, line in zip(["", *lines], lines, strict=False):
            if before.endswith("\\"):  # a continued command line is indented under it
                assert line.startswith("   "), (command, line)
                continue
            assert line.startswith(tuple(" " + p for p in PROGRAMS)), (command, line)  # flush, as all
            assert "../" not in line, f"nmt {command}: {line.strip()} uses a path users do not have"


def test_an_engine_or_dtype_that_does_not_exist_lists_every_choice():
    for option, value, choices in (
        ("--dtype", "int9", ["auto", "fp32", "bf16", "fp16", "int8"]),
        ("--engine", "onnx", ["torch", "ctranslate2"]),
    ):
        result = CliRunner().invoke(app, ["translate", "-m", "model.pt", option, value], input=b"a\n")
        assert result.exit_code == 2
        assert option in result.output and all(f"'{c}'" in result.output for c in choices), result.output


def test_a_dtype_is_read_in_one_place_and_mapped_to_what_each_engine_computes_in():
    from nmt.config import Precision
    from nmt.errors import ConfigError, NmtError

    assert (
        Precision.parse(" INT8 ", "--dtype") is Precision.INT8
        and Precision.parse(Precision.FP32, "x") == "fp32"
    )
    with pytest.raises(ConfigError, match=r"^--dtype int9: expected one of auto, fp32, bf16, fp16, int8$"):
        Precision.parse("int9", "--dtype")
    pytest.importorskip("ctranslate2", reason="needs CTranslate2 (the dev extra)")
    import ctranslate2

    from nmt.translate.ctranslate2_engine import compute_type

    cpu = torch.device("cpu")
    assert [compute_type(p, cpu) for p in (Precision.AUTO, Precision.FP32, Precision.INT8)] == [
        "default",
        "float32",
        "int8",
    ]
    supported = ctranslate2.get_supported_compute_types("cpu")
    for precision, name in ((Precision.BF16, "bfloat16"), (Precision.FP16, "float16")):
        if name in supported:
            assert compute_type(precision, cpu) == name
        else:  # refused, never silently another type
            with pytest.raises(NmtError, match=rf"--dtype {precision}: CTranslate2 cannot compute in {name}"):
                compute_type(precision, cpu)
