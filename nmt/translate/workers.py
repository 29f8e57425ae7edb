"""Worker processes for `nmt translate` over a file: N processes of T threads each, as CTranslate2's
`inter_threads` x `intra_threads` or Marian's `--cpu-threads`.

The workers are forked after the model is loaded, so its weights (and the decoder's prepacked copies)
are shared copy-on-write rather than loaded N times. The parent keeps everything that touches lines and
files: it reads, cleans, encodes and batches (nmt.translate.frontend), sends each batch's subword ids to
an idle worker, and writes the translations in input order through the same output path as one process.
A worker only searches and detokenizes, and the search is batch-invariant on the CPU, so the output is
byte-identical to one process's whatever worker takes which batch.

Threads: GNU OpenMP cannot start a thread pool in a child forked after the parent had one running (the
child hangs at its first parallel region), so the parent loads the model with one thread
(`single_threaded_parent`) and each worker sets its own count after the fork.

Stopping: a worker ignores SIGINT (Ctrl-C reaches the whole process group; the parent decides) and is
killed when the parent stops early (an error, SIGTERM, Ctrl-C); a worker whose parent went away (killed
with SIGKILL) sees its pipe close and exits. A worker never returns into the parent's code (it ends
with os._exit), so the parent's `finally` blocks, an -o file's temporary file among them, run in the
parent alone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import traceback
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from multiprocessing import get_context
from multiprocessing.connection import Connection, wait

import torch

from nmt.config import Engine
from nmt.errors import ConfigError, NmtError
from nmt.limits import check

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class WorkerDied(NmtError):
    """A worker process ended without answering (killed by the OOM killer, say): exit status 1."""

    exit_code = 1


def single_threaded_parent(workers: int) -> int:
    """Before the model loads: the threads each of `workers` workers will run (the process's threads
    shared out, at least one), the parent itself set to one thread so that workers can be forked."""
    threads = max(1, torch.get_num_threads() // workers)
    torch.set_num_threads(1)
    return threads


class WorkerPool:
    """`workers` forked processes, each searching whole batches with `translator` in `threads` threads.

    `search_many` has the signature of LineTranslator.search_many: the line translator hands it its
    batches while its WorkerPlan runs one."""

    def __init__(self, translator, workers: int, threads: int):
        context = get_context("fork")
        self.conns: list[Connection] = []
        self.processes = []
        try:
            for _ in range(workers):
                parent_end, child_end = context.Pipe()
                # The fork copies the parent's ends of every pipe so far: the worker closes them, so that
                # it reads the end of its pipe when the parent is gone.
                ends = [*self.conns, parent_end]
                process = context.Process(
                    target=work, args=(child_end, ends, translator, threads), daemon=True
                )
                # A stop signal landing during the fork was seen by the new worker (its copy of Python's
                # handler raised there) and lost by the parent, which went on translating: blocked over
                # the fork, it stays pending for the parent alone (a fork starts with none pending) and
                # is raised here once the fork returns.
                previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
                try:
                    process.start()
                finally:
                    signal.pthread_sigmask(signal.SIG_SETMASK, previous)
                child_end.close()
                self.conns.append(parent_end)
                self.processes.append(process)
        except BaseException:
            self.close(abort=True)
            raise

    def search_many(
        self, work: list[tuple], nbest: int | None
    ) -> Iterator[tuple[int, list[list[tuple[str, float]]]]]:
        """(index, n-best (text, score) of each line) of each batch of `work` (LineTranslator.search_batch's
        arguments), as workers finish them.

        The costliest batches go first, so the last to finish is a short one and no worker waits long
        for another at the end of a chunk."""
        pending = deque(sorted(range(len(work)), key=lambda b: -batch_size(work[b][0])))
        idle, busy = list(self.conns), {}
        while pending or busy:
            while idle and pending:
                conn, b = idle.pop(), pending.popleft()
                try:
                    conn.send((b, *work[b], nbest))
                except OSError:  # a worker killed while idle: its death, not a reader gone (status 141)
                    raise self.died(self.conns.index(conn)) from None
                busy[conn] = b
            for conn in wait(list(busy)):
                try:
                    b, found, error = conn.recv()
                except (EOFError, OSError):
                    raise self.died(self.conns.index(conn)) from None
                del busy[conn]
                idle.append(conn)
                if isinstance(error, BaseException):
                    raise error
                if error is not None:  # not an NmtError: a bug, with the worker's traceback
                    raise RuntimeError(f"a translation worker failed:\n{error}")
                yield b, found

    def died(self, k: int) -> WorkerDied:
        """Worker `k` (numbered from 1 in the message) found dead, as a one-line error."""
        process = self.processes[k]
        process.join(timeout=1.0)
        code = process.exitcode
        how = (
            f"signal {-code} ({signal.Signals(-code).name})"
            if code is not None and code < 0
            else f"status {code}"
        )
        hint = " (out of memory? try fewer --workers)" if code == -signal.SIGKILL else ""
        return WorkerDied(f"worker {k + 1} died: {how}, process {process.pid}{hint}")

    def close(self, abort: bool = False) -> None:
        """Stop the workers: told to when all went well, killed at once on `abort` (they hold nothing to
        clean up, and SIGKILL cannot be lost, as a SIGTERM landing before a new worker's handlers are
        set would be)."""
        for conn in self.conns:
            try:
                if not abort:
                    conn.send(None)
            except OSError:
                pass
            conn.close()
        if abort:  # all killed first, then waited for: a stop does not wait on each worker in turn
            for process in self.processes:
                process.kill()
        for process in self.processes:
            process.join(timeout=30.0)
            if process.is_alive():
                process.kill()
                process.join()
        self.conns, self.processes = [], []

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, kind, value, tb) -> None:
        self.close(abort=kind is not None)


class BatchThreads:
    """CTranslate2's inter_threads: `n` batches searched at once, each handed over by a thread of ours
    (translate_batch releases the GIL, and the engine runs each call on one of its `n` replicas, which
    share the weights). The interface of WorkerPool."""

    def __init__(self, translator, n: int):
        self.translator, self.executor = translator, ThreadPoolExecutor(n, thread_name_prefix="batches")

    def search_many(
        self, work: list[tuple], nbest: int | None
    ) -> Iterator[tuple[int, list[list[tuple[str, float]]]]]:
        order = sorted(range(len(work)), key=lambda b: -batch_size(work[b][0]))  # costliest first
        search = self.translator.search_batch
        futures = {self.executor.submit(search, *work[b], nbest): b for b in order}
        for future in as_completed(futures):
            yield futures[future], future.result()

    def __enter__(self) -> BatchThreads:
        return self

    def __exit__(self, kind, value, tb) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)


def batch_size(ids: list[list[int]]) -> int:
    return len(ids) * max((len(x) for x in ids), default=0)


def work(conn: Connection, ends: list[Connection], translator, threads: int) -> None:
    """A worker's life: batches in, n-best texts out, until told to stop or the parent is gone. `ends`:
    the parent's ends of the pipes, which the fork copied."""
    status = 0
    try:
        for end in ends:
            end.close()
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # blocked by the parent over the fork
        torch.set_num_threads(threads)  # the fork's copy of the front end searches here (search_batch)
        while True:
            try:
                job = conn.recv()
            except (EOFError, OSError):  # the parent is gone
                break
            if job is None:
                break
            b, *batch, nbest = job
            try:
                reply = (b, translator.search_batch(*batch, nbest), None)
            except NmtError as e:
                reply = (b, None, e)
            except Exception:
                reply = (b, None, traceback.format_exc())
            try:
                conn.send(reply)
            except OSError:
                break
            except Exception:  # an error that does not pickle: its message
                conn.send((b, None, f"{type(reply[2]).__name__}: {reply[2]}"))
    except BaseException:
        status = 1
    finally:
        os._exit(status)


