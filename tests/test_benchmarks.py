"""The benchmarks (benchmarks/*.py) at tiny sizes, so that they cannot rot: the training throughput's FLOP
count and figures, the synthetic data, the RESULTS.md writer, the side-by-side training and serving
scripts, and the GPU check's harness run on the CPU."""

from __future__ import annotations

import importlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from nmt.config import ModelConfig
from nmt.model import Transformer
from nmt.train.loss import label_smoothed_nll

# The benchmarks are scripts that import their neighbours (`import common`), as `python benchmarks/x.py`
# runs them: their folder goes on the path here, for this module only.
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
common = importlib.import_module("common")
throughput = importlib.import_module("train_throughput")
speed = importlib.import_module("train_speed")
check = importlib.import_module("gpu_check")
typed = importlib.import_module("typed_input")

TINY = [
    "--set=model.encoder_layers=1",
    "--set=model.decoder_layers=1",
    "--set=model.d_model=32",
    "--set=model.d_ff=64",
    "--set=model.heads=2",
    "--set=data.vocab_size=100",
    "--set=train.batch_tokens=256",
    "--set=train.update_tokens=512",  # two micro-batches per update
    "--set=train.compile=false",  # explicit: a smoke test should not wait for compilation
    "--updates=2",
    "--warmup-updates=1",
    "--windows=2",
    "--matmul-size=128",
    "--device=cpu",
    "--json",
]


def test_model_flops_by_hand():
    cfg = ModelConfig(encoder_layers=1, decoder_layers=1, d_model=4, d_ff=8, heads=2)
    d, f, v = 4, 8, 10
    flops = 0
    for s, t in ((3, 2), (1, 4)):  # (source, target) tokens as the model sees them
        encoder = 2 * (4 * d * d + 2 * d * f) * s + 2 * 2 * s * s * d
        decoder = (
            2 * (4 * d * d + 2 * d * d + 2 * d * f) * t  # self Q,K,V,O; cross Q,O; FFN
            + 2 * (2 * d * d) * s  # cross K,V over the source
            + 2 * 2 * t * t * d  # self-attention, full T^2
            + 2 * 2 * t * s * d  # cross-attention
        )
        output = 2 * d * v * t
        flops += 3 * (encoder + decoder + output)
    assert throughput.model_flops(cfg, [3, 1], [2, 4], v) == flops
    # pair by pair: padding to the longest pair would count (3, 4) and (3, 4)
    one_by_one = throughput.model_flops(cfg, [3], [2], v) + throughput.model_flops(cfg, [1], [4], v)
    assert (
        throughput.model_flops(cfg, [3, 1], [2, 4], v)
        == one_by_one
        < throughput.model_flops(cfg, [3, 3], [4, 4], v)
    )


def test_model_flops_equals_torch_count_of_a_real_training_pass():
    """Forward + backward through the real model and loss, counted op by op by torch's FlopCounterMode."""
    cfg = ModelConfig(encoder_layers=2, decoder_layers=1, d_model=16, d_ff=24, heads=2, dropout=0.0)
    vocab, b, s, t = 50, 3, 5, 7
    model = Transformer(cfg, vocab)
    src, tgt_in, tgt_out = (torch.randint(4, vocab, (b, n)) for n in (s, t, t))  # no padding
    # The math backend runs attention as counted matmuls; fused CPU kernels are invisible to the counter.
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        loss, _ = label_smoothed_nll(model(src, tgt_in), tgt_out, 0.1, 0)
        loss.backward()
    assert throughput.model_flops(cfg, [s] * b, [t] * b, vocab) == counter.get_total_flops()


def test_synthetic_lengths_follow_the_length_model():
    src, tgt = throughput.WMT_LENGTHS.pairs(50_000, seed=3)
    assert abs(src.double().mean().item() - 27.0) < 1.0
    assert abs((tgt.double().mean() / src.double().mean()).item() - 1.1) < 0.05
    assert int(src.min()) >= 1 and int(tgt.max()) <= 250


