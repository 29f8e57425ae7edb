"""Training: the loop (nmt.train.loop) and its parts, one job a module.

runtime (process, device, precision, DDP), update (one optimizer update), optim (Adam and the schedule),
loss (label-smoothed cross-entropy), validate, resume (what a run saves and how it continues), stopping
(budgets and signals agreed by every process), monitor (metrics.jsonl, train.log, the live line).
"""

from nmt.train.loop import dry_run, train

__all__ = ["dry_run", "train"]
