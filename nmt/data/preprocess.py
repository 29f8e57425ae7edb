"""`nmt preprocess`: from a recipe's corpora to the files the trainer reads, in three resumable steps.

    text      fetch every corpus; clean the training pairs into data/clean/train.<lang>; write the raw
              validation text data/valid.<lang> and the raw test text data/test/<name>.<lang>
    subword   train the joint SentencePiece model data/spm.model on the cleaned training text
    binarize  encode every split, drop training pairs over data.max_subwords, write data/*.bin|.idx and
              data/stats.json

Each step writes its outputs under temporary names, renames them when complete, and only then writes its
marker (data/.done/<step>.json, holding a fingerprint of the data settings it used). A step whose marker is
present and current is skipped; a step killed midway has no marker and is redone, and so is every step
after one that ran. --force redoes them all. Downloads are cached separately (see nmt.data.fetch).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from operator import itemgetter
from pathlib import Path

from rich.console import Console
from rich.table import Table

from nmt import atomic
from nmt.config import Config, CorpusSpec, DataConfig, config_to_dict
from nmt.data.augment import MODIFIERS, augment_pair, is_on
from nmt.data.binarized import write_split
from nmt.data.clean import REASONS, Seen, clean_pairs, open_text, read_pairs
from nmt.data.corpora import corpus_text
from nmt.data.terms import Annotator, lexicon
from nmt.errors import ConfigError, DataError
from nmt.languages import BT_TAG
from nmt.progress import Progress, count_lines
from nmt.subword import Subword, train_subword

STEPS = ("text", "subword", "binarize")
FORMAT = 1  # bump when the outputs change meaning, so old work directories are redone
ENCODE_CHUNK = 20_000
PROGRESS_LINES = 10_000  # lines between two updates of the progress display
PERCENTILES = (50, 90, 95, 99, 100)
SUBWORD_KEYS = (
    "vocab_size",
    "subword_type",
    "character_coverage",
    "spm_sample_sentences",
    "max_subwords",
    "init_from",
)


def preprocess(
    cfg: Config,
    workdir: Path,
    mirror: str | None = None,
    force: bool = False,
    console: Console | None = None,
    checkpoint_subword: Callable[[str], bytes] | None = None,
    subword: bytes | None = None,
) -> dict:
    """Run the steps not yet done for this data config; returns the statistics of data/stats.json.

    A fine-tuning recipe (data.init_from) encodes with the checkpoint's own subword model, which
    `checkpoint_subword` reads (nmt.checkpoint.checkpoint_subword): passed in, so that the data stage
    imports nothing of the checkpoint's level above it. `subword` is a SentencePiece model to encode with
    instead of training one: the one a back-translation recipe's reverse and forward models share.
    """
    console = console or Console(stderr=True, quiet=True)
    data, out = cfg.data, Path(workdir) / "data"
    init_subword = subword
    if data.init_from:
        if checkpoint_subword is None:
            raise ConfigError("data.init_from: this caller cannot read checkpoints")
        init_subword = checkpoint_subword(data.init_from)
    stale = force
    for step in STEPS:
        fingerprint = _fingerprint(data, step, init_subword)
        reason = "forced" if force else _why_redo(out, step, fingerprint, _outputs(out, data, step))
        if reason is None and not stale:
            continue
        stale = True
        console.print(f"[bold]{step}[/]: {reason or 'an earlier step was redone'}", highlight=False)
        start = time.perf_counter()
        if step == "text":
            info = write_text(data, out, mirror=mirror, console=console)
        elif step == "subword" and init_subword is not None:  # fine-tuning: the checkpoint's own subwords
            atomic.write_bytes(out / "spm.model", init_subword)
            info = {"model": str(out / "spm.model"), "from": data.init_from or "given"}
        elif step == "subword":
            files = [path for d in data.directions for path in clean_text(out, data, d)]
            model = train_subword(files, out / "spm", data, _by_language(out, data))
            info = {"model": str(model)}
        else:
            text_info = _marker(out, "text")["info"]
            info = binarize(data, out, text_info, console)
            _write_json(out / "stats.json", info)
            _print_stats(info, data, console)
        _write_json(out / ".done" / f"{step}.json", {"fingerprint": fingerprint, "info": info})
        console.print(f"[bold]{step}[/]: done in {time.perf_counter() - start:.1f} s", highlight=False)
    if not stale:
        console.print(f"preprocess: already done in {out} (--force redoes it)", highlight=False)
    return json.loads((out / "stats.json").read_text(encoding="utf-8"))


# ---------------------------------------------------------------------------------------------------------
# Steps


def write_text(data: DataConfig, out: Path, *, mirror: str | None, console: Console) -> dict:
    """Fetch all corpora; write the cleaned training text and the raw validation and test text."""
    texts = {
        section: [
            corpus_text(c, *data.direction(c), mirror=mirror, console=console) for c in getattr(data, section)
        ]
        for section in ("train", "valid", "test")
    }
    staged: list[tuple[Path, Path]] = []  # (.part, final) renamed together once everything is written

    def writers(paths: tuple[Path, Path]):
        parts = tuple(p.with_name(p.name + ".part") for p in paths)
        staged.extend(zip(parts, paths, strict=True))
        for p in parts:
            p.parent.mkdir(parents=True, exist_ok=True)
        return open_text(parts[0], "w"), open_text(parts[1], "w")

    train: dict = {"corpora": {}}
    augmented = dict.fromkeys(MODIFIERS, 0)
    kept_before = Seen() if data.dedup else None  # across corpora: a pair in two of them is kept once
    index = 0  # of the kept pair, over all corpora: what its augmentation is drawn from
    for direction in data.directions:
        fs, ft = writers(clean_text(out, data, direction))
        with fs, ft:
            for spec, text in zip(data.train, texts["train"], strict=True):
                if data.direction(spec) != direction:
                    continue
                console.print(f"cleaning {text.name}", highlight=False)
                progress = Progress(console, f"clean {text.name}", count_lines(text.src))
                seen = _Counted(read_pairs(text.src, text.tgt), progress)
                dropped = dict.fromkeys(REASONS, 0)
                kept = 0
                with progress:
                    pairs = clean_pairs(
                        seen, data, dropped, kept_before, langid=spec.langid, direction=direction
                    )
                    for s, t in pairs:
                        if is_on(data.augment):
                            s, t, applied = augment_pair(s, t, data.augment, epoch=0, index=index)
                            for m in applied:
                                augmented[m] += 1
                        fs.write(s + "\n")
                        ft.write(t + "\n")
                        kept += 1
                        index += 1
                train["corpora"][corpus_key(data, spec)] = {
                    "lines": seen.n,
                    "kept": kept,
                    "dropped": dropped,
                }
    train["augmented"] = augmented
    valid_lines = dict.fromkeys(data.directions, 0)
    for direction in data.directions:
        fs, ft = writers(valid_text(out, data, direction))
        with fs, ft:
            for spec, text in zip(data.valid, texts["valid"], strict=True):
                if data.direction(spec) != direction:
                    continue
                for s, t in read_pairs(text.src, text.tgt):
                    fs.write(s + "\n")
                    ft.write(t + "\n")
                    valid_lines[direction] += 1
    test = {}
    for spec, text in zip(data.test, texts["test"], strict=True):
        fs, ft = writers(test_text(out, data, spec))
        key = corpus_key(data, spec)
        with fs, ft:
            test[key] = 0
            for s, t in read_pairs(text.src, text.tgt):
                fs.write(s + "\n")
                ft.write(t + "\n")
                test[key] += 1
    for part, final in staged:
        os.replace(part, final)
    valid: dict = {"lines": sum(valid_lines.values())}
    if data.multilingual:
        valid["directions"] = {f"{s}-{t}": n for (s, t), n in valid_lines.items()}
    return {"train": train, "valid": valid, "test": test}


def binarize(data: DataConfig, out: Path, text_info: dict, console: Console | None = None) -> dict:
    """Encode the cleaned training text and the validation text; returns the statistics.

    Directions are written one after another, each corpus's pairs together, and `groups` in the
    statistics says how many pairs of the split each corpus holds, in that order, and its weight: what
    the loader samples by (nmt.data.sampling). A model of several targets has each source begin with
    its target's tag, by id. A tagged corpus (CorpusSpec.tag) has <BT> before that, first, as Caswell
    et al. (2019) place it: the first thing the encoder sees says the source is synthetic. Its id is
    counted in data.max_subwords as the target tag's is.
    """
    sub = Subword.load(out / "spm.model")
    train = dict(text_info["train"])
    dropped = {r: sum(c["dropped"][r] for c in train["corpora"].values()) for r in REASONS}
    lengths = (Counter(), Counter())
    groups = []

    annotators: list[Annotator] = []

    def kept_pairs(progress: Progress) -> Iterator[tuple[list[int], list[int]]]:
        dropped["too_many_subwords"] = 0
        for direction in data.directions:
            text, annotator = clean_text(out, data, direction), None
            if data.augment.inline_terms > 0:  # a lexicon of each direction's own cleaned pairs
                first = sum(a.seen for a in annotators)
                annotator = Annotator(
                    sub, lexicon(read_pairs(*text)), data.augment, first, data.max_subwords - 2
                )
                annotators.append(annotator)
            pairs = _encoded(sub, *text, progress, _tag(data, direction), annotator)
            for spec in (c for c in data.train if data.direction(c) == direction):
                group = {"corpus": corpus_key(data, spec), "pairs": 0, "weight": spec.weight}
                groups.append(group)
                bt = [sub.tags[BT_TAG]] if spec.tag else []
                for src, tgt in itertools.islice(pairs, train["corpora"][group["corpus"]]["kept"]):
                    src = bt + src if bt else src
                    if len(src) > data.max_subwords or len(tgt) > data.max_subwords:
                        dropped["too_many_subwords"] += 1
                        continue
                    lengths[0][len(src)] += 1
                    lengths[1][len(tgt)] += 1
                    group["pairs"] += 1
                    yield src, tgt
            # the direction's pairs are all taken: resumed once more, the encoder counts its last chunk
            if next(pairs, None) is not None:
                raise DataError(f"{clean_text(out, data, direction)[0]}: more lines than its corpora kept")

    kept = sum(c["kept"] for c in train["corpora"].values())
    with Progress(console, "encode and binarize train", kept) as progress:
        n_train = _write_pairs(out / "train", kept_pairs(progress), sub.vocab_size)
    train.update(
        lines=sum(c["lines"] for c in train["corpora"].values()),
        kept=n_train,
        dropped=dropped,
        **_sizes(lengths),
    )
    if annotators:  # summed over directions; the lexicons' sizes too
        train["inline_terms"] = {k: sum(a.stats()[k] for a in annotators) for k in annotators[0].stats()}
    valid_lengths = (Counter(), Counter())

    def valid_pairs(progress: Progress) -> Iterator[tuple[list[int], list[int]]]:
        for direction in data.directions:
            for src, tgt in _encoded(sub, *valid_text(out, data, direction), progress, _tag(data, direction)):
                valid_lengths[0][len(src)] += 1
                valid_lengths[1][len(tgt)] += 1
                yield src, tgt

    with Progress(console, "encode and binarize valid", text_info["valid"]["lines"]) as progress:
        n_valid = _write_pairs(out / "valid", valid_pairs(progress), sub.vocab_size)
    stats = {
        "src_lang": data.src_lang,
        "tgt_lang": data.tgt_lang,
        "vocab_size": sub.vocab_size,
        "subword_type": data.subword_type,
        "train": train,
        "valid": {"lines": n_valid, **_sizes(valid_lengths)},
        "test": text_info["test"],
        "groups": groups,
    }
    if data.multilingual:
        stats["directions"] = [f"{s}-{t}" for s, t in data.directions]
        stats["valid"]["directions"] = text_info["valid"]["directions"]
    return stats


def clean_text(out: Path, data: DataConfig, direction: tuple[str, str]) -> tuple[Path, Path]:
    """The cleaned training text of a direction: data/clean/train.<lang>, or with several directions
    data/clean/<src>-<tgt>/train.<lang>."""
    folder = out / "clean" / (f"{direction[0]}-{direction[1]}" if data.multilingual else "")
    return folder / f"train.{direction[0]}", folder / f"train.{direction[1]}"


def valid_text(out: Path, data: DataConfig, direction: tuple[str, str]) -> tuple[Path, Path]:
    """The validation text of a direction: data/valid.<lang>, or data/valid.<src>-<tgt>.<lang>."""
    stem = f"valid.{direction[0]}-{direction[1]}" if data.multilingual else "valid"
    return out / f"{stem}.{direction[0]}", out / f"{stem}.{direction[1]}"


def test_text(out: Path, data: DataConfig, corpus: CorpusSpec) -> tuple[Path, Path]:
    """A test set's source and reference text: data/test/<name>.<lang>, or with several directions
    data/test/<name>.<src>-<tgt>.<lang>."""
    s, t = data.direction(corpus)
    stem = f"{corpus.name}.{s}-{t}" if data.multilingual else corpus.name
    return out / "test" / f"{stem}.{s}", out / "test" / f"{stem}.{t}"


def corpus_key(data: DataConfig, corpus: CorpusSpec) -> str:
    """How statistics and results name a corpus: its name, and its direction where there are several."""
    s, t = data.direction(corpus)
    return f"{corpus.name} {s}-{t}" if data.multilingual else corpus.name


def _tag(data: DataConfig, direction: tuple[str, str]) -> str | None:
    return data.target_tag(direction[1])


def _by_language(out: Path, data: DataConfig) -> dict[str, list[Path]] | None:
    """Each language's cleaned training files, for a balanced vocabulary; None for one direction."""
    if not data.multilingual:
        return None
    files: dict[str, list[Path]] = {}
    for direction in data.directions:
        for lang, path in zip(direction, clean_text(out, data, direction), strict=True):
            files.setdefault(lang, []).append(path)
    return files