def test_synthetic_text_has_newstest_lengths_and_zipf_frequencies():
    lines = common.SyntheticText(seed=5).lines(5000, common.NEWSTEST_WORDS)
    words = [len(line.split()) for line in lines]
    assert abs(statistics.mean(words) - 25) < 1.5 and abs(statistics.stdev(words) - 14) < 2.5
    assert min(words) >= 1 and max(words) <= 120
    counts = Counter(w.lower().rstrip(".") for line in lines for w in line.split()).most_common(3)
    assert 1.7 < counts[0][1] / counts[1][1] < 2.3  # p(rank r) ~ 1 / r: the first twice the second
    assert 1.3 < counts[1][1] / counts[2][1] < 1.7


def test_train_throughput_figures_are_sane(capsys):
    assert throughput.main(["multi30k-en-de", *TINY]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["accumulation"] == 2 and r["updates"] == 2 and len(r["window_target_tokens_per_s"]) == 2
    assert r["target_tokens_per_s"] > 0 and r["source_tokens_per_s"] > 0 and r["updates_per_s"] > 0
    # The budget counts padded slots of the longer side, so an update holds fewer real target tokens.
    assert 0 < r["target_tokens_per_update"] <= 512
    assert 0 <= r["padding_fraction"] < 0.5
    assert r["peak_memory_bytes"] > 10 * 2**20
    assert r["mfu"] > 0  # no upper bound: both rates are timed on a shared machine
    assert r["model_flops_per_s"] == pytest.approx(r["mfu"] * r["matmul_flops_per_s"])
    per_token = r["model_flops_per_update"] / r["target_tokens_per_update"]
    assert r["model_flops_per_s"] == pytest.approx(per_token * r["target_tokens_per_s"], rel=0.3)
    assert r["end_to_end_target_tokens_per_s"] > 0
    p = r["projection"]
    assert p["hours"] == pytest.approx(p["steps"] * 512 / r["target_tokens_per_s"] / 3600)


FAKE_FAIRSEQ = """#!/usr/bin/env python3
import sys
# fairseq-train's log format: a line every --log-interval updates with wps (target tokens/s)
for i, wps in enumerate([100, 900, 1000, 1100, 1000, 1000, 1000, 1000]):
    print(f"epoch 001:  {10 * (i + 1)} / 300 loss=9.1, wps={wps}.5, ups=1, wpb=4000")
"""


@pytest.mark.slow
@pytest.mark.multi30k
def test_train_speed_runs_fairseq_and_nmt_one_after_the_other(tmp_path, capsys, multi30k_mirror):
    from nmt.config import load_config
    from nmt.data.preprocess import preprocess

    data = tmp_path / "m30k"
    preprocess(load_config("multi30k-en-de"), data, mirror=str(multi30k_mirror))
    peers = tmp_path / "peers"
    fake = peers / "venv-fairseq" / "bin" / "fairseq-train"
    fake.parent.mkdir(parents=True)
    fake.write_text(FAKE_FAIRSEQ)
    fake.chmod(0o755)
    (peers / "fairseq" / "data-bin").mkdir(parents=True)
    results = tmp_path / "RESULTS.md"
    tiny = [
        "model.d_model=32",
        "model.d_ff=64",
        "model.heads=2",
        "train.valid_bleu=false",
        "train.log_every=2",
    ]
    argv = ["--data", str(data / "data"), "--minutes=0.15", "--variants=fp32", f"--peers={peers}"]
    argv += [f"--out={tmp_path / 'out'}", "--record", f"--results={results}", *(f"--set={s}" for s in tiny)]
    assert speed.main(argv) == 0
    out = capsys.readouterr().out
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in out.splitlines() if line.startswith("| ")}
    # the fake peer's log, first quarter dropped: median of 1000, 1100, 1000, 1000, 1000, 1000 (+0.5)
    assert rows["fairseq 0.12.3 fp32"][1:3] == ["1,000", "1.00"]
    nmt = rows["nmt fp32"]
    speed_nmt = float(nmt[1].replace(",", ""))
    # the table rounds nmt's speed to whole tokens/s before it is shown, the ratio is of the unrounded one
    assert speed_nmt > 0 and float(nmt[2]) == pytest.approx(speed_nmt / 1000.5, abs=0.011)
    assert float(nmt[3].split()[0]) > 0.1
    assert int(nmt[4].rstrip(" |")) >= 2  # log lines the median was taken over
    text = results.read_text()
    assert "## Training speed side by side" in text and "train_speed.py" in text and "| nmt fp32 |" in text


