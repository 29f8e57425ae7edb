"""What a training run shows and records: metrics.jsonl and train.log for plotting, the live line.

`TrainMeter` adds up an update's figures between log lines without a host-device sync; one happens
only when a line is written.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from nmt.config import Config
from nmt.data.loader import Update
from nmt.train.loss import perplexity
from nmt.train.resume import TrainProgress
from nmt.train.runtime import Runtime


class TrainMeter:
    """Running sums since the last log line: loss and nll on the device, token counts on the host."""

    def __init__(self, rt: Runtime):
        self.rt = rt
        self.sums = torch.zeros(2, device=rt.device)  # loss, nll
        self.targets = self.real = self.padded = 0
        self.start = time.monotonic()
        self.wait_start = 0.0

    def add(self, update: Update, sums: torch.Tensor) -> None:
        self.sums += sums
        self.targets, self.real, self.padded = (
            self.targets + update.targets,
            self.real + update.real,
            self.padded + update.padded,
        )

    def record(self, prog: TrainProgress, lr: float, grad_norm: torch.Tensor, data_wait: float) -> dict:
        """The log line's figures over all ranks, then start a new interval. `data_wait`: the seconds
        the loop has waited for the loader so far (the share of this interval goes in the record)."""
        totals = torch.cat([self.sums, torch.tensor([float(self.targets)], device=self.rt.device)])
        if self.rt.world_size > 1:
            dist.all_reduce(totals)
        loss_sum, nll_sum, tokens = totals.tolist()
        now = time.monotonic()
        seconds = max(now - self.start, 1e-9)
        record = {
            "kind": "train",
            "step": prog.step,
            "elapsed": round(prog.elapsed, 2),
            "loss": loss_sum / tokens,
            "nll": nll_sum / tokens,
            "ppl": perplexity(nll_sum / tokens),
            "lr": lr,
            "tokens_per_s": tokens / seconds,
            "grad_norm": float(grad_norm),
            "padding": round(1 - self.real / max(self.padded, 1), 4),
            "data_wait": round((data_wait - self.wait_start) / seconds, 4),
        }
        self.sums.zero_()
        self.targets = self.real = self.padded = 0
        self.start, self.wait_start = now, data_wait
        return record


class MetricsLog:
    """Appends one JSON object per line to WORKDIR/metrics.jsonl (and a text line to train.log)."""

    def __init__(self, workdir: Path, enabled: bool):
        self.enabled = enabled
        self.workdir = workdir
        self.tensorboard = None
        if enabled:
            workdir.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(ImportError):
                from torch.utils.tensorboard import SummaryWriter

                self.tensorboard = SummaryWriter(str(workdir / "tensorboard"))

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        line = json.dumps(record)
        with open(self.workdir / "metrics.jsonl", "a", encoding="utf-8") as f:
            f.write(line + "\n")
        with open(self.workdir / "train.log", "a", encoding="utf-8") as f:
            f.write(
                " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items())
                + "\n"
            )
        if self.tensorboard is not None:
            for key, value in record.items():
                if isinstance(value, int | float) and key not in ("step", "kind"):
                    self.tensorboard.add_scalar(f"{record['kind']}/{key}", value, record["step"])
            self.tensorboard.flush()


class ProgressDisplay:
    """Rich live line: step, loss, ppl, lr, tokens/s, elapsed, ETA, last validation BLEU.

    Only on a terminal: in a log (a file, a pipe) Rich would print the live line once at the end, cut
    to the console's width with ellipses, so a log gets whole plain lines and no bar."""

    def __init__(self, console: Console, cfg: Config, prog: TrainProgress):
        self.cfg, self.prog = cfg, prog
        self.live = console.is_terminal
        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            TextColumn("step {task.completed}/{task.total}"),
            TimeElapsedColumn(),
            TextColumn("{task.fields[eta]}"),
            TextColumn("{task.fields[info]}"),
            console=console,
            transient=False,
        )
        self.train_info = ""
        self.valid_info = ""

    def __enter__(self) -> ProgressDisplay:
        if not self.live:
            return self
        self.progress.start()
        self.task = self.progress.add_task(
            "train", total=self.cfg.train.max_steps, completed=self.prog.step, eta="", info=""
        )
        return self

    def update(self, record: dict) -> None:
        self.train_info = (
            f"loss {record['loss']:.3f} ppl {record['ppl']:.2f} lr {record['lr']:.2e} "
            f"{record['tokens_per_s']:,.0f} tok/s"
        )
        if not self.live:  # a log file or pipe gets whole plain lines instead of a bar
            self.progress.console.print(
                f"step {record['step']}: {self.train_info}", highlight=False, soft_wrap=True
            )
        self.refresh(record["step"], record["elapsed"])

    def validation(self, record: dict) -> None:
        bleu = f" BLEU {record['bleu']:.2f}" if record.get("bleu") is not None else ""
        self.valid_info = f"| valid ppl {record['ppl']:.2f}{bleu}"
        self.progress.console.print(
            f"step {record['step']}: valid loss {record['loss']:.3f} ppl {record['ppl']:.2f}{bleu}",
            highlight=False,
            soft_wrap=True,
        )
        self.refresh(record["step"], record["elapsed"])

    def refresh(self, step: int, elapsed: float) -> None:
        if not self.live:
            return
        t = self.cfg.train
        left = (t.max_steps - step) * elapsed / max(step, 1)
        if t.max_minutes:
            left = min(left, t.max_minutes * 60 - elapsed)
        eta = f"ETA {int(max(left, 0)) // 60}:{int(max(left, 0)) % 60:02d}"
        self.progress.update(self.task, completed=step, eta=eta, info=f"{self.train_info} {self.valid_info}")

    def __exit__(self, *exc) -> None:
        if self.live:
            self.progress.stop()


def training_summary(workdir: Path) -> dict:
    """Updates, time and speed of training from metrics.jsonl."""
    path = workdir / "metrics.jsonl"
    train_records, valid_records = [], []
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            (train_records if record.get("kind") == "train" else valid_records).append(record)
    if not train_records:
        return {}
    speeds = [r["tokens_per_s"] for r in train_records]
    return {
        "updates": train_records[-1]["step"],
        "minutes": round(train_records[-1]["elapsed"] / 60, 1),
        "target_tokens_per_s": round(sorted(speeds)[len(speeds) // 2]),
        "best_valid_bleu": max((r["bleu"] for r in valid_records if r.get("bleu") is not None), default=None),
    }
