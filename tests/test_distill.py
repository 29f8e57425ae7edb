"""`nmt distill`: chrF selection on scripted n-best lists, the filters, the student recipes' stated sizes,
and the whole command on the reversal task, killed once in every step, against an uninterrupted run."""

from __future__ import annotations

import hashlib
import json
import os
import re
from io import StringIO

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

from nmt import atomic
from nmt.cli import app
from nmt.config import RECIPES_DIR, config_from_dict, config_to_dict, load_config
from nmt.data.filters import FilterSettings, bad_ratio, filter_pairs, repeats
from nmt.distill import DistillOptions, distill
from nmt.distill import steps as distill_steps
from nmt.distill.select import select_chrf, select_top1
from nmt.errors import ConfigError, DataError
from nmt.limits import max_workers
from nmt.train import dry_run
from nmt.translate.chunks import chunk_path

from .conftest import Killed, kill_after
from .synthetic import reverse, sentence

# ---- selection ------------------------------------------------------------------------------------------


def test_chrf_selection_keeps_the_hypothesis_closest_to_the_reference():
    refs = ["ein Mann fährt Fahrrad", "zwei Hunde spielen im Schnee"]
    nbest = [
        ["ein Hund rennt", "ein Mann fährt Rad", "ein Mann fährt Fahrrad"],  # the exact one is third
        ["zwei Hunde spielen im Schnee", "zwei Hunde spielen im Schnee ."],  # the teacher's best is exact
    ]
    chosen = select_chrf(nbest, refs)
    assert [c.rank for c in chosen] == [2, 0]
    assert chosen[0].score == pytest.approx(100.0) and chosen[1].score == pytest.approx(100.0)


def test_chrf_selection_breaks_ties_for_the_teachers_preference():
    chosen = select_chrf([["b c", "a", "b c"]], ["b c"])
    assert chosen[0].rank == 0


def test_top1_keeps_the_teachers_best_with_its_score():
    chosen = select_top1([[-0.1, -0.5], [-2.0]])
    assert [(c.rank, c.score) for c in chosen] == [(0, -0.1), (0, -2.0)]


# ---- filters --------------------------------------------------------------------------------------------


def test_repeats_finds_loops_of_one_to_four_words():
    assert repeats("a a a a", 4) and not repeats("a a a b", 4)
    assert repeats("x a b a b a b a b y", 4) and not repeats("a b a b a b", 4)
    assert repeats("1 2 3 4 " * 4, 4)


def test_bad_ratio_spares_short_pairs():
    assert not bad_ratio("zwei", "two men sit", 1.5)  # 1 word against 3: short, kept
    assert bad_ratio("a b c d", "a b c d e f g h i j k l m", 3.0)
    assert not bad_ratio("a b c d", "a b c d e f g h i j k l", 3.0)


def test_filters_count_what_each_removed_and_drop_the_worst_scores():
    srcs = ["a b c d"] * 24
    hyps = ["w x y z"] * 24
    hyps[0] = ""  # empty
    hyps[1] = "w " * 20  # too long, also repeating: counted once, by the first filter
    hyps[2] = "w x w x w x w x"  # repeating
    scores = [float(i) for i in range(24)]
    kept, removed = filter_pairs(srcs, hyps, scores, FilterSettings(max_ratio=3.0, worst_percent=10))
    # 21 pairs pass the first three filters; 10% of 21 rounds down to 2: the scores 3.0 and 4.0
    assert removed == {"empty": 1, "length_ratio": 1, "repeating": 1, "worst_score": 2}
    assert kept == list(range(5, 24))


# ---- student recipes ------------------------------------------------------------------------------------

STUDENTS = sorted(p.stem for p in RECIPES_DIR.glob("*student*.yaml"))


def test_the_student_recipes_ship():
    assert "multi30k-en-de-student" in STUDENTS
    assert any(name.startswith("wmt14-en-de-student") for name in STUDENTS)


