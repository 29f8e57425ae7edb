"""How many CPU threads a batch's search runs on: chosen batch by batch, at most torch's setting.

One process of several threads (`nmt translate --workers 1` or line by line, `nmt serve`) searches each
batch in an OpenMP team: hundreds of small parallel regions a decoder step. Measured on an Intel Xeon
virtual machine of 2 cores (benchmarks/RESULTS.md, 2026-11-27 08:57, threads batch by batch) and an AMD
EPYC (2026-11-26 12:25):
- a sentence alone is too small to share: one thread was as fast as two for a sentence at beam 4
  (0.98-1.11x) and faster for greedy batches of 1-16 sentences (int8: two threads 0.86-0.92x);
- a team's thread that waits for a core another process holds stalls every parallel region: one process
  of two spinning threads translated 23-31 lines/s with a core busy, one thread 63-72;
- threads that sleep while they wait (OMP_WAIT_POLICY=PASSIVE, nmt's setting before) do not stall so, but
  are woken through the kernel at every region: in one sitting that made two threads slower than one at
  every batch size (0.43-0.76x), in another it cost nothing.
So the team spins (libgomp's default; OMP_WAIT_POLICY and GOMP_SPINCOUNT as the user sets them), and a
batch runs on
- one thread when it has at most FEW_ROWS rows (sentences x beam: one sentence at beam 4, a few greedy);
- otherwise on all of torch's threads, but none on a core another process took since the last batch:
  /proc/stat's busy time of the process's CPUs less the process's own, over the time between batches
  (`SearchThreads.taken`); all threads where that cannot be read (no /proc);
- and on one thread where the model's fp32 or bf16 products would give a row other bits on that many
  (nmt.translate.prepacked.keeps_bits_on, probed when a batch first would run on them).
In both sittings this was as fast as the best of passive threads and one thread, idle and busy.

The thread count does not change an int8 translation (its products' sums are exact): the same bits on
one thread and on two (tests/test_threads.py). In fp32 it moves scores in the last bits where a BLAS
splits a product's sums between threads, as the number of rows in a batch already did (MKL's, for the
encoder's products of a small batch: 7e-6 relative at most in that test), and the texts stayed the same
there and on 256 Multi30k test lines in batches of 1 to 64 sentences (the demo model, fp32 and int8).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from nmt.limits import max_workers

FEW_ROWS = 4  # a batch of at most this many rows (sentences x beam) runs on one thread
TAKEN_SHARE = 0.3  # a core counts as taken by other processes that used this share of it, or more
MIN_WINDOW = 0.05  # seconds: between batches closer than this, the last count stays
STAT = Path("/proc/stat")
# /proc/stat's columns after the CPU's name: user nice system idle iowait irq softirq steal. Busy is all
# but idle and iowait; steal (the hypervisor running another machine) takes the core as another process.
BUSY_COLUMNS = (0, 1, 2, 5, 6, 7)


@dataclass(frozen=True)
class Sample:
    pid: int
    wall: float  # time.monotonic()
    busy: float  # seconds the process's CPUs were busy, since boot
    own: float  # seconds of CPU the process used (all its threads)
    cpus: int


def busy_seconds(stat: str, cpus: set[int]) -> float | None:
    """Seconds the CPUs `cpus` were busy since boot, from the text of /proc/stat; None if it names none."""
    ticks, found = 0, 0
    for line in stat.splitlines():
        name, _, rest = line.partition(" ")
        if not (name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus):
            continue
        columns = rest.split()
        ticks += sum(int(columns[i]) for i in BUSY_COLUMNS if i < len(columns))
        found += 1
    return ticks / os.sysconf("SC_CLK_TCK") if found else None


def sample(stat: Path = STAT) -> Sample | None:
    """The process's CPUs' busy time and its own now; None where /proc/stat cannot be read."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    try:
        busy = busy_seconds(stat.read_text(), cpus)
    except (OSError, ValueError):
        return None
    if busy is None:
        return None
    return Sample(os.getpid(), time.monotonic(), busy, time.process_time(), len(cpus))


AT_IMPORT = sample()


