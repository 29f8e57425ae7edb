"""Turn a recipe's CorpusSpec into two aligned plain-text files.

A corpus given by files is fetched (cache, mirror, checksum) and its members unpacked into the cache, keyed
by the archive's checksum, so recipes sharing an archive (base and big) share the work. A corpus named by
sacrebleu (`wmt13`, `wmt14/full`) is read through sacrebleu's own dataset object, which knows its URL,
member layout and format (the SGML of newstest2014); only the download goes through our fetcher, so that
--mirror and a local test server work for it too.
"""

from __future__ import annotations

import copy
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from nmt.config import CorpusSpec, FileSpec
from nmt.data.fetch import basename, cache_dir, fetch, unpack
from nmt.errors import DataError


@dataclass(frozen=True)
class CorpusText:
    name: str
    src: Path
    tgt: Path


def corpus_text(
    corpus: CorpusSpec,
    src_lang: str,
    tgt_lang: str,
    *,
    mirror: str | None = None,
    console: Console | None = None,
) -> CorpusText:
    """Local aligned text files of `corpus` (line counts are checked by whoever reads them)."""
    if corpus.sacrebleu is not None:
        src, tgt = sacrebleu_text(corpus.sacrebleu, f"{src_lang}-{tgt_lang}", mirror=mirror, console=console)
        return CorpusText(corpus.name, src, tgt)
    assert corpus.src is not None and corpus.tgt is not None  # config._check guarantees one of the two forms
    paths = files_text([corpus.src, corpus.tgt], mirror=mirror, console=console)
    return CorpusText(corpus.name, paths[0], paths[1])


def files_text(specs: list[FileSpec], *, mirror: str | None, console: Console | None) -> list[Path]:
    """The plain text of each FileSpec: a verified download, unpacked and gunzipped as needed."""
    out: list[Path | None] = [None] * len(specs)
    by_archive: dict[tuple[str, str], list[int]] = {}
    for i, spec in enumerate(specs):
        by_archive.setdefault((spec.url, spec.sha256), []).append(i)
    for (url, sha256), indices in by_archive.items():
        text_dir = cache_dir() / "text" / f"sha256-{sha256[:16]}"
        targets = {}
        for i in indices:
            member = specs[i].member or ""
            name = member or basename(url)
            out[i] = text_dir / name.removesuffix(".gz")
            if member or name.endswith(".gz"):
                targets[member] = out[i]
        missing = {m: p for m, p in targets.items() if not p.is_file()}
        plain = [i for i in indices if not (specs[i].member or basename(url).endswith(".gz"))]
        if missing or plain:
            archive = fetch(url, sha256, mirror=mirror, console=console)
            for i in plain:
                out[i] = archive  # already plain text: read it where it lies
            if missing:
                unpack(archive, missing)
    return [p for p in out if p is not None]


def sacrebleu_text(
    name: str, langpair: str, *, mirror: str | None = None, console: Console | None = None
) -> tuple[Path, Path]:
    """(source, reference) text files of a sacrebleu test set, processed by sacrebleu itself.

    sacrebleu would download into its own folder with its own downloader; instead we give a copy of its
    dataset object a folder in our cache, put the archive (fetched and md5-checked by us) and the members
    for `langpair` where it expects them, and let it convert them to text.
    """
    from sacrebleu.dataset import DATASETS

    if name not in DATASETS:
        raise DataError(f"sacrebleu has no test set {name!r} (e.g. wmt13, wmt14/full; see sacrebleu --list)")
    dataset = copy.copy(DATASETS[name])
    if langpair not in dataset.langpairs:
        pairs = ", ".join(sorted(dataset.langpairs))
        raise DataError(f"sacrebleu test set {name} has no language pair {langpair} (it has {pairs})")
    dataset._outdir = str(cache_dir() / "sacrebleu" / name)
    dataset._rawdir = os.path.join(dataset._outdir, "raw")
    raw = Path(dataset._rawdir)
    raw.mkdir(parents=True, exist_ok=True)
    md5s = dataset.md5 or [None] * len(dataset.data)
    members = [m for m in dataset.langpairs[langpair] if not (raw / m).is_file()]
    for url, md5 in zip(dataset.data, md5s, strict=True):
        if md5 is None:
            raise DataError(f"sacrebleu test set {name}: no checksum for {url} in sacrebleu's registry")
        archive = fetch(url, md5, algorithm="md5", mirror=mirror, console=console)
        # Where sacrebleu's maybe_download looks: present, so it downloads nothing itself.
        placed = raw / dataset._get_tarball_filename(url)
        if not placed.exists():
            placed.unlink(missing_ok=True)  # a dangling link from an emptied cache
            try:
                os.symlink(archive.resolve(), placed)
            except OSError:  # no symlinks on this file system
                shutil.copyfile(archive, placed)
        if members:  # a set may span several archives: take from each what it has
            found = unpack(archive, {m: raw / m for m in members}, strict=False)
            members = [m for m in members if m not in found]
    if members:
        raise DataError(f"sacrebleu test set {name}: {', '.join(members)} not in {', '.join(dataset.data)}")
    try:
        dataset.process_to_text(
            langpair
        )  # cheap (a few thousand lines); redone so a killed run can't leave half
        return Path(dataset.get_source_file(langpair)), Path(dataset.get_reference_files(langpair)[0])
    except (OSError, AssertionError) as e:
        raise DataError(f"sacrebleu test set {name} {langpair}: cannot convert {raw}: {e}") from None
