"""Translation front end: load, read lines, sort by length, batch, search, detokenize, restore order.

The output contract, whatever the input: exactly one output line per input line (K lines with --nbest K),
in input order. Input is read as bytes and split on b"\\n" only (never str.splitlines, which also splits
on \\x0b, \\x0c, \\x1c-\\x1e, \\x85, \\u2028 and \\u2029); a trailing \\r is dropped; invalid UTF-8 is
replaced, with a warning naming the lines. Blank lines give empty lines without reaching the model; a
line longer than the model's positions is truncated with a warning. Any line-breaking character in a
translation becomes a space, so every translation is exactly one line. Warnings go to stderr.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import torch
from rich.console import Console

from nmt.config import DecodeConfig
from nmt.device import inference_dtype, resolve_device
from nmt.errors import NmtError
from nmt.search import EOS, PAD, Hypothesis, beam_search, greedy_search

CHUNK_LINES = 2000  # lines read, sorted and batched together; their translations are flushed together
# Every character str.splitlines() breaks on: none may survive inside one output line.
LINE_BREAKS = str.maketrans(dict.fromkeys("\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029", " "))


def one_line(text: str) -> str:
    return text.translate(LINE_BREAKS)


def token_batches(lengths: list[int], max_tokens: int, rows_per_sentence: int) -> list[list[int]]:
    """Indices of `lengths` sorted by length, cut into batches of at most `max_tokens`.

    A batch's cost is sentences x rows_per_sentence (the beam) x its longest source (EOS included): the
    decoder attends over that many source positions per row. A sentence alone over budget gets its own batch.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    for i in order:
        # Ascending order: the sentence being added is the batch's longest.
        if batches and (len(batches[-1]) + 1) * rows_per_sentence * lengths[i] <= max_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def padded_sources(ids: list[list[int]], device: torch.device) -> torch.Tensor:
    """Source ids + EOS, right-padded: (B, S)."""
    src = torch.full((len(ids), max(map(len, ids)) + 1), PAD, dtype=torch.long)
    for row, seq in enumerate(ids):
        src[row, : len(seq) + 1] = torch.tensor([*seq, EOS])
    return src.to(device, non_blocking=True)


class LineTranslator:
    """The engine-independent front end: encode, truncate, batch by length, detokenize, keep the order.

    An engine subclasses it and provides `search(ids) -> list[list[Hypothesis]]`, the n best of each
    source (subword ids without EOS), best first.
    """

    def __init__(self, subword, decode: DecodeConfig, max_positions: int, console: Console | None = None):
        self.subword, self.decode, self.console = subword, decode, console
        self.max_source = max_positions - 1  # subwords before the EOS

    def search(self, ids: list[list[int]]) -> list[list[Hypothesis]]:
        raise NotImplementedError

    def translate(self, lines: list[str]) -> list[str]:
        """One translation per line, in order; blank lines give empty strings."""
        return [nbest[0][0] for nbest in self.translate_nbest(lines)]

    def translate_nbest(self, lines: list[str], first_line: int = 1) -> list[list[tuple[str, float]]]:
        """Up to decode.nbest (text, score) pairs per line, best first; a blank line gives [("", 0.0)].

        `first_line` numbers the lines in warnings (a stream passes the line number of lines[0]).
        """
        results: list[list[tuple[str, float]]] = [[("", 0.0)] for _ in lines]
        todo = [i for i, line in enumerate(lines) if line.strip()]
        sources: dict[int, list[int]] = {}
        for i, ids in zip(todo, self.subword.encode([lines[i] for i in todo]), strict=True):
            if len(ids) > self.max_source:
                self.warn(
                    f"line {first_line + i}: {len(ids)} subwords, truncated to the model's {self.max_source}"
                )
                ids = ids[: self.max_source]
            if ids:  # a line of characters the subword model drops entirely translates to nothing
                sources[i] = ids
        keys = list(sources)
        beam = self.decode.beam
        for batch in token_batches([len(sources[i]) + 1 for i in keys], self.decode.batch_tokens, beam):
            rows = [keys[j] for j in batch]
            for i, hyps in zip(rows, self.search([sources[i] for i in rows]), strict=True):
                texts = self.subword.decode([h.tokens for h in hyps])
                results[i] = [(one_line(text), h.score) for text, h in zip(texts, hyps, strict=True)]
        return results

    def warn(self, message: str) -> None:
        if self.console is not None:
            self.console.print(f"[yellow]warning:[/] {message}", highlight=False, soft_wrap=True)


class Translator(LineTranslator):
    """The PyTorch engine: a model and its subwords, searched with nmt.search."""

    def __init__(
        self, model, subword, decode: DecodeConfig, device: torch.device, console: Console | None = None
    ):
        super().__init__(subword, decode, model.cfg.max_positions, console)
        self.model, self.device = model, torch.device(device)

    def search(self, ids: list[list[int]]) -> list[list[Hypothesis]]:
        """Greedy for beam 1 (the same result, less work), else beam search; eval mode, then restored."""
        d, model = self.decode, self.model
        was_training = model.training
        model.eval()
        try:
            with torch.inference_mode():
                src = padded_sources(ids, self.device)
                if d.beam == 1:
                    return [
                        [h] for h in greedy_search(model, src, d.max_len_a, d.max_len_b, d.lenpen, d.min_len)
                    ]
                return beam_search(model, src, d.beam, d.lenpen, d.max_len_a, d.max_len_b, d.nbest, d.min_len)
        finally:
            model.train(was_training)


