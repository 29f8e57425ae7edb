"""What a training run saves and how it resumes: progress, optimizer, RNG and the facts it depends on.

checkpoints/ holds step-N.pt (weights only: what averaging and translation need), best.pt, last.pt
(everything a resume needs) and last.prev.pt (the previous last.pt, in case the newest cannot be read).
A resumed run first checks that it continues the same thing (model, batching, seed, vocabulary, data)
and says in one line what changed when it does not.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console

from nmt.atomic import link_or_copy
from nmt.checkpoint import (
    STEP_FILE,
    Checkpoint,
    init_weights,
    load_checkpoint,
    save_checkpoint,
    step_checkpoints,
)
from nmt.config import Config, config_to_dict
from nmt.data.loader import TrainData, shard
from nmt.errors import CheckpointError, OutputError
from nmt.train.runtime import Runtime
from nmt.train.update import Learner


@dataclass
class TrainProgress:
    step: int = 0  # optimizer updates done
    epoch: int = 0
    cursor: int = 0  # micro-batches of this epoch's shard already consumed
    elapsed: float = 0.0  # training seconds, over all runs
    best_score: float | None = None
    best_step: int = 0
    bad_validations: int = 0
    nonfinite_in_row: int = 0
    last_bleu: float | None = None


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1])}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((3, tuple(state["python"]), None))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------------------------------------------------
# Saving


def save_training_checkpoint(
    ckpt_dir: Path, learner: Learner, cfg: Config, subword, prog: TrainProgress, best: bool, facts: dict
) -> Path:
    """step-N.pt with the weights, last.pt with everything a resume needs, the previous last.pt kept as
    last.prev.pt.

    Only last.pt carries the optimizer's state (twice the weights for Adam): with keep_last 20, big
    EN-DE needs 20 x 0.9 GB of step files instead of 20 x 2.6 GB. Free space is checked first, and a
    disk that fills up anyway leaves every earlier file as it was.
    """
    path = ckpt_dir / f"step-{prog.step}.pt"
    state = {
        "progress": dataclasses.asdict(prog),
        "optimizer": learner.optimizer.state_dict(),
        "scaler": learner.scaler.state_dict() if learner.scaler is not None else None,
        "rng": rng_state(),
        "run": facts,
    }
    weights = learner.model.state_dict()
    check_free_space(ckpt_dir, tensor_bytes(weights) * 2 + tensor_bytes(state["optimizer"]))
    vocab_size = learner.model.vocab_size
    common = dict(model_state=weights, config=cfg, subword_proto=subword.proto, vocab_size=vocab_size)
    last = ckpt_dir / "last.pt"
    try:
        save_checkpoint(path, **common)
        if last.exists():
            link_or_copy(last, ckpt_dir / "last.prev.pt")
        save_checkpoint(last, **common, train_state=state)
    except (OSError, OutputError) as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            what = str(e) if isinstance(e, OutputError) else f"{ckpt_dir}: the disk filled up"
            raise OutputError(
                f"{what} while saving step {prog.step}; the earlier checkpoints are intact: free some space "
                "and run the same command to resume",
                errno=e.errno,
            ) from None
        raise
    if best:
        link_or_copy(path, ckpt_dir / "best.pt")
    for old in step_checkpoints(ckpt_dir)[: -cfg.train.keep_last]:
        old.unlink(missing_ok=True)
    return path


def tensor_bytes(tree) -> int:
    """Bytes of every tensor in a nest of dicts and lists (a state dict, an optimizer's state)."""
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(tensor_bytes(v) for v in tree.values())
    if isinstance(tree, list | tuple):
        return sum(tensor_bytes(v) for v in tree)
    return 0


def check_free_space(folder: Path, needed: int) -> None:
    """Refuse to start a save that cannot fit: a clear stop beats a half-written file and a traceback."""
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    margin = 64 * 2**20  # the file's own framing, the metrics and logs written meanwhile
    if free < needed + margin:
        raise CheckpointError(
            f"{folder}: {free / 2**30:.2f} GiB free, a checkpoint needs {(needed + margin) / 2**30:.2f} GiB; "
            "the earlier checkpoints are intact: free some space (or lower train.keep_last) and run the "
            "same command to resume"
        )


def disk_line(parameters: int, keep_last: int) -> str:
    """What the checkpoints folder will hold at most: weights-only step files, best.pt and average.pt,
    and last.pt + last.prev.pt with Adam's two moments besides the weights (fp32 throughout)."""
    weights = parameters * 4
    total = (keep_last + 2) * weights + 2 * 3 * weights
    return (
        f"disk: about {total / 2**30:.2f} GiB of checkpoints ({keep_last} step files and best/average of "
        f"{weights / 2**30:.2f} GiB, last.pt and last.prev.pt of {3 * weights / 2**30:.2f} GiB)"
    )


# ---------------------------------------------------------------------------------------------------------
# Resuming


def run_facts(data: TrainData, rt: Runtime) -> dict:
    """What a saved data position and saved weights mean: checked again when a run resumes."""
    return {
        "vocabulary_sha256": hashlib.sha256(data.subword.proto).hexdigest(),
        "train_pairs": len(data.train),
        "world_size": rt.world_size,
    }


# Keys a resumed run must keep: the weights' shapes and what the saved data position points into.
# Budgets, logging, checkpoint counts, devices and decoding may change between runs.
RESUME_KEYS = (
    "model",
    "train.batch_tokens",
    "train.update_tokens",
    "train.seed",
    "data.vocab_size",
    "data.init_from",
)


def check_resume(path: Path, ckpt: Checkpoint, cfg: Config, facts: dict) -> None:
    """One line naming what changed since the checkpoint was written, rather than a traceback or a
    run that silently continues on something else."""
    hint = "; resume needs the same (or start anew in another --workdir)"
    old, new = config_to_dict(ckpt.config), config_to_dict(cfg)
    for key in RESUME_KEYS:
        before, now = old, new
        for part in key.split("."):
            before, now = before[part], now[part]
        if key == "model":
            for name in before:
                if before[name] != now[name]:
                    raise CheckpointError(
                        f"{path}: trained with model.{name} {before[name]}, "
                        f"the recipe now says {now[name]}{hint}"
                    )
        elif before != now:
            raise CheckpointError(f"{path}: trained with {key} {before}, the recipe now says {now}{hint}")
    saved = ckpt.train_state.get("run", {})
    if saved.get("vocabulary_sha256", facts["vocabulary_sha256"]) != facts["vocabulary_sha256"]:
        raise CheckpointError(
            f"{path}: trained with another SentencePiece model than data/spm.model "
            f"(was preprocessing redone?){hint}"
        )
    if saved.get("train_pairs", facts["train_pairs"]) != facts["train_pairs"]:
        raise CheckpointError(
            f"{path}: trained on {saved['train_pairs']:,} pairs, "
            f"data/train now holds {facts['train_pairs']:,}{hint}"
        )


SET_ASIDE = "set-aside"  # checkpoints/set-aside/: files a resumed run must not use, kept for inspection


def find_resume_checkpoint(
    ckpt_dir: Path, console: Console, set_aside: bool = True
) -> tuple[Path, Checkpoint] | None:
    """last.pt, or when that does not verify last.prev.pt; None for a fresh start.

    A file that does not verify is moved to checkpoints/set-aside/ (by the main process, `set_aside`),
    so the next save cannot rotate it over the good last.prev.pt as if it were a checkpoint.
    """
    candidates = [ckpt_dir / "last.pt", ckpt_dir / "last.prev.pt"]
    damaged: list[Path] = []
    for path in candidates:
        if not path.exists():
            continue
        try:
            ckpt = load_checkpoint(path)
        except CheckpointError as e:
            console.print(f"[yellow]warning:[/] {e}; trying an older checkpoint", highlight=False)
            damaged.append(path)
            continue
        if ckpt.train_state is None:
            continue
        for bad in damaged if set_aside else []:
            console.print(f"{bad.name} set aside as {move_aside(bad)}", highlight=False)
        return path, ckpt
    if any(p.exists() for p in candidates):
        raise CheckpointError(f"{ckpt_dir}: no readable checkpoint to resume from")
    return None


def move_aside(path: Path) -> Path:
    """Move a checkpoint into checkpoints/set-aside/, never over an earlier one set aside there."""
    folder = path.parent / SET_ASIDE
    folder.mkdir(exist_ok=True)
    target, n = folder / path.name, 1
    while target.exists():
        target, n = folder / f"{path.name}.{n}", n + 1
    os.replace(path, target)
    return target


def set_aside_later_steps(ckpt_dir: Path, step: int, console: Console) -> None:
    """Step files written after `step` by a run whose last.pt was lost belong to a line of training
    that the resumed run does not continue: averaging them with its own would mix two runs. best.pt
    goes with them when it is one of them."""
    later = [p for p in step_checkpoints(ckpt_dir) if int(STEP_FILE.search(p.name).group(1)) > step]
    best = ckpt_dir / "best.pt"
    if later and best.exists():
        best_stat = best.stat()
        if any(p.stat().st_ino == best_stat.st_ino and p.stat().st_dev == best_stat.st_dev for p in later):
            later.append(best)
    for path in later:
        move_aside(path)
    if later:
        names = ", ".join(p.name for p in later)
        console.print(
            f"{names}: written after step {step} by the run being continued from an older checkpoint; "
            f"set aside in {ckpt_dir / SET_ASIDE}",
            highlight=False,
        )


def resume(ckpt_dir: Path, learner: Learner, cfg: Config, data: TrainData, console: Console) -> TrainProgress:
    """Load the newest readable training state into the learner's model, optimizer and scaler, after
    checking it continues this run; returns its progress (a fresh one when there is nothing to resume)."""
    rt = learner.rt
    found = find_resume_checkpoint(ckpt_dir, console, set_aside=rt.is_main)
    if found is None:
        if cfg.data.init_from:  # fine-tuning: the weights start from the checkpoint, the optimizer fresh
            init_weights(learner.model, cfg.data.init_from, data.subword)
            console.print(f"starting from the weights of {cfg.data.init_from}", highlight=False)
        return TrainProgress()
    path, ckpt = found
    check_resume(path, ckpt, cfg, run_facts(data, rt))
    if rt.is_main:
        set_aside_later_steps(ckpt_dir, ckpt.train_state["progress"]["step"], console)
    learner.model.load_state_dict(ckpt.model_state)
    try:
        learner.optimizer.load_state_dict(ckpt.train_state["optimizer"])
    except ValueError as e:  # its parameter groups: weight decay switched on or off since (build_optimizer)
        raise CheckpointError(
            f"{path}: its optimizer state does not fit this run's optimizer ({e}); was train.weight_decay "
            "changed from or to 0? resume needs the same (or start anew in another --workdir)"
        ) from None
    if learner.scaler is not None and ckpt.train_state["scaler"]:
        learner.scaler.load_state_dict(ckpt.train_state["scaler"])
    prog = TrainProgress(**ckpt.train_state["progress"])
    set_rng_state(ckpt.train_state["rng"])
    console.print(f"resuming from {path} (step {prog.step})", highlight=False)
    saved_world = ckpt.train_state.get("run", {}).get("world_size", rt.world_size)
    if saved_world != rt.world_size:
        # Each process's shard of an epoch has another length now: keep the same share of the epoch.
        old = len(shard(data.train, cfg, prog.epoch, 0, saved_world, data.groups))
        new = len(shard(data.train, cfg, prog.epoch, 0, rt.world_size, data.groups))
        share = prog.cursor / max(old, 1)
        prog.cursor = min(new, round(share * new))
        console.print(
            f"{saved_world} processes before, {rt.world_size} now: epoch {prog.epoch} continues "
            f"{share:.0%} of the way through its batches, as cut for {rt.world_size} processes",
            highlight=False,
        )
    return prog
