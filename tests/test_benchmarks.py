"""The training-throughput benchmark: its FLOP count, its figures on a tiny model, its RESULTS.md entries."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from nmt.config import ModelConfig
from nmt.loss import label_smoothed_nll
from nmt.model import Transformer

# The benchmarks are scripts, not a package: import them the way `python benchmarks/x.py` would.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
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
    "--set=train.compile=false",  # the recipe compiles; a smoke test should not wait for it
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
    assert flops == 3 * (768 + 144 + 640 + 192 + 64 + 96 + 160) + 3 * (256 + 16 + 1280 + 64 + 256 + 64 + 320)
    assert throughput.model_flops(cfg, [3, 1], [2, 4], v) == flops


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
    src, tgt = throughput.synthetic_lengths(50_000, throughput.WMT_LENGTHS, seed=3)
    assert abs(src.double().mean().item() - 27.0) < 1.0
    assert abs((tgt.double().mean() / src.double().mean()).item() - 1.1) < 0.05
    assert int(src.min()) >= 1 and int(tgt.max()) <= 250


def test_train_throughput_figures_are_sane(capsys):
    assert throughput.main(["multi30k-en-de", *TINY]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["accumulation"] == 2 and r["updates"] == 2 and len(r["window_target_tokens_per_s"]) == 2
    assert r["target_tokens_per_s"] > 0 and r["source_tokens_per_s"] > 0 and r["updates_per_s"] > 0
    # The budget counts padded slots of the longer side, so an update holds fewer real target tokens.
    assert 0 < r["target_tokens_per_update"] <= 512
    assert 0 <= r["padding_fraction"] < 0.5
    assert r["peak_memory_bytes"] > 10 * 2**20
    assert 0 < r["mfu"] < 1
    assert r["model_flops_per_s"] == pytest.approx(r["mfu"] * r["matmul_flops_per_s"])
    per_token = r["model_flops_per_update"] / r["target_tokens_per_update"]
    assert r["model_flops_per_s"] == pytest.approx(per_token * r["target_tokens_per_s"], rel=0.3)
    assert r["end_to_end_target_tokens_per_s"] > 0
    p = r["projection"]
    assert p["hours"] == pytest.approx(p["steps"] * 512 / r["target_tokens_per_s"] / 3600)


def test_train_speed_prints_the_comparison_and_records_it(tmp_path, capsys):
    results = tmp_path / "RESULTS.md"
    threads = torch.get_num_threads()
    try:
        code = speed.main([*TINY[:-1], f"--results={results}", "--record", "--threads=2", "--no-end-to-end"])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    out = capsys.readouterr().out
    assert "fairseq 0.12.3" in out and "target" in out and "MFU" in out
    text = results.read_text()
    assert text.startswith("# Benchmark results\n\n## Training throughput\n")
    assert "train_speed.py" in text and "| JoeyNMT 2.3 |" in text


def test_comparison_scales_the_peers_by_the_matmul_rate():
    figures = {"matmul_flops_per_s": 400e9, "target_tokens_per_s": 3460.0, "peak_memory_bytes": 2**30}
    rows = {row[0]: row for row in speed.comparison(figures)}
    assert rows["fairseq 0.12.3"][1] == "3,460 (1,730)" and rows["fairseq 0.12.3"][2] == "1.00"
    assert rows["target"][1] == "5,200 (2,600)"


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
