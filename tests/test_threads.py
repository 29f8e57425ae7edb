"""Each batch's search on as many threads as pay (nmt.translate.threads): one for a sentence alone, fewer
while other processes take cores, and the same translations whatever the count."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from nmt.config import DecodeConfig, Precision
from nmt.model import Transformer
from nmt.translate import Translator, inference_model
from nmt.translate import threads as T
from nmt.translate.threads import (
    FEW_ROWS,
    MIN_WINDOW,
    Sample,
    SearchThreads,
    busy_seconds,
    serving_threads,
    serving_words,
)

from .synthetic import make_config, translate_summary

TICK = os.sysconf("SC_CLK_TCK")


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


class Clock:
    """Samples as /proc/stat and the process would give them: `advance` moves time on, with the seconds of
    CPU other processes and this one used meanwhile."""

    def __init__(self, cpus: int = 2):
        self.now = Sample(os.getpid(), 100.0, 5000.0, 10.0, cpus)

    def advance(self, seconds: float, others: float, own: float = 0.0) -> None:
        n = self.now
        self.now = dataclasses.replace(
            n, wall=n.wall + seconds, busy=n.busy + (others + own) * seconds, own=n.own + own * seconds
        )


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(T, "sample", lambda stat=T.STAT: clock.now)
    monkeypatch.setattr(T, "AT_IMPORT", None)  # the first window from the clock's start
    return clock


def test_busy_seconds_count_the_process_cpus_all_but_idle_and_iowait():
    stat = (
        "cpu  900 900 900 900 900 0 0 0 0 0\n"
        "cpu0 100 10 20 5000 7 1 2 3 0 0\n"
        "cpu1 200 0 0 6000 0 0 0 40 0 0\n"
        "cpu2 999 999 999 0 0 0 0 0 0 0\n"
        "intr 1 2 3\n"
    )
    assert busy_seconds(stat, {0, 1}) == (100 + 10 + 20 + 1 + 2 + 3 + 200 + 40) / TICK
    assert busy_seconds(stat, {2}) == 3 * 999 / TICK
    assert busy_seconds(stat, {7}) is None  # a CPU it does not list: nothing to tell


def test_a_batch_of_few_rows_runs_on_one_thread_and_more_on_all(two_threads, clock):
    threads = SearchThreads()
    clock.advance(1.0, others=0.0, own=2.0)
    assert [threads.count(rows) for rows in (1, FEW_ROWS, FEW_ROWS + 1, 500)] == [1, 1, 2, 2]


def test_one_thread_only_ever_runs_one(clock):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        clock.advance(1.0, others=0.0)
        assert SearchThreads().count(500) == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("others", "threads"),
    [
        (0.0, 2),  # idle
        (0.2, 2),  # a shell, the hypervisor's steal: noise
        (0.5, 1),  # a busy process sharing a core with this process's team gets about half of it
        (1.0, 1),  # a busy process on a core while this one ran one thread
        (2.0, 1),  # both cores taken: still one
    ],
)
def test_cores_other_processes_took_since_the_last_batch_are_left_to_them(
    two_threads, clock, others, threads
):
    search = SearchThreads()
    clock.advance(2.0, others=others, own=1.0)
    assert search.count(64) == threads


def test_the_count_follows_the_other_processes_batch_by_batch(two_threads, clock):
    search = SearchThreads()
    seen = []
    for others in (0.0, 1.0, 1.0, 0.0):
        clock.advance(1.0, others=others, own=1.0)
        seen.append(search.count(64))
    assert seen == [2, 1, 1, 2]


def test_a_window_too_short_to_tell_keeps_the_last_count_and_goes_on(two_threads, clock):
    search = SearchThreads()
    clock.advance(1.0, others=1.0)
    assert search.count(64) == 1
    clock.advance(MIN_WINDOW / 2, others=0.0)
    assert search.count(64) == 1  # too short: the busy window stands
    clock.advance(1.0, others=0.0)
    assert search.count(64) == 2  # measured from the last long window's end, the short one included


def test_a_forked_worker_starts_its_own_window(two_threads, clock):
    search = SearchThreads()
    search.last = dataclasses.replace(clock.now, pid=clock.now.pid + 1, own=1e6)  # the parent's reading
    clock.advance(1.0, others=0.0)
    assert search.count(64) == 2  # no window yet: not a negative time of its own taken for others
    assert search.last.pid == os.getpid()


def test_without_proc_stat_a_batch_runs_on_all_threads(two_threads, tmp_path):
    search = SearchThreads(stat=tmp_path / "missing")
    assert search.last is None
    assert search.count(64) == 2 and search.count(1) == 1


def test_a_batch_runs_on_its_count_and_gives_torchs_setting_back(two_threads, clock):
    search = SearchThreads()
    clock.advance(1.0, others=1.0)
    with search.batch(64) as n:
        assert n == 1 and torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError), search.batch(1):
        assert torch.get_num_threads() == 1
        raise RuntimeError("a search that fails")
    assert torch.get_num_threads() == 2


@pytest.mark.skipif(not Path("/proc/stat").is_file(), reason="reads /proc/stat (Linux)")
def test_a_real_busy_process_is_seen_taking_a_core(two_threads):
    """Another process spinning while this one waits: /proc/stat shows its core taken."""
    search = SearchThreads()
    busy = subprocess.Popen(
        [sys.executable, "-c", "import time\nend = time.time() + 30\nwhile time.time() < end: pass"]
    )
    try:
        time.sleep(0.3)  # started
        search.count(64)  # the window starts here
        time.sleep(1.0)
        assert search.taken() >= 1
    finally:
        busy.kill()
        busy.wait()


class Ids:
    def decode(self, seqs: list[list[int]]) -> list[str]:
        return [" ".join(map(str, s)) for s in seqs]


@pytest.mark.numerics
@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_a_translation_is_the_same_on_one_thread_and_on_two(two_threads, monkeypatch, dtype):
    """A model large enough for torch and oneDNN to split its products between threads (d_model 256,
    d_ff 1024, 512 subwords; 39 sentences at beam 4, 7 or 8 of a width a batch: 28-32 rows a step): its
    n-best lists, texts and scores, on two threads and on one: to the bit in int8, within rounding in
    fp32. The engine's count is held to torch's (no other process counted), and the search is seen to run
    on two."""
    vocab = 512
    cfg = dataclasses.replace(make_config().model, d_model=256, d_ff=1024, heads=4, max_positions=128)
    torch.manual_seed(0)
    base = Transformer(cfg, vocab).eval()
    for p in base.parameters():  # spread the logits, so that the search is not decided by near-ties alone
        p.data.mul_(2.0)
    cpu = torch.device("cpu")
    model = inference_model(base, Precision(dtype), cpu)
    monkeypatch.setattr(SearchThreads, "taken", lambda self: 0)
    seen = []
    step = Transformer.step
    monkeypatch.setattr(Transformer, "step", lambda *a: seen.append(torch.get_num_threads()) or step(*a))
    translator = Translator(model, Ids(), DecodeConfig(beam=4, max_len_a=0.0, max_len_b=16, nbest=2), cpu)
    gen = torch.Generator().manual_seed(3)
    sources = [torch.randint(4, vocab, (n,), generator=gen).tolist() for n in range(1, 40)]
    on_two = translator.search_sources(len(sources), dict(enumerate(sources)))
    assert set(seen) == {2}
    torch.set_num_threads(1)
    on_one = translator.search_sources(len(sources), dict(enumerate(sources)))
    assert seen[-1] == 1
    assert len({hyps[0][0] for hyps in on_one}) > 10  # a model that says different things
    if dtype == "int8":  # exact sums: the same bits
        assert on_two == on_one
        return
    # fp32 where a BLAS splits a product's sums by the thread count (MKL for the encoder's products of a
    # small batch, on an Intel Xeon with AVX-512: 7e-6 relative at most): each sentence's best score within
    # 1e-4 relative (16 steps, each a log-softmax and products of 256-1024 terms whose sums, reordered, may
    # each move by 1024 roundings of 6e-8); a best score does not jump where two texts are near-tied, so
    # the texts are asserted for nearly all sentences, not each
    best_two, best_one = [hyps[0] for hyps in on_two], [hyps[0] for hyps in on_one]
    assert all(abs(a - b) <= 1e-4 * abs(b) for (_, a), (_, b) in zip(best_two, best_one, strict=True))
    assert sum(a == b for (a, _), (b, _) in zip(best_two, best_one, strict=True)) >= 0.9 * len(sources)


def test_a_sentence_alone_is_searched_on_one_thread(two_threads, monkeypatch):
    torch.manual_seed(0)
    model = inference_model(Transformer(make_config().model, 64).eval(), Precision.FP32, torch.device("cpu"))
    monkeypatch.setattr(SearchThreads, "taken", lambda self: 0)
    seen = []
    # the encoder, not the step: a few rows' search runs its steps inside one scripted loop
    encode = Transformer.encode
    monkeypatch.setattr(Transformer, "encode", lambda *a: seen.append(torch.get_num_threads()) or encode(*a))
    translator = Translator(
        model, Ids(), DecodeConfig(beam=4, max_len_a=0.0, max_len_b=8), torch.device("cpu")
    )
    translator.search_sources(1, {0: [5, 6, 7]})
    assert seen and set(seen) == {1}
    seen.clear()
    translator.search_sources(2, {0: [5, 6, 7], 1: [8, 9, 10]})  # 8 rows
    assert seen and set(seen) == {2}
    assert torch.get_num_threads() == 2


def test_the_summary_says_how_one_process_shares_its_threads(synthetic_run: Path, two_threads):
    """`nmt translate --workers 1` on two threads says so in its summary line; worker processes of one
    thread each (the default for files) have nothing to share out."""

    def summary(*options: str) -> str:
        return translate_summary(synthetic_run, *options)

    one_process = summary("--device", "cpu", "--workers", "1")
    assert one_process.endswith(
        f", 2 threads (one for a batch of up to {FEW_ROWS} rows, fewer while other processes take cores)"
    )
    assert "threads" not in summary("--device", "cpu", "--workers", "2")


def test_nmt_serve_leaves_a_core_to_its_requests_even_when_told_all():
    assert [serving_threads({}, cores, cores) for cores in (1, 2, 16)] == [1, 1, 15]
    assert serving_threads({}, 8, 16) == 7  # torch's default (its physical cores) less one
    told = {"OMP_NUM_THREADS": "3"}
    assert [serving_threads(told, 3, cores) for cores in (16, 4, 3, 2, 1)] == [3, 3, 2, 1, 1]
    assert serving_words(1, {}) == "searching on 1 thread, a core left to the requests"
    said = serving_words(3, told)
    assert said.startswith("searching on 3 threads (one for a batch of up to") and "left" not in said
    said = serving_words(2, told)  # held below what the user asked: the line says so, and why
    assert said.endswith("a core left to the requests (OMP_NUM_THREADS=3)"), said


def test_the_serve_command_searches_on_a_core_fewer(monkeypatch, two_threads, tmp_path):
    """`nmt serve` sets the process's threads before it loads a model (the server itself is stubbed)."""
    from typer.testing import CliRunner

    from nmt import serve as serve_module
    from nmt.cli import app

    seen = []
    monkeypatch.setattr(serve_module, "serve", lambda *a, **k: seen.append(torch.get_num_threads()))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    model = tmp_path / "model.pt"
    model.touch()
    result = CliRunner().invoke(app, ["serve", "-m", str(model)])
    assert result.exit_code == 0, result.output
    assert seen == [1]
    # OMP_NUM_THREADS of every core the process has: held to one fewer as well
    from nmt.translate import threads

    monkeypatch.setattr(threads, "max_workers", lambda: 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    torch.set_num_threads(2)  # as torch reads OMP_NUM_THREADS=2 at start
    result = CliRunner().invoke(app, ["serve", "-m", str(model)])
    assert result.exit_code == 0, result.output
    assert seen == [1, 1]
