"""`nmt run`: preprocess, train, average, translate each test set, score, and write results.md/json.

Every step leaves an output that proves it finished (written atomically), and is skipped when that output
is already there, so running the same command after a crash continues where it stopped.
"""

from __future__ import annotations

import json
import os
import platform
import re
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from nmt.atomic import write_text
from nmt.checkpoint import average_last, checkpoint_subword
from nmt.config import Config, CorpusSpec
from nmt.data.preprocess import corpus_key, preprocess, test_text
from nmt.device import resolve_device
from nmt.score import corpus_scores, language_share, read_lines
from nmt.train import train
from nmt.train.monitor import training_summary
from nmt.translate import LineTranslator, build_translator


def run_pipeline(
    cfg: Config, workdir: Path, mirror: str | None = None, console: Console | None = None
) -> dict:
    console = console or Console(stderr=True)
    workdir = Path(workdir)
    ckpt_dir = workdir / "checkpoints"

    console.rule("[bold]1. preprocess")
    preprocess(cfg, workdir, mirror=mirror, console=console, checkpoint_subword=checkpoint_subword)

    console.rule("[bold]2. train")
    train(cfg, workdir, console=console)

    console.rule("[bold]3. average")
    model_path = average_last(cfg, ckpt_dir, console)

    console.rule("[bold]4. translate")
    # The same loading and defaults as `nmt translate -m average.pt`, so both give the same lines.
    device = resolve_device(cfg.train.device, key="train.device")
    translator = build_translator(model_path, device=device, console=console, command="nmt run").translator
    speeds = {}
    for corpus in cfg.data.test:
        speeds[corpus] = translate_test_set(cfg, workdir, corpus, translator, model_path, console)

    console.rule("[bold]5. score")
    results = {
        "recipe": " ".join(f"{s}-{t}" for s, t in cfg.data.directions),
        "model": str(model_path),
        "training": training_summary(workdir),
        "device": device_summary(device),
        "decode": {
            "beam": cfg.decode.beam,
            "lenpen": cfg.decode.lenpen,
            "max_len": f"{cfg.decode.max_len_a:g} * source + {cfg.decode.max_len_b}",
        },
        "tests": {},
    }
    for corpus in cfg.data.test:
        _, tgt_lang = cfg.data.direction(corpus)
        hyp = read_lines(translation_path(cfg, workdir, corpus))
        ref = read_lines(test_text(workdir / "data", cfg.data, corpus)[1])
        scores = corpus_scores(hyp, [ref], ("bleu", "chrf"))
        entry = {name: {"score": round(s.score, 2), "signature": s.signature} for name, s in scores.items()}
        if tgt_lang == "de":
            entry["tok_bleu_compound_split"] = round(compound_split_bleu(hyp, ref), 2)
        if cfg.data.multilingual:
            entry["direction"] = "-".join(cfg.data.direction(corpus))
            # The off-target rate, beside the references' own: a language identifier misjudges captions
            shares = language_share(hyp, tgt_lang), language_share(ref, tgt_lang)
            if None not in shares:
                entry["in_language"] = {"output": round(shares[0], 4), "reference": round(shares[1], 4)}
        entry["speed"] = speeds[corpus]
        results["tests"][corpus_key(cfg.data, corpus)] = entry
    write_results(workdir, results)
    show_results(results, console)
    return results


def translation_path(cfg: Config, workdir: Path, corpus: CorpusSpec) -> Path:
    """translations/<name>.<tgt>, or with several directions translations/<name>.<src>-<tgt>.<tgt>."""
    return workdir / "translations" / test_text(workdir / "data", cfg.data, corpus)[1].name


def translate_test_set(
    cfg: Config,
    workdir: Path,
    corpus: CorpusSpec,
    translator: LineTranslator,
    model_path: Path,
    console: Console,
) -> dict:
    name = corpus_key(cfg.data, corpus)
    src_path = test_text(workdir / "data", cfg.data, corpus)[0]
    out = translation_path(cfg, workdir, corpus)
    tag = cfg.data.target_tag(cfg.data.direction(corpus)[1])
    meta = out.with_name(out.name + ".json")
    if (
        out.exists()
        and meta.exists()
        and json.loads(meta.read_text()).get("model_mtime") == model_path.stat().st_mtime
    ):
        console.print(f"translate {name}: already done ({out})")
        return json.loads(meta.read_text())["speed"]
    lines = read_lines(src_path)
    start = time.perf_counter()
    hyps = translator.translate(lines, target=tag)
    seconds = time.perf_counter() - start
    tokens = sum(
        len(ids) + 1 for ids in translator.subword.encode_target(hyps)
    )  # + EOS, as the decoder emitted
    speed = {
        "sentences": len(lines),
        "seconds": round(seconds, 2),
        "sentences_per_s": round(len(lines) / seconds, 1),
        "target_tokens_per_s": round(tokens / seconds, 1),
    }
    write_text(out, "".join(h + "\n" for h in hyps))
    write_text(meta, json.dumps({"model_mtime": model_path.stat().st_mtime, "speed": speed}))
    console.print(f"translate {name}: {len(lines)} lines in {seconds:.1f} s -> {out}")
    return speed


