"""The model worker: one thread owns the model; fair batches from the waiting requests, failures isolated.

Requests are cut into pieces of at most `max_batch_tokens` (subwords x beam, as `nmt translate` budgets),
and each batch takes the next piece of every waiting request in turn, so a one-line request waits about
one batch however large the others are. A batch that fails is retried piece by piece, so only the faulty
request fails; the worker never dies.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

from rich.console import Console

from nmt.config import DecodeConfig
from nmt.serve.metrics import Metrics
from nmt.serve.settings import ServeSettings


class QueueFull(Exception):
    pass


@dataclass(eq=False)
class Job:
    """One request's lines (subword ids by line index; blank lines absent), cut into pieces."""

    sources: dict[int, list[int]]
    count: int
    nbest: int
    deadline: float
    pieces: deque  # of lists of line indices, in line order
    queued: int  # lines still waiting
    served: int = 0  # pieces taken into batches so far
    results: list = field(default_factory=list)
    future: Future = field(default_factory=Future)

    def done(self) -> bool:
        return self.future.done()


def settle(job: Job) -> None:
    """Answer a job, unless its handler gave up on it (deadline) a moment before."""
    try:
        job.future.set_result(job.results)
    except InvalidStateError:
        pass


class Batcher:
    """The one thread that runs the model: fair batches from the waiting requests, failures isolated."""

    def __init__(self, translator, settings: ServeSettings, metrics: Metrics, console: Console):
        self.translator, self.settings, self.metrics, self.console = translator, settings, metrics, console
        self.decode: DecodeConfig = translator.decode
        self.max_source = translator.max_source
        self.wait = settings.batch_wait_ms / 1000
        self.cond = threading.Condition()
        self.jobs: deque[Job] = deque()  # jobs with pieces left, in arrival order
        self.queued = 0  # lines waiting, over all jobs
        self.closing = False
        self.thread = threading.Thread(target=self.run, name="nmt-batcher", daemon=True)
        self.thread.start()

    def cost(self, ids: list[int], nbest: int) -> int:
        """Decoder rows x source positions one line takes, as the front end's token_batches counts it."""
        rows = nbest if self.decode.sampling else self.decode.beam
        return rows * (len(ids) + 1)

    def submit(self, sources: dict[int, list[int]], count: int, nbest: int, deadline: float) -> Job:
        """Queue a request's encoded lines; its future gets the n-best of every line (blank: [("", 0.0)])."""
        pieces: deque[list[int]] = deque()
        piece, spent = [], 0
        for i, ids in sources.items():  # line order: a piece is a run of neighbouring lines
            c = self.cost(ids, nbest)
            if piece and spent + c > self.settings.max_batch_tokens:
                pieces.append(piece)
                piece, spent = [], 0
            piece.append(i)
            spent += c
        if piece:
            pieces.append(piece)
        job = Job(sources, count, nbest, deadline, pieces, len(sources))
        job.results = [[("", 0.0)] for _ in range(count)]
        if not pieces:
            job.future.set_result(job.results)
            return job
        with self.cond:
            if self.closing:
                raise QueueFull("the server is shutting down")
            if self.queued + job.queued > self.settings.max_queue and self.queued > 0:
                raise QueueFull(f"{self.queued} lines are waiting for the model")
            self.jobs.append(job)
            self.queued += job.queued
            self.metrics.queue_depth = self.queued
            self.cond.notify()
        return job

    def run(self) -> None:
        while True:
            try:
                batch = self.take()
                if batch is None:
                    return
                if batch:  # empty when every waiting request had passed its deadline
                    self.serve(batch)
            except Exception as e:  # the worker serves every other request: it must not die
                self.console.print(f"[red]batcher error:[/] {type(e).__name__}: {e}", highlight=False)

    def take(self) -> list[tuple[Job, list[int]]] | None:
        """The next batch: one piece from each waiting job in turn, same n-best, within the token budget.

        Jobs served least so far go first (arrival order among equals): a request that just came is in
        the next batch, however many pieces of a large one are still waiting.
        """
        with self.cond:
            while not self.jobs and not self.closing:
                self.cond.wait()
            if not self.jobs:
                return None
            # The window: a lone small request waits a little for others to share its batch.
            end = time.monotonic() + self.wait
            while (
                self.queued_cost() < self.settings.max_batch_tokens and (left := end - time.monotonic()) > 0
            ):
                if self.closing:
                    break
                self.cond.wait(left)
            now, budget, batch = time.monotonic(), self.settings.max_batch_tokens, []
            nbest = None
            for job in sorted(self.jobs, key=lambda j: j.served):
                if job.done() or job.deadline < now:  # answered (timed out or failed) or too late to help
                    self.drop(job, TimeoutError("the deadline passed before the model reached this request"))
                    continue
                if nbest is not None and job.nbest != nbest:
                    continue
                piece = job.pieces[0]
                c = sum(self.cost(job.sources[i], job.nbest) for i in piece)
                if batch and c > budget:
                    continue
                nbest = job.nbest
                job.pieces.popleft()
                job.served += 1
                if not job.pieces:
                    self.jobs.remove(job)
                batch.append((job, piece))
                budget -= c
                if budget <= 0:
                    break
            return batch

    def queued_cost(self) -> int:
        """The cost of what waits, counted only as far as one batch's budget."""
        total = 0
        for job in self.jobs:
            for piece in job.pieces:
                total += sum(self.cost(job.sources[i], job.nbest) for i in piece)
                if total >= self.settings.max_batch_tokens:
                    return total
        return total

    def drop(self, job: Job, error: Exception) -> None:
        """Take a job off the queue (lock held) and fail it unless it is answered already."""
        if job in self.jobs:
            self.jobs.remove(job)
        left = sum(len(p) for p in job.pieces)
        job.pieces.clear()
        self.queued -= left
        self.metrics.queue_depth = self.queued
        try:
            job.future.set_exception(error)
        except InvalidStateError:  # answered or given up on already
            pass

    def serve(self, batch: list[tuple[Job, list[int]]]) -> None:
        lines = sum(len(piece) for _, piece in batch)
        self.metrics.observe_batch(lines)
        try:
            self.translate(batch)
        except Exception:  # one bad request must not fail its batch-mates: retry each alone
            for job, piece in batch:
                try:
                    self.translate([(job, piece)])
                except Exception as e:
                    self.console.print(f"[red]a request failed:[/] {type(e).__name__}: {e}", highlight=False)
                    with self.cond:
                        self.drop(job, e)
        with self.cond:
            self.queued -= lines
            self.metrics.queue_depth = self.queued

    def translate(self, batch: list[tuple[Job, list[int]]]) -> None:
        pairs = [(job, i) for job, piece in batch for i in piece if not job.done()]
        if not pairs:
            return
        t = self.translator
        nbest = batch[0][0].nbest
        if nbest != self.decode.nbest:  # alternatives: the same search, keeping more of the beam
            t.decode = t.engine.decode = dataclasses.replace(self.decode, nbest=nbest)
        try:
            results = t.search_sources(len(pairs), {k: job.sources[i] for k, (job, i) in enumerate(pairs)})
        finally:
            t.decode = t.engine.decode = self.decode
        for (job, i), hyps in zip(pairs, results, strict=True):
            job.results[i] = hyps
        for job, _ in batch:
            if not job.pieces:  # its last piece: the earlier ones were done before
                settle(job)

    def close(self, timeout: float) -> None:
        with self.cond:
            self.closing = True
            for job in list(self.jobs):
                self.drop(job, QueueFull("the server is shutting down"))
            self.cond.notify_all()
        self.thread.join(timeout)
