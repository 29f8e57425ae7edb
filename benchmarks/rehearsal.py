"""The long WMT14 run rehearsed at full size on one machine: synthetic corpus, preprocessing, training.

    python benchmarks/rehearsal.py --workdir /tmp/rehearsal --record   # 4.5M pairs, 4 minutes of training
    python benchmarks/rehearsal.py --pairs 200000 --workdir /tmp/r --skip-train

1. corpus    A synthetic parallel corpus with WMT14 EN-DE's size (--pairs, default 4.5M) and shape, written
             as the archives recipes/wmt14-en-de-base.yaml reads (same file names, same member layout,
             pairs split as upstream: Europarl v7 1.92M, Common Crawl 2.40M, News Commentary v9 0.20M),
             plus newstest2013/newstest2014 as the SGML archives sacrebleu unpacks, all in one mirror
             folder. Words are made up, with English-like and German-like spelling (200k types per
             language, ~3x that as surface forms with capitals and final full stops), drawn from a Zipf
             (Mandelbrot) distribution, so SentencePiece has a realistic vocabulary to learn. Sentence
             lengths are log-normal in words (mean about 25, clipped at 250), with 0.1% of pairs over 250
             words, some empty lines and a share of pairs with a bad length ratio (more in Common Crawl),
             so that every clean-corpus-n filter has work. The target is a noisy function of the source:
             each target word the translation of the source word at the proportional position (a fixed
             rank-preserving word map), 15% replaced by random words, the length scaled by about 1.08.
             Its generation time is reported apart: it is not part of what is rehearsed.
2. preprocess  `nmt preprocess RECIPE --workdir W --mirror M` in a subprocess, on the recipe
             wmt14-en-de-base with only the archives' checksums replaced (written to W/recipe.yaml). The
             test sets keep their sacrebleu names; sacrebleu's registry holds the checksums of the real
             archives, so the subprocess replaces those two md5s before it runs the CLI (see `_nmt`).
             Downloads are cached in W/cache (NMT_CACHE). Per step (text, subword, binarize): wall time,
             peak RSS (VmRSS sampled every 0.2 s; the whole process's peak from wait4's ru_maxrss) and
             the disk used by W/data and W/cache once the step is done.
3. train     `torchrun --standalone --nproc-per-node 2 -m nmt train` on the CPU (gloo) with
             train.max_minutes=--minutes: SIGTERM part-way (the trainer saves and exits), then the same
             command again with train.max_minutes doubled, which must log "resuming from", until that
             budget ends it. The signal
             goes to the ranks, as a scheduler's preemption does: sent to torchrun, it is passed on, but
             torchrun kills the ranks 30 s later, before a CPU update of 25000 tokens has ended. The model is
             shrunk for a CPU (--model-set, default 3+3 layers of d_model 256) and the micro-batch too
             (train.batch_tokens 3125: the recipe's 12500-token batch needs 4-6 GB per process for the
             37k-way logits), with the recipe's update of 25000 tokens kept by gradient accumulation;
             the data, the vocabulary and the batching rule are the recipe's. Validation computes the
             loss only (train.valid_bleu=false): greedy decoding of newstest2013 would take minutes.
             Reports the seconds per update and tokens/s from W/metrics.jsonl, each rank's peak RSS and
             the disk of W/checkpoints. The loader's own throughput comes from
             benchmarks/loader_speed.py on the same split.
4. extrapolation  To WMT14 EN-FR (36M pairs): each step's seconds per pair and the bytes per pair on
             disk, times 36M; peak RSS plus the arrays that grow with the corpus (the writer's offsets,
             8 bytes per pair and side).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import tarfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import common  # benchmarks/common.py: these scripts run with benchmarks/ on sys.path
import torch
import yaml
from common import GIB, MIB, RESULTS, LengthModel, Zipf, make_words, markdown_table, rss_now, wait_measured

SECTION = "## Full-size rehearsal"
ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "wmt14-en-de-base.yaml"
PAIRS = 4_500_000
EN_FR_PAIRS = 36_000_000
TARGETS = {"minutes": 15.0, "rss_gib": 4.0}
STEPS = ("text", "subword", "binarize")


@dataclass(frozen=True)
class Corpus:
    """One training archive as on statmt.org: its file name, member prefix, upstream size and noise."""

    name: str
    archive: str
    members: str  # member path without the language suffix
    upstream_pairs: int
    bad_ratio: float  # share of pairs whose length ratio clean-corpus-n rejects
    empty: float  # share of pairs with an empty target line


CORPORA = (
    Corpus(
        "europarl-v7",
        "training-parallel-europarl-v7.tgz",
        "training/europarl-v7.de-en",
        1_920_209,
        0.01,
        0.001,
    ),
    Corpus("commoncrawl", "training-parallel-commoncrawl.tgz", "commoncrawl.de-en", 2_399_123, 0.06, 0.003),
    Corpus(
        "news-commentary-v9",
        "training-parallel-nc-v9.tgz",
        "training/news-commentary-v9.de-en",
        201_288,
        0.01,
        0.001,
    ),
)
# sacrebleu's wmt13 and wmt14/full (en-de): the archives and the SGML members it reads.
TEST_SETS = {
    "wmt13": ("test.tgz", "test/newstest2013-src.en.sgm", "test/newstest2013-src.de.sgm", 3000),
    "wmt14/full": (
        "test-full.tgz",
        "test-full/newstest2014-deen-src.en.sgm",
        "test-full/newstest2014-deen-ref.de.sgm",
        3003,
    ),
}


# ---------------------------------------------------------------------------------------------------------
# 1. The synthetic corpus

TYPES = 200_000  # word types per language
# Words per sentence: log-normal with mean 24.8 (mu 3.0, sigma 0.65); German runs a little longer.
WORDS = LengthModel(mean=math.exp(3.0 + 0.65**2 / 2), sigma=0.65, ratio=1.08, noise=0.12)
LONG_SHARE = 0.001  # pairs with 251-400 source words, dropped as too long
WORD_NOISE = 0.15  # target words that are not the translation of the aligned source word
CHUNK = 50_000  # pairs generated and written at a time


class Generator:
    """Aligned synthetic sentence pairs, a chunk at a time, as text (see the module docstring)."""

    def __init__(self, seed: int = 1):
        self.g = torch.Generator().manual_seed(seed)
        self.zipf = Zipf(TYPES, s=1.05, q=2.7)  # Zipf-Mandelbrot
        # translation: a word of rank r maps to a word of about the same rank
        jitter = torch.randn(TYPES, generator=self.g, dtype=torch.float64) * (0.1 * torch.arange(TYPES) + 1)
        self.word_map = (torch.arange(TYPES) + jitter).round().clamp(0, TYPES - 1).long()
        self.forms = {}
        for i, lang in enumerate(("en", "de")):
            words = make_words(lang, TYPES, seed * 100 + i)
            # ids: [0, V) plain, [V, 2V) sentence-initial (capitalised), [2V, 3V) sentence-final ("."),
            # 3V the end of the line
            self.forms[lang] = (
                words + [w[0].upper() + w[1:] for w in words] + [w + "." for w in words] + ["\n"]
            )

    def chunk(self, n: int, bad_ratio: float, empty: float) -> tuple[str, str]:
        """n aligned lines per side."""
        g = self.g
        src_len = WORDS.sources(n, g)
        long = torch.rand(n, generator=g) < LONG_SHARE
        src_len[long] = torch.randint(251, 401, (int(long.sum()),), generator=g)
        ratio = WORDS.ratios(n, g)
        bad = torch.rand(n, generator=g) < bad_ratio
        off = torch.empty(int(bad.sum()), dtype=torch.float64).uniform_(1.8, 4.0, generator=g)
        ratio[bad] = torch.where(torch.rand(len(off), generator=g) < 0.5, off, 1 / off)
        tgt_len = (src_len * ratio).round().clamp(1, 600).long()
        tgt_len[torch.rand(n, generator=g) < empty] = 0
        src = self.zipf.draw(int(src_len.sum()), g)
        # target word j of a sentence translates source word j * |src| // |tgt|
        sent = torch.repeat_interleave(torch.arange(n), tgt_len)  # (T,)
        t_start = torch.cumsum(tgt_len, 0) - tgt_len
        s_start = torch.cumsum(src_len, 0) - src_len
        j = torch.arange(len(sent)) - t_start[sent]
        tgt = self.word_map[src[s_start[sent] + j * src_len[sent] // tgt_len[sent]]]
        noise = torch.rand(len(tgt), generator=g) < WORD_NOISE
        tgt[noise] = self.zipf.draw(int(noise.sum()), g)
        return self.text(src, src_len, "en"), self.text(tgt, tgt_len, "de")

    def text(self, ids: torch.Tensor, lengths: torch.Tensor, lang: str) -> str:
        """Lines of words: ids laid out with an end-of-line id after each sentence, mapped to strings."""
        n = len(lengths)
        ends = torch.cumsum(lengths + 1, 0) - 1  # (n,) where each line's end goes
        flat = torch.full((int(ends[-1]) + 1 if n else 0,), 3 * TYPES, dtype=torch.long)
        keep = torch.ones(len(flat), dtype=torch.bool)
        keep[ends] = False
        nonempty = lengths > 0
        first, last = (ends - lengths)[nonempty], (ends - 1)[nonempty]
        ids = ids.clone()
        flat[keep] = ids
        flat[first] += TYPES
        flat[last] = flat[last] % TYPES + 2 * TYPES
        joined = " ".join(map(self.forms[lang].__getitem__, flat.tolist())) + " "
        return joined.replace(" \n ", "\n").replace("\n ", "\n")


def sgml(lines: list[str], lang: str) -> bytes:
    segs = "".join(f'<seg id="{i + 1}">{line}</seg>\n' for i, line in enumerate(lines))
    doc = f'<doc sysid="ref" docid="synthetic" genre="news" origlang="en">\n<p>\n{segs}</p>\n</doc>\n'
    return f'<refset setid="newstest" srclang="any" trglang="{lang}">\n{doc}</refset>\n'.encode()


def write_corpus(mirror: Path, pairs: int, seed: int = 1, compresslevel: int = 1) -> dict:
    """Write the mirror folder; returns {file name: sha256 or md5, ...} and what it wrote."""
    mirror.mkdir(parents=True, exist_ok=True)
    gen = Generator(seed)
    total = sum(c.upstream_pairs for c in CORPORA)
    counts = [round(pairs * c.upstream_pairs / total) for c in CORPORA]
    counts[0] += pairs - sum(counts)
    sha256 = {}
    for corpus, n in zip(CORPORA, counts, strict=True):
        staging = mirror / ".staging"
        staging.mkdir(exist_ok=True)
        plain = {lang: staging / f"{Path(corpus.members).name}.{lang}" for lang in ("en", "de")}
        with open(plain["en"], "w", encoding="utf-8") as fe, open(plain["de"], "w", encoding="utf-8") as fd:
            for start in range(0, n, CHUNK):
                en, de = gen.chunk(min(CHUNK, n - start), corpus.bad_ratio, corpus.empty)
                fe.write(en)
                fd.write(de)
        part = mirror / (corpus.archive + ".part")
        with tarfile.open(part, "w:gz", compresslevel=compresslevel) as tar:
            for lang, path in plain.items():
                tar.add(path, arcname=f"{corpus.members}.{lang}")
                path.unlink()
        os.replace(part, mirror / corpus.archive)
        sha256[corpus.archive] = file_digest(mirror / corpus.archive, "sha256")
    md5 = {}
    for name, (archive, src_member, tgt_member, n) in TEST_SETS.items():
        en, de = gen.chunk(n, 0.0, 0.0)
        part = mirror / (archive + ".part")
        with tarfile.open(part, "w:gz") as tar:
            for member, lines, lang in ((src_member, en, "en"), (tgt_member, de, "de")):
                data = sgml(lines.splitlines(), lang)
                info = tarfile.TarInfo(member)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        os.replace(part, mirror / archive)
        md5[name] = file_digest(mirror / archive, "md5")
    (mirror / ".staging").rmdir()
    return {"pairs": dict(zip((c.name for c in CORPORA), counts, strict=True)), "sha256": sha256, "md5": md5}


def file_digest(path: Path, algorithm: str) -> str:
    h = hashlib.new(algorithm)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------------------
# 2. Preprocessing, measured


def write_recipe(path: Path, checksums: dict) -> None:
    """recipes/wmt14-en-de-base.yaml with the training archives' sha256 replaced by the synthetic ones'."""
    raw = yaml.safe_load(RECIPE.read_text(encoding="utf-8"))
    for corpus in raw["data"]["train"]:
        for side in ("src", "tgt"):
            spec = corpus[side]
            spec["sha256"] = checksums[spec["url"].rsplit("/", 1)[-1]]
    header = f"# {RECIPE.name} with the checksums of the synthetic archives (benchmarks/rehearsal.py)\n"
    path.write_text(header + yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")


def disk_bytes(path: Path) -> int:
    """Bytes allocated under `path` (what du counts)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