# ---------------------------------------------------------------------------------------------------------
# Helpers


class _Counted:
    """Pass items through, counting them, and telling `progress` every PROGRESS_LINES items."""

    def __init__(self, items: Iterator, progress: Progress):
        self.items, self.n, self.progress = items, 0, progress

    def __iter__(self):
        for item in self.items:
            self.n += 1
            if self.n % PROGRESS_LINES == 0:
                self.progress.advance(PROGRESS_LINES)
            yield item
        self.progress.advance(self.n % PROGRESS_LINES)


def _encoded(
    sub: Subword,
    src: Path,
    tgt: Path,
    progress: Progress,
    tag: str | None = None,
    annotator: Annotator | None = None,
) -> Iterator[tuple[list[int], list[int]]]:
    """Subword ids of aligned files, encoded in chunks so SentencePiece can batch (and thread) them;
    each source after `tag`'s id where given; the pairs `annotator` draws with inline terms."""
    pairs = read_pairs(src, tgt)
    first = [sub.tags[tag]] if tag is not None else []
    while chunk := list(itertools.islice(pairs, ENCODE_CHUNK)):
        sources = sub.encode([s for s, _ in chunk])
        targets = sub.encode_target([t for _, t in chunk])
        if annotator is not None:
            for j, (s, t) in enumerate(chunk):
                if (annotated := annotator(s, t)) is not None:
                    sources[j], targets[j] = annotated
        yield from zip([first + ids for ids in sources] if first else sources, targets, strict=True)
        progress.advance(len(chunk))


