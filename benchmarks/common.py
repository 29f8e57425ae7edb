"""What the benchmarks share: synthetic text and lengths, random-weight models, peak memory, RESULTS.md.

Imported as `common` (benchmarks/ is on sys.path): benchmarks/README.md.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import platform
import random
import re
import resource
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from nmt.atomic import write_text
from nmt.config import load_config

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
MIB, GIB = 1 << 20, 1 << 30
CPU_FLAGS = {"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile"}  # named beside every CPU figure
ISA_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "CT2_FORCE_CPU_ISA")  # kernels forced to an older ISA

# ---------------------------------------------------------------------------------------------------------
# Synthetic lengths and text


@dataclass(frozen=True)
class LengthModel:
    """Sentence lengths (words or subwords, without EOS/BOS), log-normal (benchmarks/README.md)."""

    mean: float
    sigma: float
    ratio: float = 1.0
    noise: float = 0.0
    max_len: int = 250

    @classmethod
    def from_sd(cls, mean: float, sd: float, **kwargs) -> LengthModel:
        """The log-normal with this mean and standard deviation."""
        return cls(mean, math.sqrt(math.log(1 + (sd / mean) ** 2)), **kwargs)

    def sources(self, n: int, g: torch.Generator) -> Tensor:
        """(n,) int64 source lengths."""
        mu = math.log(self.mean) - self.sigma**2 / 2  # E[LogNormal(mu, sigma)] = exp(mu + sigma^2 / 2)
        x = torch.exp(mu + self.sigma * torch.randn(n, generator=g, dtype=torch.float64))
        return x.round().clamp(1, self.max_len).to(torch.int64)

    def ratios(self, n: int, g: torch.Generator) -> Tensor:
        """(n,) float64 target/source length ratios."""
        return self.ratio * torch.exp(self.noise * torch.randn(n, generator=g, dtype=torch.float64))

    def pairs(self, n: int, seed: int = 0) -> tuple[Tensor, Tensor]:
        """(source, target) lengths of n pairs, int64 (n,) each."""
        g = torch.Generator().manual_seed(seed)
        src = self.sources(n, g)
        tgt = (src * self.ratios(n, g)).round().clamp(1, self.max_len).to(torch.int64)
        return src, tgt


# WMT14 en-de with a ~37k joint BPE: about 27 source subwords a sentence with a long tail, German about
# 10% longer; lengths to 250 (the recipes' clean-corpus limit).
WMT_LENGTHS = LengthModel(mean=27.0, sigma=0.6, ratio=1.1, noise=0.15)
# Measured on Multi30k en-de preprocessed with the 8k recipe: mean 14.3 / 14.8 subwords, log-sd 0.32,
# target/source ratio 1.04 with log-sd 0.18, longest 48 / 52.
MULTI30K_LENGTHS = LengthModel(mean=14.3, sigma=0.32, ratio=1.04, noise=0.18, max_len=60)
NEWSTEST_WORDS = LengthModel.from_sd(25.0, 14.0, max_len=120)


class Zipf:
    """Ranks 0..n-1 drawn with p(r) ~ 1 / (r + q)^s (Zipf-Mandelbrot; s = 1, q = 1 is Zipf's law)."""

    def __init__(self, n: int, s: float = 1.0, q: float = 1.0):
        weights = 1.0 / (torch.arange(n, dtype=torch.float64) + q) ** s
        self.n, self.cdf = n, torch.cumsum(weights / weights.sum(), 0)
        self.cdf[-1] = 1.0

    def draw(self, k: int, g: torch.Generator) -> Tensor:
        """(k,) int64 ranks."""
        u = torch.rand(k, generator=g, dtype=torch.float64)
        return torch.searchsorted(self.cdf, u).clamp_(max=self.n - 1)


# English-like spelling: onsets, nuclei, codas, suffixes
SPELLING = (
    "b c d f g h l m n p r s t w th sh ch st br tr pl gr wh cr fl".split() + [""] * 4,
    "a e i o u ea ou ai ee oo y ie".split(),
    "n r s t l nd ng st ck ght rd ll m p".split() + [""] * 14,
    ["", "", "", "s", "ed", "ing", "ly", "er", "tion", "ness", "ment", "able"],
)


def make_words(n: int, seed: int) -> list[str]:
    """n distinct made-up English-like words, in rank order: frequent words are short."""
    onsets, nuclei, codas, suffixes = SPELLING
    rng = random.Random(seed)
    words: dict[str, None] = {}  # in insertion order, without repeats
    while len(words) < n:
        # syllables grow with the rank, as frequent words are short (Zipf's law of abbreviation)
        rank = len(words)
        pick = [rng.getrandbits(30) for _ in range(3 * 4 + 3)]
        syllables = 1 + int(math.log10(rank + 1) * 0.3 + 0.6 * pick[-3] / (1 << 30))
        word = "".join(
            onsets[pick[3 * i] % len(onsets)]
            + nuclei[pick[3 * i + 1] % len(nuclei)]
            + codas[pick[3 * i + 2] % len(codas)]
            for i in range(syllables)
        )
        if rank > 1000:
            word += suffixes[pick[-1] % len(suffixes)]
        if word:
            words.setdefault(word)
    return list(words)


class SyntheticText:
    """Sentences of made-up English-like words; word frequencies follow Zipf's law (~ 1 / rank)."""

    def __init__(self, seed: int = 0, vocabulary: int = 6000):
        self.g = torch.Generator().manual_seed(seed)
        self.words, self.zipf = make_words(vocabulary, seed), Zipf(vocabulary)

    def sentences(self, lengths: Sequence[int]) -> list[str]:
        ids = iter(self.zipf.draw(sum(lengths), self.g).tolist())
        words = self.words
        return [" ".join(words[next(ids)] for _ in range(n)).capitalize() + "." for n in lengths]

    def lines(self, n: int, lengths: LengthModel) -> list[str]:
        """n sentences with word counts drawn from `lengths`."""
        return self.sentences(lengths.sources(n, self.g).tolist())


class SyntheticPairs:
    """Pairs with given lengths and random ids, as nmt.data.binarized.ParallelData for batching; each pair a
    window into one shared buffer, so a large pool costs no memory."""

    BUFFER = 1 << 16

    def __init__(self, src_lens: Tensor, tgt_lens: Tensor, vocab: int, seed: int = 0):
        self.src_lens, self.tgt_lens = src_lens, tgt_lens
        g = torch.Generator().manual_seed(seed)
        self.src_ids = self.tgt_ids = torch.randint(4, vocab, (self.BUFFER,), generator=g)  # above specials
        i = torch.arange(len(src_lens))
        longest = int(torch.maximum(src_lens, tgt_lens).max()) if len(i) else 0
        self.src_offsets = (2 * i * 7919) % (self.BUFFER - longest)  # (N,) where each window starts
        self.tgt_offsets = ((2 * i + 1) * 7919) % (self.BUFFER - longest)

    def __len__(self) -> int:
        return len(self.src_lens)


# ---------------------------------------------------------------------------------------------------------
# Random-weight models


def random_model(workdir: Path, recipe: str = "multi30k-en-de", overrides: Sequence[str] = ()) -> Path:
    """The recipe's model (with `overrides`) with random weights and its subwords trained by nmt on
    synthetic text, with the recipe's exact parameter count (benchmarks/README.md)."""
    from nmt.subword import Subword, train_subword
    from nmt.untrained import save_random_model

    cfg = load_config(recipe, list(overrides))
    corpus = workdir / "spm-train.txt"
    words = 6000 if cfg.data.vocab_size <= 8000 else cfg.data.vocab_size * 11 // 10
    text = SyntheticText(seed=1, vocabulary=words)
    corpus.write_text("\n".join(text.lines(max(20000, words), LengthModel.from_sd(12.0, 6.0))) + "\n")
    subword = Subword.load(train_subword([corpus], workdir / "spm", cfg.data))
    return save_random_model(workdir / "random.pt", cfg, subword)


# ---------------------------------------------------------------------------------------------------------
# Peak memory


def max_rss() -> int:
    """This process's resident-set high-water mark, bytes: VmHWM where there is /proc, as ru_maxrss
    survives exec (a worker would report its parent's size; benchmarks/README.md)."""
    with contextlib.suppress(OSError, TypeError), open("/proc/self/status", encoding="ascii") as f:
        return int(re.search(r"^VmHWM:\s+(\d+) kB", f.read(), re.M)[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


# ---------------------------------------------------------------------------------------------------------
# benchmarks/RESULTS.md: every benchmark appends dated entries to its own section of it


def machine_name(device: str) -> str:
    """The GPU's name, or the CPU's model name with the flags that pick kernels (CPU_FLAGS) and any
    instruction set forced through the environment (`ATEN_CPU_CAPABILITY=avx2`, ...)."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = re.search(r"^model name\s*:\s*(.+)$", info, re.M)
    forced = [f"{k}={os.environ[k]}" for k in ISA_ENV if k in os.environ]
    features = " ".join(sorted(set(info.split()) & CPU_FLAGS) + forced)
    return f"{name[1].strip() if name else platform.processor() or platform.machine()} ({features})"


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def command_line(script: str, argv: Sequence[str] | None) -> str:
    """The command that reproduces this run (argv None: this process's own arguments)."""
    args = sys.argv[1:] if argv is None else argv
    return shlex.join(["python", f"benchmarks/{Path(script).name}", *args])


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def record(entry: str, section: str, path: Path = RESULTS) -> None:
    """Append `entry` at the end of `section` (a `## ` heading), leaving every other section as it is."""
    text = path.read_text(encoding="utf-8") if path.exists() else "# Benchmark results\n"
    if section not in text:
        text = text.rstrip("\n") + f"\n\n{section}\n\n"
    start = text.index(section) + len(section)
    end = text.find("\n## ", start)
    end = len(text) if end < 0 else end + 1
    head, tail = text[:end].rstrip("\n") + "\n\n", text[end:]
    write_text(path, head + entry.rstrip("\n") + "\n" + ("\n" + tail if tail else ""))
