"""`nmt distill`: a student trained on what a teacher translates, in one resumable command.

    text      fetch the recipe's corpora: the cleaned training text, raw validation and test text
              (source/), and with --mono a copy of the monolingual file
    teacher   the teacher's n-best of every training source line, in chunks (distill/nbest/NNNNN.jsonl)
    select    per line the hypothesis closest to the reference by chrF, or the teacher's best
              (distill/selected.jsonl)
    filter    drop empty, badly sized, repeating and the worst-scoring pairs (data/clean/train.*)
    data      the student's data under the teacher's SentencePiece model, validation on the original
              references (data/, as `nmt preprocess` lays it out)
    init      with --init teacher only: the student's first weights shrunk from the teacher's
              (distill/student-init.pt, nmt.distill.shrink), from which training starts
    train     `nmt train` of the student recipe (checkpoints/; it resumes itself from last.pt)
    average   the last checkpoints into checkpoints/average.pt
    compare   teacher against student on the test sets, per engine and precision (results.md, .json)

Every output is written atomically, and a step's marker (distill/.done/<step>.json, with the seconds it
took) only after its outputs, so a kill leaves each step either done or to be redone; the teacher's
chunks are each kept once written, so a killed teacher step resumes at its first missing chunk. The
settings a work directory was started with are kept in distill/settings.json: running again with others
is refused in one line, rather than mixing two teachers' output.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from nmt import atomic
from nmt.checkpoint import checkpoint_config, checkpoint_subword
from nmt.config import Config, DecodeOverrides, Engine, Precision, config_to_dict
from nmt.data.clean import REASONS as CLEAN_REASONS
from nmt.data.filters import FilterSettings, filter_pairs
from nmt.data.preprocess import binarize, write_text
from nmt.distill.select import select_chrf, select_top1
from nmt.errors import ConfigError, DataError
from nmt.limits import check
from nmt.score import read_lines
from nmt.translate.chunks import changed_setting, is_number, read_chunks, read_jsonl

STEPS = ("text", "teacher", "select", "filter", "data", "train", "average", "compare")
SELECT = ("chrf", "top1")
INIT = ("scratch", "teacher")


@dataclass(frozen=True)
class DistillOptions:
    """What `nmt distill` takes beside the student recipe."""

    teacher: Path
    select: str = "chrf"  # chrf: closest to the reference; top1: the teacher's best (needed with mono)
    mono: Path | None = None  # monolingual source text to translate instead of the recipe's training source
    teacher_engine: Engine = Engine.TORCH
    teacher_precision: Precision = Precision.FP32
    nbest: int = 4  # hypotheses per line; the teacher's beam is at least this wide
    chunk_lines: int = 2000  # lines the teacher translates between two saved chunks
    filters: FilterSettings = FilterSettings()
    compare: bool = True  # the last step: teacher against student on the test sets
    init: str = "scratch"  # teacher: the student starts from the teacher's layers (nmt.distill.shrink)


def check_options(opts: DistillOptions) -> None:
    if not opts.teacher.is_file():
        raise ConfigError(f"--teacher {opts.teacher}: no such checkpoint")
    if opts.select not in SELECT:
        raise ConfigError(f"--select {opts.select}: expected one of {', '.join(SELECT)}")
    if opts.init not in INIT:
        raise ConfigError(f"--init {opts.init}: expected one of {', '.join(INIT)}")
    if opts.mono is not None and opts.select == "chrf":
        raise ConfigError("--select chrf needs references, and --mono text has none: use --select top1")
    if opts.mono is not None and not opts.mono.is_file():
        raise ConfigError(f"--mono {opts.mono}: no such file")
    check("--nbest", opts.nbest)
    check("--chunk-lines", opts.chunk_lines)
    check("--max-ratio", opts.filters.max_ratio)
    check("--drop-worst", opts.filters.worst_percent)


def student_config(cfg: Config, teacher: Path, teacher_config: dict | None = None) -> Config:
    """The student recipe under the teacher's vocabulary: its SentencePiece model is the teacher's.
    `teacher_config`: the teacher's config as read already (checkpoint_config), else read here."""
    if cfg.data.init_from is not None:
        raise ConfigError("data.init_from: a student starts from scratch; distill from --teacher instead")
    data = (teacher_config if teacher_config is not None else checkpoint_config(teacher))["data"]
    return dataclasses.replace(
        cfg,
        data=dataclasses.replace(cfg.data, vocab_size=data["vocab_size"], subword_type=data["subword_type"]),
    )