class SearchThreads:
    """The thread count of each batch's search in this process (the module docstring)."""

    def __init__(self, stat: Path = STAT, agrees: Callable[[int], bool] | None = None):
        """`agrees(n)`: whether the model's products give a row the same bits on n threads as on one
        (nmt.translate.prepacked.keeps_bits_on), asked once per n, when a batch first would run on n;
        a model that does not searches every batch on one thread. None: any count may run."""
        self.stat = stat
        self.agrees = agrees or (lambda threads: True)
        self.agreed = {1: True}  # agrees' answers so far
        # the first window from the process's start (this module's import: before the model loads, whose
        # own CPU time is subtracted), long enough to tell at the first batch
        self.last = AT_IMPORT if stat == STAT and AT_IMPORT is not None else sample(stat)
        self.taken_cores = 0  # at the last window long enough to tell

    def sample(self) -> Sample | None:
        return sample(self.stat)

    def taken(self) -> int:
        """The cores other processes kept busy since the last call (or since this was made): their
        share of the process's CPUs' busy time, each core from TAKEN_SHARE of it on; 0 where unknown.
        While this process runs a team on a core another process also wants, the other gets about half
        of it, so a busy core shows about half taken: hence a share well below one."""
        now = self.sample()
        if now is None:
            return 0
        last = self.last
        if last is None or last.pid != now.pid:  # first reading in this process (a forked worker)
            self.last = now
            return self.taken_cores
        window = now.wall - last.wall
        if window < MIN_WINDOW:  # keep the earlier reading: a longer window next time
            return self.taken_cores
        others = max(0.0, (now.busy - last.busy) - (now.own - last.own)) / window
        self.last, self.taken_cores = now, max(0, math.ceil(others - TAKEN_SHARE))
        return self.taken_cores

    def count(self, rows: int) -> int:
        """Threads for a batch of `rows` rows: one for FEW_ROWS or fewer, else torch's setting, less the
        cores taken (at least one)."""
        most = torch.get_num_threads()
        if most <= 1:
            return 1
        if rows <= FEW_ROWS:
            return 1
        taken = self.taken()
        cpus = self.last.cpus if self.last is not None else most
        threads = most if taken == 0 else max(1, min(most, cpus - taken))
        if threads not in self.agreed:
            self.agreed[threads] = self.agrees(threads)
        return threads if self.agreed[threads] else 1

    @contextlib.contextmanager
    def batch(self, rows: int) -> Iterator[int]:
        """The block (one batch's search) on `count(rows)` threads, torch's setting given back after."""
        threads = self.count(rows)
        with on_threads(threads):
            yield threads


@contextlib.contextmanager
def on_threads(n: int) -> Iterator[None]:
    """The block on `n` threads, torch's setting given back after. torch's setting is the calling thread's
    (OpenMP's per-thread count), so set and used here alike."""
    most = torch.get_num_threads()
    if n == most:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(most)


def serving_threads(environ: dict | None = None, default: int | None = None, cores: int | None = None) -> int:
    """The threads of `nmt serve`'s searches: one fewer than torch's default (`default`), at least one, so
    that the server's own threads (HTTP, each request's preparation, the answers) keep a core while a batch
    is searched; OMP_NUM_THREADS where the user set it, but at most one fewer than the process's cores
    (`cores`: the CPUs it may run on, max_workers).

    A search on every core did not pay at any load, nor where the user asked for it:
    - on 2 cores of an Intel Xeon virtual machine (benchmarks/RESULTS.md, 2026-11-27 08:57, threads batch
      by batch), one search thread answered 8 concurrent clients 1.5-1.6x as fast as two (27.3-29.0
      requests/s against 16.9-18.5) and 32 clients 1.5x (35.0-36.7 against 19.9-23.9): two threads
      spinning between parallel regions took the core the server's request threads needed, and sleeping
      ones (the setting before) were no better (14.1-16.5 and 20.7-21.8 requests/s). With a core busy, even;
    - on an AMX Xeon, `OMP_NUM_THREADS=2` served 0.89-1.00x one thread's rate at 1, 8 and 32 clients
      (2026-12-03 07:26), and on an AMD EPYC with AVX512-BF16 0.49-0.67x idle at 8 and 32 clients, 0.85-0.89x
      with a core busy, and no faster at one client (2026-12-04 19:00).
    So `OMP_NUM_THREADS` of all the cores, or more, is held to one fewer (the log says so: serving_words).
    """
    env = os.environ if environ is None else environ
    most = torch.get_num_threads() if default is None else default
    if "OMP_NUM_THREADS" not in env:
        return max(1, most - 1)
    return max(1, min(most, (max_workers() if cores is None else cores) - 1))


def threads_words(threads: int) -> str:
    """For a log line: how a process of `threads` (> 1) threads runs its batches."""
    few = f"one for a batch of up to {FEW_ROWS} rows"
    return f"{threads} threads ({few}, fewer while other processes take cores)"


def serving_words(threads: int, environ: dict | None = None) -> str:
    """For `nmt serve`'s first line: the threads its searches run on, and why (serving_threads)."""
    env = os.environ if environ is None else environ
    words = "1 thread" if threads <= 1 else threads_words(threads)
    asked = env.get("OMP_NUM_THREADS")
    if asked is None:
        return f"searching on {words}, a core left to the requests"
    if asked.strip() != str(threads):
        return f"searching on {words}, a core left to the requests (OMP_NUM_THREADS={asked.strip()})"
    return f"searching on {words}"
