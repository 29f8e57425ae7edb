"""The command line's own surface: `nmt --version`, and help that shows what a user types, with examples
in one format that run as written."""

from __future__ import annotations

import re
from pathlib import Path

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


@pytest.mark.parametrize(
    "args, names",
    [
        (["translate", "--bem", "3", "-m", "m.pt"], ["--bem", "--beam"]),  # click's hint on the same line
        (["translate"], ["--model"]),
        (["translate", "-m", "m.pt", "--beam", "many"], ["--beam"]),
        (["score", "-r", "ref.de", "-w", "4"], ["-w"]),  # -w is --workdir, which score has not
        (["--bogus"], ["--bogus"]),
        (["frobnicate"], ["frobnicate"]),
    ],
)
def test_a_usage_error_is_one_line_and_exit_status_2(args, names):
    result = CliRunner().invoke(app, args, input="")
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert all(name in lines[0] for name in names) and "╭" not in result.stderr


def test_bare_commands_still_show_their_help():
    result = CliRunner().invoke(app, [])
    assert result.exit_code == 2 and "Usage" in result.output and "error:" not in result.output


def test_one_spelling_per_meaning_across_commands():
    group = typer.main.get_command(app)
    for name, command in group.commands.items():
        for param in command.params:
            if "-w" in getattr(param, "opts", []):  # -w means the work directory, wherever it is taken
                assert "--workdir" in param.opts, (name, param.opts)
    for name in ("translate", "serve"):  # the batch budget: one public name, the old one hidden
        text = help_of(name)
        assert "--max-tokens" in text and "--max-batch-tokens" not in text
    assert "--width" in help_of("score")


def test_the_old_name_of_an_option_still_works(monkeypatch):
    import nmt.serve

    given = {}
    monkeypatch.setattr(
        nmt.serve,
        "serve",
        lambda model, settings, overrides, *a, **k: given.update(overrides.values),
    )
    for option in ("--max-tokens", "--max-batch-tokens"):
        given.clear()
        result = CliRunner().invoke(app, ["serve", "-m", "m.pt", option, "1234"])
        assert result.exit_code == 0 and given["batch_tokens"] == 1234, (option, result.output)


def test_any_misspelt_option_of_any_command_is_one_line():
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies

    @hypothesis.given(
        st.sampled_from(COMMANDS),
        st.text("abcdefghijklmnopqrstuvwxyz-=0123456789é", max_size=12),
        st.lists(st.text("abc -/é\t", max_size=6), max_size=3),
    )
    def one_line(command, name, rest):
        result = CliRunner().invoke(app, [command, "--x" + name, *rest], input="")
        assert result.exit_code == 2, result.output
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr

    one_line()


def test_the_cli_imports_no_torch_to_show_its_help():
    """`nmt --help`, and a command's, stay quick: the options read their defaults from light modules
    (nmt.serve.settings, nmt.distill.options, ...), and torch is imported by the commands that run."""
    import subprocess
    import sys

    code = (
        "import sys\nfrom nmt.cli import app\nloaded = 'torch' in sys.modules\n"
        "for command in ([], ['serve'], ['distill'], ['shortlist'], ['backtranslate']):\n"
        "    try:\n        app([*command, '--help'])\n    except SystemExit:\n        pass\n"
        "print('torch:', loaded, 'torch' in sys.modules, file=sys.stderr)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip().endswith("torch: False False"), done.stderr


def test_the_cli_defaults_are_the_library_settings_own():
    """An option that sets a field of a library's settings has that field's default, so the two cannot
    drift: every field of ServeSettings, DistillOptions (but the teacher and the comparison, no options),
    FilterSettings and ShortlistSizes, and nmt backtranslate's options."""
    import dataclasses

    from nmt.backtranslate import BacktranslateOptions
    from nmt.config import ShortlistSizes
    from nmt.data.filters import FilterSettings
    from nmt.distill.options import DistillOptions
    from nmt.serve.settings import ServeSettings

    commands = typer.main.get_command(app).commands

    def defaults(record, *without: str) -> dict:
        """Field -> its default, of every field that has one but those `without` (no option of that name)."""
        fields = dataclasses.fields(record)
        return {
            f.name: f.default
            for f in fields
            if f.default is not dataclasses.MISSING and f.name not in without
        }

    filters = FilterSettings()
    back = BacktranslateOptions(reverse=None, mono=(), output=None)
    expected = {
        "serve": defaults(ServeSettings),
        "distill": {
            **defaults(DistillOptions, "filters", "compare"),
            "max_ratio": filters.max_ratio,
            "drop_worst": filters.worst_percent,
        },
        "shortlist": defaults(ShortlistSizes),
        "backtranslate": {
            "method": back.method,
            "engine": back.engine,
            "dtype": back.precision,
            "device": back.device,
            "seed": back.seed,
            "chunk_lines": back.chunk_lines,
            "max_lines": back.max_lines,
            "max_ratio": back.filters.max_ratio,
        },
    }
    for command, fields in expected.items():
        params = {p.name: p for p in commands[command].params}
        for name, default in fields.items():
            assert name in params, f"nmt {command} has no option for {name}"
            assert params[name].default == default, (command, name, params[name].default, default)
    # the rule for --select's default is the library's: top1 for --mono text (no references), else chrf
    assert DistillOptions(teacher=None).select == "chrf"
    assert DistillOptions(teacher=None, mono=Path("mono.en")).select == "top1"


def test_help_asks_an_option_its_type_only_where_typer_can_answer():
    """typer 0.27 and 0.28 (which carry their own click) have no `display_type`: every command failed
    there with an AttributeError before it ran. Checked by hand with those wheels; here, the lookup."""
    from nmt.cli import display_type

    class OldOption:  # what such a typer's option offers: no display_type
        pass

    class NewOption:
        def display_type(self, ctx):
            return "<list[Path]>"

    assert display_type(OldOption(), None) == ""
    assert display_type(NewOption(), None) == "<list[Path]>"