@dataclass
class Step:
    name: str
    seconds: float = 0.0
    peak_rss: int = 0
    data_bytes: int = 0
    cache_bytes: int = 0


@dataclass
class Whole:
    """The whole preprocessing run: wall time, and from wait4 its peak RSS and CPU (user + system) time,
    which a machine shared with other jobs cannot inflate."""

    seconds: float
    peak_rss: int
    cpu_seconds: float


def run_preprocess(
    workdir: Path, recipe: Path, mirror: Path, md5: dict, overrides: list[str], quiet: bool = False
) -> tuple[list[Step], Whole]:
    """`nmt preprocess` in a subprocess; per-step wall time, sampled peak RSS and disk after the step."""
    env = dict(os.environ, NMT_CACHE=str(workdir / "cache"), REHEARSAL_TEST_MD5=json.dumps(md5))
    argv = [
        sys.executable,
        __file__,
        "_nmt",
        "preprocess",
        str(recipe),
        "--workdir",
        str(workdir),
        "--mirror",
        str(mirror),
        *(f"--set={o}" for o in overrides),
    ]
    steps: dict[str, Step] = {}
    current: list[Step] = []
    start = time.monotonic()
    proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    log_path = workdir / "preprocess.log"
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.2):
            rss = rss_now(proc.pid)
            if current:
                current[-1].peak_rss = max(current[-1].peak_rss, rss)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    step_start = start
    with open(log_path, "w", encoding="utf-8") as log:
        assert proc.stderr is not None
        for line in proc.stderr:
            log.write(line)
            if not quiet:
                sys.stderr.write("  | " + line)
            m = re.match(r"(text|subword|binarize): (.*)", line)
            if m is None:
                continue
            name, what = m.groups()
            if what.startswith("done in"):
                step = steps[name]
                step.seconds = time.monotonic() - step_start
                step.data_bytes = disk_bytes(workdir / "data")
                step.cache_bytes = disk_bytes(workdir / "cache")
                step_start = time.monotonic()
            elif name not in steps:
                steps[name] = Step(name)
                current.append(steps[name])
                step_start = time.monotonic()
    returncode, peak_rss, cpu_seconds = wait_measured(proc)
    stop.set()
    sampler.join()
    if returncode != 0:
        raise SystemExit(f"nmt preprocess failed (exit {returncode}); see {log_path}")
    return [steps[s] for s in STEPS if s in steps], Whole(time.monotonic() - start, peak_rss, cpu_seconds)


