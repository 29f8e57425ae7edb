"""Translation speed: nmt's PyTorch engine and CTranslate2, side by side on one model and one input.

Target subwords/s, sentences/s, latency, peak RSS and agreement per engine, over --model, --input, --beam,
--shortlist, --refs, --threads, --device, --repeats; --terminology measures glossaries, --glossary-entries
the time to read a large one. Engines, method and
figures: benchmarks/README.md, Translation speed and Terminology.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gzip
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import common  # benchmarks/common.py: these scripts run with benchmarks/ on sys.path
import sacrebleu
from common import MIB, NEWSTEST_WORDS, RESULTS, SyntheticText, max_rss, random_model

SECTION = "## Translation speed"
CPU_ENGINES = [("nmt", "fp32"), ("nmt", "int8"), ("ctranslate2", "float32"), ("ctranslate2", "int8")]
GPU_ENGINES = [("nmt", "bf16"), ("ctranslate2", "float16"), ("ctranslate2", "bfloat16")]
# --isa: the instruction sets a CPU engine can be held to, newest first, each with the /proc/cpuinfo flag
# that says the CPU has it and the environment that holds torch's (ATen, oneDNN) and CTranslate2's kernels
# to it. "native" is whatever the CPU has, AMX included (reachable_isas decides when it is worth a table).
ISAS = {
    "native": ("", {}),
    "avx512_core_vnni": (
        "avx512_vnni",
        {
            "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI",
            "ATEN_CPU_CAPABILITY": "avx512",
            "CT2_FORCE_CPU_ISA": "AVX512",
        },
    ),
    "avx512_core": (
        "avx512f",
        {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "ATEN_CPU_CAPABILITY": "avx512", "CT2_FORCE_CPU_ISA": "AVX512"},
    ),
    "avx2": (
        "avx2",
        {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "CT2_FORCE_CPU_ISA": "AVX2"},
    ),
}


def reachable_isas() -> list[str]:
    """--isa all: each of ISAS this CPU has, newest first; `native` only where it is more than AVX2."""
    flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
    found = [name for name, (flag, _) in ISAS.items() if flag in flags]
    return (["native"] if flags & {"amx_tile", "avx512f"} else []) + found


def worker() -> None:
    """Load one engine, then answer commands on stdin (run, latency, quit) with one JSON line each."""
    job = json.loads(sys.stdin.readline())
    from nmt.config import DecodeConfig, Precision

    decode = DecodeConfig(**{**job["decode"], "shortlist": job["shortlist"]})
    if job["engine"] == "nmt":
        import torch

        from nmt.checkpoint import load_model
        from nmt.shortlist import load_shortlist
        from nmt.translate import Translator, inference_model

        torch.set_num_threads(job["threads"])
        rss_imports = max_rss()
        device = torch.device(job["device"])
        model, subword, _ = load_model(Path(job["checkpoint"]), device)
        shortlist = load_shortlist(Path(job["checkpoint"])) if job["shortlist"] else None
        model = inference_model(model, Precision(job["compute"]), device)
        translator = Translator(model, subword, decode, device, shortlist=shortlist)
    else:
        from nmt.translate import ctranslate2_translator

        rss_imports = max_rss()
        translator = ctranslate2_translator(
            Path(job["ct2_dir"]), decode, job["device"], job["compute"], job["threads"]
        )
        subword = translator.subword
    lines, latency_lines = job["lines"], job["latency_lines"]
    translator.translate(lines[:16])  # warm-up: allocators, kernels' first calls
    send({"rss_imports": rss_imports, "rss_loaded": max_rss()})
    for command in sys.stdin:
        command = command.strip()
        if command == "run":
            start = time.perf_counter()
            out = translator.translate(lines)
            seconds = time.perf_counter() - start
            tokens = sum(len(ids) for ids in subword.encode(out))
            send({"seconds": seconds, "target_tokens": tokens, "sentences": len(lines), "outputs": out})
        elif command == "latency":
            times = []
            for line in latency_lines:
                start = time.perf_counter()
                translator.translate([line])
                times.append(time.perf_counter() - start)
            send({"latency": times})
        else:
            send({"rss_peak": max_rss()})
            return


def send(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


class WorkerDied(SystemExit):
    """An engine's process ended before answering (its error is on stderr above)."""