def test_train_speed_without_fairseq_reports_nmt_only():
    assert not speed.has_fairseq(None)
    rows = [speed.Row("nmt fp32", 2000.0, 1.5, 10)]
    assert speed.table(rows)[2] == "| nmt fp32 | 2,000 | n/a | 1.50 GiB | 10 |"
    assert speed.median_after_warmup([1, 100, 3, 3, 5, 5, 5, 5]) == 5


def test_terminology_placement_tells_a_term_in_place_from_one_appended():
    translate = importlib.import_module("translate_speed")

    class Aligner:  # each output word to the source word the test says
        def __init__(self, links):
            self.links = links

        def align(self, source, hyp):
            return self.links

    source = "A man rides a bike."
    placed = Aligner([0, 1, 2, 3, 4])  # "Velo." to "bike."
    assert translate.placement(placed, source, "Ein Mann fährt ein Velo.", "bike", "Velo") == "placed"
    beside = Aligner([0, 1, 2, 3, 2])  # "Velo." to "rides"
    assert translate.placement(beside, source, "Ein Mann fährt ein Velo.", "bike", "Velo") == "elsewhere"
    after = "Ein Mann fährt ein Fahrrad. Velo."
    assert translate.placement(placed, source, after, "bike", "Velo") == "appended"
    # a source of two sentences: the first sentence's end is not the translation's
    two = "A man rides a bike. He smiles."
    inside = Aligner([0, 1, 4, 5, 6])  # "Velo" to "bike."
    assert translate.placement(inside, two, "Ein Mann. Velo lächelt.", "bike", "Velo") == "placed"
    assert translate.placement(placed, two, "Ein Mann. Er lächelt. Velo.", "bike", "Velo") == "appended"
    assert translate.placement(placed, source, "Ein Mann fährt.", "bike", "Velo") == "unaligned"
    assert translate.placement(Aligner(None), source, "Ein Velo.", "bike", "Velo") == "unaligned"
    assert translate.shares(["placed", "placed", "appended", "elsewhere"]) == (
        "50.0% / 25.0% / 25.0% / 0.0% of 4"
    )


def test_terminology_needs_a_model(capsys):
    translate = importlib.import_module("translate_speed")
    with pytest.raises(SystemExit) as stop:
        translate.main(["--terminology"])
    assert stop.value.code == 2 and "--terminology needs --model" in capsys.readouterr().err


@pytest.mark.slow  # 20 s: two repetitions of a trained model's worker process
def test_translate_speed_without_latency_lines_reports_speed_and_no_latency(synthetic_run, capsys):
    translate = importlib.import_module("translate_speed")
    model, source = synthetic_run / "checkpoints" / "best.pt", synthetic_run / "data" / "valid.xx"
    args = ["--model", str(model), "--input", str(source), "--lines", "20", "--threads", "1"]
    (row,) = translate.main([*args, "--engine", "nmt:fp32", "--latency-lines", "0", "--repeats", "2"])
    assert row.latency_ms is None and row.sentences_per_s > 0 and len(row.ratios) == 2
    table = capsys.readouterr().out
    assert "| nmt fp32 |" in table and "| n/a |" in table
    (timed,) = translate.main([*args, "--engine", "nmt:fp32", "--latency-lines", "3", "--repeats", "1"])
    assert timed.latency_ms > 0


def test_an_engine_that_cannot_load_is_left_out_and_the_others_run(synthetic_run, capsys):
    """CTranslate2 refuses float16 on a CPU: its worker dies at load, the table keeps nmt's row. The first
    engine is the baseline, so one that cannot load there ends the run."""
    pytest.importorskip("ctranslate2", reason="pip install -e '.[dev]'")
    translate = importlib.import_module("translate_speed")
    model, source = synthetic_run / "checkpoints" / "best.pt", synthetic_run / "data" / "valid.xx"
    args = [
        "--model",
        str(model),
        "--input",
        str(source),
        "--lines",
        "8",
        "--threads",
        "1",
        "--latency-lines",
        "0",
    ]
    (row,) = translate.main(
        [*args, "--engine", "nmt:fp32", "--engine", "ctranslate2:float16", "--repeats", "1"]
    )
    assert row.name == "nmt fp32"
    assert (
        "the CTranslate2 float16 worker died (exit status 1): left out of the table"
        in capsys.readouterr().err
    )
    with pytest.raises(SystemExit, match="the CTranslate2 float16 worker died"):
        translate.main([*args, "--engine", "ctranslate2:float16", "--engine", "nmt:fp32", "--repeats", "1"])