def _nmt(argv: list[str]) -> None:
    """The nmt CLI, with sacrebleu's md5s of wmt13 and wmt14/full replaced by those of the synthetic
    archives (REHEARSAL_TEST_MD5): the one checksum a recipe cannot set, as it lives in sacrebleu."""
    import copy

    from sacrebleu.dataset import DATASETS

    from nmt.cli import main

    for name, md5 in json.loads(os.environ.get("REHEARSAL_TEST_MD5", "{}")).items():
        dataset = copy.copy(DATASETS[name])
        dataset.md5 = [md5]
        DATASETS[name] = dataset
    sys.argv = ["nmt", *argv]
    main()


# ---------------------------------------------------------------------------------------------------------
# 3. Training under torchrun, killed and resumed


def children(pid: int) -> list[int]:
    """Every descendant of `pid`."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


@dataclass
class TrainRun:
    returncode: int
    seconds: float
    rank_peak_rss: list[int]
    resumed: bool


def run_train(
    argv: list[str], env: dict, log: Path, kill_after_step: int | None, deadline_s: float
) -> TrainRun:
    """Run torchrun; SIGTERM it once metrics.jsonl shows `kill_after_step` (if given); sample the ranks."""
    metrics = Path(argv[argv.index("--workdir") + 1]) / "metrics.jsonl"
    start = time.monotonic()
    with open(log, "a", encoding="utf-8") as out:
        out.write(f"$ {shlex.join(argv)}\n")
        out.flush()
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        peaks: dict[int, int] = {}
        killed = False
        while proc.poll() is None:
            time.sleep(0.5)
            for pid in children(proc.pid):
                peaks[pid] = max(peaks.get(pid, 0), rss_now(pid))
            done = max((r["step"] for r in train_records(metrics)), default=0)
            if kill_after_step is not None and not killed and done >= kill_after_step:
                # As a scheduler preempting the job would: SIGTERM to the ranks themselves. Sent to
                # torchrun, it is passed on, but torchrun kills the ranks 30 s later, and a CPU update of
                # 25000 tokens takes longer than that to finish before the rank can save.
                for pid in children(proc.pid):
                    os.kill(pid, signal.SIGTERM)
                killed = True
            if time.monotonic() - start > deadline_s:
                os.killpg(proc.pid, signal.SIGKILL)
                raise SystemExit(f"training did not end within {deadline_s:.0f} s; see {log}")
    text = log.read_text(encoding="utf-8", errors="replace")
    ranks = sorted(peaks.values(), reverse=True)[:2]  # the two workers are the largest processes
    return TrainRun(proc.returncode, time.monotonic() - start, ranks, "resuming from" in text.split("$ ")[-1])


def train_records(metrics: Path) -> list[dict]:
    try:
        lines = metrics.read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    return [r for r in map(json.loads, filter(str.strip, lines)) if r.get("kind") == "train"]


# ---------------------------------------------------------------------------------------------------------
# 4. Report


def loader_speed(workdir: Path) -> str:
    """The figures of benchmarks/loader_speed.py on the binarized data."""
    script = Path(__file__).resolve().parent / "loader_speed.py"
    argv = [sys.executable, str(script), "--data", str(workdir)]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    return (done.stdout.strip() or done.stderr.strip()[-2000:]) or f"exit {done.returncode}"


def preprocess_rows(steps: list[Step], pairs: int) -> list[list[str]]:
    rows = []
    for s in steps:
        per_pair = s.seconds / pairs
        rows.append(
            [
                s.name,
                f"{s.seconds:,.1f}",
                f"{per_pair * 1e6:,.1f}",
                f"{s.peak_rss / GIB:.2f}",
                f"{s.data_bytes / GIB:.2f}",
                f"{s.cache_bytes / GIB:.2f}",
                f"{per_pair * EN_FR_PAIRS / 60:,.1f}",
            ]
        )
    return rows


def extrapolation(steps: list[Step], pairs: int, whole: Whole) -> dict:
    """Figures for WMT14 EN-FR (36M pairs) from this run's per-pair rates and bytes per pair."""
    scale = EN_FR_PAIRS / pairs
    last = steps[-1] if steps else Step("none")
    grow = (EN_FR_PAIRS - pairs) * 2 * 8  # the writer's int64 offsets, one per pair and side
    return {
        "minutes": sum(s.seconds for s in steps) * scale / 60,
        "data_gib": last.data_bytes * scale / GIB,
        "cache_gib": last.cache_bytes * scale / GIB,
        "peak_rss_gib": (whole.peak_rss + grow) / GIB,
    }


