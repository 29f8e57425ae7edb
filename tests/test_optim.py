"""Adam and the learning rate: the paper's schedule (eq. 3), its scale, the cool-down, weight decay."""

import dataclasses

import pytest
import torch
import yaml

from nmt.config import config_from_dict, resolve_recipe
from nmt.model import Transformer
from nmt.train.optim import build_optimizer, cooldown_factor, inverse_sqrt_lr, lr_scale

from .synthetic import make_config

# numerics: trains or compares numbers, so `make test` runs it again with the AVX2 kernels forced
pytestmark = pytest.mark.numerics


def test_learning_rate_schedule_is_equation_3():
    d, w = 512, 4000
    assert inverse_sqrt_lr(1, d, w) == pytest.approx(d**-0.5 * 1 * w**-1.5)
    assert inverse_sqrt_lr(w, d, w) == pytest.approx(d**-0.5 * w**-0.5)  # the peak, ~7e-4
    assert inverse_sqrt_lr(4 * w, d, w) == pytest.approx(d**-0.5 * (4 * w) ** -0.5)
    assert inverse_sqrt_lr(2000, d, w) < inverse_sqrt_lr(4000, d, w) > inverse_sqrt_lr(8000, d, w)


def test_peak_lr_sets_the_scale_so_the_warmup_ends_at_it():
    cfg = config_from_dict(
        {
            **_minimal(),
            "model": {"d_model": 256, "heads": 4},
            "train": {"warmup": 100, "peak_lr": 0.002},
        }
    )
    scale = lr_scale(cfg.model, cfg.train)
    assert inverse_sqrt_lr(100, 256, 100, scale) == pytest.approx(0.002)
    assert inverse_sqrt_lr(400, 256, 100, scale) == pytest.approx(0.001)


def test_cooldown_is_linear_to_zero_over_the_last_part_of_the_budget():
    assert cooldown_factor(0.5, 0.0) == cooldown_factor(1.0, 0.0) == 1.0  # off: the paper's schedule
    assert cooldown_factor(0.0, 0.3) == cooldown_factor(0.7, 0.3) == 1.0
    assert cooldown_factor(0.85, 0.3) == pytest.approx(0.5)
    assert cooldown_factor(1.0, 0.3) == cooldown_factor(1.2, 0.3) == 0.0
    assert cooldown_factor(0.25, 1.0) == pytest.approx(0.75)


def _minimal() -> dict:
    recipe = resolve_recipe("multi30k-en-de")
    return {"data": yaml.safe_load(recipe.read_text())["data"]}


def test_weight_decay_leaves_biases_and_layernorm_alone():
    """AdamW's decay on the matrices only (two groups, as fairseq and transformers): with every gradient
    zero, Adam's own step is zero, so one step shows exactly what decay does to each parameter."""
    cfg = make_config(weight_decay=0.1)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, norm="pre"))  # final norms too
    model = Transformer(cfg.model, 40)
    optimizer = build_optimizer(model, cfg.train)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    lr = 0.01
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    decayed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    names = {n for n, _ in model.named_parameters()}
    spared = {n for n in names if n.endswith(".bias") or "norm" in n}
    assert spared and any("norm" in n for n in spared) and any(n.endswith(".bias") for n in spared)
    assert decayed == names - spared  # every matrix and the embeddings, nothing else
    for n in decayed:
        torch.testing.assert_close(dict(model.named_parameters())[n], before[n] * (1 - lr * 0.1))

    # without decay: plain Adam over one group, as the checkpoints of earlier runs hold it
    plain = build_optimizer(model, make_config().train)
    assert type(plain) is torch.optim.Adam and len(plain.param_groups) == 1
