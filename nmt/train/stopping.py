"""When training ends: budgets, early stopping and signals, decided by all ranks at the same update.

Every rank must leave the loop at the same update, or one would wait in a collective the others never
reach and the job would hang. The reasons only one rank can see (a signal a scheduler sent to one
process, its own clock) are therefore shared through one tiny all-reduce each update.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nmt.config import Config
from nmt.train.resume import TrainProgress
from nmt.train.runtime import Runtime


@dataclass(frozen=True)
class Stop:
    """Why training ended; `signal` is set when a signal ended it, so the run must say it did not finish."""

    why: str
    signal: signal.Signals | None = None

    def __str__(self) -> str:
        return self.why


class StopRequest:
    """SIGINT/SIGTERM set a flag; the loop saves a checkpoint at the end of the update and exits."""

    def __init__(self):
        self.signal: int | None = None

    def __enter__(self) -> StopRequest:
        self.previous = {s: signal.signal(s, self.handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def handle(self, signum, _frame) -> None:
        self.signal = signum

    def __exit__(self, *exc) -> None:
        for s, h in self.previous.items():
            signal.signal(s, h)


def finished(prog: TrainProgress, cfg: Config, clock: bool = True) -> Stop | None:
    """Why training is over at this point (budget spent, patience lost), or None to go on.

    `clock=False` leaves out the time budget: each rank's clock differs, so in the loop that is decided
    together (agree_to_stop).
    """
    t = cfg.train
    if prog.step >= t.max_steps:
        return Stop(f"reached train.max_steps={t.max_steps}")
    if clock and over_time(prog, cfg):
        return Stop(f"reached train.max_minutes={t.max_minutes:g}")
    if t.patience and prog.bad_validations >= t.patience:
        return Stop(f"no better validation for {t.patience} validations (early stopping)")
    return None


def budget_used(prog: TrainProgress, cfg: Config) -> float:
    """The fraction of the training budget spent: of max_steps, or of max_minutes if that is ahead."""
    t = cfg.train
    used = prog.step / t.max_steps
    return max(used, prog.elapsed / (60 * t.max_minutes)) if t.max_minutes else used


def over_time(prog: TrainProgress, cfg: Config) -> bool:
    return bool(cfg.train.max_minutes) and prog.elapsed >= cfg.train.max_minutes * 60


def agree_to_stop(signum: int | None, prog: TrainProgress, cfg: Config, rt: Runtime) -> Stop | None:
    """The reasons to stop that one rank alone can see, shared by all: a signal (schedulers send SIGTERM
    to one process or to all) and the time budget on its own clock. One tiny all-reduce an update.

    prog.elapsed becomes the slowest rank's, so that a rate that depends on it (train.cooldown with
    max_minutes) is the same on every rank.
    """
    sigint, sigterm = signum == signal.SIGINT, signum == signal.SIGTERM
    if rt.world_size > 1:
        shared = torch.tensor([sigint, sigterm, prog.elapsed], dtype=torch.float64, device=rt.device)
        dist.all_reduce(shared, op=dist.ReduceOp.MAX)
        sigint, sigterm, prog.elapsed = shared[0] > 0, shared[1] > 0, shared[2].item()
    if sigterm or sigint:
        sig = signal.SIGTERM if sigterm else signal.SIGINT
        return Stop(f"stopped by {sig.name}", sig)
    return Stop(f"reached train.max_minutes={cfg.train.max_minutes:g}") if over_time(prog, cfg) else None


def broadcast_stop(reason: Stop | None, rt: Runtime) -> Stop | None:
    """Rank 0 decides early stopping; every rank must leave the loop at the same update."""
    flag = torch.tensor([1.0 if reason else 0.0], device=rt.device)
    dist.broadcast(flag, src=0)
    return reason or (Stop("early stopping (rank 0)") if flag.item() else None)