@pytest.mark.parametrize("name", STUDENTS)
def test_a_student_recipe_states_its_parameter_count(name):
    text = (RECIPES_DIR / f"{name}.yaml").read_text()
    stated = re.search(r"# Parameters: ([\d,]+)", text)
    assert stated, f"{name}.yaml states no parameter count"
    cfg = load_config(name)
    assert dry_run(cfg) == int(stated[1].replace(",", ""))
    assert cfg.model.decoder_layers < cfg.model.encoder_layers  # deep encoder, shallow decoder


# ---- the command, killed in every step ------------------------------------------------------------------


def write_mirror(folder, seed=3):
    """Aligned files of the reversal task, and the FileSpecs that name them (as a mirror serves them)."""
    import random

    rng = random.Random(seed)
    specs = {}
    for split, n in (("train", 120), ("valid", 20), ("test", 12)):
        src = [sentence(rng) for _ in range(n)]
        for lang, lines in (("xx", src), ("yy", [reverse(s) for s in src])):
            path = folder / f"{split}.{lang}"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(line + "\n" for line in lines))
            sha = hashlib.sha256(path.read_bytes()).hexdigest()
            specs[split, lang] = {"url": f"http://127.0.0.1/data/{path.name}", "sha256": sha}
    return specs


def student_config(specs):
    corpus = lambda split: {"name": split, "src": specs[split, "xx"], "tgt": specs[split, "yy"]}  # noqa: E731
    return config_from_dict(
        {
            "data": {
                "src_lang": "xx",
                "tgt_lang": "yy",
                "train": [corpus("train")],
                "valid": [corpus("valid")],
                "test": [corpus("test")],
                "vocab_size": 64,
                "max_ratio": 3.0,
            },
            "model": {
                "encoder_layers": 2,
                "decoder_layers": 1,
                "d_model": 32,
                "d_ff": 64,
                "heads": 2,
                "dropout": 0.0,
                "max_positions": 64,
            },
            "train": {
                "batch_tokens": 512,
                "update_tokens": 512,
                "warmup": 5,
                "peak_lr": 0.003,
                "max_steps": 12,
                "log_every": 4,
                "validate_every": 1000,
                "valid_bleu": False,
                "save_every": 4,
                "keep_last": 3,
                "average_last": 2,
                "precision": "fp32",
                "threads": 1,
            },
            "decode": {"beam": 2, "lenpen": 0.6, "max_len_a": 1.0, "max_len_b": 5},
        }
    )


@pytest.fixture
def setup(tmp_path, monkeypatch, synthetic_run):
    monkeypatch.setenv("NMT_CACHE", str(tmp_path / "cache"))
    mirror = tmp_path / "mirror"
    cfg = student_config(write_mirror(mirror))
    teacher = tmp_path / "teacher.pt"
    teacher.write_bytes((synthetic_run / "checkpoints" / "best.pt").read_bytes())
    opts = DistillOptions(teacher=teacher, nbest=2, chunk_lines=50, filters=FilterSettings(worst_percent=5))
    return cfg, opts, str(mirror)


def outcome(workdir):
    """What the distillation produced: the selected and filtered corpus, the student, the scores."""
    avg = torch.load(workdir / "checkpoints" / "average.pt", weights_only=True)
    rows = json.loads((workdir / "results.json").read_text())["rows"]
    return {
        "selected": (workdir / "distill" / "selected.jsonl").read_text(),
        "train.xx": (workdir / "data" / "clean" / "train.xx").read_text(),
        "train.yy": (workdir / "data" / "clean" / "train.yy").read_text(),
        "data": (workdir / "data" / "train.tgt.bin").read_bytes(),
        "weights": avg["model"],
        "scores": [(r["system"], r["engine"], r["precision"], r["beam"], r["bleu"], r["chrf"]) for r in rows],
    }