def plan_workers(
    requested: int | None,
    engine: str,
    device: torch.device,
    interactive: bool,
    sampling: bool = False,
) -> int:
    """How many workers `nmt translate` runs: `requested` (--workers), or by default one per thread the
    process would use, of one thread each (benchmarks/RESULTS.md: 2 workers of 1 thread translated
    1.07-1.46x as fast as 1 process of 2 threads) where the whole input is read anyway. One process
    where workers cannot help or are not wanted: lines answered one by one, a GPU, sampling (one random
    stream for the whole input). A glossary's lines go to the workers as the others do (each worker's
    fork holds the glossary). With CTranslate2 the workers are its `inter_threads` (BatchThreads), in
    one process."""
    # More than the CPUs (nmt.limits) is refused, not clamped: more processes than CPUs only share them
    # out (each worker has at least one thread) and each holds its own activations, so the count asked
    # for is a mistake to fix, and a clamp would run something other than what was asked without the
    # user knowing why.
    check("--workers", requested)
    alone = (
        "lines are answered one by one"
        if interactive
        else f"--device {device} is not the CPU"
        if device.type != "cpu"
        else "sampling draws from one random stream"
        if sampling
        else None
    )
    if alone is not None:
        if requested is not None and requested > 1:
            raise NmtError(f"--workers {requested}: {alone}, so one process translates here")
        return 1
    if requested is not None:
        return requested
    return max(1, torch.get_num_threads())


