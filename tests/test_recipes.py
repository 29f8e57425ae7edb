"""The WMT14 recipes against the paper's Table 3 and section 5, and their dry runs."""

from __future__ import annotations

import pytest
import torch

from nmt.config import load_config
from nmt.data.loader import batch_plan
from nmt.model import Transformer, count_parameters
from nmt.train import dry_run

# Vaswani et al. 2017, Table 3 (base, big) and sections 5.1-5.4, 6.1.
PAPER = {
    "base": {"d_model": 512, "d_ff": 2048, "heads": 8, "steps": 100_000, "average": 5},
    "big": {"d_model": 1024, "d_ff": 4096, "heads": 16, "steps": 300_000, "average": 20},
}
DROPOUT = {("de", "base"): 0.1, ("de", "big"): 0.3, ("fr", "base"): 0.1, ("fr", "big"): 0.1}
VOCAB = {"de": 37000, "fr": 32000}
PARAMETERS = {("de", "base"): 63_082_496, ("de", "big"): 214_245_376}


@pytest.mark.parametrize("lang", ["de", "fr"])
@pytest.mark.parametrize("size", ["base", "big"])
def test_wmt14_recipe_matches_the_paper(lang, size):
    cfg = load_config(f"wmt14-en-{lang}-{size}")
    m, t, d, paper = cfg.model, cfg.train, cfg.decode, PAPER[size]
    assert (cfg.data.src_lang, cfg.data.tgt_lang) == ("en", lang)
    assert cfg.data.vocab_size == VOCAB[lang] and cfg.data.subword_type == "bpe"
    assert (m.encoder_layers, m.decoder_layers) == (6, 6)
    assert (m.d_model, m.d_ff, m.heads) == (paper["d_model"], paper["d_ff"], paper["heads"])
    assert m.dropout == DROPOUT[(lang, size)] and m.norm == "post"
    assert t.label_smoothing == 0.1 and t.warmup == 4000 and t.lr_scale == 1.0 and t.peak_lr is None
    assert (t.adam_beta1, t.adam_beta2, t.adam_eps) == (0.9, 0.98, 1e-9)
    assert t.max_steps == paper["steps"] and t.average_last == paper["average"]
    assert t.keep_last >= t.average_last
    assert 24_000 <= t.update_tokens <= 26_000  # "approximately 25000 source and 25000 target tokens"
    assert (d.beam, d.lenpen, d.max_len_a, d.max_len_b) == (4, 0.6, 1.0, 50)
    assert cfg.data.valid[0].sacrebleu == "wmt13"  # newstest2013
    assert cfg.data.test[0].sacrebleu == "wmt14/full"  # newstest2014, 3003 sentences for EN-DE
    assert all(c.src.sha256 and c.tgt.sha256 for c in cfg.data.train)


@pytest.mark.parametrize(
    "world, accum, per_device", [(1, 2, 12500), (2, 1, 12500), (3, 1, 8334), (8, 1, 3125)]
)
def test_effective_batch_is_the_recipes_whatever_the_gpu_count(world, accum, per_device):
    cfg = load_config("wmt14-en-de-base")
    plan = batch_plan(cfg, world)
    assert (plan.accumulation, plan.device_tokens) == (accum, per_device)
    assert plan.update_tokens == per_device * world * accum
    assert 25_000 <= plan.update_tokens < 25_000 + world


@pytest.mark.parametrize("lang, size", sorted(PARAMETERS))
def test_dry_run_counts_the_papers_parameters(lang, size):
    cfg = load_config(f"wmt14-en-{lang}-{size}")
    assert dry_run(cfg) == PARAMETERS[(lang, size)]


@pytest.mark.parametrize("size", ["base", "big"])
def test_en_fr_dry_run(size):
    cfg = load_config(f"wmt14-en-fr-{size}")
    with torch.device("meta"):
        expected = count_parameters(Transformer(cfg.model, 32000))
    assert dry_run(cfg) == expected
