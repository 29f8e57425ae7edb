"""Training data loader speed: collated, padded batches per second on one core, against the pair-by-pair path.

    python benchmarks/loader_speed.py                                # synthetic WMT14-size lengths
    python benchmarks/loader_speed.py --data runs/wmt14-en-de-base   # a preprocessed split (memory-mapped)
    python benchmarks/loader_speed.py --data WORKDIR --record

Three ways to produce the updates of a recipe's plan (nmt.data.loader.update_plan, the recipe's
batch_tokens and update_tokens, one process), each timed over the same updates with one torch thread:

- pair by pair: each pair's ids fetched and copied into the padded tensors one at a time (how batches
  were collated before the vectorised path; kept here as the baseline);
- vectorised: nmt.data.loader.prepare, the function the loader thread runs (a few tensor ops a batch);
- loader: nmt.data.loader.Loader, the background thread as the trainer consumes it (here by a loop that
  does nothing else, so it shows the most the thread can deliver).

Figures: target tokens/s (real target tokens incl. EOS, what the trainer's tokens/s counts), padded
tokens/s (every slot of both sides the model computes on) and updates/s. The issue's target for the
WMT-size split: at least 1,000,000 target tokens/s on one core.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import common  # benchmarks/common.py: these scripts run with benchmarks/ on sys.path
import torch
from common import RESULTS, WMT_LENGTHS, SyntheticPairs
from torch import Tensor

from nmt.config import load_config
from nmt.data.loader import Loader, PlannedUpdate, prepare, update_plan
from nmt.tokens import BOS, EOS, PAD

SECTION = "## Training data loader"


def pair_by_pair(data, planned: PlannedUpdate) -> tuple[int, int]:
    """The baseline: every pair's ids sliced and written into the padded batch on its own."""
    targets = padded = 0
    for idx in planned.batches:
        pairs = [(_slice(data, "src", i), _slice(data, "tgt", i)) for i in idx.tolist()]
        n, s = len(pairs), max(len(x) for x, _ in pairs) + 1
        t = max(len(y) for _, y in pairs) + 1
        src = torch.full((n, s), PAD, dtype=torch.long)
        tgt_in = torch.full((n, t), PAD, dtype=torch.long)
        tgt_out = torch.full((n, t), PAD, dtype=torch.long)
        for i, (x, y) in enumerate(pairs):
            src[i, : len(x)] = x
            src[i, len(x)] = EOS
            tgt_in[i, 0] = BOS
            tgt_in[i, 1 : len(y) + 1] = y
            tgt_out[i, : len(y)] = y
            tgt_out[i, len(y)] = EOS
            targets += len(y) + 1
        padded += src.numel() + tgt_in.numel()
    return targets, padded


def _slice(data, side: str, i: int) -> Tensor:
    start, length = int(getattr(data, f"{side}_offsets")[i]), int(getattr(data, f"{side}_lens")[i])
    return getattr(data, f"{side}_ids")[start : start + length].to(torch.int64)


def measure(data, cfg, updates: int) -> dict[str, dict[str, float]]:
    plan = update_plan(data, cfg, 0, 1, 0, 0)
    planned = [next(plan) for _ in range(updates)]
    rows = {}

    start = time.perf_counter()
    counts = [pair_by_pair(data, p) for p in planned]
    rows["pair by pair"] = figures(counts, time.perf_counter() - start)

    start = time.perf_counter()
    prepared = [prepare(data, p, pin=False) for p in planned]
    rows["vectorised (prepare)"] = figures(
        [(u.targets, u.padded) for u in prepared], time.perf_counter() - start
    )

    with Loader(data, iter(planned), torch.device("cpu")) as loader:
        start = time.perf_counter()
        got = [next(loader) for _ in planned]
        rows["background loader"] = figures([(u.targets, u.padded) for u in got], time.perf_counter() - start)
    return rows


def figures(counts: list[tuple[int, int]], seconds: float) -> dict[str, float]:
    return {
        "target_tokens_per_s": sum(c[0] for c in counts) / seconds,
        "padded_tokens_per_s": sum(c[1] for c in counts) / seconds,
        "updates_per_s": len(counts) / seconds,
    }


def table(rows: dict[str, dict[str, float]]) -> list[str]:
    base = rows["pair by pair"]["target_tokens_per_s"]
    header = ["path", "target tok/s", "padded tok/s", "updates/s", "vs pair by pair"]
    return common.markdown_table(
        header,
        [
            [name, f"{r['target_tokens_per_s']:,.0f}", f"{r['padded_tokens_per_s']:,.0f}"]
            + [f"{r['updates_per_s']:,.1f}", f"{r['target_tokens_per_s'] / base:.1f}x"]
            for name, r in rows.items()
        ],
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="wmt14-en-de-base", help="recipe whose batching is used")
    p.add_argument("--data", type=Path, help="work directory of `nmt preprocess` (reads DATA/data/train)")
    p.add_argument("--pairs", type=int, default=4_500_000, help="synthetic pairs without --data")
    p.add_argument("--updates", type=int, default=40, help="updates timed per path")
    p.add_argument("--record", action="store_true", help="append the figures to benchmarks/RESULTS.md")
    p.add_argument("--results", type=Path, default=RESULTS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    cfg = load_config(args.recipe)
    if args.data:
        from nmt.data.binarized import ParallelData

        data, source = ParallelData(args.data / "data" / "train"), f"{args.data}/data/train"
    else:
        src, tgt = WMT_LENGTHS.pairs(args.pairs, seed=0)
        data, source = SyntheticPairs(src, tgt, cfg.data.vocab_size), f"synthetic, {args.pairs:,} pairs"
    rows = measure(data, cfg, args.updates)
    lines = table(rows)
    head = (
        f"{args.recipe} batching ({cfg.train.batch_tokens} tokens a batch, "
        f"{cfg.train.update_tokens} an update), {source}, {args.updates} updates per path, 1 torch thread"
    )
    print(head)
    print("\n".join(lines))
    if args.record:
        command = common.command_line(__file__, argv)
        machine = f"Machine: {common.machine_name('cpu')}. Command: `{command}`."
        entry = "\n".join([f"### {common.now()}: {source}", "", machine, head + ".", "", *lines, ""])
        common.record(entry, SECTION, args.results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