@dataclass
class WorkerPlan:
    """How `nmt translate` searches its batches: `workers` at once, each in `threads` threads (0: one
    process, its threads as they are). The torch engine's workers are processes (WorkerPool), forked after
    the model is loaded; CTranslate2's are its inter_threads (BatchThreads), in one process."""

    requested: int | None  # --workers, None: the default
    workers: int
    threads: int
    ct2: bool
    parent_threads: int  # the process's threads before the plan: given back by `restore`
    running: WorkerPool | BatchThreads | None = None  # while `run` is open

    @property
    def ct2_threads(self) -> tuple[int, int] | None:
        """CTranslate2's (inter_threads, intra_threads), None: its defaults."""
        return (self.workers, self.threads) if self.ct2 and self.workers > 1 else None

    def fit(self, sampling: bool) -> WorkerPlan:
        """The plan once the model's own decode settings are known: a recipe that samples draws from one
        random stream, so one process (an error where --workers asked for more)."""
        if self.workers <= 1 or not sampling:
            return self
        if self.requested is not None:
            raise ConfigError(
                f"--workers {self.workers}: sampling draws from one random stream; use --workers 1"
            )
        self.restore()
        return WorkerPlan(self.requested, 1, 0, self.ct2, self.parent_threads)

    def restore(self) -> None:
        torch.set_num_threads(self.parent_threads)

    @contextlib.contextmanager
    def run(self, translator) -> Iterator[None]:
        """The workers of `translator` (a LineTranslator) while the block runs: forked here, before any
        thread (a progress bar's) starts and before an -o file's temporary file is opened."""
        if self.workers <= 1:
            yield
            return
        pool = (
            BatchThreads(translator, self.workers)
            if self.ct2
            else WorkerPool(translator, self.workers, self.threads)
        )
        with pool:
            self.running = pool
            try:
                yield
            finally:
                self.running = None


def plan(
    requested: int | None,
    engine: Engine | str,
    device: torch.device,
    interactive: bool,
    sampling: bool = False,
) -> WorkerPlan:
    """The worker plan of `nmt translate` (plan_workers), made before the model loads: with worker
    processes the process drops to one thread now, as forking needs (the module docstring's OpenMP rule),
    and each worker takes its share of the threads after the fork."""
    workers = plan_workers(requested, engine, device, interactive, sampling)
    parent = torch.get_num_threads()
    ct2 = Engine.parse(engine, "--engine") is Engine.CTRANSLATE2
    threads = 0
    if workers > 1:
        threads = max(1, parent // workers) if ct2 else single_threaded_parent(workers)
    return WorkerPlan(requested, workers, threads, ct2, parent)