class Worker:
    """The parent's handle on one engine's process."""

    def __init__(self, engine: str, compute: str, job: dict):
        self.name = f"{job['label']}{'nmt' if engine == 'nmt' else 'CTranslate2'} {compute}"
        self.name += " +shortlist" if job["shortlist"] else ""
        cmd = [sys.executable, __file__, "--worker"]
        env = {**os.environ, "OMP_NUM_THREADS": str(job["threads"]), "PYTHONUNBUFFERED": "1"}
        env.update(ISAS[job["isa"]][1])  # the kernels held to an instruction set (--isa)
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.ready = self.ask(json.dumps({**job, "engine": engine, "compute": compute}))  # after loading
        self.runs: list[dict] = []

    def ask(self, line: str) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline()
        if not reply:
            raise WorkerDied(f"the {self.name} worker died (exit status {self.proc.wait()})")
        return json.loads(reply)


@dataclass
class Result:
    name: str
    tokens_per_s: float  # median over repetitions
    sentences_per_s: float
    ratios: list[float]  # nmt time / this engine's time, per repetition
    latency_ms: float | None  # median, one sentence at a time; None with --latency-lines 0
    rss_peak: int
    rss_over_imports: int
    same_as_nmt: float  # fraction of lines
    bleu: float | None = None  # with --refs
    chrf: float | None = None


def measure(job: dict, engines: list[tuple[str, str, bool]], repeats: int, refs: list | None) -> list[Result]:
    # Started one after another, each waited for: loading is not timed, and would share the CPU. An engine
    # that cannot load here (CTranslate2 refuses bfloat16 on most CPUs) is left out and the others run;
    # the first is the one the others are compared with, so it has to load.
    workers = []
    for engine, compute, sl in engines:
        try:
            workers.append(Worker(engine, compute, {**job, "shortlist": sl}))
        except WorkerDied as died:
            if not workers:
                raise
            print(f"{died}: left out of the table", file=sys.stderr)
    for rep in range(repeats):
        for w in workers[rep % len(workers) :] + workers[: rep % len(workers)]:
            w.runs.append(w.ask("run"))
            seconds = w.runs[-1]["seconds"]
            print(f"repetition {rep + 1}/{repeats}: {w.name:22s} {seconds:7.2f} s", file=sys.stderr)
    latencies = {w.name: w.ask("latency")["latency"] if job["latency_lines"] else [] for w in workers}
    peaks = {w.name: w.ask("quit")["rss_peak"] for w in workers}
    for w in workers:
        w.proc.wait()

    base = workers[0]
    results = []
    for w in workers:
        outputs = w.runs[0]["outputs"]
        same = sum(a == b for a, b in zip(outputs, base.runs[0]["outputs"], strict=True)) / len(outputs)
        results.append(
            Result(
                name=w.name,
                tokens_per_s=statistics.median(r["target_tokens"] / r["seconds"] for r in w.runs),
                sentences_per_s=statistics.median(r["sentences"] / r["seconds"] for r in w.runs),
                ratios=[b["seconds"] / r["seconds"] for b, r in zip(base.runs, w.runs, strict=True)],
                latency_ms=1000 * statistics.median(latencies[w.name]) if latencies[w.name] else None,
                rss_peak=peaks[w.name],
                rss_over_imports=peaks[w.name] - w.ready["rss_imports"],
                same_as_nmt=same,
                bleu=sacrebleu.corpus_bleu(outputs, [refs]).score if refs else None,
                chrf=sacrebleu.corpus_chrf(outputs, [refs]).score if refs else None,
            )
        )
    return results


