"""`nmt backtranslate`: monolingual target-language text into a parallel corpus (Sennrich et al., 2016),
synthetic sources beside real targets, for the forward model to train on.

A reverse model (target -> source) translates the monolingual lines: by unrestricted sampling (the
default; Edunov et al., 2018, "Understanding Back-Translation at Scale", found it beats beam search when
the parallel data is plentiful, since beam outputs are too regular to teach anything), from the 10
likeliest tokens (`topk`), by beam search (`beam`, the model's own beam), or greedily (`greedy`: with
little parallel data, Edunov et al.'s 80k pairs, greedy and beam outputs taught more than samples, and
greedy costs a beam's fraction). Steps:

    read       every --mono file, strictly UTF-8; blank lines skipped, repeated lines kept once (the
               first), capped at --max-lines: the lines to translate, in their order
    reverse    the reverse model over them in chunks, the teacher step of `nmt distill`
               (nmt.translate.chunks): PREFIX.work/chunks/NNNNN.jsonl, each kept once written; sampled
               chunks draw from their own seeded streams, so a killed run resumes to the same corpus
    filter     nmt.data.filters: empty, length ratio, repeats (the reverse model looping)
    write      PREFIX.<src> (synthetic) and PREFIX.<tgt> (real), then PREFIX.work/done.json

The settings are kept in PREFIX.work/settings.json: running again with others (another reverse model,
other text, another method or seed) is refused in one line rather than mixing two corpora.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from nmt import atomic
from nmt.config import DecodeOverrides, Engine, Precision
from nmt.data.fetch import file_digest
from nmt.data.filters import FilterSettings, filter_pairs
from nmt.errors import ConfigError, DataError
from nmt.limits import check
from nmt.translate.chunks import changed_setting

METHODS = ("sampling", "topk", "beam", "greedy")
TOPK = 10  # `topk`: Edunov et al.'s restricted sampling, k = 10
# A sentence-per-line file has lines of hundreds of bytes; one of a megabyte is a file without line
# breaks (a document, a binary), which no sentence pair should be made of.
MAX_LINE_BYTES = 1 << 20


@dataclass(frozen=True)
class BacktranslateOptions:
    """What `nmt backtranslate` takes."""

    reverse: Path  # the target -> source checkpoint
    mono: tuple[Path, ...]  # monolingual target-language text (.gz read as gzip)
    output: Path  # PREFIX: writes PREFIX.<src>, PREFIX.<tgt> and keeps its work in PREFIX.work/
    method: str = "sampling"
    engine: Engine = Engine.TORCH
    precision: Precision = Precision.FP32
    device: str = "auto"
    seed: int = 1  # the samples' seed: the same seed, text and model give the same corpus
    chunk_lines: int = 2000  # lines translated between two saved chunks
    max_lines: int | None = None  # at most this many monolingual lines (after repeats are dropped)
    # A sample's log-probability says how unusual it is, which is what sampling is for: no pair is
    # dropped for its score by default.
    filters: FilterSettings = FilterSettings(worst_percent=0.0)
    vocab: Path | None = None  # the forward recipe's SentencePiece model the reverse model must have
    direction: tuple[str, str] | None = None  # the forward recipe's (source, target)
    inputs: tuple[Path, ...] = ()  # other files read (the recipe), never written over
    recipe: bool = False  # run by `nmt run` of a back-translation recipe: errors name its keys

    @property
    def workdir(self) -> Path:
        return Path(f"{self.output}.work")


def check_options(opts: BacktranslateOptions) -> None:
    if not opts.reverse.is_file():
        raise ConfigError(f"--reverse {opts.reverse}: no such checkpoint")
    if opts.method not in METHODS:
        raise ConfigError(f"--method {opts.method}: expected one of {', '.join(METHODS)}")
    if not opts.mono:
        raise ConfigError(
            "--mono: give at least one file of monolingual target-language text, or a recipe that names "
            "data.backtranslate.mono"
        )
    for path in opts.mono:
        if not path.is_file():
            raise ConfigError(f"--mono {path}: no such file")
    check("--seed", opts.seed)
    check("--chunk-lines", opts.chunk_lines)
    check("--max-lines", opts.max_lines)
    check("--max-ratio", opts.filters.max_ratio)


def outputs(opts: BacktranslateOptions, src_lang: str, tgt_lang: str) -> list[tuple[str, Path]]:
    """What the command writes, for the output guard (nmt.atomic.refuse_overlaps)."""
    return [("-o", Path(f"{opts.output}.{lang}")) for lang in (src_lang, tgt_lang)] + [("-o", opts.workdir)]


def languages(reverse_config: dict, opts: BacktranslateOptions) -> tuple[str, str]:
    """The forward direction (source, target): the reverse model's, swapped."""
    data = reverse_config["data"]
    src, tgt = data["tgt_lang"], data["src_lang"]
    if src == tgt:
        raise ConfigError(f"--reverse {opts.reverse}: translates {tgt}->{src}, one language into itself")
    if opts.direction is not None and opts.direction != (src, tgt):
        want_src, want_tgt = opts.direction
        raise ConfigError(
            f"--reverse {opts.reverse}: translates {tgt}->{src}; the recipe needs {want_tgt}->{want_src}"
        )
    return src, tgt


