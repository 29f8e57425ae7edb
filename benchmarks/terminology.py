"""Glossaries: how well constrained decoding obeys terms, what it does to quality, and what it costs.

    NMT_DATA_MIRROR=../shared/data/multi30k python benchmarks/terminology.py --model average.pt --record

Terms come from the data: a word lexicon of Multi30k train by Dice co-occurrence (source and target words
of 4+ letters seen 20+ times, Dice >= 0.3, each target word used once), applied to each test_2016_flickr
line whose source has the source word and whose reference has the target word (one term a line, its
rarest). Figures on those lines: the term-use rate (outputs holding the target word as often as it
matched), duplicated terms, BLEU and chrF against the references of constrained and unconstrained decoding,
and the other lines' outputs the same bytes as without a glossary. Speed: sentences/s of the whole test set
at beam 4 with 0%, 10% and 100% of its lines constrained (the first lines with a term, then lines given a
term of their own: the target of the lexicon's entry for one of their words), the median of --repeats.
"""

from __future__ import annotations

import argparse
import gzip
import os
import re
import statistics
import time
from collections import Counter
from pathlib import Path

import common
import torch
from sacrebleu.metrics import BLEU, CHRF

from nmt.checkpoint import load_model
from nmt.translate import Translator
from nmt.translate.terminology import Glossary, Terminology, entry

WORD = re.compile(r"\w{4,}")
FLAGS = {"avx2", "avx512f", "avx512_bf16", "amx_tile"}


def words(line: str) -> set[str]:
    return set(WORD.findall(line.lower()))


def lexicon(src: list[str], tgt: list[str], min_count: int = 20, min_dice: float = 0.3) -> dict[str, str]:
    cs, ct, pair, surface = Counter(), Counter(), Counter(), Counter()
    for s, t in zip(src, tgt, strict=True):
        ws, wt = words(s), words(t)
        cs.update(ws), ct.update(wt), pair.update((a, b) for a in ws for b in wt)
        surface.update(WORD.findall(t.partition(" ")[2]))  # not the first word: capitalised anyway
    dice = {(a, b): 2 * n / (cs[a] + ct[b]) for (a, b), n in pair.items() if n >= min_count}
    out, used = {}, set()
    for (a, b), d in sorted(dice.items(), key=lambda x: -x[1]):
        if d >= min_dice and a not in out and b not in used:
            out[a], used = b, used | {b}
    written = {}  # each target word as it is most often written (German nouns capitalised)
    for w, _ in surface.most_common():
        written.setdefault(w.lower(), w)
    return {a: written.get(b, b) for a, b in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--lines", type=int, default=0, help="the first N test lines only (0: all)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    mirror = Path(os.environ["NMT_DATA_MIRROR"])

    def read(name: str) -> list[str]:
        return gzip.open(mirror / name, "rt", encoding="utf-8").read().rstrip("\n").split("\n")

    lex = lexicon(read("train.en.gz"), read("train.de.gz"))
    src, ref = read("test_2016_flickr.en.gz"), read("test_2016_flickr.de.gz")
    src, ref = (src[: args.lines], ref[: args.lines]) if args.lines else (src, ref)
    model, sub, cfg = load_model(args.model)
    decode = cfg.decode.__class__(**{**cfg.decode.__dict__, "beam": 4})
    plain = Translator(model, sub, decode, torch.device("cpu"))
    terms, own = {}, {}  # line -> (source, target): with the reference's word, and any word's entry
    for i, (s, r) in enumerate(zip(src, ref, strict=True)):
        found = sorted((a for a in words(s) if a in lex), key=lambda a: -len(a))
        if found:
            own[i] = (found[0], lex[found[0]])
        if hits := [a for a in found if lex[a].lower() in words(r)]:
            terms[i] = (hits[0], lex[hits[0]])

    plain.terminology = Terminology(sub, model.max_positions)  # a request's glossary adds to it
    sources = plain.encode(src).sources

    def constraints(chosen: dict[int, tuple[str, str]]) -> dict:
        """Each chosen line under a glossary of its own term."""
        out = {}
        for i, (a, b) in chosen.items():
            out |= plain.terminology.apply({i: src[i]}, Glossary([entry(a, b, f"line {i + 1}")]))
        return out

    def run(cons: dict) -> list[str]:
        return [h[0][0] for h in plain.search_sources(len(src), sources, constraints=cons or None)]

    base, out = run({}), run(constraints(terms))
    rows, keep = sorted(terms), [i for i in range(len(src)) if i not in terms]

    def uses(hyps: list[str]) -> list[tuple[int, int]]:
        """(times the target word appears, times its source term matched) per line with a term."""
        return [
            (
                # as written, ending a word (its start may be glued: the term's form without the word-start
                # marker), or capitalised as the line's first word
                len(re.findall(rf"{re.escape(terms[i][1])}(?!\w)", hyps[i]))
                + (
                    terms[i][1] != (cap := terms[i][1][:1].upper() + terms[i][1][1:])
                    and bool(re.match(rf"{re.escape(cap)}(?!\w)", hyps[i]))
                ),
                len(Glossary([entry(*terms[i], "")]).matches(src[i])),
            )
            for i in rows
        ]

    counts, before = uses(out), uses(base)

    def score(hyps: list[str]) -> str:
        refs = [[ref[i] for i in rows]]
        return f"{BLEU().corpus_score(hyps, refs).score:.2f} / {CHRF().corpus_score(hyps, refs).score:.2f}"

    quality = [
        ("lines with a term", f"{len(rows)} of {len(src)} ({len(lex)} lexicon entries)"),
        ("term-use rate unconstrained", f"{sum(got >= want for got, want in before) / len(rows):.1%}"),
        ("term-use rate", f"{sum(got >= want for got, want in counts) / len(rows):.1%}"),
        ("duplicated terms", str(sum(got > want for got, want in counts))),
        ("BLEU / chrF unconstrained", score([base[i] for i in rows])),
        ("BLEU / chrF constrained", score([out[i] for i in rows])),
        ("other lines byte-identical", f"{sum(out[i] == base[i] for i in keep)} of {len(keep)}"),
    ]
    every = {**own, **terms}
    speed = []
    for share in (0.0, 0.1, 1.0):
        cons = constraints(dict(list(every.items())[: round(share * len(src))]))
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            run(cons)
            times.append(time.perf_counter() - start)
        speed.append((f"{share:.0%} ({len(cons)} lines)", len(src) / statistics.median(times)))
    speed = [(name, f"{rate:.1f}", f"{rate / speed[0][1]:.2f}x") for name, rate in speed]
    flags = " ".join(sorted(set(Path("/proc/cpuinfo").read_text().split()) & FLAGS))
    load = f"load {os.getloadavg()[0]:.2f}"
    head = f"{common.now()}, {common.machine_name('cpu')} ({flags}), {args.threads} threads, {load}"
    entry_text = "\n".join(
        [
            f"### {head}",
            "",
            f"`{common.command_line(__file__, None)}`; model {args.model.name}, beam 4, test_2016_flickr.",
            "",
            *common.markdown_table(["figure", "value"], quality),
            "",
            *common.markdown_table(["lines constrained", "sentences/s", "vs none"], speed),
        ]
    )
    print(entry_text)
    if args.record:
        common.record(entry_text, "## Terminology")


if __name__ == "__main__":
    main()