@pytest.mark.numerics
@pytest.mark.slow  # a kill in each of 8 steps
def test_distill_killed_in_every_step_ends_as_an_uninterrupted_run(
    setup, tmp_path, monkeypatch, one_torch_thread
):
    cfg, opts, mirror = setup
    whole = tmp_path / "whole"
    distill(cfg, opts, whole, mirror=mirror)
    expected = outcome(whole)
    assert len(expected["scores"]) >= 6  # teacher, student, greedy student, in torch fp32 and int8
    assert json.loads((whole / "distill" / ".done" / "teacher.json").read_text())["info"]["chunks"] == 3

    import nmt.checkpoint
    import nmt.train.loop

    def path_is(name):
        return lambda path, *a, **k: str(path).endswith(name)

    kills = [
        ("text", lambda m: kill_after(m, distill_steps, "write_text")),
        ("teacher", lambda m: kill_after(m, atomic, "write_text", path_is("00001.jsonl"))),
        ("select", lambda m: kill_after(m, atomic, "write_text", path_is("selected.jsonl"))),
        ("filter", lambda m: kill_after(m, atomic, "write_text", path_is("train.xx"))),
        ("data", lambda m: kill_after(m, distill_steps, "binarize")),
        ("train", lambda m: kill_after(m, nmt.train.loop, "save_training_checkpoint")),
        ("average", lambda m: kill_after(m, nmt.checkpoint, "average_checkpoints")),
        # the first translation written, its record not: done again, not taken as finished
        (
            "compare",
            lambda m: kill_after(m, atomic, "write_text", path_is("teacher-torch-fp32-beam4/test.yy")),
        ),
    ]
    resumed = tmp_path / "resumed"
    for step, arm in kills:
        with monkeypatch.context() as m:
            arm(m)
            with pytest.raises(Killed):
                distill(cfg, opts, resumed, mirror=mirror)
        assert not (resumed / "distill" / ".done" / f"{step}.json").exists()
    distill(cfg, opts, resumed, mirror=mirror)
    got = outcome(resumed)
    weights = got.pop("weights")
    want = expected.pop("weights")
    assert got == expected
    assert weights.keys() == want.keys() and all(torch.equal(weights[k], want[k]) for k in want)

    # A student trained further (here: average.pt newer) is translated again; the teacher's are kept.
    stale = resumed / "translations" / "student-torch-fp32-beam2" / "test.yy"
    stale.write_text("x\n" * len(stale.read_text().splitlines()))
    teacher_out = resumed / "translations" / "teacher-torch-fp32-beam4" / "test.yy"
    teacher_mtime = teacher_out.stat().st_mtime_ns
    average = resumed / "checkpoints" / "average.pt"
    os.utime(average, ns=(average.stat().st_atime_ns, average.stat().st_mtime_ns + 10**9))
    distill(cfg, opts, resumed, mirror=mirror)
    assert outcome(resumed)["scores"] == expected["scores"]
    assert teacher_out.stat().st_mtime_ns == teacher_mtime


def test_a_work_directory_refuses_other_settings(setup, tmp_path, monkeypatch):
    cfg, opts, mirror = setup
    workdir = tmp_path / "w"
    kill_after(monkeypatch, distill_steps, "write_text")
    with pytest.raises(Killed):
        distill(cfg, opts, workdir, mirror=mirror)
    other = DistillOptions(teacher=opts.teacher, nbest=3, chunk_lines=opts.chunk_lines, filters=opts.filters)
    with pytest.raises(ConfigError, match=r"--nbest differs.*another --workdir"):
        distill(cfg, other, workdir, mirror=mirror)


def test_cli_refuses_chrf_selection_without_references(tmp_path):
    mono = tmp_path / "mono.en"
    mono.write_text("a man\n")
    teacher = tmp_path / "t.pt"
    teacher.write_bytes(b"")
    args = ["distill", "multi30k-en-de-student", "--teacher", str(teacher), "--mono", str(mono)]
    result = CliRunner().invoke(app, [*args, "--select", "chrf", "--workdir", str(tmp_path / "w")])
    assert result.exit_code == 2
    assert "--select chrf needs references" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "w").exists()


