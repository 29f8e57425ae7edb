"""`nmt run`: preprocess, train, average, translate each test set, score, and write results.md/json.

Every step leaves an output that proves it finished (written atomically), and is skipped when that output
is already there, so running the same command after a crash continues where it stopped.

A back-translation recipe (data.backtranslate) runs three steps before those, each resumable alike:

    bitext     `nmt preprocess` of the recipe's own corpora into bitext/: the joint SentencePiece
               model (with <BT> reserved) that every model of the run shares
    reverse    the target -> source model, trained on the bitext swapped (reverse/), or the one given
    backtranslate
               `nmt backtranslate` of the monolingual text with it (backtranslate/<name>.<lang>)

and then the usual steps on the recipe with the synthetic pairs as one more training corpus. With
data.backtranslate.baseline, the recipe without them (bitext only, the same vocabulary and minutes) is
trained in bitext/ as well, and results.md shows it beside the forward model.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import platform
import re
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from nmt.atomic import write_text
from nmt.checkpoint import average_last, checkpoint_config, checkpoint_subword
from nmt.config import REGULARIZATION, Config, CorpusSpec, FileSpec, config_to_dict
from nmt.data.corpora import files_text
from nmt.data.fetch import file_digest
from nmt.data.preprocess import corpus_key, preprocess, test_text
from nmt.device import resolve_device
from nmt.errors import ConfigError
from nmt.languages import BT_TAG
from nmt.score import corpus_scores, language_share, read_lines
from nmt.subword import Subword
from nmt.train import train
from nmt.train.monitor import training_summary
from nmt.translate import build_translator
from nmt.translate.testset import translate_test_file


def run_pipeline(
    cfg: Config, workdir: Path, mirror: str | None = None, console: Console | None = None
) -> dict:
    console = console or Console(stderr=True)
    workdir = Path(workdir)
    bt = cfg.data.backtranslate
    if bt is None:
        return run_steps(cfg, workdir, mirror, console)
    forward, subword, bitext_subword, info = backtranslated(cfg, workdir, mirror, console)
    start = forward.data.init_from  # the reverse model, with data.backtranslate.warm_start
    synthetic = {
        "method": bt.method,
        "tagged": bt.tag,
        "weight": bt.weight,
        "warm_start": start,
        "translated": info["translated"],
        "pairs": info["pairs"],
        "removed": info["removed"],
        "seconds": info["seconds"],
    }
    results = run_steps(
        forward, workdir, mirror, console, subword=subword, extra={"backtranslation": synthetic}
    )
    if bt.baseline:
        console.rule("[bold]bitext only: the recipe without the synthetic corpus")
        bitext = cfg
        if start is not None:  # from the same weights: what the synthetic pairs add, and nothing else
            bitext = dataclasses.replace(
                cfg, data=dataclasses.replace(cfg.data, init_from=start, backtranslate=None)
            )
        base = run_steps(bitext, workdir / "bitext", mirror, console, subword=bitext_subword)
        results["bitext_only"] = compared(base, workdir / "bitext")
    if bt.compare_untagged:
        console.rule("[bold]untagged: the same synthetic pairs without <BT>")
        corpora = tuple(
            dataclasses.replace(c, tag=False) if c.name == bt.name else c for c in forward.data.train
        )
        untagged = dataclasses.replace(forward, data=dataclasses.replace(forward.data, train=corpora))
        other = run_steps(untagged, workdir / "untagged", mirror, console, subword=subword)
        results["untagged"] = compared(other, workdir / "untagged")
    if bt.baseline or bt.compare_untagged:
        write_results(workdir, results)
        show_results(results, console)
    return results


def compared(results: dict, workdir: Path) -> dict:
    """What results.json keeps of a run the forward model is compared with: its training and scores."""
    return {
        "workdir": str(workdir),
        "training": results["training"],
        "tests": {name: {m: e[m]["score"] for m in ("bleu", "chrf")} for name, e in results["tests"].items()},
    }


def backtranslated(
    cfg: Config, workdir: Path, mirror: str | None, console: Console
) -> tuple[Config, bytes, bytes | None, dict]:
    """The steps before the forward model's: returns the recipe with the synthetic corpus among its
    training corpora, the SentencePiece model every model of the run shares, the one the bitext was
    preprocessed with as given (None where it trained its own), and what back-translation counted."""
    from nmt.backtranslate import BacktranslateOptions, backtranslate

    bt = cfg.data.backtranslate
    assert bt is not None
    bitext = workdir / "bitext"
    console.rule("[bold]bitext: preprocess the recipe's corpora")
    given = checkpoint_subword(bt.reverse) if bt.reverse is not None else None
    if given is not None and bt.tag and BT_TAG not in Subword(given).tags:
        raise ConfigError(
            f"data.backtranslate.reverse: {bt.reverse} has no {BT_TAG} in its vocabulary, which tagged "
            "back-translation needs; set data.backtranslate.tag: false, or let the run train a reverse model"
        )
    preprocess(cfg, bitext, mirror=mirror, console=console, subword=given)
    vocab = bitext / "data" / "spm.model"
    subword = vocab.read_bytes()
    if bt.reverse is not None:
        reverse_model = Path(bt.reverse)
    else:
        console.rule("[bold]reverse: train the target -> source model")
        rev = reverse_config(cfg)
        preprocess(rev, workdir / "reverse", mirror=mirror, console=console, subword=subword)
        train(rev, workdir / "reverse", console=console)
        reverse_model = average_last(rev, workdir / "reverse" / "checkpoints", console)
    if bt.warm_start:  # checked before back-translating: one line, not a load_state_dict error later
        mine, theirs = config_to_dict(cfg)["model"], checkpoint_config(reverse_model)["model"]
        # dropouts shape training, not the weights: a fine-tuning recipe may change them too
        key = next((k for k in mine if k not in REGULARIZATION and mine[k] != theirs.get(k)), None)
        if key is not None:
            raise ConfigError(
                f"data.backtranslate.warm_start: {reverse_model} has model.{key} {theirs.get(key)!r}, the "
                f"recipe {mine[key]!r}; the forward model can start from a reverse model of its own shape"
            )
    console.rule("[bold]backtranslate: the monolingual text into synthetic sources")
    src_lang, tgt_lang = cfg.data.src_lang, cfg.data.tgt_lang
    output = workdir / "backtranslate" / bt.name
    info = backtranslate(
        BacktranslateOptions(
            reverse=reverse_model,
            mono=tuple(files_text(list(bt.mono), mirror=mirror, console=console)),
            output=output,
            method=bt.method,
            device=cfg.train.device,
            seed=bt.seed,
            max_lines=bt.max_lines,
            vocab=vocab,
            direction=(src_lang, tgt_lang),
            recipe=True,
        ),
        console,
    )
    synthetic = CorpusSpec(
        name=bt.name,
        src=local_file(Path(f"{output}.{src_lang}")),
        tgt=local_file(Path(f"{output}.{tgt_lang}")),
        tag=bt.tag,
        weight=bt.weight,
    )
    # The forward recipe: the synthetic corpus is one of its training corpora now, tagged if it is
    init_from = str(reverse_model) if bt.warm_start else None
    forward = dataclasses.replace(
        cfg,
        data=dataclasses.replace(
            cfg.data, train=(*cfg.data.train, synthetic), backtranslate=None, init_from=init_from
        ),
    )
    return forward, subword, given, info


def reverse_config(cfg: Config) -> Config:
    """The recipe with sources and targets swapped, for the reverse model's minutes; no test sets (the
    reverse model is judged by what its corpus gives the forward one), no back-translation of its own."""
    bt = cfg.data.backtranslate
    assert bt is not None

    def swapped(c: CorpusSpec) -> CorpusSpec:
        return dataclasses.replace(
            c, src=c.tgt, tgt=c.src, src_lang=c.tgt_lang, tgt_lang=c.src_lang, tag=False
        )

    data = dataclasses.replace(
        cfg.data,
        src_lang=cfg.data.tgt_lang,
        tgt_lang=cfg.data.src_lang,
        train=tuple(map(swapped, cfg.data.train)),
        valid=tuple(map(swapped, cfg.data.valid)),
        test=(),
        backtranslate=None,
    )
    minutes = bt.reverse_minutes if bt.reverse_minutes is not None else cfg.train.max_minutes
    return dataclasses.replace(cfg, data=data, train=dataclasses.replace(cfg.train, max_minutes=minutes))


def local_file(path: Path) -> FileSpec:
    """A corpus file this run wrote, named by its path and checksum: a new corpus is a new fingerprint."""
    return FileSpec(url=str(path.resolve()), sha256=file_digest(path))


def run_steps(
    cfg: Config,
    workdir: Path,
    mirror: str | None,
    console: Console,
    subword: bytes | None = None,
    extra: dict | None = None,
) -> dict:
    """The steps of `nmt run` from preprocessing to results.md/json; `extra`: more sections of the
    results (a back-translation recipe's), written with them."""
    ckpt_dir = workdir / "checkpoints"

    console.rule("[bold]1. preprocess")
    preprocess(
        cfg, workdir, mirror=mirror, console=console, checkpoint_subword=checkpoint_subword, subword=subword
    )

    console.rule("[bold]2. train")
    train(cfg, workdir, console=console)

    console.rule("[bold]3. average")
    model_path = average_last(cfg, ckpt_dir, console)

    console.rule("[bold]4. translate")
    # The same loading and defaults as `nmt translate -m average.pt`, so both give the same lines; loaded
    # once, and only where a test set is not translated by this model yet.
    device = resolve_device(cfg.train.device, key="train.device")
    build = functools.cache(
        lambda: build_translator(model_path, device=device, console=console, command="nmt run")
    )
    speeds = {}
    for corpus in cfg.data.test:
        src = test_text(workdir / "data", cfg.data, corpus)[0]
        out = translation_path(cfg, workdir, corpus)
        tag = cfg.data.target_tag(cfg.data.direction(corpus)[1])
        name = corpus_key(cfg.data, corpus)
        info = translate_test_file(src, out, model_path, build, tag, console=console, name=name)
        speeds[corpus] = info["speed"]

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
            # The off-target rate, beside the references' own (a language identifier misjudges captions):
            # among the model's languages, the ones it can wrongly write, and among all py3langid knows
            for key, among in (("in_language", cfg.data.languages), ("in_any_language", ())):
                shares = language_share(hyp, tgt_lang, among), language_share(ref, tgt_lang, among)
                if None not in shares:
                    entry[key] = {"output": round(shares[0], 4), "reference": round(shares[1], 4)}
        entry["speed"] = speeds[corpus]
        results["tests"][corpus_key(cfg.data, corpus)] = entry
    results.update(extra or {})
    write_results(workdir, results)
    show_results(results, console)
    return results


def translation_path(cfg: Config, workdir: Path, corpus: CorpusSpec) -> Path:
    """translations/<name>.<tgt>, or with several directions translations/<name>.<src>-<tgt>.<tgt>."""
    return workdir / "translations" / test_text(workdir / "data", cfg.data, corpus)[1].name


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
            "| test set | direction | sacreBLEU | chrF | in its language: output / reference | "
            "(among all languages) | sentences/s |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
    else:
        lines += [
            "| test set | sacreBLEU | chrF | tok. BLEU (compound split) | sentences/s | target tokens/s |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
    for name, e in results["tests"].items():
        tok = e.get("tok_bleu_compound_split", "n/a")
        if multi:
            shares = [
                f"{share['output']:.1%} / {share['reference']:.1%}" if (share := e.get(key)) else "n/a"
                for key in ("in_language", "in_any_language")
            ]
            test = name.rsplit(" ", 1)[0]
            lines.append(
                f"| {test} | {e['direction']} | {e['bleu']['score']} | {e['chrf']['score']} | {shares[0]} | "
                f"{shares[1]} | {e['speed']['sentences_per_s']} |"
            )
            continue
        lines.append(
            f"| {name} | {e['bleu']['score']} | {e['chrf']['score']} | {tok} | "
            f"{e['speed']['sentences_per_s']} | {e['speed']['target_tokens_per_s']} |"
        )
    if multi:
        lines += [
            "",
            "In its language: the share of lines py3langid puts in the direction's target when it chooses "
            "among the model's languages, the ones an output can wrongly be in; among all of its 97 it also "
            "picks close neighbours (short Czech captions as Slovak or Croatian).",
        ]
    lines += backtranslation_lines(results)
    lines += ["", "Signatures:", ""]
    for name, e in results["tests"].items():
        lines += [f"- {name} BLEU: `{e['bleu']['signature']}`", f"- {name} chrF: `{e['chrf']['signature']}`"]
    write_text(workdir / "results.md", "\n".join(lines) + "\n")


def backtranslation_lines(results: dict) -> list[str]:
    """results.md's account of a back-translation recipe: the synthetic corpus, and the forward model
    against the recipe without it (data.backtranslate.baseline) and against the same pairs untagged
    (data.backtranslate.compare_untagged) where those were trained."""
    bt = results.get("backtranslation")
    if bt is None:
        return []
    removed = ", ".join(f"{reason.replace('_', ' ')} {n:,}" for reason, n in bt["removed"].items())
    lines = [
        "",
        "## Back-translation",
        "",
        f"{bt['pairs']:,} synthetic pairs from {bt['translated']:,} monolingual lines ({bt['method']}, "
        f"{'tagged' if bt['tagged'] else 'untagged'}, weight {bt['weight']:g}; removed: {removed}), "
        f"back-translated in {bt['seconds']:,} s.",
    ]
    if bt.get("warm_start"):
        lines += ["", f"The forward model started from the reverse model's weights (`{bt['warm_start']}`)."]
    base = results.get("bitext_only")
    if base is None:
        lines += ["", "The recipe without them (bitext only) was not trained: data.backtranslate.baseline."]
    else:
        t = base["training"]
        lines += comparison_lines(
            results,
            base,
            f"Against the same recipe without the synthetic corpus (bitext only, the same vocabulary, "
            f"budget{' and starting weights' if bt.get('warm_start') else ''}; {t.get('updates')} updates in "
            f"{t.get('minutes')} min, `{base['workdir']}`):",
            "bitext only",
        )
    untagged = results.get("untagged")
    if untagged is not None:
        t = untagged["training"]
        lines += comparison_lines(
            results,
            untagged,
            f"Against the same synthetic pairs without `{BT_TAG}` (the same vocabulary, budget and start; "
            f"{t.get('updates')} updates in {t.get('minutes')} min, `{untagged['workdir']}`):",
            "untagged",
        )
    return lines


def comparison_lines(results: dict, other: dict, intro: str, name: str) -> list[str]:
    """The forward model's scores beside another run's, a row per test set."""
    lines = [
        "",
        intro,
        "",
        f"| test set | with back-translation: BLEU / chrF | {name}: BLEU / chrF | BLEU difference |",
        "| --- | --- | --- | --- |",
    ]
    for test, e in results["tests"].items():
        b = other["tests"].get(test)
        if b is None:
            continue
        lines.append(
            f"| {test} | {e['bleu']['score']} / {e['chrf']['score']} | {b['bleu']} / {b['chrf']} | "
            f"{e['bleu']['score'] - b['bleu']:+.2f} |"
        )
    return lines


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
