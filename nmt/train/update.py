"""One update of the paper's recipe (section 5.3): set the rate, forward/backward over the update's
micro-batches with the label-smoothed loss, clip, and step Adam, or skip an update that is not finite.

`build_learner` makes what every update works on and `train_step` runs one update: `nmt train` and the
throughput benchmark both call them, so what the benchmark times is what training runs.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from nmt.config import Config, TrainConfig
from nmt.data.loader import Update
from nmt.model import Transformer
from nmt.train.loss import batch_loss
from nmt.train.optim import build_optimizer
from nmt.train.runtime import Runtime, compile_for_training


@dataclass(frozen=True)
class Learner:
    """What every update works on, built once by `build_learner`."""

    net: torch.nn.Module  # what runs forward: the model, or its DDP and/or compiled wrapper
    model: Transformer  # the parameters themselves
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None  # fp16 only
    train: TrainConfig  # label smoothing, clipping
    rt: Runtime


def build_learner(cfg: Config, rt: Runtime, vocab: int) -> Learner:
    """The model with its initial weights (seeded by train.seed), the optimizer, the fp16 loss scaler,
    and what runs forward: the model wrapped for DDP when there are several processes (which makes every
    process start from rank 0's weights), compiled when train.compile asks. In training mode."""
    torch.manual_seed(cfg.train.seed)
    model = Transformer(cfg.model, vocab).to(rt.device)
    optimizer = build_optimizer(model, cfg.train)
    scaler = torch.amp.GradScaler("cuda") if rt.dtype == torch.float16 else None
    net = model
    if rt.world_size > 1:
        net = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[rt.device] if rt.device.type == "cuda" else None
        )
    if cfg.train.compile:
        net = compile_for_training(net)
    model.train()
    return Learner(net, model, optimizer, scaler, cfg.train, rt)


def train_step(learner: Learner, update: Update, lr: float) -> tuple[Tensor | None, Tensor]:
    """Run one update at rate `lr`; returns (the gradient norm, or None when it was not finite and the
    update was skipped; the summed (loss, nll) of its target tokens, on the device)."""
    for group in learner.optimizer.param_groups:
        group["lr"] = lr
    # The loss is normalised by the target tokens of the whole update on all ranks, so the gradients
    # equal those of one big batch; DDP averages over ranks, which the world size undoes.
    total = update.target_tokens
    if learner.rt.world_size > 1:
        total = total.clone()
        dist.all_reduce(total)
    sums = forward_backward(learner, update.batches, learner.rt.world_size / total)
    return optimizer_step(learner), sums


def forward_backward(
    learner: Learner, batches: Sequence[tuple[Tensor, Tensor, Tensor]], loss_scale
) -> Tensor:
    """Accumulate the gradients of one update's micro-batches; returns the summed (loss, nll).

    Each micro-batch's summed loss is multiplied by `loss_scale` (a number or a one-element tensor)
    before its backward pass. Under DDP only the last micro-batch all-reduces.
    """
    net, rt, scaler = learner.net, learner.rt, learner.scaler
    sums = torch.zeros(2, device=rt.device)
    last = len(batches) - 1
    for i, batch in enumerate(batches):
        sync = i == last or rt.world_size == 1
        with contextlib.nullcontext() if sync else net.no_sync(), rt.autocast():
            loss, nll = batch_loss(learner.model, batch, learner.train.label_smoothing, net)
        (scaler.scale(loss * loss_scale) if scaler else loss * loss_scale).backward()
        sums += torch.stack([loss.detach(), nll.detach()])
    return sums


def optimizer_step(learner: Learner) -> Tensor | None:
    """Clip (when asked) and step; returns the gradient norm, or None when it was not finite (skipped)."""
    optimizer, scaler = learner.optimizer, learner.scaler
    if scaler is not None:
        scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(
        learner.model.parameters(), learner.train.clip_norm or math.inf
    )
    finite = bool(torch.isfinite(grad_norm))  # the one host-device sync of an update
    if scaler is not None:
        scaler.step(optimizer)  # skips by itself on inf/NaN
        scaler.update()
    elif finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm if finite else None
