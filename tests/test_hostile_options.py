"""Hostile numbers on the command line, generated: every int and float option of every command of the CLI,
found by walking the Typer app (a new numeric option is covered without a line here, and fails the first
test until nmt.limits states its bound), takes negative, zero, huge (2**63, 10**30), tiny, NaN and
infinite values, and the edges of its own bound.

What each case proves:
- a value out of its bound: exit 2 and exactly one line, nmt.limits' own message naming the option and the
  value, before any work: no model loaded (torch.load would raise), no process forked, no file written;
  the other arguments are valid and point at real files, so without the check the command would run;
- text that is not a number for an int option: click's one line naming the option, exit 2;
- a value within its bound: the command runs on a tiny model and tiny files and ends with status 0, or a
  one-line error naming the option where the value clashes with the model's own settings (--nbest past
  the model's beam); never a traceback or a hang. `nmt serve` and `nmt distill` would serve forever or
  train: there the model or teacher named is missing, so an in-bound value is proved to pass the bound
  and the command to stop at its own first check (that file) in one line.

Example counts are bounded (the `nmt` profile in tests/conftest.py, and fewer here), so the file takes
about a minute on 2 cores.
"""

from __future__ import annotations

import itertools
import math
import shutil
from pathlib import Path

import pytest
import torch

hypothesis = pytest.importorskip(
    "hypothesis", reason="hypothesis generates the inputs: pip install -e '.[dev]'"
)
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from nmt import limits  # noqa: E402

from .conftest import sentences  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def build_cli():
    import typer.main

    from nmt.cli import app

    return typer.main.get_command(app)


CLI = build_cli()  # once: building it takes longer than most refusals


def cli(*args: str):
    """The command run in this process by typer's CliRunner, as conftest's cli(), but over the CLI built
    once; the result keeps the exception a crash raised (CliRunner turns it into status 1)."""
    from unittest import mock

    from typer.testing import CliRunner

    from nmt.cli import app

    with mock.patch("typer.testing._get_command", lambda _: CLI):
        return CliRunner().invoke(app, [str(a) for a in args])


def numeric_options() -> list[tuple[str, str, type, object]]:
    """(command, option, int or float, default) for every numeric option of every command, hidden ones
    included, as the CLI itself finds them (nmt.cli's Command checks the same ones)."""
    from nmt.cli import number_type, option_name

    found = []
    for name, command in sorted(CLI.commands.items()):
        for param in command.params:
            if (kind := number_type(param)) is not None:
                found.append((name, option_name(param), kind, param.default))
    return found


OPTIONS = numeric_options()
IDS = [f"{command} {option}" for command, option, _, _ in OPTIONS]


def test_every_numeric_option_has_a_stated_bound_its_default_keeps():
    # A walk that found nothing (typer changed how it describes types) would prove nothing below.
    assert len(OPTIONS) >= 30 and {c for c, *_ in OPTIONS} >= {"translate", "serve", "shortlist", "score"}
    unbounded = [f"nmt {c} {o}" for c, o, _, _ in OPTIONS if limits.bound(o) is None]
    assert not unbounded, f"state their bounds in nmt.limits.OPTIONS: {unbounded}"
    for command, option, _, default in OPTIONS:
        assert default is None or limits.problem(option, default) is None, (command, option, default)
    # and the table names no option the CLI no longer has
    assert set(limits.OPTIONS) == {o for _, o, _, _ in OPTIONS}
    for bound in limits.QUANTITIES.values():
        assert bound.why and (bound.most() is None or bound.low <= bound.most())


# ---- the files each command is given ------------------------------------------------------------------