def check_vocab(opts: BacktranslateOptions, reverse_subword: bytes) -> None:
    """The reverse model must have the forward recipe's joint SentencePiece model: the synthetic sources
    are then made of the pieces the forward model reads."""
    if opts.vocab is None:
        return
    try:
        vocab = opts.vocab.read_bytes()
    except OSError as e:
        raise DataError(f"{opts.vocab}: cannot read: {e.strerror or e}") from None
    if vocab != reverse_subword:
        raise ConfigError(
            f"--reverse {opts.reverse}: its subword vocabulary is not {opts.vocab}, the forward recipe's; "
            "back-translate with a reverse model trained on that SentencePiece model"
        )


def read_mono(path: Path) -> list[str]:
    """A monolingual file's lines, strictly UTF-8 (a file of another encoding would make a corpus of
    mojibake), without trailing space; an empty file, or a line over MAX_LINE_BYTES, is refused."""
    try:
        data = path.read_bytes()
        if path.suffix == ".gz":
            data = gzip.decompress(data)
    except (OSError, EOFError) as e:
        raise DataError(f"--mono {path}: cannot read: {getattr(e, 'strerror', None) or e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DataError(f"--mono {path} line {line}: not UTF-8 (byte {e.start:,})") from None
    for number, raw in enumerate(data.split(b"\n"), 1):
        if len(raw) > MAX_LINE_BYTES:
            raise DataError(
                f"--mono {path} line {number}: {len(raw):,} bytes, over {MAX_LINE_BYTES:,}: not one "
                "sentence a line"
            )
    lines = [line.rstrip() for line in text.split("\n")]
    if lines[-1] == "":  # the end of the last line, not a line
        lines.pop()
    if not any(lines):
        raise DataError(f"--mono {path}: no text to back-translate (empty, or blank lines only)")
    return lines


def mono_lines(opts: BacktranslateOptions) -> tuple[list[str], dict]:
    """The lines to translate: every file's non-blank lines in order, each text once, capped."""
    seen: set[str] = set()
    lines, read, blank = [], 0, 0
    for path in opts.mono:
        for line in read_mono(path):
            read += 1
            if not line:
                blank += 1
            elif line not in seen:
                seen.add(line)
                lines.append(line)
    repeated = read - blank - len(lines)
    capped = 0
    if opts.max_lines is not None and len(lines) > opts.max_lines:
        capped = len(lines) - opts.max_lines
        lines = lines[: opts.max_lines]
    return lines, {"read": read, "blank": blank, "repeated": repeated, "capped": capped}


def decode_overrides(opts: BacktranslateOptions) -> DecodeOverrides:
    flags = {"sampling": "--method", "sampling_topk": "--method", "seed": "--seed"}
    if opts.method == "beam":
        return DecodeOverrides.given(flags, sampling=False, nbest=1)
    if opts.method == "greedy":
        return DecodeOverrides.given(flags, sampling=False, nbest=1, beam=1)
    topk = TOPK if opts.method == "topk" else 0
    return DecodeOverrides.given(
        flags, sampling=True, sampling_topk=topk, sampling_topp=1.0, temperature=1.0, nbest=1, seed=opts.seed
    )


def settings(opts: BacktranslateOptions, src_lang: str, tgt_lang: str) -> dict:
    return {
        "reverse_sha256": file_digest(opts.reverse),
        "mono_sha256": [file_digest(p) for p in opts.mono],
        "languages": [src_lang, tgt_lang],
        "method": opts.method,
        "seed": opts.seed if opts.method in ("sampling", "topk") else None,
        "engine": str(opts.engine),
        "precision": str(opts.precision),
        "chunk_lines": opts.chunk_lines,
        "max_lines": opts.max_lines,
        "filters": dataclasses.asdict(opts.filters),
    }


NAMES = {
    "reverse_sha256": "--reverse (another checkpoint)",
    "mono_sha256": "--mono (other text)",
    "languages": "--reverse (another direction)",
    "filters": "--max-ratio",
}


# The same, as a back-translation recipe (nmt.pipeline) sets them
RECIPE_NAMES = {
    "reverse_sha256": "the reverse model (data.backtranslate.reverse, or reverse/ trained further)",
    "mono_sha256": "data.backtranslate.mono",
    "languages": "data.src_lang/tgt_lang",
}


def check_settings(opts: BacktranslateOptions, now: dict) -> None:
    """The first run records its settings; a later one must match them (one line names the first that
    differs), since the chunks translated so far were made with them."""
    key = changed_setting(opts.workdir / "settings.json", now)
    if key is None:
        return
    if opts.recipe:
        name = RECIPE_NAMES.get(key, f"data.backtranslate.{key}")
        raise ConfigError(
            f"{opts.workdir}: back-translated so far with other settings ({name} differs); restore them "
            f"to continue, or remove {opts.output.parent} to back-translate again"
        )
    name = NAMES.get(key, f"--{key.replace('_', '-')}")
    raise ConfigError(
        f"{opts.workdir}: back-translated so far with other settings ({name} differs); run with the "
        "same ones to continue, or write to another -o"
    )


def backtranslate(opts: BacktranslateOptions, console: Console | None = None) -> dict:
    """Write the synthetic corpus (or find it written); returns its counts (also PREFIX.work/done.json)."""
    from nmt.checkpoint import load_checkpoint
    from nmt.config import config_to_dict
    from nmt.translate.chunks import ChunkedRun, read_chunks, translate_chunks

    console = console or Console(stderr=True)
    check_options(opts)
    ckpt = load_checkpoint(opts.reverse)
    src_lang, tgt_lang = languages(config_to_dict(ckpt.config), opts)
    check_vocab(opts, ckpt.subword_proto)
    del ckpt  # the translator loads its own copy, on its device and in its precision
    written = {lang: Path(f"{opts.output}.{lang}") for lang in (src_lang, tgt_lang)}
    atomic.refuse_overlaps(
        outputs(opts, src_lang, tgt_lang), [opts.reverse, *opts.mono, opts.vocab, *opts.inputs]
    )
    lines, counts = mono_lines(opts)
    check_settings(opts, settings(opts, src_lang, tgt_lang))
    done = opts.workdir / "done.json"
    if done.exists() and all(p.exists() for p in written.values()):
        try:
            info = json.loads(done.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            info = None
        if isinstance(info, dict):
            console.print(f"backtranslate: already done ({done})", highlight=False)
            return info
        # damaged from outside: the corpus is written again from the chunks, which are checked
        console.print(f"[yellow]warning:[/] {done}: damaged; writing the corpus again", highlight=False)
    start = time.perf_counter()
    model = opts.reverse
    if opts.engine is Engine.CTRANSLATE2:
        from nmt.formats.export import exported

        model = exported(opts.reverse, opts.workdir / "export-ctranslate2", console)
    run = ChunkedRun(
        model, decode_overrides(opts), opts.device, opts.precision, opts.engine,
        label="reverse", name=str(opts.reverse), command="nmt backtranslate",
    )  # fmt: skip
    chunks = opts.workdir / "chunks"
    search = translate_chunks(lines, chunks, opts.chunk_lines, run, console)
    found = read_chunks(chunks, len(lines), opts.chunk_lines)
    best, scores = [n["hyps"][0] for n in found], [n["scores"][0] for n in found]
    # the synthetic side is the one a model wrote, so it is the one that may loop (filters.repeats)
    kept, removed = filter_pairs(lines, best, scores, opts.filters)
    atomic.write_text(written[src_lang], "".join(best[i] + "\n" for i in kept))
    atomic.write_text(written[tgt_lang], "".join(lines[i] + "\n" for i in kept))
    info = {
        "mono": counts,
        "translated": len(lines),
        "removed": removed,
        "pairs": len(kept),
        "method": opts.method,
        "search": search,
        "seconds": round(time.perf_counter() - start, 1),
        "files": {lang: str(p) for lang, p in written.items()},
    }
    atomic.write_text(done, json.dumps(info, indent=2) + "\n")
    console.print(
        f"backtranslate: {counts['read']:,} lines read ({counts['blank']:,} blank, {counts['repeated']:,} "
        f"repeated, {counts['capped']:,} over --max-lines); {len(lines):,} translated, removed "
        + ", ".join(f"{reason.replace('_', ' ')} {n:,}" for reason, n in removed.items())
        + f"; {len(kept):,} pairs in {written[src_lang]} and {written[tgt_lang]}",
        highlight=False,
    )
    return info