def test_mono_source_on_ctranslate2_int8_keeps_the_teachers_best(setup, tmp_path, one_torch_thread):
    """--mono with --select top1, the teacher in CTranslate2 int8: the log and the marker name the engine,
    every monolingual line gets an n-best list, and the teacher's best is what the student learns."""
    pytest.importorskip("ctranslate2")

    from nmt.config import Engine, Precision

    cfg, opts, mirror = setup
    mono = tmp_path / "mono.xx"
    mono.write_text("a b c\nd e f g\nh i\n")
    opts = DistillOptions(
        teacher=opts.teacher,
        select="top1",
        mono=mono,
        teacher_engine=Engine.CTRANSLATE2,
        teacher_precision=Precision.INT8,
        nbest=2,
        chunk_lines=2,
    )
    log = StringIO()
    run = distill_steps.Run(
        distill_steps.student_config(cfg, opts.teacher),
        opts,
        tmp_path / "w",
        mirror,
        Console(file=log, width=500),
    )
    for name in distill_steps.STEPS[:4]:
        run.step(name, getattr(run, name))
    info = run.marker_info("teacher")
    assert (info["engine"], info["lines"], info["chunks"]) == ("ctranslate2", 3, 2)
    assert info["precision"].startswith("int8")  # CTranslate2's compute type: int8_float32 on a CPU
    assert "on ctranslate2" in log.getvalue()
    selected = [
        json.loads(x) for x in (tmp_path / "w" / "distill" / "selected.jsonl").read_text().splitlines()
    ]
    nbest = [
        json.loads(x)
        for k in (0, 1)
        for x in (tmp_path / "w" / "distill" / "nbest" / f"{k:05d}.jsonl").read_text().splitlines()
    ]
    assert [s["hyp"] for s in selected] == [n["hyps"][0] for n in nbest]
    assert all(len(n["hyps"]) == 2 for n in nbest)
    filtered = run.marker_info("filter")
    assert filtered["pairs"] == 3 and filtered["kept"] == 3 - sum(filtered["removed"].values())
    clean = tmp_path / "w" / "data" / "clean"
    kept = list(
        zip(
            clean.joinpath("train.xx").read_text().splitlines(),
            clean.joinpath("train.yy").read_text().splitlines(),
            strict=True,
        )
    )
    assert len(kept) == filtered["kept"]
    assert set(kept) <= set(zip(mono.read_text().splitlines(), [s["hyp"] for s in selected], strict=True))


# ---- --init teacher: shrink and fine-tune -----------------------------------------------------------------

QUIET = Console(file=StringIO())


def test_a_student_stack_takes_the_teachers_layers_spread_evenly():
    from nmt.distill.shrink import picks

    assert picks(3, 1) == [0] and picks(3, 3) == [0, 1, 2] and picks(12, 2) == [0, 11]
    assert picks(6, 3) == [0, 2, 5] and picks(6, 4) == [0, 2, 3, 5]


def test_init_teacher_writes_the_students_first_weights_from_the_teachers(setup, tmp_path):
    """The init step on the reversal teacher (2+2 layers): a 2+1 student of its width gets its embeddings,
    both encoder layers and the first decoder layer, bit for bit; training then starts from that file."""
    cfg, opts, mirror = setup
    teacher = torch.load(opts.teacher, weights_only=True)
    width = {k: teacher["config"]["model"][k] for k in ("d_model", "d_ff", "heads", "norm", "output_bias")}
    model = dict(teacher["config"]["model"], **width, encoder_layers=2, decoder_layers=1)
    cfg = config_from_dict({**config_to_dict(cfg), "model": model})
    opts = DistillOptions(teacher=opts.teacher, init="teacher")
    run = distill_steps.Run(
        distill_steps.student_config(cfg, opts.teacher), opts, tmp_path / "w", mirror, QUIET
    )
    assert run.init() == {"encoder": [0, 1], "decoder": [0]}
    student = torch.load(run.init_path, weights_only=True)["model"]
    tmodel = teacher["model"]
    assert student.keys() == {k for k in tmodel if not k.startswith("decoder.1.")}
    assert all(torch.equal(v, tmodel[k]) for k, v in student.items())


def test_init_teacher_refuses_a_student_of_another_width_in_one_line(setup, tmp_path):
    cfg, opts, mirror = setup  # the setup's student: d_model 32, the teacher's 64
    opts = DistillOptions(teacher=opts.teacher, init="teacher")
    run = distill_steps.Run(
        distill_steps.student_config(cfg, opts.teacher), opts, tmp_path / "w", mirror, QUIET
    )
    with pytest.raises(
        ConfigError, match=r"^--init teacher: the student's model.d_model 32 is not the teacher's 64"
    ):
        run.init()
    assert not run.init_path.exists()
    with pytest.raises(ConfigError, match=r"--init sideways: expected one of scratch, teacher"):
        distill_steps.check_options(DistillOptions(teacher=opts.teacher, init="sideways"))


