"""Translations users can trust, on a model really trained on Multi30k (near-ties, early EOS, long tails):
no empty output for a real sentence, and the same output on every path and batch.

A reversal toy has none of a real model's near-ties, so it cannot show a batch-dependent result; this
module trains a small Multi30k model through `nmt run` (about half a minute) and translates its test set.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from nmt.cli import app

# numerics: trains or compares numbers, so `make test` runs it again with the AVX2 kernels forced
pytestmark = [pytest.mark.numerics, pytest.mark.slow]  # trains a Multi30k model through `nmt run`

SMALL = [
    "data.vocab_size=2000",
    "model.encoder_layers=2",
    "model.decoder_layers=2",
    "model.d_model=128",
    "model.d_ff=256",
    "model.heads=4",
    "train.max_steps=150",
    "train.max_minutes=null",
    "train.save_every=50",
    "train.validate_every=150",
    "train.valid_bleu=false",
    "train.average_last=2",
    "train.threads=2",
    "train.compile=false",
    "train.precision=fp32",  # the same model on every CPU (auto is bf16 where it is native)
]


@pytest.fixture(scope="module")
def multi30k_run(tmp_path_factory, multi30k_mirror) -> Path:
    """`nmt run` on Multi30k with a small model: the work dir, with translations/ from its translate step."""
    workdir = tmp_path_factory.mktemp("m30k-run")
    args = ["run", "multi30k-en-de", "--workdir", str(workdir), "--mirror", str(multi30k_mirror)]
    for item in SMALL:
        args += ["--set", item]
    mp = pytest.MonkeyPatch()
    mp.setenv("NMT_CACHE", str(workdir / "cache"))
    try:
        result = CliRunner().invoke(app, args)
    finally:
        mp.undo()
    assert result.exit_code == 0, result.output
    return workdir


def translate(workdir: Path, *options: str, stdin: str | None = None) -> list[str]:
    model = workdir / "checkpoints" / "average.pt"
    args = ["translate", "-m", str(model), *options]
    if stdin is None:
        args += ["-i", str(workdir / "data" / "test" / "test_2016_flickr.en")]
    result = CliRunner().invoke(app, args, input=stdin)
    assert result.exit_code == 0, result.output
    return result.stdout.split("\n")[:-1]


def test_no_empty_translation_for_a_real_sentence(multi30k_run):
    src = (multi30k_run / "data" / "test" / "test_2016_flickr.en").read_text().split("\n")[:-1]
    hyps = translate(multi30k_run)
    assert len(hyps) == len(src) == 1000
    assert [i for i, (s, h) in enumerate(zip(src, hyps, strict=True)) if s.strip() and not h.strip()] == []
    nbest = translate(multi30k_run, "--nbest", "4")
    assert all(line.split("\t")[2].strip() for line in nbest)  # not even among the n-best


def test_the_same_lines_from_nmt_run_every_batch_budget_and_one_at_a_time(multi30k_run):
    reference = (multi30k_run / "translations" / "test_2016_flickr.de").read_text().split("\n")[:-1]
    assert translate(multi30k_run) == reference  # nmt translate with its defaults == nmt run's step
    for budget in ("1000", "8192", "32000"):
        assert translate(multi30k_run, "--max-tokens", budget) == reference, budget
    src = (multi30k_run / "data" / "test" / "test_2016_flickr.en").read_text()
    lines = src.split("\n")[:300]
    # --interactive answers each line alone: a batch of one sentence
    alone = translate(multi30k_run, "--interactive", stdin="\n".join(lines) + "\n")
    assert alone == reference[:300]


def test_the_model_has_near_ties(multi30k_run):
    """What makes the tests above able to fail: competing hypotheses within a hair of each other."""
    nbest = translate(multi30k_run, "--nbest", "2", "--beam", "4")
    scores: dict[str, list[float]] = {}
    for line in nbest:
        index, score, _ = line.split("\t")
        scores.setdefault(index, []).append(float(score))
    gaps = sorted(s[0] - s[1] for s in scores.values() if len(s) == 2)
    assert gaps[0] < 0.01, gaps[:5]


def test_int8_the_same_lines_every_batch_budget_and_one_at_a_time(multi30k_run):
    """int8 rounds each row's activations with a scale of its own, so a last-bit difference that a longer
    batch companion makes (softmax and attention sums over more masked positions) can become a whole
    rounding step, and at a near-tie another word. Each source is padded to its own width (rounded up to
    8) whatever shares its batch, so it sees the same numbers alone and in any batch."""
    reference = translate(multi30k_run, "--dtype", "int8")
    assert len(reference) == 1000
    for budget in ("1000", "32000"):
        assert translate(multi30k_run, "--dtype", "int8", "--max-tokens", budget) == reference, budget
    src = (multi30k_run / "data" / "test" / "test_2016_flickr.en").read_text()
    lines = src.split("\n")[:100]
    alone = translate(multi30k_run, "--dtype", "int8", "--interactive", stdin="\n".join(lines) + "\n")
    assert alone == reference[:100]
