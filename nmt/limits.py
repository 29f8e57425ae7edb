"""The bounds of every number a command of nmt takes, in one table, checked before any work starts.

Each quantity has a least and a most value, and a reason for the most: a natural one where there is
(a port, a probability, the CPUs), a stated cap where there is none (a beam, a chunk of lines), chosen
far past any real use and short of what would exhaust memory, overflow a float or hang. NaN is refused
everywhere (it compares false with every bound) and so is an infinity (a finite bound excludes it).

The CLI checks each numeric option by its name (`OPTIONS`) before a command runs (nmt.cli's Command); the
library functions that take the same numbers (ServeSettings.check, plan_workers, check_sizes, a recipe's
decode section) check them against the same table, so a number lives here and nowhere else. An option's
name means one quantity in every command that takes it: --nbest is a beam's n-best in translate and the
teacher's in distill, --max-tokens the batch budget in translate and serve.

Imports nothing heavy, so the CLI can check before torch loads.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass

from nmt.errors import ConfigError

# The model sizes a recipe may ask for (nmt.config's MODEL_LIMITS): several decode counts are bounded by
# them, since nothing a model outputs is longer than its positions or wider than its vocabulary.
MAX_POSITIONS = 65_536
MAX_VOCAB = 1_000_000


def max_workers() -> int:
    """The most workers `nmt translate` runs: the CPUs this process may run on (its affinity: a
    container's or taskset's share, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class Bound:
    """`low` to `high`, both included unless `low_excluded` / `high_excluded`. `high` None: no most
    value, for a count that means "all" past what there is (`why` says so); a callable: a most value
    read where the check runs (the CPUs)."""

    low: float
    high: float | Callable[[], int] | None
    why: str  # why the most value is what it is
    low_excluded: bool = False
    high_excluded: bool = False

    def most(self) -> float | None:
        return self.high() if callable(self.high) else self.high

    def problem(self, value: float) -> str | None:
        """What `value` should be, in a few words ("at least 1"), or None when it is within bounds."""
        high = self.most()
        if isinstance(value, float) and math.isnan(value):
            return f"a number from {show(self.low)} to {show(high) if high is not None else 'any'}"
        if value < self.low or (self.low_excluded and value == self.low):
            return f"{'more than' if self.low_excluded else 'at least'} {show(self.low)}"
        if high is not None and (value > high or (self.high_excluded and value == high)):
            return f"{'less than' if self.high_excluded else 'at most'} {show(high)} ({self.why})"
        if isinstance(value, float) and math.isinf(value):  # below a high of None: no number is infinite
            return f"a finite number ({self.why})"
        return None


def show(x: float) -> str:
    """A bound or value as a user reads it: 1,024 and 2,000; 0.01 and 1e+308; nan and inf."""
    if isinstance(x, float) and not x.is_integer():
        return f"{x:g}"
    return f"{int(x):,}" if isinstance(x, int) or math.isfinite(x) and abs(x) < 1e15 else f"{x:g}"


DAY = 86_400.0  # seconds

QUANTITIES: dict[str, Bound] = {
    # Decoding (nmt translate and serve, and a recipe's decode section, whose field names these are)
    "beam": Bound(1, 1024, "a wider beam only spends memory and time; search is best at 4 to 10"),
    "nbest": Bound(1, 1024, "as wide as a beam at most"),
    "lenpen": Bound(-10.0, 10.0, "the penalty ((5+|Y|)/6)^alpha overflows for long outputs past this"),
    "max_len_a": Bound(0.0, 100.0, "no translation is a hundred times as long as its source"),
    "max_len_b": Bound(0, MAX_POSITIONS, "no model has more positions"),
    "min_len": Bound(0, MAX_POSITIONS, "no model has more positions"),
    "batch_tokens": Bound(1, 2**24, "a batch this large holds far more than any device's memory"),
    "no_repeat_ngram_size": Bound(0, MAX_POSITIONS, "no model has more positions"),
    "sampling_topk": Bound(0, MAX_VOCAB, "no vocabulary is larger; past the model's own, all of it"),
    "sampling_topp": Bound(0.0, 1.0, "a probability", low_excluded=True),
    "temperature": Bound(
        0.01, 100.0, "past 100 every token is about as likely; below 0.01 sampling is greedy search"
    ),
    "seed": Bound(0, 2**32 - 1, "CTranslate2's seed is unsigned 32-bit; one seed serves both engines"),
    "workers": Bound(1, max_workers, "the CPUs this process may run on"),
    # The server (nmt.serve.ServeSettings, and where it listens)
    "port": Bound(0, 65535, "a TCP port; 0 picks a free one"),
    "batch_wait_ms": Bound(0.0, 60_000.0, "a minute: longer is a timeout, not a batch"),
    "max_chars": Bound(1, 10_000_000, "a request body of 60 MB; larger documents go in parts"),
    "max_queue": Bound(1, 10_000_000, "ten million lines waiting is hours of work held in memory"),
    "timeout": Bound(0.0, DAY, "a day", low_excluded=True),
    "read_timeout": Bound(0.0, 3600.0, "an hour", low_excluded=True),
    "keep_alive": Bound(0.0, 3600.0, "an hour", low_excluded=True),
    "max_connections": Bound(1, 1_048_576, "Linux's most open files of one process (fs.nr_open)"),
    "shutdown_timeout": Bound(0.0, DAY, "a day", low_excluded=True),
    # nmt shortlist: a set never holds more than the vocabulary, so a larger size means all of it
    "frequent": Bound(0, None, "none: past the vocabulary, all of it"),
    "per_source": Bound(1, None, "none: past the vocabulary, all of it"),
    "iterations": Bound(1, 100, "IBM Model 1's EM converges in a handful; more only spends time"),
    # nmt distill and backtranslate
    "chunk_lines": Bound(1, 1_000_000, "a chunk is held in memory and saved whole"),
    "max_lines": Bound(1, 2**40, "a trillion lines; more than any corpus"),
    "max_ratio": Bound(1.0, 1000.0, "a word-count factor past any sentence pair's"),
    "drop_worst": Bound(0.0, 100.0, "a percentage of the pairs; all of them leaves none", high_excluded=True),
    # nmt average and score
    "last": Bound(1, 1_000_000, "far more checkpoints than any run keeps"),
    "width": Bound(0, 20, "decimals past a float's 17 significant digits are noise"),
}

# Every numeric option of the CLI -> its quantity. tests/test_hostile_options.py walks the CLI and fails
# for an option missing here.
OPTIONS: dict[str, str] = {
    "--beam": "beam",
    "--nbest": "nbest",
    "--lenpen": "lenpen",
    "--max-len-a": "max_len_a",
    "--max-len-b": "max_len_b",
    "--min-len": "min_len",
    "--max-tokens": "batch_tokens",
    "--max-batch-tokens": "batch_tokens",
    "--no-repeat-ngram-size": "no_repeat_ngram_size",
    "--sampling-topk": "sampling_topk",
    "--sampling-topp": "sampling_topp",
    "--temperature": "temperature",
    "--seed": "seed",
    "--workers": "workers",
    "--port": "port",
    "--batch-wait-ms": "batch_wait_ms",
    "--max-chars": "max_chars",
    "--max-queue": "max_queue",
    "--timeout": "timeout",
    "--read-timeout": "read_timeout",
    "--keep-alive": "keep_alive",
    "--max-connections": "max_connections",
    "--shutdown-timeout": "shutdown_timeout",
    "--frequent": "frequent",
    "--per-source": "per_source",
    "--iterations": "iterations",
    "--chunk-lines": "chunk_lines",
    "--max-lines": "max_lines",
    "--max-ratio": "max_ratio",
    "--drop-worst": "drop_worst",
    "--last": "last",
    "--width": "width",
}


def bound(option: str) -> Bound | None:
    """The bound of a CLI option (`--beam`), or None where the table states none."""
    quantity = OPTIONS.get(option)
    return QUANTITIES[quantity] if quantity is not None else None


def problem(option: str, value: float) -> str | None:
    """The one-line error for `value` of `option` (`--beam 0: at least 1`), or None when it is in bounds
    or the option has no bound."""
    found = bound(option)
    why = found.problem(value) if found is not None else None
    return f"{option} {show(value) if isinstance(value, float) else value}: {why}" if why else None


def check(option: str, value: float | None) -> None:
    """Raise ConfigError naming `option` when `value` is out of its bounds; None (not given) passes."""
    if value is not None and (message := problem(option, value)) is not None:
        raise ConfigError(message)
