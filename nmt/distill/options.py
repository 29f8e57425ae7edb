"""What `nmt distill` takes beside the student recipe, with its defaults and checks: the CLI's options
read their defaults here, so this module imports nothing heavy (no torch)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from nmt.config import Engine, Precision
from nmt.data.filters import FilterSettings
from nmt.errors import ConfigError
from nmt.limits import check

SELECT = ("chrf", "top1")
INIT = ("scratch", "teacher")


@dataclass(frozen=True)
class DistillOptions:
    """What `nmt distill` takes beside the student recipe."""

    teacher: Path
    # chrf: closest to the reference; top1: the teacher's best. None: top1 for --mono text (it has no
    # references), else chrf
    select: str | None = None
    mono: Path | None = None  # monolingual source text to translate instead of the recipe's training source
    teacher_engine: Engine = Engine.TORCH
    teacher_precision: Precision = Precision.FP32
    nbest: int = 4  # hypotheses per line; the teacher's beam is at least this wide
    chunk_lines: int = 2000  # lines the teacher translates between two saved chunks
    filters: FilterSettings = FilterSettings()
    compare: bool = True  # the last step: teacher against student on the test sets
    init: str = "scratch"  # teacher: the student starts from the teacher's layers (nmt.distill.shrink)

    def __post_init__(self) -> None:
        if self.select is None:
            object.__setattr__(self, "select", "top1" if self.mono is not None else "chrf")


def check_options(opts: DistillOptions) -> None:
    if not opts.teacher.is_file():
        raise ConfigError(f"--teacher {opts.teacher}: no such checkpoint")
    if opts.select not in SELECT:
        raise ConfigError(f"--select {opts.select}: expected one of {', '.join(SELECT)}")
    if opts.init not in INIT:
        raise ConfigError(f"--init {opts.init}: expected one of {', '.join(INIT)}")
    if opts.mono is not None and opts.select == "chrf":
        raise ConfigError("--select chrf needs references, and --mono text has none: use --select top1")
    if opts.mono is not None and not opts.mono.is_file():
        raise ConfigError(f"--mono {opts.mono}: no such file")
    check("--nbest", opts.nbest)
    check("--chunk-lines", opts.chunk_lines)
    check("--max-ratio", opts.filters.max_ratio)
    check("--drop-worst", opts.filters.worst_percent)
