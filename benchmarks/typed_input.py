"""Input as people type it: BLEU of one model on a test set in ALL CAPS, Title Case and without final
punctuation, beside its BLEU on the test set as written (issue 43).

    python benchmarks/typed_input.py -m runs/multi30k-en-de/checkpoints/average.pt \\
        --src runs/multi30k-en-de/data/test/test_2016_flickr.en \\
        --ref runs/multi30k-en-de/data/test/test_2016_flickr.de --out runs/typed-input [--record]

Writes each variant's source, reference and translation to --out (<variant>.src|ref|hyp), translates
with `nmt translate` (the model's own decode settings unless --beam is given), scores with sacrebleu and
prints a table. Method: benchmarks/README.md, Input as people type it.
"""

from __future__ import annotations

import argparse
import functools
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import sacrebleu
from common import RESULTS, command_line, markdown_table, now, record

from nmt import atomic
from nmt.data.augment import strip_end_punct, title_case

SECTION = "## Input as people type it"


@dataclass(frozen=True)
class Variant:
    name: str
    src: str  # how the source is typed
    ref: str  # what it is scored against
    lowercase: bool  # case-insensitive BLEU
    baseline: str  # the variant whose BLEU it is compared with
    goal: float  # the share of the baseline's BLEU that issue 43 asks for


VARIANTS = (
    Variant("as written", "as written", "as written", False, "as written", 1.0),
    Variant("as written, any case", "as written", "as written", True, "as written, any case", 1.0),
    Variant("ALL CAPS", "upper-cased", "upper-cased", False, "as written", 0.85),
    Variant("Title Case", "title-cased", "as written", True, "as written, any case", 0.90),
    Variant("no final punctuation", "final punctuation removed", "as written", False, "as written", 1.0),
)
TYPED = {
    "as written": lambda line: line,
    "upper-cased": str.upper,
    "title-cased": title_case,
    "final punctuation removed": lambda line: strip_end_punct(line) or line,
}


def translate(model: Path, src: Path, hyp: Path, beam: int | None, extra: tuple[str, ...] = ()) -> None:
    cmd = [sys.executable, "-m", "nmt", "translate", "-m", str(model), "-i", str(src), "-o", str(hyp)]
    cmd += ["--beam", str(beam)] if beam is not None else []
    cmd += extra
    done = subprocess.run(cmd, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        sys.exit(f"nmt translate failed on {src}: {done.stderr.strip().splitlines()[-1:]}")


def measure(
    model: Path, src: Path, ref: Path, out: Path, beam: int | None = None, translate=translate
) -> list[dict]:
    """One row per variant: its BLEU and that BLEU as a share of its baseline's. `translate(model, src,
    hyp, beam)` writes the translations of the file `src` to `hyp`."""
    sources = src.read_text(encoding="utf-8").splitlines()
    references = ref.read_text(encoding="utf-8").splitlines()
    if len(sources) != len(references):
        sys.exit(f"{src} has {len(sources)} lines but {ref} has {len(references)}")
    hyps: dict[str, list[str]] = {}  # by how the source was typed: each is translated once
    for typed in dict.fromkeys(v.src for v in VARIANTS):
        name = typed.replace(" ", "-")
        atomic.write_text(out / f"{name}.src", "".join(TYPED[typed](s) + "\n" for s in sources))
        translate(model, out / f"{name}.src", out / f"{name}.hyp", beam)
        hyps[typed] = (out / f"{name}.hyp").read_text(encoding="utf-8").splitlines()
    rows, bleu = [], {}
    for v in VARIANTS:
        refs = [TYPED[v.ref](r) for r in references]
        if v.ref != "as written":
            atomic.write_text(out / f"{v.ref.replace(' ', '-')}.ref", "".join(r + "\n" for r in refs))
        bleu[v.name] = sacrebleu.corpus_bleu(hyps[v.src], [refs], lowercase=v.lowercase).score
        base = bleu[v.baseline]
        share = bleu[v.name] / base if base > 0 else 0.0
        rows.append(
            {
                "variant": v.name,
                "bleu": bleu[v.name],
                "share": share,
                "goal": v.goal,
                "lowercase": v.lowercase,
            }
        )
    return rows


def table(rows: list[dict]) -> list[str]:
    return markdown_table(
        ["input", "BLEU", "scored", "of its baseline", "goal"],
        [
            [
                r["variant"],
                f"{r['bleu']:.2f}",
                "case-insensitive" if r["lowercase"] else "cased",
                f"{100 * r['share']:.1f}%",
                f"{100 * r['goal']:.0f}%" if r["goal"] < 1 else "",
            ]
            for r in rows
        ],
    )


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", type=Path, required=True, help="checkpoint (nmt train / nmt average)")
    p.add_argument("--src", type=Path, required=True, help="the test set's source, one sentence a line")
    p.add_argument("--ref", type=Path, required=True, help="its reference translations")
    p.add_argument("--out", type=Path, required=True, help="folder for the variants and translations")
    p.add_argument("--beam", type=int, default=None, help="beam size; default: the model's")
    p.add_argument(
        "--recase", action=argparse.BooleanOptionalAction, default=None,
        help="nmt translate --recase (or --no-recase); default: the model's decode.recase",
    )  # fmt: skip
    p.add_argument("--record", action="store_true", help=f"append the table to {RESULTS.name}")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    extra = () if args.recase is None else ("--recase",) if args.recase else ("--no-recase",)
    run = functools.partial(translate, extra=extra)
    rows = measure(args.model, args.src, args.ref, args.out, args.beam, run)
    lines = table(rows)
    print("\n".join(lines))
    if args.record:
        command = command_line("benchmarks/typed_input.py", argv)
        record(f"### {now()}: {args.model}\n\n`{command}`\n\n" + "\n".join(lines) + "\n", SECTION)
    return rows


if __name__ == "__main__":
    main()