# ---- checked before the teacher runs; damage from outside is one line ----------------------------------


def nothing_done(workdir) -> bool:
    return not (workdir / "distill" / "nbest").exists() and not (workdir / "source").exists()


def test_a_teacher_of_the_other_direction_is_refused_before_it_translates(setup, tmp_path):
    cfg, opts, mirror = setup  # the teacher translates xx->yy
    import dataclasses

    backwards = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, src_lang="yy", tgt_lang="xx"))
    with pytest.raises(ConfigError, match=r"^--teacher .*: translates xx->yy, the student recipe yy->xx$"):
        distill(backwards, opts, tmp_path / "w", mirror=mirror, console=QUIET)
    assert nothing_done(tmp_path / "w")


def test_a_student_init_teacher_cannot_start_from_is_refused_before_the_teacher_runs(setup, tmp_path):
    cfg, opts, mirror = setup  # the setup's student: d_model 32, the teacher's 64
    opts = DistillOptions(teacher=opts.teacher, init="teacher")
    with pytest.raises(ConfigError, match=r"^--init teacher: the student's model.d_model 32"):
        distill(cfg, opts, tmp_path / "w", mirror=mirror, console=QUIET)
    assert nothing_done(tmp_path / "w")


@pytest.mark.parametrize("text", [b"", b"\n\n  \n"])
def test_an_empty_mono_file_is_refused_before_any_step(setup, tmp_path, text):
    cfg, opts, mirror = setup
    mono = tmp_path / "mono.xx"
    mono.write_bytes(text)
    opts = DistillOptions(teacher=opts.teacher, mono=mono, select="top1")
    with pytest.raises(DataError, match=r"^--mono .*mono.xx: no text to translate"):
        distill(cfg, opts, tmp_path / "w", mirror=mirror, console=QUIET)
    assert nothing_done(tmp_path / "w")


def test_invalid_utf8_in_mono_is_a_counted_warning(tmp_path):
    mono = tmp_path / "mono.xx"
    mono.write_bytes("a b \ufffd\n".encode() + b"c \xff d \xc3\n")  # one real U+FFFD, two bad bytes
    out = StringIO()
    distill_steps.check_mono(mono, Console(file=out, width=200))
    assert "2 invalid UTF-8 sequence(s)" in out.getvalue() and str(mono) in out.getvalue()
    clean = StringIO()
    mono.write_bytes("a b \ufffd\n".encode())
    distill_steps.check_mono(mono, Console(file=clean))
    assert clean.getvalue() == ""


