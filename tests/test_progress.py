"""Progress of long steps: a bar on a terminal, a plain line now and then in a log, never on stdout."""

from __future__ import annotations

import io
import re

import yaml
from rich.console import Console
from typer.testing import CliRunner

from nmt.cli import app
from nmt.progress import Progress, count_lines

from .test_preprocess import generated_pairs, small_corpus, small_recipe


def log_console() -> tuple[Console, io.StringIO]:
    buffer = io.StringIO()
    return Console(file=buffer, width=80), buffer


def test_a_log_gets_a_line_per_interval_with_count_rate_and_eta(monkeypatch):
    monkeypatch.setenv("NMT_PROGRESS_EVERY", "0")
    console, buffer = log_console()
    with Progress(console, "translate big.en", total=12_000) as progress:
        for _ in range(3):
            progress.advance(2000)
    lines = buffer.getvalue().splitlines()
    assert [
        re.match(r"translate big.en: ([\d,]+) of 12,000 lines \((\d+)%\)", x).groups() for x in lines
    ] == [
        ("2,000", "17"),
        ("4,000", "33"),
        ("6,000", "50"),
    ]
    assert all(re.search(r", [\d,]+ lines/s, ETA \d+:\d\d:\d\d$", x) for x in lines), lines


def test_short_work_in_a_log_is_silent_and_long_work_ends_with_its_total(monkeypatch):
    console, buffer = log_console()
    with Progress(console, "clean corpus", total=100) as progress:  # 30 s between lines by default
        progress.advance(100)
    assert buffer.getvalue() == ""

    monkeypatch.setenv("NMT_PROGRESS_EVERY", "0.2")
    clock = iter([0.0, 0.1, 0.3, 0.35, 0.4, 0.45])  # start, then one reading per advance and at the end
    monkeypatch.setattr("nmt.progress.monotonic", lambda: next(clock))
    with Progress(console, "download x.gz", total=5_000_000, unit="bytes") as progress:
        for _ in range(4):
            progress.advance(1_000_000)
    lines = buffer.getvalue().splitlines()
    assert len(lines) == 2, lines  # one when 0.2 s had passed, then the total when closed
    assert lines[0].startswith("download x.gz: 2.0 MB of 5.0 MB (40%), 6.7 MB/s, ETA 0:00:00")
    assert lines[1].startswith("download x.gz: 4.0 MB of 5.0 MB (80%)")


def test_a_terminal_gets_a_bar_with_count_rate_and_time_left():
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=120)
    with Progress(console, "encode and binarize train", total=40_000) as progress:
        progress.advance(10_000)
        progress.bar.refresh()  # what the terminal shows now (rich redraws ten times a second)
        progress.advance(10_000)
        progress.bar.refresh()
    drawn = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", buffer.getvalue())  # without the cursor movements
    assert "encode and binarize train" in drawn
    assert "10000/40000" in drawn and "20000/40000" in drawn
    assert re.search(r"[\d,]+ lines/s", drawn) and re.search(r"\d+:\d\d:\d\d", drawn)


def test_nothing_when_there_is_no_console_or_a_quiet_one(monkeypatch):
    monkeypatch.setenv("NMT_PROGRESS_EVERY", "0")
    buffer = io.StringIO()
    for console in (None, Console(file=buffer, quiet=True)):
        with Progress(console, "x", total=2) as progress:
            progress.advance(1)
    assert buffer.getvalue() == ""


def test_count_lines(tmp_path):
    for text, n in [(b"", 0), (b"a\n", 1), (b"a\nb", 2), (b"\n\n\n", 3), (b"x\n" * 700_000, 700_000)]:
        (tmp_path / "f").write_bytes(text)
        assert count_lines(tmp_path / "f") == n


def test_preprocess_in_a_log_prints_counts_of_cleaning_and_binarizing(tmp_path, monkeypatch):
    monkeypatch.setenv("NMT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("NMT_PROGRESS_EVERY", "0")
    small_corpus(tmp_path / "m", generated_pairs(25_000))
    recipe = tmp_path / "r.yaml"
    spec = small_recipe(tmp_path / "m", vocab_size=64)
    spec["data"]["dedup"] = False  # the generated pairs repeat some: every one of them is binarized here
    recipe.write_text(yaml.safe_dump(spec))
    args = ["preprocess", str(recipe), "-w", str(tmp_path / "w"), "--mirror", str(tmp_path / "m")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert result.stdout == ""
    err = result.stderr
    for count in ("10,000", "20,000", "25,000"):
        assert f"clean corpus: {count} of 25,000 lines" in err, err
    assert "encode and binarize train: 20,000 of 25,000 lines (80%)" in err, err
    assert "encode and binarize train: 25,000 of 25,000 lines (100%)" in err, err


def test_translation_progress_moves_per_batch_not_per_chunk(tmp_path, monkeypatch):
    """A chunk of lines is many batches: a log (or the bar's rate and ETA) hears of each one, not only of
    the whole chunk minutes later."""
    from nmt.config import DecodeOverrides
    from nmt.translate.stream import CHUNK_LINES, translate_stream
    from nmt.untrained import save_random_model

    from .synthetic import make_config, make_subword

    monkeypatch.setenv("NMT_PROGRESS_EVERY", "0")
    model = save_random_model(tmp_path / "m.pt", make_config(), make_subword(tmp_path / "spm"))
    src = tmp_path / "in.xx"
    lines = 200
    assert lines < CHUNK_LINES  # one chunk
    src.write_text("a b c d\n" * (lines - 2) + "\n\n")  # two blank lines: never searched, still counted
    console, buffer = log_console()
    overrides = DecodeOverrides.given(beam=1, max_len_b=1, batch_tokens=64)
    translate_stream(model, src, tmp_path / "out.txt", overrides, "cpu", "fp32", False, console)
    counts = [int(m[1].replace(",", "")) for m in re.finditer(r"([\d,]+) of 200 lines", buffer.getvalue())]
    assert len(counts) > 5, buffer.getvalue()  # many batches of about 10 lines each
    assert counts == sorted(counts) and counts[-1] == lines


def test_a_training_log_gets_whole_lines_never_a_cut_live_line():
    """Rich prints its live line once at the end in a log, cut to the width with ellipses: a log that is
    not a terminal gets only whole plain lines."""
    from nmt.train.monitor import ProgressDisplay
    from nmt.train.resume import TrainProgress

    from .synthetic import make_config

    buffer = io.StringIO()
    console = Console(file=buffer, width=40)  # narrower than any line
    record = {"step": 10, "loss": 3.25, "ppl": 25.8, "lr": 1e-3, "tokens_per_s": 12345.0, "elapsed": 5.0}
    with ProgressDisplay(console, make_config(), TrainProgress()) as display:
        display.update(record)
        display.validation({**record, "bleu": 12.5})
    text = buffer.getvalue()
    assert "…" not in text and "..." not in text, text
    assert text.splitlines() == [
        "step 10: loss 3.250 ppl 25.80 lr 1.00e-03 12,345 tok/s",
        "step 10: valid loss 3.250 ppl 25.80 BLEU 12.50",
    ]