def compound_split_bleu(hyps: list[str], refs: list[str]) -> float:
    """BLEU on tokenized text with German compounds split at hyphens, as the paper's EN-DE scores were
    computed (tensor2tensor's get_ende_bleu.sh: tokenizer, then `-` -> ` ##AT##-##AT## `). For comparison
    with published figures only; the sacreBLEU score is the one to report.

    Tokenization here is sacrebleu's 13a (mteval's), not the Moses tokenizer, so figures can differ
    slightly from the paper's pipeline.
    """
    from sacrebleu.metrics import BLEU
    from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

    tokenize = Tokenizer13a()

    def split(line: str) -> str:
        return re.sub(r"(\S)-(\S)", r"\1 ##AT##-##AT## \2", tokenize(line))

    bleu = BLEU(tokenize="none", force=True)  # force: this text is tokenized on purpose
    return bleu.corpus_score([split(h) for h in hyps], [[split(r) for r in refs]]).score


def device_summary(device: torch.device) -> dict:
    if device.type == "cuda":
        return {"type": torch.cuda.get_device_name(device), "count": int(os.environ.get("WORLD_SIZE", "1"))}
    return {
        "type": platform.processor() or platform.machine(),
        "count": 1,
        "threads": torch.get_num_threads(),
    }


def write_results(workdir: Path, results: dict) -> None:
    write_text(workdir / "results.json", json.dumps(results, indent=2) + "\n")
    t = results["training"]
    lines = [
        f"# Results: {results['recipe']}",
        "",
        f"Model: `{results['model']}`; decoding: beam {results['decode']['beam']}, length penalty "
        f"{results['decode']['lenpen']}, max length {results['decode']['max_len']}.",
        f"Training: {t.get('updates')} updates in {t.get('minutes')} min, median "
        f"{t.get('target_tokens_per_s')} target tokens/s on {results['device']['type']} "
        f"x {results['device']['count']}.",
        "",
    ]
    multi = any("direction" in e for e in results["tests"].values())
    if multi:  # a row per direction and test set, with how often its output is in its language
        lines += [
            "| test set | direction | sacreBLEU | chrF | in its language: output / reference | sentences/s |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
    else:
        lines += [
            "| test set | sacreBLEU | chrF | tok. BLEU (compound split) | sentences/s | target tokens/s |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
    for name, e in results["tests"].items():
        tok = e.get("tok_bleu_compound_split", "n/a")
        if multi:
            share = e.get("in_language")
            shares = f"{share['output']:.1%} / {share['reference']:.1%}" if share else "n/a"
            test = name.rsplit(" ", 1)[0]
            lines.append(
                f"| {test} | {e['direction']} | {e['bleu']['score']} | {e['chrf']['score']} | {shares} | "
                f"{e['speed']['sentences_per_s']} |"
            )
            continue
        lines.append(
            f"| {name} | {e['bleu']['score']} | {e['chrf']['score']} | {tok} | "
            f"{e['speed']['sentences_per_s']} | {e['speed']['target_tokens_per_s']} |"
        )
    lines += ["", "Signatures:", ""]
    for name, e in results["tests"].items():
        lines += [f"- {name} BLEU: `{e['bleu']['signature']}`", f"- {name} chrF: `{e['chrf']['signature']}`"]
    write_text(workdir / "results.md", "\n".join(lines) + "\n")


def show_results(results: dict, console: Console) -> None:
    t = results["training"]
    table = Table(title=f"nmt {results['recipe']}")
    for column in ("test set", "BLEU", "chrF", "training", "translation"):
        table.add_column(column)
    for name, e in results["tests"].items():
        table.add_row(
            name,
            f"{e['bleu']['score']:.2f}",
            f"{e['chrf']['score']:.2f}",
            f"{t.get('updates')} updates, {t.get('minutes')} min",
            f"{e['speed']['sentences_per_s']} sent/s, {e['speed']['target_tokens_per_s']} tok/s",
        )
    console.print(table)
