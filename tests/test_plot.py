"""`nmt plot`: metrics.jsonl in, learning curves PNG out; robust to what a killed trainer leaves behind."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from nmt.cli import app
from nmt.errors import NmtError
from nmt.plot import read_metrics

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
needs_matplotlib = pytest.mark.skipif(
    not HAS_MATPLOTLIB, reason="matplotlib is not installed: pip install 'nmt[plot]' to run"
)
runner = CliRunner()


def write_metrics(workdir: Path, steps: int = 60) -> Path:
    """A run as the trainer logs it, with an unknown key, an unknown kind and a truncated last line."""
    workdir.mkdir(parents=True, exist_ok=True)
    lines = []
    for step in range(1, steps + 1):
        nll = 6 * math.exp(-step / 20) + 1.5
        lines.append(
            {
                "kind": "train",
                "step": step,
                "elapsed": step * 0.5,
                "loss": nll + 0.4,
                "nll": nll,
                "ppl": math.exp(nll),
                "lr": 1e-3 * min(step / 10, (10 / step) ** 0.5),
                "tokens_per_s": 4000.0 + step,
                "grad_norm": 1.0,
                "rank": 0,  # a key this reader does not know
            }
        )
        if step % 20 == 0:
            bleu = None if step == 20 else 10.0 + step / 10
            lines.append(
                {"kind": "valid", "step": step, "elapsed": step * 0.5, "loss": nll + 0.6, "nll": nll + 0.2}
                | {"ppl": math.exp(nll + 0.2), "bleu": bleu}
            )
    lines.append({"kind": "event", "step": steps, "message": "saved checkpoint"})
    path = workdir / "metrics.jsonl"
    text = "".join(json.dumps(r) + "\n" for r in lines) + '{"kind": "train", "step": 6'  # killed mid-write
    path.write_text(text, encoding="utf-8")
    return path


def test_read_metrics_skips_truncated_and_unknown(tmp_path):
    curves = read_metrics(write_metrics(tmp_path / "run", steps=60))
    assert [r["step"] for r in curves.train] == list(range(1, 61))
    assert [r["step"] for r in curves.valid] == [20, 40, 60]
    assert curves.valid[0]["bleu"] is None


def test_missing_metrics_is_a_user_error(tmp_path):
    """Works without matplotlib: the file is checked before matplotlib is imported."""
    result = runner.invoke(app, ["plot", str(tmp_path / "norun")])
    assert result.exit_code == 2
    assert str(tmp_path / "norun" / "metrics.jsonl") in result.stderr
    assert not (tmp_path / "norun" / "curves.png").exists()


def test_empty_metrics_is_a_user_error(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"kind": "tr', encoding="utf-8")
    with pytest.raises(NmtError, match="no training or validation records"):
        read_metrics(tmp_path / "metrics.jsonl")


def test_missing_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    write_metrics(tmp_path)
    # A None entry in sys.modules makes `import matplotlib...` raise ImportError, as if not installed.
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    monkeypatch.setitem(__import__("sys").modules, "matplotlib.figure", None)
    from nmt.plot import plot

    with pytest.raises(NmtError, match=r"pip install 'nmt\[plot\]'"):
        plot(tmp_path)


@needs_matplotlib
def test_plot_writes_png(tmp_path):
    run = tmp_path / "run"
    write_metrics(run)
    result = runner.invoke(app, ["plot", str(run)])
    assert result.exit_code == 0, result.output
    png = run / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(run.glob("*.tmp"))

    out = tmp_path / "elsewhere" / "c.png"
    result = runner.invoke(app, ["plot", str(run), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@needs_matplotlib
def test_plot_validation_only_or_no_bleu(tmp_path):
    """A run killed before its first validation, or one with only validation records, still plots."""
    from nmt.plot import plot

    run = tmp_path / "early"
    write_metrics(run, steps=5)  # no validation record at all
    assert plot(run).exists()

    valid_only = tmp_path / "valid"
    valid_only.mkdir()
    record = {"kind": "valid", "step": 10, "elapsed": 3.0, "loss": 3.0, "nll": 2.5, "ppl": 12.2, "bleu": None}
    (valid_only / "metrics.jsonl").write_text(json.dumps(record) + "\n", encoding="utf-8")
    assert plot(valid_only, valid_only / "x.png").exists()