def check_teacher(cfg: Config, opts: DistillOptions, teacher: dict) -> None:
    """What would fail or mislead only after the teacher has translated the whole corpus, refused
    before: a teacher of the other direction, and a student `--init teacher` cannot start from."""
    from nmt.config import config_from_dict

    if cfg.data.multilingual:
        raise ConfigError("nmt distill trains a student of one direction: give it a recipe of one pair")
    data = config_from_dict(teacher, corpora=False).data
    # a multilingual teacher teaches any of its directions (translating with its target's tag)
    directions = data.directions if data.train else ((data.src_lang, data.tgt_lang),)
    if (cfg.data.src_lang, cfg.data.tgt_lang) not in directions:
        held = ", ".join(f"{s}->{t}" for s, t in directions)
        raise ConfigError(
            f"--teacher {opts.teacher}: translates {held}, the student recipe "
            f"{cfg.data.src_lang}->{cfg.data.tgt_lang}"
        )
    if opts.init == "teacher":
        from nmt.distill.shrink import check_shapes

        check_shapes(config_from_dict(teacher).model, cfg.model)


def check_mono(path: Path, console: Console) -> None:
    """--mono: text to translate, read as UTF-8. Invalid bytes become U+FFFD, as every reader here does,
    and a warning counts them; a file without one non-blank line is refused before any step runs."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DataError(f"--mono {path}: cannot read: {e.strerror or e}") from None
    text = data.decode("utf-8", errors="replace")
    bad = text.count("\ufffd") - data.decode("utf-8", errors="ignore").count("\ufffd")
    if bad:
        console.print(
            f"[yellow]warning:[/] --mono {path}: {bad:,} invalid UTF-8 sequence(s), each read as U+FFFD",
            highlight=False,
        )
    if not text.strip():
        raise DataError(f"--mono {path}: no text to translate (empty, or blank lines only)")


def distill(
    cfg: Config,
    opts: DistillOptions,
    workdir: Path,
    mirror: str | None = None,
    console: Console | None = None,
) -> dict:
    """Run the steps not yet done; returns the comparison (results.json), or the step times without it."""
    from nmt.checkpoint import average_last
    from nmt.train import train

    console = console or Console(stderr=True)
    check_options(opts)
    teacher_config = checkpoint_config(opts.teacher)  # read once: the student's vocabulary, decode, compare
    cfg = student_config(cfg, opts.teacher, teacher_config)
    check_teacher(cfg, opts, teacher_config)
    if opts.mono is not None:
        check_mono(opts.mono, console)
    workdir = Path(workdir)
    run = Run(cfg, opts, workdir, mirror, console, teacher_config)
    run.check_settings()
    run.step("text", run.text)
    run.step("teacher", run.teacher)
    run.step("select", run.select)
    run.step("filter", run.filter)
    run.step("data", run.data)
    train_cfg = cfg
    if opts.init == "teacher":
        run.step("init", run.init)
        train_cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, init_from=str(run.init_path)))
    console.rule("[bold]train")
    start = time.perf_counter()
    train(train_cfg, workdir, console=console)
    run.times["train"] = time.perf_counter() - start
    console.rule("[bold]average")
    start = time.perf_counter()
    model = average_last(cfg, workdir / "checkpoints", console)
    run.times["average"] = time.perf_counter() - start
    if not opts.compare:
        return run.times
    console.rule("[bold]compare")
    from nmt.distill.compare import compare

    return compare(cfg, opts, workdir, model, run.step_seconds(), console, run.teacher_config)


class Run:
    """The steps of one work directory, each a method that writes its outputs."""

    def __init__(
        self,
        cfg: Config,
        opts: DistillOptions,
        workdir: Path,
        mirror: str | None,
        console: Console,
        teacher_config: dict | None = None,
    ):
        self.cfg, self.opts, self.workdir, self.mirror, self.console = cfg, opts, workdir, mirror, console
        self.given_teacher_config = teacher_config
        self.source = workdir / "source"
        self.dir = workdir / "distill"
        self.init_path = self.dir / "student-init.pt"
        self.times: dict[str, float] = {}
        self.src_lang, self.tgt_lang = cfg.data.src_lang, cfg.data.tgt_lang

    @functools.cached_property
    def teacher_config(self) -> dict:
        """The teacher checkpoint's config, read once (or as `distill` read it)."""
        if self.given_teacher_config is not None:
            return self.given_teacher_config
        return checkpoint_config(self.opts.teacher)

    # -- bookkeeping ------------------------------------------------------------------------------------

    def settings(self) -> dict:
        opts = self.opts
        return {
            "teacher_sha256": file_sha256(opts.teacher),
            "mono_sha256": file_sha256(opts.mono) if opts.mono is not None else None,
            "select": opts.select,
            "teacher_engine": str(opts.teacher_engine),
            "teacher_precision": str(opts.teacher_precision),
            "nbest": opts.nbest,
            "chunk_lines": opts.chunk_lines,
            "filters": dataclasses.asdict(opts.filters),
            "data": config_to_dict(self.cfg)["data"],
        }

    def check_settings(self) -> None:
        """The first run records its settings; a later one must match them (one line names the first
        that differs), since the steps done so far were made with them."""
        key = changed_setting(self.dir / "settings.json", self.settings())
        if key is not None:
            what = {
                "teacher_sha256": "--teacher (another checkpoint)",
                "mono_sha256": "--mono (other text)",
            }
            name = what.get(
                key, "the recipe's data section" if key == "data" else f"--{key.replace('_', '-')}"
            )
            raise ConfigError(
                f"{self.workdir}: distilled so far with other settings ({name} differs); run with the "
                f"same ones to continue, or use another --workdir"
            )

    def step(self, name: str, work) -> None:
        self.console.rule(f"[bold]{name}")
        marker = self.dir / ".done" / f"{name}.json"
        if marker.exists():
            self.console.print(f"{name}: already done ({marker})", highlight=False)
            return
        start = time.perf_counter()
        info = work()
        seconds = time.perf_counter() - start
        self.times[name] = seconds
        write_json(marker, {"seconds": round(seconds, 1), "info": info})
        self.console.print(f"{name}: done in {seconds:.1f} s", highlight=False)

    def step_seconds(self) -> dict:
        """Seconds each step took when it ran (from the markers, so a resumed run reports them all)."""
        seconds = {}
        for name in STEPS[:5]:
            marker = self.dir / ".done" / f"{name}.json"
            if marker.exists():
                seconds[name] = read_marker(marker)["seconds"]
        for name in ("train", "average"):
            if name in self.times:
                seconds[f"{name} (this run)"] = round(self.times[name], 1)
        return seconds

    def marker_info(self, name: str) -> dict:
        return read_marker(self.dir / ".done" / f"{name}.json")["info"]

    # -- the steps --------------------------------------------------------------------------------------

    def text(self) -> dict:
        info = write_text(self.cfg.data, self.source, mirror=self.mirror, console=self.console)
        if self.opts.mono is not None:
            atomic.write_text(
                self.teacher_source(), "".join(line + "\n" for line in read_lines(self.opts.mono))
            )
        return info

    def teacher_source(self) -> Path:
        if self.opts.mono is not None:
            return self.source / f"mono.{self.src_lang}"
        return self.source / "clean" / f"train.{self.src_lang}"

    def teacher(self) -> dict:
        from nmt.translate.chunks import ChunkedRun, translate_chunks

        opts = self.opts
        model = opts.teacher
        if opts.teacher_engine is Engine.CTRANSLATE2:
            model = self.teacher_export()
        decode = self.teacher_config["decode"]
        overrides = DecodeOverrides.given(nbest=opts.nbest, beam=max(decode["beam"], opts.nbest))
        run = ChunkedRun(
            model, overrides, self.cfg.train.device, opts.teacher_precision, opts.teacher_engine,
            label="teacher", name=str(opts.teacher), command="nmt distill", target=self.tgt_lang,
        )  # fmt: skip
        info = translate_chunks(
            read_lines(self.teacher_source()), self.dir / "nbest", opts.chunk_lines, run, self.console
        )
        return {k: info[k] for k in ("lines", "chunks", "engine", "precision", "beam", "nbest")}

    def teacher_export(self) -> Path:
        from nmt.formats.export import exported

        return exported(self.opts.teacher, self.workdir / "export" / "teacher-ctranslate2", self.console)

    def select(self) -> dict:
        lines = read_lines(self.teacher_source())
        nbest = read_chunks(self.dir / "nbest", len(lines), self.opts.chunk_lines)
        if self.opts.select == "chrf":
            refs = read_lines(self.source / "clean" / f"train.{self.tgt_lang}")
            chosen = select_chrf([n["hyps"] for n in nbest], refs)
        else:
            chosen = select_top1([n["scores"] for n in nbest])
        text = "".join(
            json.dumps(
                {"hyp": n["hyps"][c.rank], "rank": c.rank, "score": round(c.score, 4)}, ensure_ascii=False
            )
            + "\n"
            for n, c in zip(nbest, chosen, strict=True)
        )
        atomic.write_text(self.dir / "selected.jsonl", text)
        ranks: dict[int, int] = {}
        for c in chosen:
            ranks[c.rank] = ranks.get(c.rank, 0) + 1
        self.console.print(
            f"select ({self.opts.select}): kept rank "
            + ", ".join(f"{r + 1}: {ranks[r]:,}" for r in sorted(ranks)),
            highlight=False,
        )
        return {"select": self.opts.select, "ranks": {str(r + 1): n for r, n in sorted(ranks.items())}}

    def filter(self) -> dict:
        srcs = read_lines(self.teacher_source())
        selected = read_jsonl(self.dir / "selected.jsonl", {"hyp": str, "score": (int, float)})
        if len(selected) != len(srcs):
            raise DataError(f"{self.dir / 'selected.jsonl'}: {len(selected)} lines for {len(srcs)} sources")
        hyps, scores = [s["hyp"] for s in selected], [s["score"] for s in selected]
        kept, removed = filter_pairs(srcs, hyps, scores, self.opts.filters)
        clean = self.workdir / "data" / "clean"
        atomic.write_text(clean / f"train.{self.src_lang}", "".join(srcs[i] + "\n" for i in kept))
        atomic.write_text(clean / f"train.{self.tgt_lang}", "".join(hyps[i] + "\n" for i in kept))
        self.console.print(
            f"filter: {len(srcs):,} pairs, removed "
            + ", ".join(f"{reason.replace('_', ' ')} {n:,}" for reason, n in removed.items())
            + f"; kept {len(kept):,}",
            highlight=False,
        )
        return {"pairs": len(srcs), "removed": removed, "kept": len(kept)}

    def init(self) -> dict:
        """distill/student-init.pt: the student's first weights, from the teacher's (--init teacher)."""
        from nmt.checkpoint import load_checkpoint, save_checkpoint
        from nmt.distill.shrink import picks, shrink
        from nmt.model import Transformer

        ckpt = load_checkpoint(self.opts.teacher)
        t, s = ckpt.config.model, self.cfg.model
        student = Transformer(s, ckpt.vocab_size)
        student.load_state_dict(shrink(t, ckpt.model_state, s, student.state_dict().keys()))
        save_checkpoint(
            self.init_path,
            model_state=student.state_dict(),
            config=self.cfg,
            subword_proto=ckpt.subword_proto,
            vocab_size=ckpt.vocab_size,
        )
        layers = {
            k: picks(getattr(t, f"{k}_layers"), getattr(s, f"{k}_layers")) for k in ("encoder", "decoder")
        }
        self.console.print(
            f"init: the student starts from the teacher's embeddings, its encoder layers "
            f"{layers['encoder']} and decoder layers {layers['decoder']} (counted from 0)",
            highlight=False,
        )
        return layers

    def data(self) -> dict:
        """data/ as `nmt preprocess` writes it, with the teacher's subwords and the filtered pairs."""
        out = self.workdir / "data"
        atomic.write_bytes(out / "spm.model", checkpoint_subword(self.opts.teacher))
        text = self.marker_info("text")
        names = [f"valid.{lang}" for lang in (self.src_lang, self.tgt_lang)]
        names += [f"test/{name}.{lang}" for name in text["test"] for lang in (self.src_lang, self.tgt_lang)]
        for name in names:
            atomic.link_or_copy(self.source / name, out / name)
        kept = self.marker_info("filter")["kept"]
        text_info = {
            "train": {
                "corpora": {
                    "distilled": {"lines": kept, "kept": kept, "dropped": dict.fromkeys(CLEAN_REASONS, 0)}
                }
            },
            "valid": text["valid"],
            "test": text["test"],
        }
        # binarize groups the pairs by the recipe's training corpora; here they are one, the distilled text
        distilled = dataclasses.replace(self.cfg.data.train[0], name="distilled", weight=1.0, tag=False)
        data = dataclasses.replace(self.cfg.data, train=(distilled,))
        stats = binarize(data, out, text_info, self.console)
        write_json(out / "stats.json", stats)
        self.console.print(
            f"data: {stats['train']['kept']:,} training pairs, {stats['valid']['lines']:,} validation pairs "
            f"(the original references), vocabulary {stats['vocab_size']:,} (the teacher's)",
            highlight=False,
        )
        return {"train_pairs": stats["train"]["kept"], "valid_pairs": stats["valid"]["lines"]}


def read_marker(path: Path) -> dict:
    """A step's marker: {"seconds": ..., "info": ...}; damage from outside is one line naming it."""
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        obj = None
    if not isinstance(obj, dict) or not is_number(obj.get("seconds")) or "info" not in obj:
        raise DataError(f"{path}: damaged; delete it to run that step again")
    return obj


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def write_json(path: Path, obj: dict) -> None:
    atomic.write_text(path, json.dumps(obj, indent=2) + "\n")
