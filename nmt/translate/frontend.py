"""Translation front end: load, read lines, sort by length, batch, search, detokenize, restore order.

The output contract, whatever the input: exactly one output line per input line (K lines with --nbest K),
in input order. Input is read as bytes and split on b"\\n" only (never str.splitlines, which also splits
on \\x0b, \\x0c, \\x1c-\\x1e, \\x85, \\u2028 and \\u2029); a trailing \\r is dropped; invalid UTF-8 is
replaced, with a warning naming the lines. Blank lines give empty lines without reaching the model; a
line longer than the model's positions is truncated with a warning. Any line-breaking character in a
translation becomes a space, so every translation is exactly one line. Warnings go to stderr.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import torch
from rich.console import Console

from nmt.config import DecodeConfig, DecodeOverrides
from nmt.device import inference_dtype, resolve_device
from nmt.errors import NmtError
from nmt.output import output_stream, refuse_input_as_output, stdout, write_failed
from nmt.progress import Progress, count_lines
from nmt.translate.torch_engine import TorchEngine

CHUNK_LINES = 2000  # lines read, sorted and batched together; their translations are flushed together
# Every character str.splitlines() breaks on: none may survive inside one output line.
LINE_BREAKS = str.maketrans(dict.fromkeys("\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029", " "))


# SentencePiece's default max_sentencepiece_length, which nmt.subword keeps: the most characters
# one subword covers.
MAX_PIECE_CHARS = 16
# C0 and C1 control characters but the tab: none is text; \n never reaches here, \r only at a line's end.
CONTROLS = "".join(map(chr, [*range(0x00, 0x09), *range(0x0A, 0x20), *range(0x7F, 0xA0)]))
CONTROL = re.compile(f"[{re.escape(CONTROLS)}]")
CONTROL_TO_SPACE = str.maketrans(dict.fromkeys(CONTROLS, " "))


def cut_line(line: str, max_chars: int) -> str:
    """The first `max_chars` characters, ending at a space where there is one in the last quarter, so the
    last word kept is whole and encodes as it would in the full line."""
    head = line[:max_chars]
    space = head.rfind(" ", max_chars * 3 // 4)
    return head[:space] if space > 0 else head


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


class LineTranslator:
    """The engine-independent front end: encode, truncate, batch by length, detokenize, keep the order.

    The engine (torch_engine.TorchEngine, ctranslate2_engine.CT2Engine) takes subword ids and
    returns hypotheses; it knows nothing of lines or files: `engine.search(ids, prefixes) ->
    list[list[Hypothesis]]`, the n best of each source (ids without EOS), best first, and
    `engine.max_positions`.
    """

    def __init__(self, engine, subword, decode: DecodeConfig, console: Console | None = None):
        self.engine, self.subword, self.decode, self.console = engine, subword, decode, console
        self.max_source = engine.max_positions - 1  # subwords before the EOS
        # A line is cut to this many characters before SentencePiece sees it (a 50 MB line would cost
        # minutes and gigabytes to encode whole): no subword is longer than MAX_PIECE_CHARS, so the cut
        # keeps every character the model's max_source subwords can hold.
        self.max_chars = self.max_source * MAX_PIECE_CHARS

    def translate(self, lines: list[str], prefixes: list[str] | None = None) -> list[str]:
        """One translation per line, in order; blank lines give empty strings."""
        return [nbest[0][0] for nbest in self.translate_nbest(lines, prefixes=prefixes)]

    def translate_nbest(
        self, lines: list[str], first_line: int = 1, prefixes: list[str] | None = None
    ) -> list[list[tuple[str, float]]]:
        """Up to decode.nbest (text, score) pairs per line, best first; a blank line gives [("", 0.0)].

        `first_line` numbers the lines in warnings (a stream passes the line number of lines[0]).
        `prefixes`, one per line ("" for none), are target text each translation must begin with.
        """
        cut = {i for i, line in enumerate(lines) if len(line) > self.max_chars}
        lines = [cut_line(line, self.max_chars) if i in cut else line for i, line in enumerate(lines)]
        lines = self.clean(lines, first_line)
        todo = [i for i, line in enumerate(lines) if line.strip()]
        sources: dict[int, list[int]] = {}
        for i, ids in zip(todo, self.subword.encode([lines[i] for i in todo]), strict=True):
            if i in cut or len(ids) > self.max_source:
                size = f"over {self.max_chars:,} characters" if i in cut else f"{len(ids)} subwords"
                limit = f"the model's {self.max_source} subwords"
                self.warn(f"line {first_line + i}: {size}, truncated to {limit}")
                ids = ids[: self.max_source]
            if ids:  # a line of characters the subword model drops entirely translates to nothing
                sources[i] = ids
        forced: dict[int, list[int]] = {}
        if prefixes is not None:
            keys = [i for i in sources if prefixes[i].strip()]
            for i, ids in zip(keys, self.subword.encode_target([prefixes[i] for i in keys]), strict=True):
                forced[i] = ids[: self.max_source]
        return self.search_sources(len(lines), sources, forced)

    def search_sources(
        self, count: int, sources: dict[int, list[int]], forced: dict[int, list[int]] | None = None
    ) -> list[list[tuple[str, float]]]:
        """The n-best of `count` lines whose subword ids (truncated, non-empty) are `sources[i]`.

        Lines missing from `sources` (blank ones) give [("", 0.0)]. The server encodes in its request
        handlers and calls this from its model worker.
        """
        results: list[list[tuple[str, float]]] = [[("", 0.0)] for _ in range(count)]
        keys = list(sources)
        d = self.decode
        rows_per_sentence = d.nbest if d.sampling else d.beam  # decoder rows each sentence takes
        for batch in token_batches([len(sources[i]) + 1 for i in keys], d.batch_tokens, rows_per_sentence):
            rows = [keys[j] for j in batch]
            wanted = [forced.get(i, []) for i in rows] if forced else None
            for i, hyps in zip(rows, self.engine.search([sources[i] for i in rows], wanted), strict=True):
                texts = self.subword.decode([h.tokens for h in hyps])
                results[i] = [(one_line(text), h.score) for text, h in zip(texts, hyps, strict=True)]
        return results

    def clean(self, lines: list[str], first_line: int) -> list[str]:
        """Control characters (NUL, ESC, BEL, ...) become spaces, with one warning naming the lines, so a
        line of nothing else is blank, as a blank line, rather than a sentence of unknown tokens."""
        bad = [i for i, line in enumerate(lines) if CONTROL.search(line)]
        if not bad:
            return lines
        lines = list(lines)
        for i in bad:
            lines[i] = lines[i].translate(CONTROL_TO_SPACE)
        more = f" and {len(bad) - 10} more" if len(bad) > 10 else ""
        shown = ", ".join(str(first_line + i) for i in bad[:10]) + more
        self.warn(f"control characters replaced by spaces on line {shown}")
        return lines

    def warn(self, message: str) -> None:
        if self.console is not None:
            self.console.print(f"[yellow]warning:[/] {message}", highlight=False, soft_wrap=True)


class Translator(LineTranslator):
    """Lines through the PyTorch engine: a model (or an Ensemble) and its subwords."""

    def __init__(
        self, model, subword, decode: DecodeConfig, device: torch.device, console: Console | None = None
    ):
        super().__init__(TorchEngine(model, decode, device), subword, decode, console)
        self.model = model


def ctranslate2_translator(
    model_dir: Path,
    decode: DecodeConfig,
    device: str = "cpu",
    compute_type: str = "default",
    threads: int | None = None,
    console: Console | None = None,
) -> LineTranslator:
    """Lines through CTranslate2, over a folder written by `nmt export` (its own subword model)."""
    try:
        from nmt.translate.ctranslate2_engine import CT2Engine
    except ImportError as e:
        raise NmtError(
            f"--engine ctranslate2 is not available ({e}); pip install 'nmt[ctranslate2]'"
        ) from None
    from nmt.subword import Subword

    engine = CT2Engine(Path(model_dir), decode, device, compute_type, threads)
    return LineTranslator(engine, Subword.load(Path(model_dir) / "spm.model"), decode, console)


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
        console.print(
            f"[yellow]warning:[/] invalid UTF-8 replaced on line {shown}", highlight=False, soft_wrap=True
        )
    return [text for text, _ in decoded]


def read_chunks(stream: BinaryIO, size: int, max_bytes: int | None = None) -> Iterator[list[bytes]]:
    """Lines (split on b"\\n" only, the newline removed) in lists of `size`; size 1 answers each at once.

    A line over `max_bytes` keeps its first `max_bytes` bytes and the rest is skipped unread into
    memory: a line too long for the model is cut before any work is spent on it.
    """
    chunk: list[bytes] = []
    while line := read_one(stream, max_bytes):
        chunk.append(line[:-1] if line.endswith(b"\n") else line)
        if len(chunk) >= size:
            yield chunk
            chunk = []
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


def load_translator(
    model_path: Path | list[Path],
    overrides: DecodeOverrides,
    device: str,
    dtype: str,
    engine: str,
    console,
    source: str = "nmt translate",
):
    """The engine's translator and its decode settings: the checkpoint's, overridden by the given options.

    Several checkpoints (torch engine) are decoded as one ensemble; they must share their subword model,
    and the first one's decode settings apply. The ctranslate2 engine takes a folder from `nmt export`,
    which keeps the checkpoint's decode settings.
    """
    paths = [Path(p) for p in (model_path if isinstance(model_path, list | tuple) else [model_path])]
    torch_device = resolve_device(device)
    if engine == "ctranslate2":
        if len(paths) > 1:
            raise NmtError("--engine ctranslate2 decodes one model: ensembles need --engine torch")
        try:
            from nmt.formats.ctranslate2 import exported_decode
        except ImportError as e:
            raise NmtError(
                f"--engine ctranslate2 is not available ({e}); pip install 'nmt[ctranslate2]'"
            ) from None
        decode = overrides.apply(exported_decode(paths[0]), source)
        compute_type = "int8" if dtype.strip().lower() == "int8" else "default"
        translator = ctranslate2_translator(
            paths[0], decode, str(torch_device), compute_type, console=console
        )
        return translator, decode
    if engine != "torch":
        raise NmtError(f"--engine {engine}: expected torch or ctranslate2")
    from nmt.checkpoint import load_model

    loaded = [load_model(p, torch_device) for p in paths]
    model, subword, cfg = loaded[0]
    for path, (_, other, _) in zip(paths[1:], loaded[1:], strict=True):
        if other.proto != subword.proto:
            raise NmtError(f"{path}: its subword vocabulary differs from {paths[0]}'s; an ensemble needs one")
    if len(loaded) > 1:
        from nmt.translate.ensemble import Ensemble

        model = Ensemble([m for m, _, _ in loaded])
    decode = overrides.apply(cfg.decode, source)
    return Translator(
        inference_model(model, dtype, torch_device), subword, decode, torch_device, console
    ), decode


def inference_model(model, dtype: str, device: torch.device, prepack: bool = True):
    """The model (or each member of an Ensemble) in the precision --dtype names: a torch dtype
    (nmt.device.inference_dtype), or int8 weights on the CPU (nmt.translate.int8). In float32 on the
    CPU the decoder's weights are prepacked for oneDNN (nmt.translate.prepacked) unless `prepack` is off."""
    int8 = dtype.strip().lower() == "int8"
    if int8 and device.type != "cpu":
        raise NmtError(f"--dtype int8 runs on the CPU, not {device}: add --device cpu")
    torch_dtype = torch.float32 if int8 else inference_dtype(dtype, device)
    # An Ensemble keeps its members in a plain list, out of reach of its own .to()
    for member in getattr(model, "members", [model]):
        member.to(torch_dtype)
        if int8:
            from nmt.translate.int8 import quantize_int8

            quantize_int8(member)
        elif prepack and device.type == "cpu" and torch_dtype == torch.float32:
            from nmt.translate.prepacked import prepack_decoder

            prepack_decoder(member)
    return model


