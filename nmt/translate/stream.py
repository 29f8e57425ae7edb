"""`nmt translate`'s stream: lines from a file or stdin to a file or stdout, in order, chunk by chunk.

The output contract, whatever the input: exactly one output line per input line (K lines with --nbest K),
in input order. Input is read as bytes and split on b"\\n" only (never str.splitlines, which also splits
on \\x0b, \\x0c, \\x1c-\\x1e, \\x85, \\u2028 and \\u2029); a trailing \\r is dropped; invalid UTF-8 is
replaced, with a warning naming the lines; a line longer than the model can use is cut while it is read.
What happens to each line then is the front end's (nmt.translate.frontend). Warnings go to stderr.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import torch
from rich.console import Console

from nmt.atomic import STDIN, refuse_inputs
from nmt.config import DecodeOverrides, Engine, Precision
from nmt.device import resolve_device
from nmt.errors import ConfigError, NmtError
from nmt.output import output_stream, stdout, write_failed
from nmt.progress import Progress, count_lines
from nmt.translate.builder import build_translator
from nmt.translate.frontend import cut_line
from nmt.translate.split import SentenceTranslator, short_lines
from nmt.translate.workers import plan as worker_plan

CHUNK_LINES = 2000  # lines read, sorted and batched together; their translations are flushed together
CHUNK_BYTES = 64 << 20  # and at most about this much text, however long the lines
# A line split into sentences is read up to this many characters (a paragraph of some 10,000 sentences);
# past it, it is cut, with a warning naming it, so that reading stays bounded whatever the input.
SPLIT_MAX_CHARS = 1_000_000


def decode_bytes(raw: bytes) -> tuple[str, bool]:
    """One line's bytes, without its b"\\n" -> text without a trailing \\r, and whether UTF-8 was invalid."""
    if raw.endswith(b"\r"):
        raw = raw[:-1]
    try:
        return raw.decode("utf-8"), False
    except UnicodeDecodeError:
        return raw.decode("utf-8", errors="replace"), True


def decode_chunk(chunk: list[bytes], first_line: int, console: Console) -> list[str]:
    """Text of each line; one warning per chunk names the lines whose invalid UTF-8 was replaced."""
    decoded = [decode_bytes(raw) for raw in chunk]
    bad = [first_line + i for i, (_, invalid) in enumerate(decoded) if invalid]
    if bad:
        more = f" and {len(bad) - 10} more" if len(bad) > 10 else ""
        shown = ", ".join(map(str, bad[:10])) + more
        console.print(
            f"[yellow]warning:[/] invalid UTF-8 replaced on line {shown}", highlight=False, soft_wrap=True
        )
    return [text for text, _ in decoded]


def read_chunks(stream: BinaryIO, size: int, max_bytes: int | None = None) -> Iterator[list[bytes]]:
    """Lines (split on b"\\n" only, the newline removed) in lists of `size` (or CHUNK_BYTES of text);
    size 1 answers each at once.

    A line over `max_bytes` keeps its first `max_bytes` bytes and the rest is skipped unread into
    memory: a line too long for the model is cut before any work is spent on it.
    """
    chunk: list[bytes] = []
    held = 0
    while line := read_one(stream, max_bytes):
        chunk.append(line[:-1] if line.endswith(b"\n") else line)
        held += len(line)
        if len(chunk) >= size or held >= CHUNK_BYTES:
            yield chunk
            chunk, held = [], 0
    if chunk:
        yield chunk


def read_one(stream: BinaryIO, max_bytes: int | None) -> bytes:
    """One line with its b"\\n" (b"" at the end), at most max_bytes of it kept."""
    if max_bytes is None:
        return stream.readline()
    line = stream.readline(max_bytes)
    if len(line) == max_bytes and not line.endswith(b"\n"):
        while (rest := stream.readline(1 << 20)) and not rest.endswith(b"\n"):
            pass
        # Drop a character the cut split (continuation bytes 10xxxxxx and their lead byte): it is past
        # what the translator keeps anyway, and must not read as invalid UTF-8.
        end = len(line)
        while end > len(line) - 3 and line[end - 1] & 0xC0 == 0x80:
            end -= 1
        if line[end - 1] >= 0xC0:
            end -= 1
        line = line[:end] + b"\n"
    return line