def test_a_damaged_chunk_is_translated_again_and_other_damage_is_one_line(setup, tmp_path):
    cfg, opts, mirror = setup
    cfg = distill_steps.student_config(cfg, opts.teacher)
    run = distill_steps.Run(cfg, opts, tmp_path / "w", mirror, QUIET)
    run.step("text", run.text)
    run.step("teacher", run.teacher)
    chunk = chunk_path(run.dir / "nbest", 1)
    whole = chunk.read_text()
    for damage in (
        whole[: len(whole) // 2],
        whole.replace("hyps", "hips", 1),
        "\n".join(whole.split("\n")[1:]),
    ):
        chunk.write_text(damage)
        run.teacher()
        assert chunk.read_text() == whole
    chunk.write_text(whole[: len(whole) // 2])
    with pytest.raises(DataError, match=r"00001.jsonl line \d+: damaged"):
        run.select()
    chunk.write_text(whole)
    run.select()
    selected = run.dir / "selected.jsonl"
    selected.write_text(selected.read_text()[:-20])
    with pytest.raises(DataError, match=r"selected.jsonl line \d+: damaged"):
        run.filter()
    marker = run.dir / ".done" / "text.json"
    marker.write_text("{")
    with pytest.raises(DataError, match=r"text.json: damaged; delete it to run that step again"):
        run.marker_info("text")


@pytest.mark.numerics
@pytest.mark.slow  # three real processes killed, then resumed, beside an uninterrupted one
def test_distill_killed_by_signals_inside_its_steps_resumes_to_the_same_student(setup, tmp_path):
    """SIGKILL in the teacher step (a chunk written, the next not), SIGTERM in training, SIGKILL in the
    average/compare steps: each real process dies where it is, and the run then ends as one never
    killed did. Unlike the test above, nothing is scripted: the signal lands wherever the process is."""
    import signal
    import subprocess
    import sys
    import time

    import yaml

    cfg, opts, mirror = setup
    recipe = tmp_path / "student.yaml"
    recipe.write_text(yaml.safe_dump(config_to_dict(cfg)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NMT_DATA_MIRROR": mirror}

    def command(workdir):
        return [sys.executable, "-m", "nmt", "distill", str(recipe), "-t", str(opts.teacher), "-w",
                str(workdir), "--nbest", "2", "--chunk-lines", "50", "--drop-worst", "5"]  # fmt: skip

    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    done = subprocess.run(command(whole), env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    for sig, sign in (
        (signal.SIGKILL, "distill/nbest/00000.jsonl"),
        (signal.SIGTERM, "checkpoints/step-4.pt"),
        (signal.SIGKILL, "checkpoints/average.pt"),
    ):
        process = subprocess.Popen(
            command(resumed), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        deadline = time.monotonic() + 300
        while not (resumed / sign).exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        process.send_signal(sig)
        _, stderr = process.communicate(timeout=120)
        assert "Traceback" not in stderr.decode(), stderr.decode()
    done = subprocess.run(command(resumed), env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    got, want = outcome(resumed), outcome(whole)
    weights, want_weights = got.pop("weights"), want.pop("weights")
    assert got == want
    assert all(torch.equal(weights[k], want_weights[k]) for k in want_weights)


def test_the_results_table_fits_a_log_in_plain_lines():
    """A fixed-width table written to a log was cut to 80 columns ("teach…")."""
    from nmt.distill.compare import show

    row = {
        "system": "teacher", "engine": "ctranslate2", "precision": "float16", "beam": 4,
        "test": "test_2016_flickr", "bleu": 35.031, "chrf": 61.2, "sentences_per_s": 123.4,
        "latency_ms": 56.7,
    }  # fmt: skip
    out = StringIO()
    show({"rows": [row, {**row, "system": "student"}]}, Console(file=out, width=80))
    lines = out.getvalue().splitlines()
    assert "…" not in out.getvalue() and len(lines) == 4
    assert lines[2].split("\t") == ["teacher", "ctranslate2", "float16", "4", "test_2016_flickr", "35.03",
                                    "61.20", "123.4", "56.7"]  # fmt: skip


def test_the_teacher_translates_with_the_workers_and_progress_of_nmt_translate(setup, tmp_path, monkeypatch):
    """The teacher's step runs the worker plan `nmt translate` makes for a file (here 2 threads: two
    one-thread workers) and shows progress per batch, not one line per saved chunk."""
    import nmt.translate.workers as workers_module

    cfg, opts, mirror = setup
    monkeypatch.setenv("NMT_PROGRESS_EVERY", "0")
    started = []
    original = workers_module.WorkerPool.__init__

    def spy(self, translator, workers, threads):
        started.append((workers, threads))
        original(self, translator, workers, threads)

    monkeypatch.setattr(workers_module.WorkerPool, "__init__", spy)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        log = StringIO()
        cfg = distill_steps.student_config(cfg, opts.teacher)
        run = distill_steps.Run(cfg, opts, tmp_path / "w", mirror, Console(file=log, width=200))
        run.step("text", run.text)
        run.step("teacher", run.teacher)
    finally:
        torch.set_num_threads(threads)
    if max_workers() >= 2:
        assert started == [(2, 1)]
    total = run.marker_info("teacher")["lines"]
    found = re.finditer(rf"([\d,]+) of {total:,} lines", log.getvalue())
    counts = [int(m[1].replace(",", "")) for m in found]
    assert len(counts) > run.marker_info("teacher")["chunks"], log.getvalue()
    assert counts == sorted(counts) and counts[-1] == total
