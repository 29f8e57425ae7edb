"""`nmt train`: label-smoothed training of the Transformer on one CPU, one GPU or many (torchrun + DDP).

`train` is the paper's recipe as one loop that reads top to bottom: take the next update from the loader,
set the learning rate and run the update (forward/backward over its micro-batches, clip, step, or skip
it when not finite), decide together whether to stop, log, validate, save. Each job it relies on has
its module: the process and device (nmt.train.runtime), the data plan and background loader
(nmt.data.loader), the update (nmt.train.update), validation (nmt.train.validate), checkpoints and resume
(nmt.train.resume), when to stop (nmt.train.stopping), logs and the live line (nmt.train.monitor).
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console

from nmt.atomic import refuse_inputs
from nmt.config import Config
from nmt.data.loader import Loader, batch_plan, load_data, update_plan
from nmt.errors import Interrupted, NmtError
from nmt.model import Transformer, count_parameters
from nmt.train.monitor import MetricsLog, ProgressDisplay, TrainMeter
from nmt.train.optim import learning_rate
from nmt.train.resume import disk_line, resume, run_facts, save_training_checkpoint
from nmt.train.runtime import check_same_start, elastic_notes, setup_runtime
from nmt.train.stopping import StopRequest, agree_to_stop, broadcast_stop, budget_used, finished
from nmt.train.update import build_learner, train_step
from nmt.train.validate import validate


def train(cfg: Config, workdir: Path, console: Console | None = None) -> Path:
    """Train until max_steps, max_minutes or early stopping, resuming from any checkpoint; returns best.pt."""
    console = console or Console(stderr=True)
    rt = setup_runtime(cfg)
    log = console if rt.is_main else Console(quiet=True)
    data = load_data(cfg, workdir)
    ckpt_dir = workdir / "checkpoints"
    refuse_inputs(ckpt_dir, [cfg.data.init_from], "--workdir")  # it would be overwritten by a save
    random.seed(cfg.train.seed)
    learner = build_learner(cfg, rt, data.subword.vocab_size)
    prog = resume(ckpt_dir, learner, cfg, data, log)
    check_same_start(prog.step, rt)
    facts = run_facts(data, rt)
    model, t = learner.model, cfg.train
    for line in [*summary_lines(cfg, model, rt.world_size), rt.describe(cfg), *elastic_notes()]:
        log.print(line, highlight=False)
    stop_reason = finished(prog, cfg)
    if stop_reason:
        log.print(f"training already finished at step {prog.step}: {stop_reason}", highlight=False)
        return best_or_last(ckpt_dir)

    plan = update_plan(data.train, cfg, rt.rank, rt.world_size, prog.epoch, prog.cursor, data.groups)
    metrics, meter = MetricsLog(workdir, rt.is_main), TrainMeter(rt)
    last_saved, started = prog.step, time.monotonic() - prog.elapsed
    used = budget_used(prog, cfg)  # agreed by all ranks, like the stop
    with (
        Loader(data.train, plan, rt.device) as loader,
        StopRequest() as stop,
        ProgressDisplay(log, cfg, prog) as display,
    ):
        while stop_reason is None:
            # 1. the next update's batches (collated ahead by the loader) and its learning rate (eq. 3)
            update = next(loader)
            prog.epoch, prog.cursor = update.epoch, update.cursor
            lr = learning_rate(prog.step + 1, used, cfg.model, t)
            # 2. forward/backward over its micro-batches, clip and step; a non-finite update is skipped
            grad_norm, sums = train_step(learner, update, lr)
            if grad_norm is None:
                if learner.scaler is not None and learner.scaler.get_scale() >= 1.0:
                    continue  # fp16 overflow: the scaler has lowered its scale for the next update
                prog.nonfinite_in_row += 1
                log.print(f"[yellow]warning:[/] non-finite loss or gradient at step {prog.step + 1}; skipped")
                if prog.nonfinite_in_row >= t.max_nonfinite:
                    raise NmtError(
                        f"{prog.nonfinite_in_row} non-finite updates in a row at step {prog.step + 1}: "
                        f"training diverged; lower train.peak_lr/lr_scale or raise train.warmup. "
                        f"Last good checkpoint: {ckpt_dir / 'last.pt'}"
                    )
                continue
            meter.add(update, sums)
            prog.nonfinite_in_row = 0
            prog.step += 1
            prog.elapsed = time.monotonic() - started
            # 3. stop? Every rank decides at the same update, or they would wait in different collectives.
            stop_reason = finished(prog, cfg, clock=False) or agree_to_stop(stop.signal, prog, cfg, rt)
            used = budget_used(prog, cfg)
            # 4. log
            if prog.step % t.log_every == 0 or stop_reason:
                record = meter.record(prog, lr, grad_norm, loader.wait_seconds)
                metrics.write(record)
                display.update(record)
            # 5. validate and save
            validating = prog.step % t.validate_every == 0 or (stop_reason and prog.step > last_saved)
            saving = prog.step % t.save_every == 0 or (stop_reason and prog.step > last_saved)
            better = False
            if validating and rt.is_main:
                v = validate(model, data, cfg, rt)
                score = v["bleu"] if v["bleu"] is not None else -v["nll"]
                better = prog.best_score is None or score > prog.best_score
                if better:
                    prog.best_score, prog.best_step, prog.bad_validations = score, prog.step, 0
                else:
                    prog.bad_validations += 1
                prog.last_bleu = v["bleu"]
                record = {"kind": "valid", "step": prog.step, "elapsed": round(prog.elapsed, 2), **v}
                metrics.write(record)
                display.validation(record)
                stop_reason = stop_reason or finished(prog, cfg)
            if saving or better:
                prog.elapsed = time.monotonic() - started
                if rt.is_main:
                    save_training_checkpoint(ckpt_dir, learner, cfg, data.subword, prog, better, facts)
                last_saved = prog.step
            if rt.world_size > 1 and validating:
                stop_reason = broadcast_stop(stop_reason, rt)

    log.print(f"training stopped at step {prog.step}: {stop_reason}", highlight=False)
    if rt.world_size > 1:
        dist.barrier()
    if (sig := stop_reason.signal) is not None:
        raise Interrupted(
            f"training stopped by {sig.name} at step {prog.step}, {ckpt_dir / 'last.pt'} saved; "
            "run the same command to resume",
            sig,
        )
    return best_or_last(ckpt_dir)


def best_or_last(ckpt_dir: Path) -> Path:
    best = ckpt_dir / "best.pt"
    return best if best.exists() else ckpt_dir / "last.pt"


# ---------------------------------------------------------------------------------------------------------
# Summary (also `nmt train --dry-run`)


def summary_lines(cfg: Config, model: Transformer, world_size: int) -> list[str]:
    t, m = cfg.train, cfg.model
    plan = batch_plan(cfg, world_size)
    peak = learning_rate(t.warmup, 0.0, m, t)
    return [
        f"parameters: {count_parameters(model):,}",
        f"model: {m.encoder_layers}+{m.decoder_layers} layers, d_model {m.d_model}, d_ff {m.d_ff}, "
        f"{m.heads} heads, dropout {m.dropout}, {m.norm}-norm, vocabulary {model.vocab_size}",
        f"batch: {plan.device_tokens} tokens per device x {world_size} device(s) x {plan.accumulation} "
        f"accumulation = {plan.update_tokens} tokens per update "
        f"(recipe: {t.update_tokens}; padding included)",
        f"steps: {t.max_steps}" + (f", at most {t.max_minutes:g} minutes" if t.max_minutes else ""),
        f"schedule: inverse square root, warmup {t.warmup}, peak lr {peak:.3g} at step {t.warmup}, "
        + (f"linear to 0 over the last {t.cooldown:.0%} of the budget, " if t.cooldown else "")
        + f"Adam({t.adam_beta1}, {t.adam_beta2}, eps {t.adam_eps:g}), label smoothing {t.label_smoothing}",
        disk_line(count_parameters(model), t.keep_last),
    ]


def dry_run(cfg: Config, console: Console | None = None) -> int:
    """Build the model from the recipe alone (vocabulary = data.vocab_size) and print its summary."""
    console = console or Console(stderr=True)
    with torch.device("meta"):
        model = Transformer(cfg.model, cfg.data.vocab_size)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    for line in summary_lines(cfg, model, world):
        console.print(line, highlight=False)
    return count_parameters(model)