def _write_pairs(prefix: Path, pairs: Iterator[tuple[list[int], list[int]]], vocab_size: int) -> int:
    a, b = itertools.tee(pairs)  # read in lockstep by write_split's zip, so the buffer stays one pair
    return write_split(prefix, map(itemgetter(0), a), map(itemgetter(1), b), vocab_size=vocab_size)


def _sizes(lengths: tuple[Counter, Counter]) -> dict:
    """Tokens per side and length percentiles per side, from histograms of subword lengths."""
    sides = dict(zip(("src", "tgt"), lengths, strict=True))
    return {
        "tokens": {side: sum(n * c for n, c in h.items()) for side, h in sides.items()},
        "length_percentiles": {
            side: {str(p): _percentile(h, p) for p in PERCENTILES} for side, h in sides.items()
        },
    }


def _percentile(histogram: Counter, p: float) -> int:
    """The smallest length that at least p% of the sentences do not exceed (0 for no sentences)."""
    total = sum(histogram.values())
    seen = 0
    for length in sorted(histogram):
        seen += histogram[length]
        if seen * 100 >= p * total:
            return length
    return 0


def _fingerprint(data: DataConfig, step: str, init_subword: bytes | None = None) -> str:
    """A hash of the data settings `step` depends on: a new vocabulary size must not redo the cleaning."""
    settings = config_to_dict(data)
    for section in ("train", "valid", "test"):  # keys added with several directions, at their defaults,
        for corpus in settings[section]:  # leave a bilingual work directory's fingerprints as they were
            for key, default in (("src_lang", None), ("tgt_lang", None), ("weight", 1.0), ("tag", False)):
                if corpus.get(key) == default:
                    corpus.pop(key)
    if settings["sampling_temperature"] == 1.0:
        settings.pop("sampling_temperature")
    for key in ("inline_terms", "inline_terms_other"):  # binarizing's choice, and absent from older runs
        if step == "text" or settings["augment"][key] == 0.0:
            settings["augment"].pop(key)
    # A back-translation recipe's settings choose its synthetic corpus, which joins data.train by name
    # and checksum once written; the vocabulary depends only on whether <BT> is reserved in it.
    backtranslate = settings.pop("backtranslate")
    if backtranslate is not None and step != "text":
        settings["reserved_tags"] = list(data.reserved_tags)
    if step == "text":
        for key in SUBWORD_KEYS:
            settings.pop(key)
    elif init_subword is not None:  # the checkpoint's subwords, not just its path: a new file there counts
        settings["init_from_subword"] = hashlib.sha256(init_subword).hexdigest()
    raw = json.dumps({"format": FORMAT, "data": settings}, sort_keys=True)
    return hashlib.sha256(raw.encode()).hexdigest()


