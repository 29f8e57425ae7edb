"""The full-size rehearsal (benchmarks/rehearsal.py) at a tiny size, so that the script cannot rot."""

from __future__ import annotations

import importlib

import pytest

from nmt.data.binarized import ParallelData

rehearsal = importlib.import_module("rehearsal")


def test_synthetic_pairs_have_the_wmt_shape():
    gen = rehearsal.Generator(seed=3)
    en, de = gen.chunk(20_000, bad_ratio=0.05, empty=0.01)
    src, tgt = en.splitlines(), de.splitlines()
    assert len(src) == len(tgt) == 20_000
    words = [len(line.split()) for line in src]
    assert 22 < sum(words) / len(words) < 28
    assert 0 < sum(n > 250 for n in words) < 100  # a few for the too-long filter
    assert 100 < sum(not line for line in tgt) < 300  # empty target lines
    assert all(line.endswith(".") for line in src)
    ratio = [len(t.split()) / n for n, t in zip(words, tgt, strict=True) if t]
    assert 0.03 < sum(r > 1.5 or r < 1 / 1.5 for r in ratio) / len(ratio) < 0.15


@pytest.mark.slow
def test_rehearsal_runs_the_recipe_data_path_and_records(tmp_path):
    results = tmp_path / "RESULTS.md"
    argv = ["--pairs=3000", f"--workdir={tmp_path}", "--set=data.vocab_size=500", "--skip-train", "--quiet"]
    assert rehearsal.main([*argv, "--record", f"--results={results}"]) == 0
    data = tmp_path / "run" / "data"
    kept = len(ParallelData(data / "train"))
    assert 2500 < kept < 3000  # the clean filters removed something, not everything
    assert len(ParallelData(data / "valid")) == 3000  # newstest2013 through sacrebleu and the mirror
    assert (data / "test" / "newstest2014.de").read_text().count("\n") == 3003
    recipe = (tmp_path / "run" / "recipe.yaml").read_text()
    assert "training-parallel-commoncrawl.tgz" in recipe and "sacrebleu: wmt14/full" in recipe
    text = results.read_text()
    assert "## Full-size rehearsal" in text and "| binarize |" in text and "EN-FR" in text
