"""A test set translated once per model, for `nmt run` and `nmt distill`: the translation beside a record
(`<out>.json`) of the model it came from (by its file's mtime), the precision and the speed.

When the translation and its record are there and name the model as it is now, they are what the command
uses, and no translator is built; otherwise the test set is translated again (a model trained further since
is a new model). A killed translation leaves no record, so it is redone.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console

from nmt import atomic
from nmt.score import read_lines
from nmt.translate.builder import BuiltTranslator


def translate_test_file(
    src: Path,
    out: Path,
    model: Path,
    build: Callable[[], BuiltTranslator],
    target: str | None = None,
    latency_lines: int = 0,
    console: Console | None = None,
    name: str | None = None,
) -> dict:
    """Translate the lines of `src` into `out` with the translator `build()` returns, unless `out` is
    already the translation of `model` (its mtime in the record); returns the record:
    `{"model_mtime", "precision", "speed"}`.

    `build` is called only where a translation is needed; cache it (functools.cache) to share one
    translator among several test sets. `target`: the target tag of a model of several targets.
    The speed is the whole file batched (seconds, sentences/s, target tokens/s); with `latency_lines`,
    also the median time of the first that many non-empty lines translated one at a time (latency_ms,
    None for a file of none). `console` and `name`: a line on what was done.
    """
    name = name or out.name
    meta = out.with_name(out.name + ".json")
    mtime = Path(model).stat().st_mtime
    done = recorded(out, meta)
    if done is not None and done.get("model_mtime") == mtime:
        if console is not None:
            console.print(f"translate {name}: already done ({out})")
        return done
    built = build()
    translator = built.translator
    lines = read_lines(src)
    start = time.perf_counter()
    hyps = translator.translate(lines, target=target)
    seconds = time.perf_counter() - start
    tokens = sum(len(ids) + 1 for ids in translator.subword.encode_target(hyps))  # + EOS, as decoded
    speed = {
        "sentences": len(lines),
        "seconds": round(seconds, 2),
        "sentences_per_s": round(len(lines) / seconds, 1),
        "target_tokens_per_s": round(tokens / seconds, 1),
    }
    if latency_lines:
        latencies = []
        for line in [s for s in lines if s.strip()][:latency_lines]:
            start = time.perf_counter()
            translator.translate([line], target=target)
            latencies.append(time.perf_counter() - start)
        speed["latency_ms"] = round(1000 * statistics.median(latencies), 1) if latencies else None
    info = {"model_mtime": mtime, "precision": built.precision, "speed": speed}
    atomic.write_text(out, "".join(h + "\n" for h in hyps))
    atomic.write_text(meta, json.dumps(info) + "\n")  # last: the record says the translation is whole
    if console is not None:
        console.print(f"translate {name}: {len(lines)} lines in {seconds:.1f} s -> {out}")
    return info


def recorded(out: Path, meta: Path) -> dict | None:
    """The record of `out`, or None where there is no whole translation with a readable record."""
    if not (out.exists() and meta.exists()):
        return None
    try:
        info = json.loads(meta.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # not ours as written (atomic writes leave none half): translate again
        return None
    return info if isinstance(info, dict) else None