def test_record_appends_to_its_own_section_only(tmp_path):
    path = tmp_path / "RESULTS.md"
    path.write_text("# Benchmark results\n\n## Translation speed\n\ntheirs\n")
    common.record("### first\n", throughput.SECTION, path)
    path.write_text(path.read_text() + "\n## Later section\n\nalso theirs\n")
    common.record("### second\n", throughput.SECTION, path)
    text = path.read_text()
    assert text.count("## Training throughput") == 1
    assert "## Translation speed\n\ntheirs\n" in text and text.endswith("## Later section\n\nalso theirs\n")
    mine = text[text.index("## Training throughput") : text.index("## Later section")]
    assert mine.index("### first") < mine.index("### second")


@pytest.mark.slow  # 30 s: a load run against a live server
def test_serve_load_sets_one_client_against_interactive_translation(synthetic_run):
    """The server's one-client latency and `nmt translate --interactive`'s, in one table, on a real server."""
    pytest.importorskip("uvicorn", reason="nmt serve needs its extra: pip install 'nmt[serve]'")
    script = ROOT / "benchmarks" / "serve_load.py"
    model, source = synthetic_run / "checkpoints" / "best.pt", synthetic_run / "data" / "valid.xx"
    args = ["--model", str(model), "--input", str(source), "--only", "load,interactive", "--clients", "1"]
    done = subprocess.run(
        [sys.executable, str(script), *args, "--requests", "5", "--threads", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    row = next(line for line in done.stdout.splitlines() if line.startswith("| 5 lines |"))
    p50, _, versus = (cell.strip() for cell in row.strip("|").split("|")[1:])
    serve_ms, ratio = versus.split(" ms, ")
    assert float(p50.removesuffix(" ms")) > 0 and float(serve_ms) > 0
    # the table rounds to whole milliseconds, the ratio is of the unrounded figures
    expected = float(serve_ms) / float(p50.removesuffix(" ms"))
    assert float(ratio.removesuffix("x")) == pytest.approx(expected, rel=0.25)


# ---------------------------------------------------------------------------------------------------------
# benchmarks/gpu_check.py, tiny, on the CPU


def run_gpu_check(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """As on a bare GPU machine: from the source tree with PYTHONPATH=., not the installed package."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.multi30k
def test_the_gpu_check_runs_every_stage_tiny_on_the_cpu(tmp_path, multi30k_mirror):
    """`gpu_check.py --tiny` end to end (a few minutes on 2 shared cores): every stage ran its command,
    and the report holds what each one measured, in the scripts' own tables."""
    import importlib.util

    from nmt.config import load_config
    from nmt.data.preprocess import preprocess

    data = tmp_path / "m30k"  # preprocessed as a user would have it, for --data
    preprocess(load_config("multi30k-en-de"), data, mirror=str(multi30k_mirror))
    out = tmp_path / "out"
    done = run_gpu_check(str(out), "--tiny", "--data", str(data))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    stages = report["stages"]
    assert list(stages) == [s.name for s in check.STAGES]
    assert {n: e["status"] for n, e in stages.items()} == dict.fromkeys(stages, "ok"), stages
    assert report["tiny"] and report["finished"]

    env = stages["environment"]["figures"]
    assert env["torch"] == torch.__version__ and env["cuda"] == torch.cuda.is_available()

    tests = stages["tests"]["figures"]
    assert len(tests["tests"]) >= 12  # every CUDA case of tests/test_gpu.py, and no CPU case
    assert all(t["test"].startswith("test_gpu::") and "cuda" in t["test"] for t in tests["tests"])
    if not torch.cuda.is_available():
        assert tests["counts"]["skipped"] == len(tests["tests"])
        assert all("needs a CUDA GPU" in t["message"] for t in tests["tests"])

    for name in ("train-base-eager", "train-base-compiled", "train-big-eager", "train-big-compiled"):
        f = stages[name]["figures"]
        assert (
            f"benchmarks/train_throughput.py wmt14-en-de-{name.split('-')[1]} --json"
            in stages[name]["command"]
        )
        assert f["recipe"] == f"wmt14-en-de-{name.split('-')[1]}" and f["mode"] == name.split("-")[2]
        assert f["dtype"] == "bfloat16" and f["accumulation"] == 2
        assert f["target_tokens_per_s"] > 0 and f["peak_memory_bytes"] > 0
        mfu = 6 * f["parameters"] * f["target_tokens_per_s"] / f["matmul_flops_per_s"]
        assert f["mfu_6n"] == pytest.approx(mfu) and f["mfu"] > 0
        assert 0 <= f["end_to_end_data_wait"] < 1

    decode = stages["decode"]
    engines = [r["name"] for r in decode["figures"]["rows"]]
    if importlib.util.find_spec("ctranslate2"):  # on the CPU: nmt fp32 and int8 beside CTranslate2's
        assert engines == ["nmt fp32", "nmt int8", "CTranslate2 float32", "CTranslate2 int8"]
    else:
        assert engines == ["nmt fp32", "nmt int8"] and "ctranslate2 is not importable" in decode["notes"][0]
    assert all(r["tokens_per_s"] > 0 for r in decode["figures"]["rows"])
    assert decode["figures"]["rows"][0]["ratios"] == [1.0]  # nmt against itself

    demo = stages["demo"]["figures"]  # nmt run's results.json
    assert demo["training"]["updates"] > 0 and demo["data"] == str((data / "data").resolve())
    bleu = demo["tests"]["test_2016_flickr"]["bleu"]
    assert 0 <= bleu["score"] <= 100 and bleu["signature"].startswith("nrefs:1")
    assert "preprocess: already done" in (out / "logs" / "demo.log").read_text()  # --data was used

    md = (out / "report.md").read_text()
    for name in stages:
        assert f"| {name} | ok |" in md
    assert "## Targets" in md and "| MFU base >= 30% |" in md
    for name in ("base-eager", "base-compiled", "big-eager", "big-compiled"):
        assert f"## train-{name}: `train_throughput.py wmt14-en-de-{name.split('-')[0]} --json" in md
    assert md.count("MFU (6N)") == 4 and "| nmt fp32 |" in md
    assert f"| test_2016_flickr | {bleu['score']} |" in md  # nmt run's own results table


@pytest.mark.slow  # nmt processes of its own (2-3 s of torch import each)
def test_a_stage_out_of_time_is_recorded_and_the_rest_still_reported(tmp_path):
    """A stage killed at its cap is a failed stage with its log's end; a stage the budget cannot hold
    is skipped with the reason and the command that runs it alone; the report is still written."""
    out = tmp_path / "out"
    done = run_gpu_check(str(out), "--tiny", "--stages", "environment,decode", "--budget", "0.5", timeout=60)
    assert done.returncode == 0, done.stderr
    stages = json.loads((out / "report.json").read_text())["stages"]
    assert stages["environment"]["status"] == "failed"
    assert stages["environment"]["reason"].startswith("timed out after")
    assert stages["decode"] == {
        "status": "skipped",
        "reason": "the 0-second budget was spent before it; run it alone with --stages decode",
    }
    md = (out / "report.md").read_text()
    assert "| environment | failed |" in md and "| decode | skipped |" in md and "## Failures" in md


def test_bad_arguments_are_one_line_and_exit_2(tmp_path, capsys):
    assert check.main([str(tmp_path / "out"), "--stages", "tests,nope"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --stages: no stage 'nope'; stages: " + ", ".join(s.name for s in check.STAGES)
    )
    assert check.main([str(tmp_path / "out"), "--data", str(tmp_path)]) == 2
    assert "no preprocessed data there" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_stage_gets_its_cap_or_what_the_later_stages_leave():
    tests, demo = check.BY_NAME["tests"], check.BY_NAME["demo"]
    assert check.stage_budget(tests, left=1000, later=[demo], tiny=False) == tests.cap
    assert check.stage_budget(tests, left=200, later=[demo], tiny=False) == 200 - demo.minimum
    assert check.stage_budget(tests, left=200, later=[demo], tiny=True) == 200  # --tiny keeps nothing


def test_each_stage_runs_what_users_and_the_other_benchmarks_run(tmp_path):
    """The stages' commands on a GPU (what --tiny cannot show): the scripts with the issue's settings,
    and the demo as `nmt run` on a copy of --data, trained for what the budget leaves."""
    import argparse

    args = argparse.Namespace(tiny=False, out=tmp_path, data=None, mirror="/m", demo_minutes=3.0)
    train = check.COMMANDS["train"]("train-big-compiled", args, tmp_path, 150)["cmd"]
    assert train[1].endswith("benchmarks/train_throughput.py") and train[2] == "wmt14-en-de-big"
    assert {"--json", "--device=cuda", "--set=train.precision=bf16", "--set=train.compile=true"} <= set(train)
    decode = check.COMMANDS["decode"]("decode", args, tmp_path, 150)["cmd"]
    assert decode[1].endswith("benchmarks/translate_speed.py") and "wmt14-en-de-base" in decode
    assert {"--json", "--device=cuda", "--lines=300", "--repeats=3"} <= set(decode)
    demo = check.COMMANDS["demo"]("demo", args, tmp_path / "w", 330)
    assert demo["cmd"][1:5] == ["-m", "nmt", "run", "multi30k-en-de"] and demo["cmd"][-2:] == [
        "--mirror",
        "/m",
    ]
    assert "train.device=cuda" in demo["cmd"] and "train.max_minutes=3.0" in demo["cmd"]
    short = check.COMMANDS["demo"]("demo", args, tmp_path / "w", 200)  # 200 s: 80 of them for training
    assert "train.max_minutes=1.33" in short["cmd"] and "trained 1.33 of 3.0 minutes" in short["notes"][0]
    args.mirror = None
    assert check.COMMANDS["demo"]("demo", args, tmp_path / "w", 330)["status"] == "skipped"


def test_carried_wheels_are_unpacked_onto_the_stages_path(tmp_path):
    """--wheels: a machine without a package index gets pytest or ctranslate2 from wheels carried along."""
    import argparse
    import zipfile

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "carried-1.0-py3-none-any.whl", "w") as z:
        z.writestr("carried/__init__.py", "VALUE = 42\n")
        z.writestr("carried-1.0.dist-info/METADATA", "Name: carried\nVersion: 1.0\n")
    report: dict = {}
    args = argparse.Namespace(wheels=wheels)
    env = check.child_env(tmp_path / "out", args, report)
    assert report["wheels"] == f"unpacked carried from {wheels}"
    code = "import carried, nmt; print(carried.VALUE)"
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert done.stdout.strip() == "42", done.stderr  # and nmt from the source tree, not from tmp_path
    empty = tmp_path / "none"
    empty.mkdir()
    assert check.install_wheels(empty, tmp_path / "t") == (None, f"--wheels {empty}: no .whl files there")


@pytest.mark.slow  # nmt processes of its own (2-3 s of torch import each)
def test_a_stopped_check_kills_its_stage_and_says_where_it_stopped(tmp_path):
    """SIGTERM (a scheduler's limit) to the check: the running stage's processes end with it, exit 130,
    and the report names the stage it stopped in."""
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), str(out), "--tiny", "--stages=tests"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (out / "report.json").exists() or "running" not in (out / "report.json").read_text():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.5)
    children = [p.name for p in Path("/proc").iterdir() if p.name.isdigit() and is_child_of(p, proc.pid)]
    assert children  # the stage is running in its own process
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 130
    assert not any(Path("/proc", pid).exists() and not is_zombie(pid) for pid in children)
    report = json.loads((out / "report.json").read_text())
    assert report["stages"]["tests"] == {"status": "failed", "reason": "the check was stopped during it"}
    assert "stopped" in report and "| tests | failed |" in (out / "report.md").read_text()


def is_child_of(proc: Path, parent: int) -> bool:
    try:
        return int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) == parent
    except (OSError, IndexError, ValueError):
        return False