def _marker(out: Path, step: str) -> dict:
    return json.loads((out / ".done" / f"{step}.json").read_text(encoding="utf-8"))


def _outputs(out: Path, data: DataConfig, step: str) -> list[Path]:
    """The files a later step or command needs from `step` (test files are checked by whoever reads them)."""
    if step == "text":
        return [p for d in data.directions for p in (*clean_text(out, data, d), *valid_text(out, data, d))]
    if step == "subword":
        return [out / "spm.model"]
    return [
        out / f"{split}.{side}.{ext}"
        for split in ("train", "valid")
        for side in ("src", "tgt")
        for ext in ("bin", "idx")
    ] + [out / "stats.json"]


def _why_redo(out: Path, step: str, fingerprint: str, outputs: list[Path]) -> str | None:
    """None when the step is done for this data config and its outputs are there, else why it must run."""
    try:
        marker = _marker(out, step)
    except (OSError, ValueError):
        return "not done yet"
    if marker.get("fingerprint") != fingerprint:
        return "the recipe's data section changed since it was done"
    missing = [p.name for p in outputs if not p.is_file()]
    if missing:
        return f"{missing[0]} is missing"
    return None


def _write_json(path: Path, obj: dict) -> None:
    atomic.write_text(path, json.dumps(obj, indent=2) + "\n")


