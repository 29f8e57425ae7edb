"""A long input translated in chunks, each kept once written, so a killed run resumes at its first
missing chunk: the teacher step of `nmt distill` and the reverse model of `nmt backtranslate`.

A chunk is one JSON object a line, {"hyps": [...], "scores": [...]} (the n-best of one input line,
best first), in `folder/NNNNN.jsonl`, written atomically; one unreadable or of the wrong length (damage
from outside) is translated again with a warning rather than trusted. With sampling every chunk draws
from its own stream, seeded by (the decode seed, the chunk's number): a resumed run draws for its
missing chunks what an uninterrupted one drew, whatever was done before it.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from nmt import atomic
from nmt.config import DecodeConfig, DecodeOverrides, Engine, Precision
from nmt.errors import DataError


@dataclass(frozen=True)
class ChunkedRun:
    """What translates: `model` (a checkpoint, or a CTranslate2 folder with engine ctranslate2), named
    `name` and called `label` ("teacher", "reverse") in the log, with `overrides` over its decode settings."""

    model: Path
    overrides: DecodeOverrides
    device: str
    precision: Precision
    engine: Engine
    label: str
    name: str
    command: str
    target: str | None = None  # the language to translate into, for a model of several (--target)


def translate_chunks(
    lines: list[str], folder: Path, chunk_lines: int, run: ChunkedRun, console: Console
) -> dict:
    """The chunks of `lines` (of `chunk_lines` each) not yet in `folder`, translated through the worker
    plan `nmt translate` makes for a whole file (a process per thread on the CPU), with its progress
    display (lines, lines/s, ETA); returns what ran, for the step's marker."""
    from nmt.device import resolve_device
    from nmt.translate.workers import plan as worker_plan

    chunks = math.ceil(len(lines) / chunk_lines)
    todo = [k for k in range(chunks) if not chunk_done(folder, k, len(lines), chunk_lines, console)]
    sampling = bool(run.overrides.values.get("sampling"))
    plan = worker_plan(None, run.engine, resolve_device(run.device), False, sampling)
    try:
        return _translate(lines, todo, chunks, folder, chunk_lines, run, plan, console)
    finally:
        plan.restore()


def _translate(lines, todo, chunks, folder, chunk_lines, run: ChunkedRun, plan, console) -> dict:
    from nmt.progress import Progress
    from nmt.translate import build_translator

    built = build_translator(
        run.model, run.overrides, run.device, run.precision, run.engine, console, command=run.command,
        workers=plan, target=run.target,
    )  # fmt: skip
    decode = built.decode
    console.print(
        f"{run.label}: {run.name} on {built.engine} ({built.describe()}), {search_words(decode)}; "
        f"{len(lines):,} lines in {chunks} chunks of {chunk_lines:,}, {chunks - len(todo)} already done",
        highlight=False,
    )
    remaining = sum(len(lines[k * chunk_lines : (k + 1) * chunk_lines]) for k in todo)
    with (  # the workers fork before the progress display starts its thread
        built.translator.workers.run(built.translator),
        Progress(console, run.label, remaining) as progress,
    ):
        for k in todo:
            if decode.sampling:
                built.translator.engine.reseed(chunk_seed(decode.seed, k))
            part = lines[k * chunk_lines : (k + 1) * chunk_lines]
            before = progress.done
            results = built.translator.translate_nbest(part, on_batch=progress.advance)
            text = "".join(
                json.dumps(
                    {"hyps": [h for h, _ in r], "scores": [round(s, 6) for _, s in r]}, ensure_ascii=False
                )
                + "\n"
                for r in results
            )
            atomic.write_text(chunk_path(folder, k), text)
            progress.advance(len(part) - (progress.done - before))  # the blank lines, not searched
    return {
        "lines": len(lines),
        "chunks": chunks,
        "engine": str(built.engine),
        "precision": built.precision,
        "beam": decode.beam,
        "nbest": decode.nbest,
        "sampling": decode.sampling,
    }