# ---- the command line's stream ---------------------------------------------------------------------


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
        console.print(f"[yellow]warning:[/] invalid UTF-8 replaced on line {shown}", highlight=False)
    return [text for text, _ in decoded]


def read_chunks(stream: BinaryIO, size: int) -> Iterator[list[bytes]]:
    """Lines (split on b"\\n" only, the newline removed) in lists of `size`; size 1 answers each at once."""
    chunk: list[bytes] = []
    while line := stream.readline():
        chunk.append(line[:-1] if line.endswith(b"\n") else line)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def format_lines(nbest: list[list[tuple[str, float]]], first_index: int, scored: bool) -> bytes:
    """Plain: one translation a line. Scored (--nbest): `index<TAB>score<TAB>text` per hypothesis."""
    if scored:
        out = [
            f"{first_index + i}\t{score:.4f}\t{text}" for i, hyps in enumerate(nbest) for text, score in hyps
        ]
    else:
        out = [hyps[0][0] for hyps in nbest]
    return "".join(line + "\n" for line in out).encode("utf-8", errors="replace")


def load_translator(model_path: Path, decode_options: dict, device: str, dtype: str, engine: str, console):
    """The engine's translator and its decode settings: the checkpoint's, overridden by the given options.

    The ctranslate2 engine takes a folder from `nmt export`, which keeps the checkpoint's decode settings.
    """
    torch_device = resolve_device(device)
    if engine == "ctranslate2":
        try:
            from nmt.ctranslate2_engine import CT2Translator
            from nmt.export import exported_decode
        except ImportError as e:
            raise NmtError(
                f"--engine ctranslate2 is not available ({e}); pip install 'nmt[ctranslate2]'"
            ) from None

        decode = check_decode(dataclasses.replace(exported_decode(Path(model_path)), **decode_options))
        return CT2Translator(Path(model_path), decode, str(torch_device), console=console), decode
    if engine != "torch":
        raise NmtError(f"--engine {engine}: expected torch or ctranslate2")
    from nmt.checkpoint import load_model

    torch_dtype = inference_dtype(dtype, torch_device)
    model, subword, cfg = load_model(Path(model_path), torch_device)
    decode = check_decode(dataclasses.replace(cfg.decode, **decode_options))
    return Translator(model.to(torch_dtype), subword, decode, torch_device, console), decode


def check_decode(d: DecodeConfig) -> DecodeConfig:
    if d.beam < 1:
        raise NmtError(f"--beam {d.beam}: must be at least 1")
    if not 1 <= d.nbest <= d.beam:
        raise NmtError(f"--nbest {d.nbest}: must be between 1 and the beam size ({d.beam}); raise --beam")
    if d.batch_tokens < 1:
        raise NmtError(f"--max-tokens {d.batch_tokens}: must be positive")
    if d.min_len < 0:
        raise NmtError(f"--min-len {d.min_len}: must be 0 or more")
    return d


def translate_stream(
    model_path: Path,
    input: Path | None,
    output: Path | None,
    beam: int | None,
    lenpen: float | None,
    max_len_a: float | None,
    max_len_b: int | None,
    max_tokens: int | None,
    nbest: int | None,
    device: str,
    dtype: str,
    interactive: bool,
    console: Console,
    engine: str = "torch",
    min_len: int | None = None,
) -> None:
    """`nmt translate`: lines from `input` (default stdin) to `output` (default stdout), in order.

    Reads CHUNK_LINES lines at a time, translates them in length-sorted batches and writes them back in
    input order, flushing after each chunk; from a terminal or with `interactive`, line by line.
    Decode settings default to the checkpoint's own `decode` section. `nbest` (given, even 1) switches to
    the scored format `index<TAB>score<TAB>text`, index the 0-based input line.
    """
    given = {"beam": beam, "lenpen": lenpen, "max_len_a": max_len_a, "max_len_b": max_len_b}
    given |= {"batch_tokens": max_tokens, "nbest": nbest, "min_len": min_len}
    options = {k: v for k, v in given.items() if v is not None}
    translator, decode = load_translator(model_path, options, device, dtype, engine, console)

    source = open_input(input)
    interactive = interactive or (input is None and sys.stdin.isatty())
    sink = open_output(output)
    start, done = time.perf_counter(), 0
    try:
        for chunk in read_chunks(source, 1 if interactive else CHUNK_LINES):
            lines = decode_chunk(chunk, done + 1, console)
            results = translator.translate_nbest(lines, first_line=done + 1)
            sink.write(format_lines(results, done, scored=nbest is not None or decode.nbest > 1))
            sink.flush()
            done += len(chunk)
    except BrokenPipeError:  # `nmt translate ... | head`: the reader is gone, nothing left to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit flush cannot fail
        return
    finally:
        if source is not sys.stdin.buffer:
            source.close()
        if sink is not sys.stdout.buffer:
            sink.close()
    if not interactive:
        seconds = time.perf_counter() - start
        console.print(f"translated {done} lines in {seconds:.1f} s ({done / max(seconds, 1e-9):.1f} lines/s)")


def open_input(path: Path | None) -> BinaryIO:
    if path is None:
        return sys.stdin.buffer
    try:
        return open(path, "rb")
    except OSError as e:
        raise NmtError(f"{path}: cannot read the input: {e.strerror}") from None


def open_output(path: Path | None) -> BinaryIO:
    if path is None:
        return sys.stdout.buffer
    try:
        return open(path, "wb")
    except OSError as e:
        raise NmtError(f"{path}: cannot write the output: {e.strerror}") from None
