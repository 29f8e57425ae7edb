"""What each update trains on, prepared ahead of the training loop.

The plan: every epoch's batches (nmt.data.batching.epoch_batches) cut into this rank's shard and grouped
into updates of `accumulation` micro-batches. It is a pure function of (epoch, cursor), which is all a
checkpoint needs to resume where the run stopped.

The loader: a background thread walks the plan, collates each micro-batch straight from the
memory-mapped split (a few tensor ops a batch, none a pair) and pins it when a GPU will read it, keeping
`depth` updates ready. The training thread only starts their copies to the device (non-blocking), so
the host work of an update overlaps the device work of the ones before it, and nothing in the step
waits on Python code walking sentence pairs. The thread's tensor ops release the interpreter lock.
"""

from __future__ import annotations

import json
import math
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from nmt.config import Config
from nmt.data.batching import collate, epoch_batches
from nmt.data.binarized import ParallelData
from nmt.data.preprocess import valid_text
from nmt.data.sampling import Group, epoch_pairs
from nmt.errors import DataError
from nmt.subword import Subword

Batch = tuple[Tensor, Tensor, Tensor]  # src (B, S), tgt_in (B, T), tgt_out (B, T)


# ---------------------------------------------------------------------------------------------------------
# The data a run trains and validates on


@dataclass(frozen=True)
class ValidText:
    """One direction's validation text, what BLEU is computed on during training."""

    direction: tuple[str, str]
    src: list[str]
    ref: list[str]
    tag: str | None  # the target tag its sources are translated with; None for a single target


@dataclass
class TrainData:
    train: ParallelData
    valid: ParallelData
    valid_text: list[ValidText]  # one per direction
    subword: Subword
    groups: tuple[Group, ...] = ()  # the training split's corpora, in order; () for one unweighted run


def load_data(cfg: Config, workdir: Path) -> TrainData:
    """The binarized splits, validation text, corpus groups and SentencePiece model that `nmt
    preprocess` wrote."""
    data_dir = workdir / "data"
    spm = data_dir / "spm.model"
    if not spm.exists() or not (data_dir / "train.src.idx").exists():
        raise DataError(f"{data_dir}: no preprocessed data; run `nmt preprocess` with the same recipe first")
    subword = Subword.load(spm)
    if subword.vocab_size > cfg.data.vocab_size:
        raise DataError(
            f"{spm}: {subword.vocab_size} subwords, recipe says data.vocab_size {cfg.data.vocab_size}"
        )
    read = lambda p: p.read_text(encoding="utf-8").split("\n")[:-1]  # noqa: E731
    train, valid = ParallelData(data_dir / "train"), ParallelData(data_dir / "valid")
    for split in (train, valid):  # an id past the embedding would be an IndexError mid-training
        split.check_ids(subword.vocab_size, str(spm))
    texts = []
    for direction in cfg.data.directions:
        src, ref = valid_text(data_dir, cfg.data, direction)
        tag = cfg.data.target_tag(direction[1])
        texts.append(ValidText(direction, read(src), read(ref), tag))
    groups = train_groups(data_dir, len(train))
    return TrainData(train=train, valid=valid, valid_text=texts, subword=subword, groups=groups)


def train_groups(data_dir: Path, pairs: int) -> tuple[Group, ...]:
    """The corpus groups of data/stats.json, checked against the split they describe; () where a work
    directory predates them or was written by hand (one run of every pair, as it was trained)."""
    path = data_dir / "stats.json"
    if not path.is_file():
        return ()
    try:
        stats = json.loads(path.read_text(encoding="utf-8"))
        groups = tuple(
            Group(str(g["corpus"]), int(g["pairs"]), float(g["weight"])) for g in stats.get("groups", ())
        )
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{path}: unreadable ({e}); run nmt preprocess --force") from None
    if groups and sum(g.pairs for g in groups) != pairs:
        raise DataError(f"{data_dir / 'stats.json'}: its corpora hold other than the split's {pairs} pairs")
    return groups


# ---------------------------------------------------------------------------------------------------------
# The plan


@dataclass(frozen=True)
class BatchPlan:
    """How an update of train.update_tokens is cut on this many devices, derived once from the recipe."""

    device_tokens: int  # token budget of one micro-batch on one device
    accumulation: int  # micro-batches per update on each device
    world_size: int

    @property
    def update_tokens(self) -> int:
        return self.device_tokens * self.world_size * self.accumulation


def batch_plan(cfg: Config, world_size: int) -> BatchPlan:
    """The fewest micro-batches per update that bring train.update_tokens within the device budgets, and
    a per-device budget of train.batch_tokens at most, less when there are so many devices that full
    budgets would overshoot train.update_tokens. So an update holds about update_tokens whatever the GPU
    count (the paper's batch is a property of the recipe, not the machine)."""
    t = cfg.train
    accum = max(1, math.ceil(t.update_tokens / (t.batch_tokens * world_size)))
    per_device = min(t.batch_tokens, math.ceil(t.update_tokens / (world_size * accum)))
    return BatchPlan(per_device, accum, world_size)


