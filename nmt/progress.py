"""Progress of long work outside training (downloads, cleaning, encoding, translating a file).

On a terminal, rich draws a bar with the count, the rate and the time left. When stderr is a file or a
pipe (a log), a bar would print nothing until the end: a plain line is printed instead every
NMT_PROGRESS_EVERY seconds (30 by default), and a last one with the total once any was printed, so short
work stays silent and long work never floods the log. Progress goes to the console given (stderr), never
to stdout. Callers advance it per chunk of work (a megabyte, thousands of lines), not per line, so the
loops it measures pay nothing for it.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from time import monotonic

from rich import filesize
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    ProgressColumn,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.progress import Progress as Bar
from rich.text import Text

EVERY_S = 30.0


class RateColumn(ProgressColumn):
    """Items per second, in the task's unit."""

    def __init__(self, unit: str):
        super().__init__()
        self.unit = unit

    def render(self, task) -> Text:
        return Text(
            "" if task.speed is None else f"{task.speed:,.0f} {self.unit}/s", style="progress.data.speed"
        )


class Progress:
    """How far one long step is: `advance(n)` per chunk, `close()` (or a with block) at the end.

    `unit` "bytes" counts in kB/MB; any other unit is a count ("lines"). `total` None: unknown (no ETA).
    A console of None, or a quiet one, shows nothing.
    """

    def __init__(
        self, console: Console | None, what: str, total: int | None = None, unit: str = "lines", done: int = 0
    ):
        self.console = None if console is None or console.quiet else console
        self.what, self.total, self.unit, self.done, self.first = what, total, unit, done, done
        self.start = self.last = monotonic()
        self.every = every_seconds()
        self.printed, self.shown = False, done
        self.bar: Bar | None = None
        if self.console is not None and self.console.is_terminal:
            if unit == "bytes":
                columns = (DownloadColumn(), TransferSpeedColumn())
            else:
                columns = (MofNCompleteColumn(), RateColumn(unit))
            # stdout untouched: translations may go there, and they must not pass through rich
            self.bar = Bar(
                TextColumn("{task.description}"),
                BarColumn(),
                *columns,
                TimeRemainingColumn(),
                console=self.console,
                transient=True,
                redirect_stdout=False,
                redirect_stderr=False,
            )
            self.task = self.bar.add_task(what, total=total, completed=done)
            self.bar.start()

    def advance(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(self.task, completed=self.done)  # rich redraws on its own clock
        elif self.console is not None and (now := monotonic()) - self.last >= self.every:
            self.print_line(now)

    def print_line(self, now: float) -> None:
        self.last, self.printed, self.shown = now, True, self.done
        rate = (self.done - self.first) / max(now - self.start, 1e-9)
        if self.total:  # "2,000 of 12,000 lines (17%)", "2.0 MB of 5.0 MB (40%)"
            done = self.amount(self.done) if self.unit == "bytes" else f"{self.done:,}"
            count = f"{done} of {self.amount(self.total)} ({self.done / self.total:.0%})"
        else:
            count = self.amount(self.done)
        line = f"{self.what}: {count}, {self.amount(rate)}/s"
        if self.total and rate > 0 and self.done < self.total:
            line += f", ETA {timedelta(seconds=round((self.total - self.done) / rate))}"
        self.console.print(line, highlight=False, soft_wrap=True)

    def amount(self, n: float) -> str:
        return filesize.decimal(int(n)) if self.unit == "bytes" else f"{n:,.0f} {self.unit}"

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
        elif self.printed and self.shown != self.done:
            self.print_line(monotonic())  # the total, ending the series of lines

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def every_seconds() -> float:
    """The interval of the plain lines: NMT_PROGRESS_EVERY seconds, or 30."""
    try:
        return float(os.environ.get("NMT_PROGRESS_EVERY", EVERY_S))
    except ValueError:
        return EVERY_S


def count_lines(path: Path) -> int:
    """The lines of a file (a last line without a newline counted), read at memory speed in 1 MB blocks:
    a total for the progress of work that takes far longer per line."""
    lines, last = 0, b"\n"
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            lines += block.count(b"\n")
            last = block[-1:]
    return lines + (last != b"\n")