def is_zombie(pid: str) -> bool:
    try:
        return Path("/proc", pid, "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_the_tests_that_ended_are_kept_when_the_stage_is_cut_short(tmp_path):
    """Without pytest's report (a stage stopped at its cap), the tests stage reads pytest's verbose
    lines, so it still reports every test that ended before."""
    lines = [
        "tests/test_gpu.py::test_a[cuda] PASSED                                   [  8%]",
        "tests/test_gpu.py::test_b[cuda-bf16] FAILED                              [ 16%]",
        "tests/test_gpu.py::test_c[cuda] SKIPPED (needs a CUDA GPU)               [ 25%]",
        "E       AssertionError: tests/test_gpu.py::test_a[cuda] PASSED",
    ]
    partial = check.tests_result("\n".join(lines), tmp_path, None, {})
    assert [(t["test"], t["outcome"]) for t in partial["figures"]["tests"]] == [
        ("test_gpu::test_a[cuda]", "passed"),
        ("test_gpu::test_b[cuda-bf16]", "failed"),
        ("test_gpu::test_c[cuda]", "skipped"),
    ]
    assert partial["status"] == "failed" and partial["reason"] == "incomplete: pytest wrote no report"
    assert partial["figures"]["counts"] == {"passed": 1, "failed": 1, "skipped": 1, "errors": 0}
    seen = partial["figures"]["tests"]
    assert check.test_result(seen, 1)["reason"] == "1 of 3 tests failed"
    whole = check.test_result(seen[::2], 0)
    assert (whole["status"], whole["reason"]) == ("ok", None)
    assert whole["figures"]["counts"] == {"passed": 1, "failed": 0, "skipped": 1, "errors": 0}


def test_typed_input_scores_each_variant_against_its_own_reference(tmp_path):
    """With a "model" that copies its input, and a test set whose references are its sources: each
    variant scores 100 exactly when it is compared with the reference typed the same way."""
    import shutil

    sentences = ["A man rides a red bicycle.", "Two dogs play in the snow!", "a woman reads"] * 4
    src = tmp_path / "test.en"
    src.write_text("".join(s + "\n" for s in sentences))
    copy = lambda model, source, hyp, beam: shutil.copyfile(source, hyp)  # noqa: E731
    rows = {r["variant"]: r for r in typed.measure(Path("m.pt"), src, src, tmp_path / "out", translate=copy)}
    assert rows["as written"]["bleu"] == pytest.approx(100.0)
    assert rows["ALL CAPS"]["bleu"] == pytest.approx(100.0)  # caps against caps
    assert rows["Title Case"]["bleu"] == pytest.approx(100.0) and rows["Title Case"]["lowercase"]
    assert rows["no final punctuation"]["bleu"] < 99 and rows["no final punctuation"]["share"] < 0.99
    assert (tmp_path / "out" / "title-cased.src").read_text().splitlines()[2] == "A Woman Reads"
    assert (tmp_path / "out" / "upper-cased.ref").read_text() == src.read_text().upper()


@pytest.mark.slow
def test_typed_input_translates_the_variants_with_nmt_translate(tmp_path, capsys, synthetic_run):
    """On the session's reversal model: the variants are the test set as people type it, and each row
    is sacrebleu's score of that variant's translations against the reference the table names."""
    import sacrebleu

    data = synthetic_run / "data"
    src, ref = tmp_path / "test.xx", tmp_path / "test.yy"
    sources = data.joinpath("valid.xx").read_text().splitlines()[:40]
    references = data.joinpath("valid.yy").read_text().splitlines()[:40]
    src.write_text("".join(s + " .\n" for s in sources))  # a final full stop to remove
    ref.write_text("".join(r + " .\n" for r in references))
    out = tmp_path / "out"
    rows = typed.main(
        [
            "-m",
            str(synthetic_run / "checkpoints" / "best.pt"),
            "--src",
            str(src),
            "--ref",
            str(ref),
            "--out",
            str(out),
            "--beam",
            "1",
        ]
    )
    assert (out / "upper-cased.src").read_text() == src.read_text().upper()
    assert (out / "upper-cased.ref").read_text() == ref.read_text().upper()
    assert (out / "title-cased.src").read_text().splitlines()[0] == " ".join(
        w.capitalize() for w in sources[0].split()
    ) + " ."
    assert (out / "final-punctuation-removed.src").read_text() == "".join(s + "\n" for s in sources)
    by_name = {r["variant"]: r for r in rows}
    assert list(by_name) == [v.name for v in typed.VARIANTS]
    upper_hyps = (out / "upper-cased.hyp").read_text().splitlines()
    expected = sacrebleu.corpus_bleu(upper_hyps, [[r.upper() + " ." for r in references]]).score
    assert by_name["ALL CAPS"]["bleu"] == pytest.approx(expected)
    assert by_name["as written"]["bleu"] > 50 and by_name["as written"]["share"] == 1.0  # it learned
    caps = by_name["ALL CAPS"]
    assert caps["share"] == pytest.approx(caps["bleu"] / by_name["as written"]["bleu"])
    printed = capsys.readouterr().out
    assert "| ALL CAPS |" in printed and "| Title Case |" in printed and "85%" in printed