def shard(
    data: ParallelData, cfg: Config, epoch: int, rank: int, world_size: int, groups: tuple[Group, ...] = ()
) -> list[Tensor]:
    """This rank's batches of an epoch, in training order (every rank gets the same number); the pairs
    drawn from the corpus `groups` by their weights (nmt.data.sampling) where they are weighted."""
    budget = batch_plan(cfg, world_size).device_tokens
    seed = cfg.train.seed
    pool = epoch_pairs(groups, cfg.data.sampling_temperature, seed, epoch) if groups else None
    if pool is None:
        batches = epoch_batches(data.src_lens, data.tgt_lens, budget, seed, epoch, world_size)
    else:
        lens = data.src_lens[pool], data.tgt_lens[pool]
        batches = [pool[b] for b in epoch_batches(*lens, budget, seed, epoch, world_size)]
    if not batches:
        raise DataError("the training data holds fewer batches than there are processes")
    return batches[rank::world_size]


@dataclass(frozen=True)
class PlannedUpdate:
    batches: list[Tensor]  # pair indices of each micro-batch
    epoch: int  # the data position once this update is consumed
    cursor: int  # micro-batches of `epoch`'s shard consumed


def update_plan(
    data: ParallelData,
    cfg: Config,
    rank: int,
    world_size: int,
    epoch: int,
    cursor: int,
    groups: tuple[Group, ...] = (),
) -> Iterator[PlannedUpdate]:
    """Endless stream of this rank's updates from the position (epoch, cursor) on."""
    accum = batch_plan(cfg, world_size).accumulation
    while True:
        batches = shard(data, cfg, epoch, rank, world_size, groups)
        while cursor < len(batches):
            chunk = batches[cursor : cursor + accum]
            cursor += len(chunk)
            yield PlannedUpdate(chunk, epoch, cursor)
        epoch, cursor = epoch + 1, 0


# ---------------------------------------------------------------------------------------------------------
# The loader


@dataclass
class Update:
    """One update's micro-batches, on their way to the device, and its token counts."""

    batches: list[Batch]
    target_tokens: Tensor  # (1,) float32, this rank's target tokens incl. EOS: the loss's normaliser
    targets: int  # the same, on the host, for logging
    real: int  # real tokens of both sides (incl. EOS / BOS)
    padded: int  # padded slots of both sides
    epoch: int
    cursor: int


def prepare(data: ParallelData, planned: PlannedUpdate, pin: bool) -> Update:
    """Collate an update's micro-batches and count its tokens, on the host."""
    batches, targets, real, padded = [], 0, 0, 0
    for idx in planned.batches:
        batch = collate(data, idx)
        src, tgt_in, _ = batch
        src_tokens, tgt_tokens = (
            int(data.src_lens[idx].sum()) + len(idx),
            int(data.tgt_lens[idx].sum()) + len(idx),
        )
        targets, real, padded = (
            targets + tgt_tokens,
            real + src_tokens + tgt_tokens,
            padded + src.numel() + tgt_in.numel(),
        )
        batches.append(tuple(t.pin_memory() for t in batch) if pin else batch)
    count = torch.tensor([float(targets)])
    return Update(
        batches, count.pin_memory() if pin else count, targets, real, padded, planned.epoch, planned.cursor
    )


def to_device(update: Update, device: torch.device) -> Update:
    """Start the copies of an update's tensors to `device`; from pinned memory they return at once and
    run in order on the compute stream."""
    if device.type != "cpu":
        update.batches = [tuple(t.to(device, non_blocking=True) for t in b) for b in update.batches]
        update.target_tokens = update.target_tokens.to(device, non_blocking=True)
    return update


class Loader:
    """Iterator of Updates, collated by a background thread `depth` updates ahead of the consumer.

    `wait_seconds` adds up the time the consumer spent waiting for data: zero when the loader keeps up.
    """

    def __init__(
        self, data: ParallelData, plan: Iterator[PlannedUpdate], device: torch.device, depth: int = 4
    ):
        self.device = device
        self.wait_seconds = 0.0
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._closed = threading.Event()
        pin = device.type == "cuda"
        self._thread = threading.Thread(
            target=self._fill, args=(data, plan, pin), daemon=True, name="nmt-loader"
        )
        self._thread.start()

    def _fill(self, data: ParallelData, plan: Iterator[PlannedUpdate], pin: bool) -> None:
        try:
            if pin:  # pin through this rank's GPU, not a new context on GPU 0 (as torch's DataLoader does)
                torch.cuda.set_device(self.device)
            for planned in plan:
                if not self._put(prepare(data, planned, pin)):
                    return
        except BaseException as e:  # handed to the consumer, who raises it where it would have happened
            self._put(e)

    def _put(self, item) -> bool:
        """Queue `item`, waiting for room; False once the loader is closed."""
        while not self._closed.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Loader:
        return self

    def __next__(self) -> Update:
        start = time.perf_counter()
        item = self._queue.get()
        self.wait_seconds += time.perf_counter() - start
        if isinstance(item, BaseException):
            raise item
        return to_device(item, self.device)

    def close(self) -> None:
        self._closed.set()
        while self._thread.is_alive():
            try:
                self._queue.get(timeout=0.1)
            except queue.Empty:
                pass
            self._thread.join(timeout=0.1)

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
