"""Learning curves of a training run, drawn from WORKDIR/metrics.jsonl into one PNG (`nmt plot`).

matplotlib is an optional extra (`pip install 'nmt[plot]'`): it is imported only when drawing, so reading
the metrics and every error about them work without it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from nmt.atomic import atomic_write, refuse_inputs
from nmt.errors import DataError, NmtError


@dataclass
class Curves:
    """The records of metrics.jsonl split by kind, each a list of dicts in file order."""

    train: list[dict] = field(default_factory=list)
    valid: list[dict] = field(default_factory=list)


def read_metrics(path: Path) -> Curves:
    """Read the trainer's metrics.jsonl, skipping lines that do not parse.

    The trainer may be killed mid-write, leaving a truncated last line; unknown keys and kinds are
    ignored so that newer trainers' files still plot.
    """
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        raise DataError(f"no metrics file {path}: train a model in that work directory first") from None
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e}") from None
    curves = Curves()
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(record, dict) or not isinstance(record.get("step"), int | float):
            continue
        if record.get("kind") == "train":
            curves.train.append(record)
        elif record.get("kind") == "valid":
            curves.valid.append(record)
    if not curves.train and not curves.valid:
        raise DataError(f"{path} holds no training or validation records")
    return curves


def _series(records: list[dict], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the records that carry a number under `key` (BLEU may be null), by step.

    A resumed run logs again the steps after its last checkpoint: the later record of a step wins.
    """
    points = {r["step"]: r[key] for r in records if isinstance(r.get(key), int | float) and r[key] == r[key]}
    steps = sorted(points)
    return steps, [points[s] for s in steps]


def _draw(ax, records: list[dict], key: str, label: str, **style) -> bool:
    steps, values = _series(records, key)
    if steps:
        ax.plot(steps, values, label=label, **style)
    return bool(steps)


def plot(workdir: Path, output: Path | None = None) -> Path:
    """Draw loss, perplexity, validation BLEU, learning rate, tokens/s and wall time against step.

    Writes the PNG atomically (default WORKDIR/curves.png) and returns its path.
    """
    metrics = Path(workdir) / "metrics.jsonl"
    refuse_inputs(output, [metrics])
    curves = read_metrics(metrics)
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise NmtError("nmt plot needs matplotlib: pip install 'nmt[plot]'") from None

    output = Path(output) if output is not None else Path(workdir) / "curves.png"
    train, valid = curves.train, curves.valid
    # A Figure without pyplot: no GUI backend, no global state, works headless.
    fig = Figure(figsize=(12, 10), layout="constrained")
    axes = fig.subplots(3, 2, sharex=True)
    (loss, ppl), (bleu, lr), (speed, wall) = axes

    _draw(loss, train, "loss", "train (label-smoothed)", color="tab:blue", alpha=0.7)
    _draw(loss, train, "nll", "train NLL", color="tab:orange", alpha=0.7)
    _draw(loss, valid, "loss", "valid (label-smoothed)", color="tab:blue", marker="o")
    _draw(loss, valid, "nll", "valid NLL", color="tab:orange", marker="o")
    loss.set_title("loss (nats/token)")

    has_train_ppl = _draw(ppl, train, "ppl", "train", color="tab:orange", alpha=0.7)
    if _draw(ppl, valid, "ppl", "valid", color="tab:orange", marker="o") or has_train_ppl:
        ppl.set_yscale("log")  # perplexity falls by orders of magnitude early on
    ppl.set_title("perplexity")

    if not _draw(bleu, valid, "bleu", "valid BLEU", marker="o", color="tab:green"):
        bleu.text(0.5, 0.5, "no validation BLEU yet", ha="center", va="center", transform=bleu.transAxes)
    bleu.set_title("validation BLEU")

    _draw(lr, train, "lr", "learning rate", color="tab:purple")
    lr.set_title("learning rate")

    _draw(speed, train, "tokens_per_s", "tokens/s", color="tab:orange")
    speed.set_title("throughput (tokens/s)")

    # Wall time against step shows stalls, restarts (resumed runs) and the cost of validation.
    _draw(wall, train or valid, "elapsed", "elapsed", color="tab:gray")
    wall.set_title("wall time (s)")

    for ax in axes.flat:
        ax.grid(True, alpha=0.3)
    for ax in (loss, ppl):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    for ax in axes[-1]:
        ax.set_xlabel("step")
    fig.suptitle(f"{Path(workdir).name}: learning curves")

    with atomic_write(output) as f:  # never a half-written PNG behind a crash
        fig.savefig(f, format="png", dpi=100)
    return output