@pytest.fixture(scope="module")
def files(checkpoint, tmp_path_factory) -> dict[str, Path]:
    """Inputs for every command, all valid: the tiny random model, text, a checkpoint folder."""
    d = tmp_path_factory.mktemp("inputs")
    lines = sentences(6, 3)
    (d / "one.txt").write_text(lines[0] + "\n")
    (d / "src.txt").write_text("\n".join(lines) + "\n")
    (d / "tgt.txt").write_text("\n".join(reversed(lines)) + "\n")
    (d / "checkpoints").mkdir()
    for step in (1, 2):
        shutil.copy(checkpoint, d / "checkpoints" / f"step-{step}.pt")
    return {"model": checkpoint, "inputs": d, "outputs": tmp_path_factory.mktemp("outputs")}


def arguments(command: str, files: dict[str, Path], out: Path, stop_early: bool) -> list[str]:
    """Valid arguments of `command` but for the option under test; `stop_early`: where a run would serve or
    train for good, a missing model or teacher instead, which stops it at its first check."""
    d, model, missing = files["inputs"], files["model"], files["inputs"] / "missing.pt"
    return {
        "translate": ["-m", model, "-i", d / "one.txt", "-o", out / "out.txt", "--device", "cpu"],
        "serve": ["-m", missing if stop_early else model, "--device", "cpu"],
        "shortlist": ["-m", model, "--src", d / "src.txt", "--tgt", d / "tgt.txt", "-o", out / "s.pt"],
        "score": ["-r", d / "src.txt", "-i", d / "tgt.txt"],
        "average": ["--dir", d / "checkpoints", "-o", out / "average.pt"],
        "distill": ["multi30k-en-de-student", "--teacher", missing if stop_early else model, "-w", out / "w"],
        "backtranslate": ["--reverse", model, "--mono", d / "src.txt", "-o", out / "bt", "--device", "cpu"],
    }[command]


# Options a run needs beside the one under test, to exercise it: sampling's own settings sample; one
# worker unless the count of workers is what is drawn.
NEEDS = {
    "--sampling-topk": ["--sampling"],
    "--sampling-topp": ["--sampling"],
    "--temperature": ["--sampling"],
}
NEEDS["--seed"] = NEEDS["--sampling-topk"]
ALWAYS = {"translate": ["--workers", "1"], "serve": ["--port", "0"]}


def command_line(command: str, option: str, text: str, files, out: Path, stop_early: bool) -> list[str]:
    base = [str(a) for a in arguments(command, files, out, stop_early)]
    extra = [] if option in ALWAYS.get(command, []) else ALWAYS.get(command, [])
    needs = NEEDS.get(option, []) if command == "translate" else []
    return [command, *base, *extra, *needs, option, text]


class Started(BaseException):
    """Work started before the option was checked: a BaseException, so no `except Exception` hides it."""