def format_lines(nbest: list[list[tuple[str, float]]], first_index: int, scored: bool) -> bytes:
    """Plain: one translation a line. Scored (--nbest): `index<TAB>score<TAB>text` per hypothesis."""
    if scored:
        out = [
            f"{first_index + i}\t{score:.4f}\t{text}" for i, hyps in enumerate(nbest) for text, score in hyps
        ]
    else:
        out = [hyps[0][0] for hyps in nbest]
    return "".join(line + "\n" for line in out).encode("utf-8", errors="replace")


def translate_stream(
    model_path: Path | list[Path],
    input: Path | None,
    output: Path | None,
    overrides: DecodeOverrides,
    device: str,
    dtype: Precision | str,
    interactive: bool,
    console: Console,
    engine: Engine | str = Engine.TORCH,
    prefix: Path | None = None,
    scored: bool = False,
    glossary: Path | None = None,
    avoid: Path | None = None,
    split_sentences: bool | None = None,
    workers: int | None = None,
    target: str | None = None,
    source: str | None = None,
) -> None:
    """`nmt translate`: lines from `input` (default stdin) to `output` (default stdout), in order.

    Reads CHUNK_LINES lines at a time, translates them in length-sorted batches and writes them back in
    input order, flushing after each chunk; from a terminal or with `interactive`, line by line.
    Decode settings default to the checkpoint's own `decode` section, overridden by the options given.
    `scored` (or decode.nbest > 1) switches to the format `index<TAB>score<TAB>text`, index the 0-based
    input line. `prefix` is a file of target prefixes, one per input line. `split_sentences`: each line
    translated sentence by sentence (nmt.translate.split), still one line out; None (the default): on,
    unless a --prefix is given (a prefix begins a line's translation). Either way a line whose
    translation covers much less than its source is a warning naming it (split.short_lines).
    `glossary` (a TSV of terms) and `avoid` (phrases) are obeyed by the search (nmt.translate.terminology).
    `workers`: processes that search the batches (nmt.translate.workers); None: the default for the input.
    `target`, `source`: the direction, for a model of several (nmt.translate.builder.chosen_target).
    """
    check_files(model_path, input, output, prefix, glossary, avoid, bool(split_sentences))
    split_sentences = prefix is None if split_sentences is None else split_sentences
    interactive = interactive or (input is None and sys.stdin.isatty())
    sampling = bool(overrides.values.get("sampling"))
    plan = worker_plan(workers, engine, resolve_device(device), interactive, sampling)
    source = prefixes = None
    try:
        built = build_translator(
            model_path,
            overrides,
            device,
            dtype,
            engine,
            console,
            glossary=glossary,
            avoid=avoid,
            workers=plan,
            target=target,
            source=source,
        )
        translator, decode = built.translator, built.decode
        if decode.shortlist and (scored or decode.nbest > 1):
            console.print(
                "scores are log-probabilities over each sentence's shortlist, not the whole vocabulary"
            )
        lines_of = SentenceTranslator(translator, built.src_lang) if split_sentences else translator
        source, prefixes = open_input(input), open_input(prefix) if prefix is not None else None
        max_bytes = 4 * translator.max_chars + 4  # UTF-8: enough bytes for the characters kept, no more read
        if split_sentences:  # cut only after splitting: each sentence is cut to max_chars then, if at all
            max_bytes = 4 * SPLIT_MAX_CHARS + 4

        start, done = time.perf_counter(), 0
        with (  # the workers fork before the progress bar starts its thread and an -o file is opened
            translator.workers.run(translator),
            translation_progress(input, output, interactive, console) as progress,
            output_stream(output) as sink,
        ):
            for chunk in read_chunks(source, 1 if interactive else CHUNK_LINES, max_bytes):
                lines = decode_chunk(chunk, done + 1, console)
                if split_sentences:  # unsplit, the front end cuts a line to max_chars, with a warning
                    lines = cut_paragraphs(lines, done + 1, console)
                wanted = read_prefixes(prefixes, prefix, done, len(chunk), max_bytes, console)
                before = progress.done  # advanced per batch, so a long chunk still moves the display
                results = lines_of.translate_nbest(lines, done + 1, wanted, on_batch=progress.advance)
                warn_short(lines, results, done + 1, split_sentences, console)
                sink.write(format_lines(results, done, scored=scored or decode.nbest > 1))
                sink.flush()
                done += len(chunk)
                progress.advance(len(chunk) - (progress.done - before))  # the blank lines, not searched
    except OSError as e:  # the results' destination failed: a full disk, a reader gone (`| head`)
        problem = write_failed(e, str(output) if output is not None else "standard output")
        if problem is None:
            raise  # the command line's boundary ends quietly
        raise problem from None
    finally:
        plan.restore()  # the threads the process had (a caller in the same process)
        for stream in (source, prefixes):
            if stream is not None and stream is not sys.stdin.buffer:
                stream.close()
    if not interactive:
        seconds = time.perf_counter() - start
        rate = f"{done / max(seconds, 1e-9):.1f} lines/s"
        done_in = f"translated {done} lines in {seconds:.1f} s ({rate})"
        threads = torch.get_num_threads() if plan.workers <= 1 else None  # one process searched
        console.print(f"{done_in}; {built.describe(threads)}", highlight=False)