TRAIN_HEADER = ["run", "wall s", "exit", "resumed", "updates", "s / update", "tokens/s", "rank peak RSS GiB"]
PRE_HEADER = ["step", "wall s", "µs / pair", "peak RSS GiB", "data/ GiB", "cache/ GiB", "EN-FR min"]


def _counts(counts: dict) -> str:
    return ", ".join(f"{k} {v:,}" for k, v in counts.items())


def report(r: dict) -> str:
    """The Markdown body shared by the printout and the RESULTS.md entry."""
    pairs = r["pairs"]
    ex = r["extrapolation"]
    whole = r["preprocess"]
    out = [
        f"- corpus: {pairs:,} synthetic pairs ({_counts(r['corpus']['pairs'])}),"
        f" generated in {r['corpus']['seconds']:,.0f} s; archives {r['corpus']['bytes'] / GIB:.2f} GiB",
        f"- preprocess: {whole['seconds'] / 60:.1f} min wall, {whole['cpu_seconds'] / 60:.1f} min of CPU"
        f" (user + system; load average {r['load']:.1f} at the end),"
        f" peak RSS {whole['peak_rss'] / GIB:.2f} GiB (wait4);"
        f" kept {r['stats']['kept']:,} of {r['stats']['lines']:,} pairs"
        f" (dropped: {_counts(r['stats']['dropped'])});"
        f" {r['stats']['tokens']['src']:,} / {r['stats']['tokens']['tgt']:,} subwords",
        "",
        *markdown_table(PRE_HEADER, r["steps"]),
        "",
        f"Targets: preprocessing <= {TARGETS['minutes']:.0f} min: {whole['seconds'] / 60:.1f} min"
        f" ({'met' if whole['seconds'] / 60 <= TARGETS['minutes'] else 'NOT met'}); peak RSS"
        f" <= {TARGETS['rss_gib']:.0f} GiB: {whole['peak_rss'] / GIB:.2f} GiB"
        f" ({'met' if whole['peak_rss'] / GIB <= TARGETS['rss_gib'] else 'NOT met'}).",
        "",
        f"Extrapolated to WMT14 EN-FR ({EN_FR_PAIRS / 1e6:.0f}M pairs, the same per-pair rates):"
        f" preprocessing {ex['minutes']:,.0f} min, data/ {ex['data_gib']:,.1f} GiB,"
        f" download cache {ex['cache_gib']:,.1f} GiB,"
        f" peak RSS {ex['peak_rss_gib']:.2f} GiB (this run's peak + 16 bytes of offsets per extra pair; the"
        " SentencePiece sample is capped by data.spm_sample_sentences). The subword step's time is mostly"
        " SentencePiece training on that capped sample, which does not grow with the corpus, so its"
        " linear extrapolation is an upper bound.",
    ]
    t = r.get("train")
    if t:
        out += [
            "",
            f"- training: {t['command']}",
            f"- model: {t['model']}",
            "",
            *markdown_table(TRAIN_HEADER, t["rows"]),
            "",
            f"checkpoints/: {t['checkpoint_bytes'] / MIB:,.0f} MiB; the loader: {t['loader']}",
        ]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------------------