def _print_stats(stats: dict, data: DataConfig, console: Console) -> None:
    train = stats["train"]
    table = Table(title="training pairs", title_justify="left")
    table.add_column("")
    table.add_column("pairs", justify="right")
    table.add_row("read", f"{train['lines']:,}")
    for reason, n in train["dropped"].items():
        table.add_row(f"dropped: {reason.replace('_', ' ')}", f"{n:,}")
    table.add_row("kept", f"{train['kept']:,}")
    for modifier, n in train.get("augmented", {}).items():
        table.add_row(f"of which augmented: {modifier.replace('_', ' ')}", f"{n:,}")
    if inline := train.get("inline_terms"):
        table.add_row(
            f"of which with inline terms ({inline['terms']:,} terms, {inline['other']:,} of them another "
            f"word's; lexicon {inline['lexicon']:,} words)",
            f"{inline['pairs']:,}",
        )
    console.print(table)
    p, tokens = train["length_percentiles"], train["tokens"]
    tests = ", ".join(f"{k} {v:,}" for k, v in stats["test"].items()) or "none"
    src, tgt = ("source", "target") if data.multilingual else (data.src_lang, data.tgt_lang)
    console.print(
        f"train: {tokens['src']:,} {src} / {tokens['tgt']:,} {tgt} subwords,"
        f" 95th percentile length {p['src']['95']} / {p['tgt']['95']};"
        f" valid: {stats['valid']['lines']:,} pairs; test: {tests}; vocabulary {stats['vocab_size']:,}",
        highlight=False,
    )