def nothing_may_start(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise Started(f"started with {args[:1]}")

    monkeypatch.setattr(torch, "load", refuse)  # every checkpoint nmt reads goes through it
    monkeypatch.setattr("os.fork", refuse)  # workers, and any other process


counter = itertools.count()


def fresh(files) -> Path:
    out = files["outputs"] / f"case-{next(counter)}"
    out.mkdir()
    return out


def snapshot(folder: Path) -> dict:
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def text(value: float) -> str:
    return repr(value) if isinstance(value, float) else str(value)


# ---- values ------------------------------------------------------------------------------------------


def inside(option: str, kind: type) -> st.SearchStrategy:
    """Values within the option's bound, its own edges first: the least and the most it allows."""
    bound = limits.bound(option)
    high = bound.most()
    if kind is int:
        low = int(bound.low) + bound.low_excluded
        top = 2**70 if high is None else int(high) - bound.high_excluded
        return st.one_of(st.sampled_from([low, top]), st.integers(low, top))
    floats = st.floats(
        bound.low,
        high,
        exclude_min=bound.low_excluded,
        exclude_max=bound.high_excluded,
        allow_nan=False,
        allow_infinity=False,
    )
    edges = [bound.low if not bound.low_excluded else math.nextafter(bound.low, math.inf)]
    edges.append(high if not bound.high_excluded else math.nextafter(high, -math.inf))
    return st.one_of(st.sampled_from(edges), floats)


HUGE = [2**31, 2**32, 2**63, 2**64, 10**30, -(2**63), -1, 0]
FLOATS = [math.nan, math.inf, -math.inf, 1e308, -1e308, -1.0, 0.0, -0.0, 1e-300, 5e-324]


def outside(option: str, kind: type) -> st.SearchStrategy:
    """Values out of the option's bound: just past each edge, and hostile numbers of every size."""
    bound = limits.bound(option)
    high = bound.most()
    if kind is int:
        edges = [int(bound.low) - 1 + bound.low_excluded] + ([] if high is None else [int(high) + 1])
        values = st.one_of(st.sampled_from(edges + HUGE), st.integers(-(2**70), 2**70))
    else:
        edges = [math.nextafter(bound.low, -math.inf) if not bound.low_excluded else bound.low]
        edges += [math.nextafter(high, math.inf) if not bound.high_excluded else high]
        values = st.one_of(st.sampled_from(edges + FLOATS), st.floats())
    return values.filter(lambda v: limits.problem(option, v) is not None)


# ---- the cases ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("command", "option", "kind", "default"), OPTIONS, ids=IDS)
@settings(max_examples=6)
@given(data=st.data())
def test_a_value_out_of_bounds_is_one_line_before_any_work(files, command, option, kind, default, data):
    value = data.draw(outside(option, kind), label="value")
    out = fresh(files)
    before = snapshot(files["inputs"])
    with pytest.MonkeyPatch.context() as m:
        nothing_may_start(m)
        result = cli(*command_line(command, option, text(value), files, out, stop_early=False))
    line = limits.problem(option, value)
    assert result.exit_code == 2, (line, result.stderr, result.exception)
    assert result.stderr.strip() == f"error: {line}", line
    assert list(out.iterdir()) == [] and snapshot(files["inputs"]) == before


INTS = [(o, i) for o, i in zip(OPTIONS, IDS, strict=True) if o[2] is int]


@pytest.mark.parametrize(
    ("command", "option", "kind", "default"), [o for o, _ in INTS], ids=[i for _, i in INTS]
)
@settings(max_examples=3)
@given(data=st.data())
def test_text_that_is_not_an_integer_is_one_line_naming_the_option(
    files, command, option, kind, default, data
):
    value = data.draw(st.sampled_from(["1.5", "nan", "inf", "1e3", "0x10", "", "ten"]), label="text")
    out = fresh(files)
    with pytest.MonkeyPatch.context() as m:
        nothing_may_start(m)
        result = cli(*command_line(command, option, value, files, out, stop_early=False))
    assert result.exit_code == 2, (result.stderr, result.exception)
    assert option in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert list(out.iterdir()) == []


@pytest.mark.parametrize(("command", "option", "kind", "default"), OPTIONS, ids=IDS)
@settings(max_examples=3)
@given(data=st.data())
def test_a_value_within_bounds_runs_or_is_one_line(files, command, option, kind, default, data):
    value = data.draw(inside(option, kind), label="value")
    out = fresh(files)
    stop_early = command in ("serve", "distill")  # these stop at the missing model or teacher
    result = cli(*command_line(command, option, text(value), files, out, stop_early))
    stderr, lines = result.stderr, [x for x in result.stderr.splitlines() if x.strip()]
    assert limits.problem(option, value) is None and result.exit_code in (0, 2), (stderr, result.exception)
    if stop_early:
        assert result.exit_code == 2 and len(lines) == 1 and "missing.pt" in lines[0], stderr
    elif result.exit_code != 0:  # a value the model's own settings rule out, named in one line
        assert len(lines) == 1 and option in lines[0], stderr
    else:  # it ran: its output is written (score's is on stdout)
        assert any(out.iterdir()) or result.stdout, stderr