def table_rows(results: list[Result]) -> list[list[str]]:
    rows = []
    for r in results:
        speeds = f"{r.tokens_per_s:,.0f}", f"{r.sentences_per_s:,.1f}"
        speedup = f"{statistics.median(r.ratios):.2f} ({min(r.ratios):.2f}-{max(r.ratios):.2f})"
        rss = f"{r.rss_peak / MIB:,.0f}", f"{r.rss_over_imports / MIB:,.0f}"
        quality = ["n/a" if q is None else f"{q:.2f}" for q in (r.bleu, r.chrf)]
        latency = "n/a" if r.latency_ms is None else f"{r.latency_ms:,.1f}"
        rows.append([r.name, *speeds, speedup, latency, *rss, f"{r.same_as_nmt:.1%}", *quality])
    return rows


HEADER = ["engine", "tgt tok/s", "sent/s", "speed-up (min-max)", "latency ms", "RSS MiB", "Δ MiB", "same"]
HEADER += ["BLEU", "chrF"]  # with --refs


def record_entry(results: list[Result], about: dict) -> str:
    lines = [f"### {common.now()}: {about['model']}, {about['device']}", ""]
    lines.append(f"- machine: {about['machine']}, threads: {about['threads']}; torch {about['torch']}, "
                 f"ctranslate2 {about['ctranslate2']}")  # fmt: skip
    lines += [f"- command: `{about['command']}`", f"- model: {about['model_detail']}"]
    lines += [f"- input: {about['input']}", f"- decoding: {about['decoding']}"]
    lines.append(f"- {about['repeats']} repetitions, round-robin; latency: {about['latency_lines']} lines "
                 "one at a time; speed-up and latency are medians")  # fmt: skip
    return "\n".join([*lines, "", *common.markdown_table(HEADER, table_rows(results)), ""])


def tree_memory(pid: int) -> list[int]:
    """RSS and PSS of a process and its children, bytes: PSS divides the pages the workers share."""
    pids = [pid, *map(int, Path(f"/proc/{pid}/task/{pid}/children").read_text().split())]
    rollups = "".join(Path(f"/proc/{p}/smaps_rollup").read_text() for p in pids)
    return [1024 * sum(map(int, re.findall(rf"^{key}:\s+(\d+)", rollups, re.M))) for key in ("Rss", "Pss")]


