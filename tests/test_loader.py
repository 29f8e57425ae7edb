"""The training data path: vectorised collation, the resumable update plan, the background loader."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from nmt.data.batching import collate
from nmt.data.binarized import ParallelData, write_split
from nmt.data.loader import Loader, prepare, update_plan
from nmt.tokens import BOS, EOS, PAD

from .synthetic import make_config


def split(tmp_path, vocab_size: int, n: int = 500, seed: int = 0) -> ParallelData:
    rng = random.Random(seed)
    ids = lambda: [rng.randrange(4, vocab_size) for _ in range(rng.randint(0, 40))]  # noqa: E731
    pairs = [(ids(), ids()) for _ in range(n)]
    write_split(tmp_path / "train", [s for s, _ in pairs], [t for _, t in pairs], vocab_size=vocab_size)
    return ParallelData(tmp_path / "train")


def reference_collate(data: ParallelData, idx: list[int]):
    """Pair by pair, as the definition reads: (src + EOS, BOS + tgt, tgt + EOS), right-padded."""
    src = [data.src(i).tolist() + [EOS] for i in idx]
    tgt_in = [[BOS] + data.tgt(i).tolist() for i in idx]
    tgt_out = [data.tgt(i).tolist() + [EOS] for i in idx]
    pad = lambda rows: torch.tensor([r + [PAD] * (max(map(len, rows)) - len(r)) for r in rows])  # noqa: E731
    return pad(src), pad(tgt_in), pad(tgt_out)


@pytest.mark.parametrize("vocab_size", [8000, 100_000])  # uint16 and int32 storage
def test_collation_gathers_exactly_the_pairs_with_their_special_tokens(tmp_path, vocab_size):
    data = split(tmp_path, vocab_size)
    for idx in (
        [0],
        [3, 1, 4, 1, 5],
        list(range(499, 0, -7)),
        [i for i in range(500) if len(data.src(i)) == 0],
    ):
        got = collate(data, torch.tensor(idx))
        for a, b in zip(got, reference_collate(data, idx), strict=True):
            assert a.dtype == torch.int64 and torch.equal(a, b)


def test_the_plan_resumes_from_any_position_and_runs_over_epochs(tmp_path):
    data = split(tmp_path, 8000, n=200)
    cfg = make_config(batch_tokens=200, update_tokens=600, seed=3)  # 3 micro-batches an update
    whole = update_plan(data, cfg, 0, 1, 0, 0)
    updates = [next(whole) for _ in range(60)]  # several epochs
    assert {u.epoch for u in updates} >= {0, 1, 2}
    assert all(len(u.batches) <= 3 for u in updates)
    for k in (1, 17, 40):
        resumed = update_plan(data, cfg, 0, 1, updates[k - 1].epoch, updates[k - 1].cursor)
        for want in updates[k : k + 10]:
            got = next(resumed)
            assert (got.epoch, got.cursor) == (want.epoch, want.cursor)
            assert all(torch.equal(a, b) for a, b in zip(got.batches, want.batches, strict=True))
    # an epoch visits every pair once
    first = [i for u in updates if u.epoch == 0 for b in u.batches for i in b.tolist()]
    assert sorted(first) == list(range(len(data)))


def test_the_loader_hands_over_the_plan_in_order_with_its_token_counts(tmp_path):
    data = split(tmp_path, 8000)
    cfg = make_config(batch_tokens=200, update_tokens=400)
    expected = update_plan(data, cfg, 0, 1, 0, 0)
    start = time.perf_counter()
    with Loader(data, update_plan(data, cfg, 0, 1, 0, 0), torch.device("cpu"), depth=2) as loader:
        for _ in range(25):
            got, planned = next(loader), next(expected)
            want = prepare(data, planned, pin=False)
            assert (got.epoch, got.cursor) == (planned.epoch, planned.cursor)
            for a, b in zip(got.batches, want.batches, strict=True):
                assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
            targets = sum(int((b[2] != PAD).sum()) for b in got.batches)
            assert got.targets == targets == int(got.target_tokens.item())
            real = sum(int((b[0] != PAD).sum()) + int((b[1] != PAD).sum()) for b in got.batches)
            assert got.real == real and got.padded == sum(b[0].numel() + b[1].numel() for b in got.batches)
        assert 0 < loader.wait_seconds <= time.perf_counter() - start

    def slow_plan():  # a producer slower than the consumer: 50 ms an update
        for planned in expected:
            time.sleep(0.05)
            yield planned

    start = time.perf_counter()
    with Loader(data, slow_plan(), torch.device("cpu"), depth=2) as loader:
        for _ in range(4):
            next(loader)
        assert 0.15 < loader.wait_seconds <= time.perf_counter() - start


def test_the_loader_raises_its_errors_in_the_consumer_and_closes_promptly(tmp_path):
    data = split(tmp_path, 8000)
    cfg = make_config(batch_tokens=200, update_tokens=200)

    def broken_plan():
        yield from (p for _, p in zip(range(3), update_plan(data, cfg, 0, 1, 0, 0), strict=False))
        raise OSError("disk read error")

    with Loader(data, broken_plan(), torch.device("cpu")) as loader:
        for _ in range(3):
            next(loader)
        with pytest.raises(OSError, match="disk read error"):
            next(loader)
    # A consumer that stops early (training ended) leaves no thread behind, even with a full queue.
    before = threading.active_count()
    loader = Loader(data, update_plan(data, cfg, 0, 1, 0, 0), torch.device("cpu"), depth=2)
    next(loader)
    loader.close()
    assert not loader._thread.is_alive() and threading.active_count() <= before


def test_batches_are_cut_greedily_within_the_budget():
    """The batch-at-a-time cut equals the definition: add pairs in order while n * longest fits."""

    def greedy(order, src_lens, tgt_lens, budget):
        batches, current, longest = [], [], 0
        for i in order.tolist():
            cost = max(int(src_lens[i]), int(tgt_lens[i])) + 1
            if current and max(longest, cost) * (len(current) + 1) > budget:
                batches.append(current)
                current, longest = [], 0
            current.append(i)
            longest = max(longest, cost)
        return batches + ([current] if current else [])

    g = torch.Generator().manual_seed(0)
    for budget in (1, 50, 300, 4096):
        src, tgt = torch.randint(0, 120, (3000,), generator=g), torch.randint(0, 120, (3000,), generator=g)
        src[::97] = 400  # pairs over the budget
        order = torch.sort(tgt * 1000 + src, stable=True).indices
        from nmt.data.batching import pack_batches

        got = [b.tolist() for b in pack_batches(order, src, tgt, budget)]
        assert got == greedy(order, src, tgt, budget)


def test_ids_past_the_vocabulary_anywhere_in_the_split_are_one_line_before_training(tmp_path):
    from nmt.data.loader import load_data
    from nmt.errors import DataError

    from .synthetic import make_workdir

    subword = make_workdir(tmp_path, n_train=20, n_valid=5)
    cfg = make_config()
    load_data(cfg, tmp_path)  # as preprocessed: fine
    pairs = [[5, 6]] * 1500 + [[5, subword.vocab_size]]  # past the first 1,000 pairs
    write_split(tmp_path / "data" / "train", [[6]] * 1501, pairs, vocab_size=subword.vocab_size)
    with pytest.raises(DataError, match=rf"^.*train\.tgt\.bin: ids beyond the {subword.vocab_size} subwords"):
        load_data(cfg, tmp_path)