def translate_stream(
    model_path: Path | list[Path],
    input: Path | None,
    output: Path | None,
    overrides: DecodeOverrides,
    device: str,
    dtype: str,
    interactive: bool,
    console: Console,
    engine: str = "torch",
    prefix: Path | None = None,
    scored: bool = False,
) -> None:
    """`nmt translate`: lines from `input` (default stdin) to `output` (default stdout), in order.

    Reads CHUNK_LINES lines at a time, translates them in length-sorted batches and writes them back in
    input order, flushing after each chunk; from a terminal or with `interactive`, line by line.
    Decode settings default to the checkpoint's own `decode` section, overridden by the options given.
    `scored` (or decode.nbest > 1) switches to the format `index<TAB>score<TAB>text`, index the 0-based
    input line. `prefix` is a file of target prefixes, one per input line.
    """
    # Before anything is opened for writing: an output that is an input would be emptied before it is read.
    refuse_input_as_output(output, [input, prefix])
    if output is None:
        stdout()  # a closed standard output is one line now, not after the model has loaded
    translator, decode = load_translator(model_path, overrides, device, dtype, engine, console)
    source = open_input(input)
    prefixes = open_input(prefix) if prefix is not None else None
    interactive = interactive or (input is None and sys.stdin.isatty())
    max_bytes = 4 * translator.max_chars + 4  # UTF-8: enough bytes for the characters kept, no more read
    start, done = time.perf_counter(), 0
    progress = translation_progress(input, output, interactive, console)
    try:
        with output_stream(output) as sink:
            for chunk in read_chunks(source, 1 if interactive else CHUNK_LINES, max_bytes):
                lines = decode_chunk(chunk, done + 1, console)
                wanted = None
                if prefixes is not None:
                    wanted = decode_chunk(
                        [read_line(prefixes, prefix, done + i + 1, max_bytes) for i in range(len(chunk))],
                        done + 1,
                        console,
                    )
                results = translator.translate_nbest(lines, first_line=done + 1, prefixes=wanted)
                sink.write(format_lines(results, done, scored=scored or decode.nbest > 1))
                sink.flush()
                done += len(chunk)
                progress.advance(len(chunk))
    except OSError as e:  # the results' destination failed: a full disk, a reader gone (`| head`)
        problem = write_failed(e, str(output) if output is not None else "standard output")
        if problem is None:
            raise  # the command line's boundary ends quietly
        raise problem from None
    finally:
        progress.close()
        for stream in (source, prefixes):
            if stream is not None and stream is not sys.stdin.buffer:
                stream.close()
    if not interactive:
        seconds = time.perf_counter() - start
        console.print(f"translated {done} lines in {seconds:.1f} s ({done / max(seconds, 1e-9):.1f} lines/s)")


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