def search_words(decode: DecodeConfig) -> str:
    """How the hypotheses are found, for the log: `beam 4, 4-best`, `sampling from the top 10, seed 1`."""
    if decode.sampling:
        top = f" from the top {decode.sampling_topk}" if decode.sampling_topk else ""
        return f"sampling{top}, seed {decode.seed}"
    return f"beam {decode.beam}" + (f", {decode.nbest}-best" if decode.nbest > 1 else "")


def chunk_seed(seed: int, k: int) -> int:
    """Chunk `k`'s own random stream under the decode seed: unrelated for every (seed, k), and under
    2**32 (CTranslate2's set_random_seed takes an unsigned 32-bit number)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{k}".encode()).digest()[:4], "little")


def chunk_done(folder: Path, k: int, total: int, chunk_lines: int, console: Console) -> bool:
    """Whether chunk `k` is there whole: one n-best list per line of its part. A chunk is written
    atomically, so only damage from outside makes one unreadable: it is translated again, with a
    warning, rather than trusted."""
    path = chunk_path(folder, k)
    if not path.exists():
        return False
    expected = min(chunk_lines, total - k * chunk_lines)
    try:
        found = read_nbest(path)
    except DataError as e:
        console.print(f"[yellow]warning:[/] {e}; translating it again", highlight=False)
        return False
    if len(found) != expected:
        console.print(
            f"[yellow]warning:[/] {path}: {len(found)} n-best lists for {expected} lines; "
            "translating it again",
            highlight=False,
        )
        return False
    return True


def read_chunks(folder: Path, total: int, chunk_lines: int) -> list[dict]:
    """Every chunk's n-best lists in order, one per line of the input (`total` lines)."""
    found = []
    for k in range(math.ceil(total / chunk_lines)):
        found += read_nbest(chunk_path(folder, k))
    if len(found) != total:
        raise DataError(f"{folder}: {len(found)} n-best lists for {total} source lines")
    return found


def read_jsonl(path: Path, fields: dict[str, type | tuple[type, ...]]) -> list[dict]:
    """The JSON objects of a file of this run, one a line, each with `fields` of their types; anything
    else (a file cut or edited outside) is one DataError naming the file and line."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read: {getattr(e, 'strerror', None) or e}") from None
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        try:
            obj = json.loads(line)
        except ValueError:
            obj = None
        if not isinstance(obj, dict) or not all(isinstance(obj.get(k), t) for k, t in fields.items()):
            raise DataError(f"{path} line {number}: damaged (not this run's JSON)")
        out.append(obj)
    return out


def is_number(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def read_nbest(path: Path) -> list[dict]:
    """A chunk: per line the hypotheses and their scores, as many of one as of the other."""
    found = read_jsonl(path, {"hyps": list, "scores": list})
    for number, n in enumerate(found, 1):
        hyps, scores = n["hyps"], n["scores"]
        texts = all(isinstance(h, str) for h in hyps)
        if not hyps or len(hyps) != len(scores) or not texts or not all(is_number(x) for x in scores):
            raise DataError(f"{path} line {number}: damaged (not this run's JSON)")
    return found


def chunk_path(folder: Path, k: int) -> Path:
    return folder / f"{k:05d}.jsonl"


def changed_setting(path: Path, now: dict) -> str | None:
    """The settings a chunked run was started with, recorded at `path` by its first run: None where
    `now` holds the same (or nothing was recorded yet, and `now` is), else the first key that differs,
    for the caller's one-line refusal: the chunks so far were made with the recorded ones."""
    if not path.exists():
        atomic.write_text(path, json.dumps(now, indent=2) + "\n")
        return None
    try:
        before = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: cannot read: {e}") from None
    return next((k for k, v in now.items() if not isinstance(before, dict) or before.get(k) != v), None)