def processes(args, job: dict, beam: int, work: Path, lines: list[str]) -> list[list[str]]:
    """--workers N: whole `nmt translate` commands, one process of --threads threads against N workers
    sharing them, both engines (CTranslate2's workers: inter_threads): lines/s as the command reports it
    (loading left out), the command's seconds, the peak RSS and PSS of its process tree."""
    (work / "in.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    runs: dict = {(engine, w): [] for engine in ("torch", "ctranslate2") for w in (1, args.workers)}
    for (e, w), rep in [(setting, rep) for rep in range(args.repeats) for setting in runs]:
        model = job["checkpoint" if e == "torch" else "ct2_dir"]
        cmd = [sys.executable, "-m", "nmt", "translate", "-m", model, "-i", work / "in.txt", "-o",
               work / f"{e}{w}", "--engine", e, "--dtype", "fp32", "--beam", str(beam),
               "--workers", str(w)]  # fmt: skip
        start, peak, env = time.perf_counter(), [0, 0], {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
        while proc.poll() is None:
            with contextlib.suppress(OSError):  # a process that ended between the listing and the reading
                peak = [max(a, b) for a, b in zip(peak, tree_memory(proc.pid), strict=True)]
            time.sleep(0.02)
        wall, stderr = time.perf_counter() - start, proc.stderr.read()
        found = re.search(r"translated (\d+) lines in ([\d.]+) s", stderr)
        assert proc.returncode == 0 and found, stderr
        runs[e, w].append((int(found[1]) / float(found[2]), wall, *peak))
        print(f"repetition {rep + 1}: {e} --workers {w}: {runs[e, w][-1]}", file=sys.stderr)
    return [[f"{'nmt' if e == 'torch' else 'CTranslate2'} {w} x {args.threads // w}",
             *(f"{statistics.median(r[k] for r in rs):,.1f}" for k in (0, 1)),
             *(f"{max(r[k] for r in rs) / MIB:,.0f}" for k in (2, 3)),
             str((work / f"{e}{w}").read_bytes() == (work / f"{e}1").read_bytes())]
            for (e, w), rs in runs.items()]  # fmt: skip


# ---------------------------------------------------------------------------------------------------------
# --terminology: glossaries' term-use rate, quality and cost


def words(line: str) -> set[str]:
    """The words of 4 letters or more of a line, lower-cased: what the lexicon pairs."""
    from nmt.data.terms import lexicon_words

    return lexicon_words(line)


def terminology(args: argparse.Namespace, argv: list[str] | None) -> None:
    import torch

    from nmt.checkpoint import load_model
    from nmt.data.terms import lexicon
    from nmt.translate import Translator
    from nmt.translate.align import Aligner
    from nmt.translate.terminology import Glossary, Terminology, entry

    torch.set_num_threads(args.threads)
    mirror = Path(os.environ["NMT_DATA_MIRROR"])

    def read(name: str) -> list[str]:
        return gzip.open(mirror / name, "rt", encoding="utf-8").read().rstrip("\n").split("\n")

    lex = lexicon(zip(read("train.en.gz"), read("train.de.gz"), strict=True))
    src, ref = read("test_2016_flickr.en.gz"), read("test_2016_flickr.de.gz")
    src, ref = (src[: args.lines], ref[: args.lines]) if args.lines else (src, ref)
    model, sub, cfg = load_model(args.model[0])
    terminology = Terminology(sub, model.max_positions)  # a request's glossary adds to it
    plain = Translator(
        model, sub, dataclasses.replace(cfg.decode, beam=4), torch.device("cpu"), terminology=terminology
    )
    terms, own = {}, {}  # line -> (source, target): with the reference's word, and any word's entry
    for i, (s, r) in enumerate(zip(src, ref, strict=True)):
        found = sorted((a for a in words(s) if a in lex), key=lambda a: -len(a))
        if found:
            own[i] = (found[0], lex[found[0]])
        if hits := [a for a in found if lex[a].lower() in words(r)]:
            terms[i] = (hits[0], lex[hits[0]])

    sources = plain.encode(src).sources

    def constraints(chosen: dict[int, tuple[str, str]]) -> tuple[dict, dict]:
        """Each chosen line under a glossary of its own term, and the lines' sources (with the terms
        inline where the model was trained for them: nmt.data.terms)."""
        out, lines = {}, dict(sources)
        for i, (a, b) in chosen.items():
            glossary = Glossary([entry(a, b, f"line {i + 1}")])
            out |= plain.terminology.apply({i: src[i]}, glossary, sources=lines)
        return out, lines

    def run(cons: tuple[dict, dict]) -> list[str]:
        found, lines = cons
        return [h[0][0] for h in plain.search_sources(len(src), lines, constraints=found or None)]

    base, out = run(({}, sources)), run(constraints(terms))
    rows, keep = sorted(terms), [i for i in range(len(src)) if i not in terms]

    def used(i: int, hyp: str) -> tuple[int, int]:
        """(times line i's target word appears in hyp, times its source term matched): as written, ending a
        word (its start may be glued), or capitalised as the line's first word."""
        b = terms[i][1]
        got = len(re.findall(rf"{re.escape(b)}(?!\w)", hyp))
        got += b != (cap := b[:1].upper() + b[1:]) and bool(re.match(rf"{re.escape(cap)}(?!\w)", hyp))
        return got, len(Glossary([entry(*terms[i], "")]).matches(src[i]))

    def uses(hyps: list[str]) -> list[tuple[int, int]]:
        return [used(i, hyps[i]) for i in rows]

    counts, before = uses(out), uses(base)

    def score(hyps: list[str]) -> str:
        refs = [[ref[i] for i in rows]]
        return (
            f"{sacrebleu.corpus_bleu(hyps, refs).score:.2f} / {sacrebleu.corpus_chrf(hyps, refs).score:.2f}"
        )

    # Where the terms went. `unknown`: each line's lexicon word given another entry's target, a term the
    # model would not write there by itself, as "bike -> Velo" is for the demo model.
    others = sorted(set(lex.values()))
    unknown = {
        i: (a, others[(others.index(b) + len(others) // 2) % len(others)]) for i, (a, b) in own.items()
    }

    # In place of the model's own word: of the lines whose translation without a glossary has the
    # lexicon's word for the term's source word, those whose translation under `unknown` has the term
    # and no longer that word ("Ein Mann fährt Velo.", not "Ein Mann fährt Fahrrad Velo.").
    def has(word: str, hyp: str) -> bool:
        return word.lower() in words(hyp)

    aligner, ends, placed, replaced, scored = Aligner(model, sub), terminology.ends, {}, {}, {}
    decode = plain.engine.decode
    # the defaults; without decode.terms_replace (the model's own word for a term's source not banned);
    # without the search's sentence-end rule
    for said, replace, rule in (
        ("", True, True),
        (", no replace", False, True),
        (", no end rule", True, False),
    ):
        terminology.ends = ends if rule else None
        plain.engine.decode = dataclasses.replace(decode, terms_replace=replace)
        ref_out = out if not said else run(constraints(terms))
        strange = run(constraints(unknown))
        placed[f"reference's term{said}"] = [placement(aligner, src[i], ref_out[i], *terms[i]) for i in rows]
        placed[f"another entry's term{said}"] = [
            placement(aligner, src[i], strange[i], *unknown[i]) for i in sorted(unknown)
        ]
        own_word = [i for i in sorted(unknown) if has(own[i][1], base[i])]
        replaced[f"another entry's term in place of the model's word{said}"] = (
            f"{sum(has(unknown[i][1], strange[i]) and not has(own[i][1], strange[i]) for i in own_word)}"
            f" of {len(own_word)}"
        )
        if said:
            scored[f"BLEU / chrF constrained{said}"] = score([ref_out[i] for i in rows])
    terminology.ends, plain.engine.decode = ends, decode

    quality = [
        ("lines with a term", f"{len(rows)} of {len(src)} ({len(lex)} lexicon entries)"),
        ("term-use rate unconstrained", f"{sum(got >= want for got, want in before) / len(rows):.1%}"),
        ("term-use rate", f"{sum(got >= want for got, want in counts) / len(rows):.1%}"),
        ("duplicated terms", str(sum(got > want for got, want in counts))),
        ("BLEU / chrF unconstrained", score([base[i] for i in rows])),
        ("BLEU / chrF constrained", score([out[i] for i in rows])),
        *scored.items(),
        ("other lines byte-identical", f"{sum(out[i] == base[i] for i in keep)} of {len(keep)}"),
        *(
            (f"{name}: placed / appended / elsewhere / unaligned", shares(found))
            for name, found in placed.items()
        ),
        *replaced.items(),
    ]
    every, speed = {**own, **terms}, []
    for share in (0.0, 0.1, 1.0):
        cons = constraints(dict(list(every.items())[: round(share * len(src))]))
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            run(cons)
            times.append(time.perf_counter() - start)
        speed.append((f"{share:.0%} ({len(cons[0])} lines)", len(src) / statistics.median(times)))
    speed = [(name, f"{rate:.1f}", f"{rate / speed[0][1]:.2f}x") for name, rate in speed]
    head = f"{common.now()}, {common.machine_name('cpu')}, {args.threads} threads"
    text = "\n".join(
        [
            f"### {head}, load {os.getloadavg()[0]:.2f}",
            "",
            f"`{common.command_line(__file__, argv)}`; model {args.model[0].name}, beam 4, test_2016_flickr.",
            "",
            *common.markdown_table(["figure", "value"], quality),
            "",
            *common.markdown_table(["lines constrained", "sentences/s", "vs none"], speed),
        ]
    )
    print(text)
    if args.record:
        common.record(text, "## Terminology", args.results)


SENTENCE_END = re.compile(r"[.!?…]+[\"'»“”)]*$")


def placement(aligner, source: str, hyp: str, term: str, target: str) -> str:
    """Where `target`, the glossary's term for the source word `term`, went in `hyp`: "appended" after
    the translation's own end (as many sentence ends before it as the source has in all: "Ein Mann fährt
    ein Fahrrad. Velo."), "placed" where the model's attention aligns it to `term` (nmt.translate.align),
    "elsewhere", or "unaligned" where the alignment cannot be read (or the term is missing)."""
    out, words_in = hyp.split(), source.split()
    at = [j for j, w in enumerate(out) if re.sub(r"\W+$", "", re.sub(r"^\W+", "", w)) == target]
    if not at:
        return "unaligned"
    j = at[0]
    ends = sum(bool(SENTENCE_END.search(w)) for w in words_in)
    if ends and sum(bool(SENTENCE_END.search(w)) for w in out[:j]) >= ends:
        return "appended"
    links = aligner.align(source, hyp)
    if links is None:
        return "unaligned"
    sources = {i for i, w in enumerate(words_in) if re.sub(r"\W+", "", w).lower() == term}
    return "placed" if links[j] in sources else "elsewhere"


def shares(found: list[str]) -> str:
    """The share of each placement, and the number of lines."""
    n = max(1, len(found))
    kinds = ("placed", "appended", "elsewhere", "unaligned")
    return " / ".join(f"{found.count(k) / n:.1%}" for k in kinds) + f" of {len(found)}"


def glossary_load(args: argparse.Namespace) -> None:
    """Seconds to read an N-entry glossary file and check it against --model's vocabulary, as `nmt translate
    --glossary` does once a process: the median of --repeats, each in a fresh process (a warm one would
    find the strings and the allocator ready)."""
    from nmt.checkpoint import checkpoint_subword

    checkpoint_subword(args.model[0])  # refused here, in one line, where it is no checkpoint
    with tempfile.TemporaryDirectory(prefix="glossary-load-") as tmp:
        path = Path(tmp) / "glossary.tsv"
        n = args.glossary_entries
        path.write_text("".join(f"term{i} word{i % 7}\tBegriff{i} Wort{i % 7}\n" for i in range(n)))
        code = (
            "import sys, time\n"
            "from nmt.checkpoint import checkpoint_subword\n"
            "from nmt.subword import Subword\n"
            "from nmt.translate.terminology import Terminology, read_glossary\n"
            "sub = Subword(checkpoint_subword(sys.argv[1]))\n"
            "start = time.perf_counter()\n"
            "Terminology(sub, 1024, read_glossary(sys.argv[2]))\n"
            "print(time.perf_counter() - start)\n"
        )
        command = [sys.executable, "-c", code, str(args.model[0]), str(path)]
        times = [
            float(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
            for _ in range(args.repeats)
        ]
    print(
        f"reading {n:,} glossary entries ({path.name}, checked against {args.model[0]}): "
        f"median {statistics.median(times):.3f} s of {', '.join(f'{t:.3f}' for t in times)}"
    )


def main(argv: list[str] | None = None) -> list[Result]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", type=Path, action="append", help="an nmt checkpoint, repeatable (default: random)"
    )
    p.add_argument("--recipe", default="multi30k-en-de", help="without --model: the random model's recipe")
    p.add_argument("--input", type=Path, help="source sentences, one a line (default: synthetic)")
    p.add_argument("--lines", type=int, help="use the first N input lines (default: all; synthetic: 300)")
    p.add_argument("--repeats", type=int, default=3, help="timed passes per engine (default 3)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU threads for every engine")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--beam", type=int, action="append", help="beam size (default 4); repeatable")
    p.add_argument("--engine", action="append", metavar="ENGINE:COMPUTE",
                   help="instead of the default engines, e.g. nmt:bf16 or ctranslate2:int8; repeatable; "
                   "the first is the speed-up's base")  # fmt: skip
    p.add_argument("--isa", action="append", choices=[*ISAS, "all"],
                   help="CPU: hold the kernels to an instruction set, a table each; repeatable; all: "
                   "every one this CPU has (default: native)")  # fmt: skip
    p.add_argument("--refs", type=Path, help="references of --input, line by line: BLEU and chrF columns")
    p.add_argument("--shortlist", action="store_true", help="every engine also over the lexical shortlist")
    p.add_argument("--max-tokens", type=int, help="batch budget (default: the checkpoint's batch_tokens)")
    p.add_argument("--max-len-a", type=float, help="length limit a (default: checkpoint's; random model: 0)")
    p.add_argument("--max-len-b", type=int, help="length limit b (default: checkpoint's; random model: 30)")
    p.add_argument("--latency-lines", type=int, default=30, help="sentences translated one at a time")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="without --model: a recipe override for the random model (repeatable)")  # fmt: skip
    p.add_argument("--terminology", action="store_true", help="glossaries on Multi30k (needs --model)")
    p.add_argument("--glossary-entries", type=int, metavar="N",
                   help="instead: seconds to read an N-entry glossary with --model")  # fmt: skip
    p.add_argument("--workers", type=int, help="instead: whole commands, 1 process against N (processes)")
    p.add_argument("--json", action="store_true", help="print the rows and what ran as one JSON object")
    p.add_argument("--record", action="store_true", help="append the figures to benchmarks/RESULTS.md")
    p.add_argument("--results", type=Path, default=RESULTS, help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker()
        return []
    if args.glossary_entries:
        if not args.model:
            p.error("--glossary-entries needs --model")
        glossary_load(args)
        return []
    if args.terminology:
        if not args.model:
            p.error("--terminology needs --model")
        terminology(args, argv)
        return []
    import importlib.util

    import torch
    from rich.console import Console

    from nmt.checkpoint import load_checkpoint
    from nmt.formats.export import export

    console = Console(stderr=True)
    ct2 = importlib.util.find_spec("ctranslate2") is not None
    engines = GPU_ENGINES if args.device.startswith("cuda") else CPU_ENGINES
    if args.engine:
        engines = [tuple(e.split(":", 1)) for e in args.engine]
        if any(len(e) != 2 or e[0] not in ("nmt", "ctranslate2") for e in engines):
            p.error("--engine: nmt:COMPUTE or ctranslate2:COMPUTE")
    engines = engines if ct2 else [e for e in engines if e[0] == "nmt"]
    isas = reachable_isas() if "all" in (args.isa or []) else (args.isa or ["native"])
    engines = [(e, c, sl) for e, c in engines for sl in ((False, True) if args.shortlist else (False,))]
    beams, refs = args.beam or [4], None
    if args.input is not None:
        lines = args.input.read_text(encoding="utf-8").splitlines()
        refs = args.refs.read_text(encoding="utf-8").splitlines() if args.refs else lines
        kept = [(line, ref) for line, ref in zip(lines, refs, strict=True) if line.strip()]
        kept = kept[: args.lines] if args.lines else kept
        lines, refs = [line for line, _ in kept], [ref for _, ref in kept] if args.refs else None
        input_about = f"{args.input} ({len(lines)} lines)" + (f", references {args.refs}" if refs else "")
    else:
        lines = SyntheticText(seed=2).lines(args.lines or 300, NEWSTEST_WORDS)
        input_about = (
            f"{len(lines)} synthetic sentences, words per sentence log-normal with newstest2014's "
            f"mean 25 and sd 14 (here: mean {statistics.mean(map(len, map(str.split, lines))):.1f})"
        )
    latency_lines = random.Random(3).sample(lines, min(args.latency_lines, len(lines)))
    results, details = [], []
    with tempfile.TemporaryDirectory(prefix="translate-speed-") as tmp:
        work = Path(tmp)
        if args.model is None:
            console.print(f"no --model: random weights of the {args.recipe} recipe's size (untrained)")
            checkpoints, random_weights = [random_model(work, args.recipe, args.overrides)], True
        else:
            checkpoints, random_weights = args.model, False
        for checkpoint in checkpoints:
            ckpt = load_checkpoint(checkpoint)
            d, cfg = ckpt.config.decode, ckpt.config.model
            a = (0.0 if random_weights else d.max_len_a) if args.max_len_a is None else args.max_len_a
            b = (30 if random_weights else d.max_len_b) if args.max_len_b is None else args.max_len_b
            ct2_dir = export(checkpoint, work / f"ct2-{len(details)}") if ct2 else work / "ct2"
            params = sum(v.numel() for v in ckpt.model_state.values())
            details.append(f"{checkpoint.stem}: {cfg.encoder_layers}+{cfg.decoder_layers} layers, d_model "
                           f"{cfg.d_model}, d_ff {cfg.d_ff}, {cfg.heads} heads, vocab {ckpt.vocab_size}, "
                           f"{params:,} parameters" + " (random weights)" * random_weights)  # fmt: skip
            for beam in beams:
                decode = dataclasses.replace(d, beam=beam, nbest=1, max_len_a=a, max_len_b=b,
                                             batch_tokens=args.max_tokens or d.batch_tokens)  # fmt: skip
                label = f"{checkpoint.stem} beam {beam}: " if len(checkpoints) + len(beams) > 2 else ""
                job = dict(checkpoint=str(checkpoint), ct2_dir=str(ct2_dir), label=label, device=args.device,
                           decode=dataclasses.asdict(decode), threads=args.threads, lines=lines,
                           latency_lines=latency_lines, isa="native")  # fmt: skip
                if args.workers:  # its own table: whole commands, tree memory
                    head = ["workers x threads", "lines/s", "command s", "RSS MiB", "PSS MiB", "same bytes"]
                    print("\n".join(common.markdown_table(head, processes(args, job, beam, work, lines))))
                    continue
                for isa in isas:
                    held = f"{isa}: " if isas != ["native"] else ""
                    results += measure(
                        {**job, "isa": isa, "label": held + label}, engines, args.repeats, refs
                    )

    ct2_version = importlib.import_module("ctranslate2").__version__ if ct2 else "not installed"
    model = ", ".join(map(str, checkpoints)) if not random_weights else f"random weights, {args.recipe}"
    decoding = f"beam {' and '.join(map(str, beams))}, lenpen {decode.lenpen}, max length {a:g} x |x| + {b}"
    about = dict(model=model, model_detail="; ".join(details), device=args.device, threads=args.threads,
                 machine=common.machine_name(args.device), torch=torch.__version__, ctranslate2=ct2_version,
                 input=input_about, command=common.command_line(__file__, argv), repeats=args.repeats,
                 latency_lines=len(latency_lines), decoding=f"{decoding}, batch budget {decode.batch_tokens} "
                 "(sentences x beam x max(source, output))")  # fmt: skip
    if args.record:
        common.record(record_entry(results, about), SECTION, args.results)
        console.print(f"recorded in {args.results}")
    if args.json:
        print(json.dumps({"about": about, "rows": [dataclasses.asdict(r) for r in results]}, indent=1))
    else:
        print(f"Translation speed: {about['model']} on {args.device}, {args.threads} threads\n")
        print("\n".join(common.markdown_table(HEADER, table_rows(results))) * (not args.workers))
        print("\n".join(f"{key}: {about[key]}" for key in ("machine", "model_detail", "input", "decoding")))
    return results


if __name__ == "__main__":
    main()
