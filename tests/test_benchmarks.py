"""The training-throughput benchmark: its FLOP count, its figures on a tiny model, its RESULTS.md entries."""

from __future__ import annotations

import importlib
import json
import statistics
from collections import Counter

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from nmt.config import ModelConfig
from nmt.model import Transformer
from nmt.train.loss import label_smoothed_nll

common = importlib.import_module("common")
throughput = importlib.import_module("train_throughput")
speed = importlib.import_module("train_speed")

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


def test_record_appends_to_its_own_section_only(tmp_path):
    path = tmp_path / "RESULTS.md"
    path.write_text("# Benchmark results\n\n## Translation speed\n\ntheirs\n")
    throughput.record("### first\n", path)
    path.write_text(path.read_text() + "\n## Later section\n\nalso theirs\n")
    throughput.record("### second\n", path)
    text = path.read_text()
    assert text.count("## Training throughput") == 1
    assert "## Translation speed\n\ntheirs\n" in text and text.endswith("## Later section\n\nalso theirs\n")
    mine = text[text.index("## Training throughput") : text.index("## Later section")]
    assert mine.index("### first") < mine.index("### second")


def test_loader_speed_compares_the_paths_on_the_same_updates(tmp_path, capsys):
    loader_speed = importlib.import_module("loader_speed")
    threads = torch.get_num_threads()
    try:
        results = tmp_path / "RESULTS.md"
        assert loader_speed.main(["--pairs=20000", "--updates=3", "--record", f"--results={results}"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "tok/s" not in line][1:]
    assert [r.split(" | ")[0] for r in rows] == [
        "| pair by pair",
        "| vectorised (prepare)",
        "| background loader",
    ]
    # every path produced the same updates: equal token totals give rates in the ratio of their speeds
    assert all(float(r.split(" | ")[1].replace(",", "")) > 0 for r in rows)
    assert "## Training data loader" in results.read_text() and "loader_speed.py" in results.read_text()


def test_serve_load_sets_one_client_against_interactive_translation(synthetic_run):
    """The server's one-client latency and `nmt translate --interactive`'s, in one table, on a real server."""
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("uvicorn", reason="nmt serve needs its extra: pip install 'nmt[serve]'")
    script = Path(__file__).parents[1] / "benchmarks" / "serve_load.py"
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