# Main


def train_part(args, workdir: Path, recipe: Path) -> dict:
    overrides = [
        f"train.max_minutes={args.minutes}",
        "train.device=cpu",
        "train.threads=1",
        "train.batch_tokens=3125",
        "train.log_every=1",
        "train.valid_bleu=false",
        *args.model_set,
        *args.set,
    ]
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    argv = [torchrun, *"--standalone --nproc-per-node 2 -m nmt train".split(), str(recipe)]
    argv += ["--workdir", str(workdir), *(f"--set={o}" for o in overrides)]
    env = dict(os.environ, NMT_CACHE=str(workdir / "cache"), OMP_NUM_THREADS="1")
    log = workdir / "train.log.rehearsal"
    deadline = args.minutes * 60 * 3 + 600
    first = run_train(argv, env, log, kill_after_step=args.kill_after, deadline_s=deadline)
    steps_first = max((r["step"] for r in train_records(workdir / "metrics.jsonl")), default=0)
    # The budget counts the first run's time, validation and saving included: give the resumed run
    # another --minutes, so that it trains some updates whatever the first run spent.
    again = [
        a if not a.startswith("--set=train.max_minutes=") else f"--set=train.max_minutes={2 * args.minutes}"
        for a in argv
    ]
    second = run_train(again, env, log, kill_after_step=None, deadline_s=deadline)
    records = train_records(workdir / "metrics.jsonl")
    rows = []
    for name, run, lo, hi in (
        ("1st (SIGTERM)", first, 0, steps_first),
        ("2nd (resumed)", second, steps_first, 1 << 62),
    ):
        mine = [x for x in records if lo < x["step"] <= hi]
        per_update = (
            f"{(mine[-1]['elapsed'] - mine[0]['elapsed']) / (len(mine) - 1):.1f}" if len(mine) > 1 else "-"
        )
        tok = sorted(x["tokens_per_s"] for x in mine[1:])
        median = f"{tok[len(tok) // 2]:,.0f}" if tok else "-"
        rss = ", ".join(f"{b / GIB:.2f}" for b in run.rank_peak_rss)
        resumed = "yes" if run.resumed else "no"
        rows.append(
            [
                name,
                f"{run.seconds:,.0f}",
                str(run.returncode),
                resumed,
                str(len(mine)),
                per_update,
                median,
                rss,
            ]
        )
    return {
        "command": "`" + shlex.join(["torchrun", *argv[1:]]) + "`",
        "model": ", ".join(o for o in overrides if o.startswith("model.")) or "the recipe's",
        "rows": rows,
        "checkpoint_bytes": disk_bytes(workdir / "checkpoints"),
        "loader": loader_speed(workdir),
        "resumed": second.resumed,
        "first_exit": first.returncode,
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=PAIRS, help="training pairs to generate (default: 4.5M)")
    p.add_argument("--workdir", type=Path, default=Path("runs/rehearsal"), help="everything goes here")
    p.add_argument("--minutes", type=float, default=4.0, help="training budget (train.max_minutes)")
    p.add_argument(
        "--kill-after", type=int, default=2, help="SIGTERM the first training run after this update"
    )
    model_help = (
        "model overrides for the CPU (repeatable; default: 3+3 layers, d_model 256, d_ff 1024, 4 heads)"
    )
    p.add_argument("--model-set", action="append", help=model_help)
    set_help = "a recipe override for every nmt command, e.g. data.vocab_size=500 for a tiny corpus"
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help=set_help)
    p.add_argument("--skip-train", action="store_true", help="generate and preprocess only")
    p.add_argument("--keep-corpus", action="store_true", help="reuse the mirror folder if already written")
    p.add_argument("--quiet", action="store_true", help="do not echo the subprocesses' output")
    p.add_argument("--record", action="store_true", help="append the figures to benchmarks/RESULTS.md")
    p.add_argument("--results", type=Path, default=RESULTS, help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true", help="print the figures as JSON on stdout")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.model_set is None:
        args.model_set = [
            f"model.{k}" for k in "encoder_layers=3 decoder_layers=3 d_model=256 d_ff=1024 heads=4".split()
        ]
    work = args.workdir.resolve()
    mirror, run = work / "mirror", work / "run"
    work.mkdir(parents=True, exist_ok=True)
    corpus_file = mirror / "corpus.json"
    if args.keep_corpus and corpus_file.exists():
        corpus = json.loads(corpus_file.read_text(encoding="utf-8"))
    else:
        print(f"corpus: writing {args.pairs:,} pairs to {mirror}", file=sys.stderr)
        start = time.monotonic()
        corpus = write_corpus(mirror, args.pairs)
        corpus["seconds"] = time.monotonic() - start
        corpus["bytes"] = sum((mirror / c.archive).stat().st_blocks * 512 for c in CORPORA)
        corpus_file.write_text(json.dumps(corpus, indent=2), encoding="utf-8")
    if corpus["pairs"] and sum(corpus["pairs"].values()) != args.pairs:
        raise SystemExit(f"{mirror} holds another corpus size; run without --keep-corpus")
    if run.exists():
        import shutil

        shutil.rmtree(run)
    run.mkdir()
    recipe = run / "recipe.yaml"
    write_recipe(recipe, corpus["sha256"])
    print(f"preprocess: {recipe}", file=sys.stderr)
    steps, whole = run_preprocess(run, recipe, mirror, corpus["md5"], args.set, quiet=args.quiet)
    stats = json.loads((run / "data" / "stats.json").read_text(encoding="utf-8"))["train"]
    result = {
        "pairs": args.pairs,
        "corpus": corpus,
        "preprocess": {
            "seconds": whole.seconds,
            "peak_rss": whole.peak_rss,
            "cpu_seconds": whole.cpu_seconds,
        },
        "steps": preprocess_rows(steps, args.pairs),
        "step_figures": [vars(s) for s in steps],
        "stats": stats,
        "load": os.getloadavg()[0],
        "extrapolation": extrapolation(steps, args.pairs, whole),
        "command_preprocess": shlex.join(
            ["nmt", "preprocess", str(recipe), "--workdir", str(run), "--mirror", str(mirror)]
            + [f"--set={o}" for o in args.set]
        ),
    }
    if not args.skip_train:
        print("train: torchrun, 2 processes, gloo", file=sys.stderr)
        result["train"] = train_part(args, run, recipe)
    body = report(result)
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        print(body)
    if args.record:
        head = (
            f"### {common.now()}: {args.pairs:,} pairs{'' if args.skip_train else ', trained'}\n\n"
            f"- machine: {common.machine_name('cpu')}, {os.cpu_count()} cores,"
            f" load average {os.getloadavg()[0]:.1f} at the end, torch {torch.__version__}\n"
            f"- command: `{common.command_line(__file__, argv)}`\n"
            f"- preprocessing as run: `{result['command_preprocess']}`\n"
        )
        common.record(head + body + "\n", SECTION, args.results)
    if "train" in result and not (result["train"]["resumed"]):
        print("the second training run did not resume", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_nmt":
        _nmt(sys.argv[2:])
    else:
        sys.exit(main())