def cut_paragraphs(lines: list[str], first_line: int, console: Console) -> list[str]:
    """Lines to be split cut to SPLIT_MAX_CHARS characters, each cut one a warning naming it."""
    out = []
    for i, line in enumerate(lines):
        if len(line) > SPLIT_MAX_CHARS:
            console.print(
                f"[yellow]warning:[/] line {first_line + i}: over {SPLIT_MAX_CHARS:,} characters, cut there "
                "before sentence splitting",
                highlight=False,
                soft_wrap=True,
            )
            line = cut_line(line, SPLIT_MAX_CHARS)
        out.append(line)
    return out


def warn_short(lines: list[str], results, first_line: int, split: bool, console: Console) -> None:
    """One warning per line whose translation covers much less than its source (split.short_lines)."""
    for i, got, want in short_lines(lines, [hyps[0][0] for hyps in results]):
        hint = "" if split else " (--no-split-sentences: the model may stop after the first)"
        console.print(
            f"[yellow]warning:[/] line {first_line + i}: the translation has {got} sentence(s) for the "
            f"source's {want} and is much shorter{hint}",
            highlight=False,
            soft_wrap=True,
        )


def check_files(
    model_path, input: Path | None, output: Path | None, prefix, glossary, avoid, split_sentences: bool
) -> None:
    """Before anything is opened for writing: an output that is an input would be emptied before it is
    read. Standard input counts only when it is read: `-i in.en -o F < F` destroys nothing."""
    if split_sentences and prefix is not None:
        raise ConfigError(
            "--prefix and --split-sentences: a prefix begins a line's translation, not a sentence's"
        )
    models = model_path if isinstance(model_path, list) else [model_path]
    refuse_inputs(output, [*models, STDIN if input is None else input, prefix, glossary, avoid])
    if output is None:
        stdout()  # a closed standard output is one line now, not after the model has loaded


def read_prefixes(
    stream: BinaryIO | None, path: Path | None, done: int, n: int, max_bytes: int, console: Console
) -> list[str] | None:
    """The prefixes of the next `n` lines (after `done`) from the --prefix file; None without one."""
    if stream is None:
        return None
    raw = [read_line(stream, path, done + i + 1, max_bytes) for i in range(n)]
    return decode_chunk(raw, done + 1, console)


def translation_progress(input: Path | None, output: Path | None, interactive: bool, console) -> Progress:
    """Lines done of the input file's total (of an unknown total from a pipe), on stderr. None when
    answering line by line, or when the translations go to the terminal the bar would be drawn on."""
    if interactive or (output is None and sys.stdout.isatty() and console.is_terminal):
        return Progress(None, "")
    total = count_lines(input) if input is not None and input.is_file() else None
    return Progress(console, f"translate {input.name if input is not None else 'stdin'}", total)


def read_line(stream: BinaryIO, path: Path, number: int, max_bytes: int | None = None) -> bytes:
    """Line `number` of a file read alongside the input; running out first is the user's mistake."""
    line = read_one(stream, max_bytes)
    if not line:
        raise NmtError(f"{path}: has no line {number}; give one prefix line (blank for none) per input line")
    return line[:-1] if line.endswith(b"\n") else line


def open_input(path: Path | None) -> BinaryIO:
    if path is None:
        return sys.stdin.buffer
    try:
        return open(path, "rb")
    except OSError as e:
        raise NmtError(f"{path}: cannot read the input: {e.strerror}") from None
