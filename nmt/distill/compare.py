"""Teacher against student on the recipe's test sets: quality and speed per engine and precision.

Each system (teacher at its beam; student at its beam and greedy) translates every test set in each
engine and precision available here: nmt's PyTorch engine in fp32 and int8, and CTranslate2 in float32
and int8 when it is installed (the models exported to it once). Speed is the whole test set batched
(sentences/s) and the median latency of the first LATENCY_LINES lines translated one at a time, both on
this process's threads. Every translation is kept with its speed and is not redone when run again, so a
killed comparison continues where it stopped (and one of a model since trained further is redone).
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from nmt import atomic
from nmt.config import Config, DecodeOverrides, Engine, Precision
from nmt.formats.export import exported
from nmt.score import corpus_scores, read_lines
from nmt.translate import BuiltTranslator, build_translator
from nmt.translate.testset import translate_test_file

LATENCY_LINES = 100


def ctranslate2_available() -> bool:
    try:
        import ctranslate2  # noqa: F401
    except ImportError:
        return False
    return True


def engines() -> list[tuple[Engine, Precision]]:
    found = [(Engine.TORCH, Precision.FP32), (Engine.TORCH, Precision.INT8)]
    if ctranslate2_available():
        found += [(Engine.CTRANSLATE2, Precision.FP32), (Engine.CTRANSLATE2, Precision.INT8)]
    return found


def compare(
    cfg: Config,
    opts,
    workdir: Path,
    student: Path,
    step_seconds: dict,
    console: Console,
    teacher_config: dict | None = None,
) -> dict:
    """Translate, time and score; write results.md and results.json in `workdir`; returns the results.
    `teacher_config`: the teacher's config as read already, else read here."""
    from nmt.checkpoint import checkpoint_config
    from nmt.train.monitor import training_summary

    start = time.perf_counter()
    teacher = teacher_config if teacher_config is not None else checkpoint_config(opts.teacher)
    teacher_beam = teacher["decode"]["beam"]
    systems = [("teacher", opts.teacher, teacher_beam), ("student", student, cfg.decode.beam)]
    if cfg.decode.beam != 1:
        systems.append(("student", student, 1))
    refs = {
        corpus.name: read_lines(workdir / "data" / "test" / f"{corpus.name}.{cfg.data.tgt_lang}")
        for corpus in cfg.data.test
    }
    rows = []
    for engine, precision in engines():
        for name, model_path, beam in systems:
            model = model_path
            if engine is Engine.CTRANSLATE2:
                model = exported(model, workdir / "export" / f"{name}-ctranslate2", console)
            label = f"{name}-{engine}-{precision}-beam{beam}"
            build = system_translator(model, beam, engine, precision, cfg.train.device, label, console)
            for test, ref in refs.items():
                src = workdir / "data" / "test" / f"{test}.{cfg.data.src_lang}"
                out = workdir / "translations" / label / f"{test}.{cfg.data.tgt_lang}"
                # the checkpoint's mtime names the model, for its CTranslate2 export too
                info = translate_test_file(src, out, model_path, build, latency_lines=LATENCY_LINES)
                scores = corpus_scores(read_lines(out), [ref], ("bleu", "chrf"))
                rows.append(
                    {
                        "system": name,
                        "engine": str(engine),
                        "precision": info["precision"],
                        "beam": beam,
                        "test": test,
                        "bleu": round(scores["bleu"].score, 2),
                        "chrf": round(scores["chrf"].score, 2),
                        **info["speed"],
                        "signatures": {k: s.signature for k, s in scores.items()},
                    }
                )
    results = {
        "teacher": str(opts.teacher),
        "student": str(student),
        "threads": torch.get_num_threads(),
        "step_seconds": {**step_seconds, "compare (this run)": round(time.perf_counter() - start, 1)},
        "training": training_summary(workdir),
        "rows": rows,
    }
    write_results(workdir, results)
    show(results, console)
    return results


def system_translator(
    model: Path | str,
    beam: int,
    engine: Engine,
    precision: Precision,
    device: str,
    label: str,
    console: Console,
) -> Callable[[], BuiltTranslator]:
    """The translator of one system, built on the first call (only where some test set needs it)."""

    @functools.cache
    def build() -> BuiltTranslator:
        built = build_translator(
            model, DecodeOverrides.given(beam=beam), device, precision, engine, console, command="nmt distill"
        )
        console.print(f"compare: {label} ({built.describe()})", highlight=False)
        return built

    return build


def write_results(workdir: Path, results: dict) -> None:
    atomic.write_text(workdir / "results.json", json.dumps(results, indent=2) + "\n")
    lines = [
        "# Distillation: teacher against student",
        "",
        f"Teacher `{results['teacher']}`, student `{results['student']}`; {results['threads']} threads. "
        f"Speed: the whole test set batched; latency: the median of the first {LATENCY_LINES} lines, "
        "each alone.",
        "",
        "| system | engine | precision | beam | test set | BLEU | chrF | sentences/s | latency ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results["rows"]:
        lines.append(
            f"| {r['system']} | {r['engine']} | {r['precision']} | {r['beam']} | {r['test']} | {r['bleu']} | "
            f"{r['chrf']} | {r['sentences_per_s']} | {r['latency_ms']} |"
        )
    lines += ["", "Steps (seconds when they ran):", ""]
    lines += [f"- {name}: {s}" for name, s in results["step_seconds"].items()]
    if results["rows"]:
        lines += ["", "Signatures:", ""]
        lines += [f"- {k}: `{v}`" for k, v in results["rows"][0]["signatures"].items()]
    atomic.write_text(workdir / "results.md", "\n".join(lines) + "\n")


SHOWN = ("system", "engine", "precision", "beam", "test set", "BLEU", "chrF", "sent/s", "latency ms")


def show(results: dict, console: Console) -> None:
    """The results as a table on a terminal; elsewhere (a log file, a pipe) as plain tab-separated lines,
    which a fixed-width table would cut to 80 columns ("teach…")."""
    rows = [
        [
            r["system"],
            r["engine"],
            r["precision"],
            str(r["beam"]),
            r["test"],
            f"{r['bleu']:.2f}",
            f"{r['chrf']:.2f}",
            str(r["sentences_per_s"]),
            str(r["latency_ms"]),
        ]
        for r in results["rows"]
    ]
    if not console.is_terminal:
        console.print("teacher against student", highlight=False)
        for row in [list(SHOWN), *rows]:  # written as is: rich would expand the tabs
            console.file.write("\t".join(row) + "\n")
        return
    table = Table(title="teacher against student")
    for column in SHOWN:
        table.add_column(column)
    for row in rows:
        table.add_row(*row)
    console.print(table)
