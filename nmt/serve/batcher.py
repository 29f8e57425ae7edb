"""The model worker: one thread owns the model; fair batches from the waiting requests, failures isolated.

Requests are cut into pieces that fit the batch budget (decode.batch_tokens, `--max-batch-tokens`, costed
by nmt.translate.frontend.batch_cost as `nmt translate` costs its batches: by the steps their search may
take, so a batch of tiny lines is no longer than one of long ones), and each batch takes the next
piece of every waiting request in turn, so a one-line request waits about one batch however large the
others are. A batch that fails is retried piece by piece, so only the faulty
request fails; the worker never dies. A server of several models has a worker for each (nmt.serve.pairs):
a model's batches never wait on another's, so fairness holds within a model and isolation across them.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

from rich.console import Console

from nmt.config import DecodeConfig
from nmt.device import release_freed_memory
from nmt.serve.metrics import Metrics
from nmt.serve.settings import ServeSettings
from nmt.translate.frontend import batch_cost, rows_per_sentence


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
    submitted: float = field(default_factory=time.monotonic)
    constraints: dict | None = None  # glossary terms by line index (nmt.translate.terminology)
    results: list = field(default_factory=list)
    future: Future = field(default_factory=Future)

    def done(self) -> bool:
        return self.future.done()


def settle(job: Job, metrics: Metrics) -> None:
    """Answer a job, unless its handler gave up on it (deadline) a moment before.

    The metrics count the answer before it is given: a client that reads /metrics as soon as it has its
    answer finds it counted."""
    if job.future.done():
        return
    metrics.characters.inc(sum(len(hyps[0][0]) for hyps in job.results))
    try:
        job.future.set_result(job.results)
    except InvalidStateError:  # given up on in the instant between the two lines: counted all the same
        pass


class Batcher:
    """The one thread that runs the model: fair batches from the waiting requests, failures isolated."""

    def __init__(
        self,
        translator,
        settings: ServeSettings,
        metrics: Metrics,
        console: Console,
        name: str = "nmt-batcher",
    ):
        self.translator, self.settings, self.metrics, self.console = translator, settings, metrics, console
        self.wait = settings.batch_wait_ms / 1000
        self.cond = threading.Condition()
        self.jobs: deque[Job] = deque()  # jobs with pieces left, in arrival order
        self.queued = 0  # lines waiting, over all jobs
        self.closing = False
        self.active: list[Job] = []  # the jobs of the batch being translated
        self.together = False  # whether the last batch held pieces of several requests
        self.thread = threading.Thread(target=self.run, name=name, daemon=True)
        self.thread.start()

    @property
    def decode(self) -> DecodeConfig:
        """The translator's decode settings, the only ones: a request's alternatives are a search's nbest."""
        return self.translator.decode

    @property
    def budget(self) -> int:
        return self.decode.batch_tokens

    def cost(self, lines: int, longest: int, nbest: int) -> int:
        """What `lines` lines, the longest of `longest` subwords with its EOS, cost against the budget."""
        rows = rows_per_sentence(self.decode, nbest)
        return batch_cost(lines, longest, rows, self.decode, self.translator.max_source)

    def piece_size(self, job: Job, piece: list[int]) -> tuple[int, int]:
        """A piece's lines, and its longest line in subwords with the EOS."""
        return len(piece), max(len(job.sources[i]) + 1 for i in piece)

    def submit(
        self, sources: dict[int, list[int]], count: int, nbest: int, deadline: float, constraints=None
    ) -> Job:
        """Queue a request's encoded lines; its future gets the n-best of every line (blank: [("", 0.0)]).
        `constraints`: the terms of the lines that have any (Terminology.apply)."""
        pieces: deque[list[int]] = deque()
        piece, longest = [], 0
        for i, ids in sources.items():  # line order: a piece is a run of neighbouring lines
            longer = max(longest, len(ids) + 1)
            if piece and self.cost(len(piece) + 1, longer, nbest) > self.budget:
                pieces.append(piece)
                piece, longer = [], len(ids) + 1
            piece.append(i)
            longest = longer
        if piece:
            pieces.append(piece)
        job = Job(sources, count, nbest, deadline, pieces, len(sources), constraints=constraints)
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
            self.metrics.tokens.inc(sum(map(len, sources.values())))
            self.queued += job.queued
            self.metrics.set_queue(self.queued, self)
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
                with self.cond:
                    self.active = []
                    idle = not self.jobs
                if idle:  # a large batch's buffers, kept for the next step (nmt.device), go back while idle
                    release_freed_memory()
            except Exception as e:  # the worker serves every other request: it must not die
                self.console.print(f"[red]batcher error:[/] {type(e).__name__}: {e}", highlight=False)

    def take(self) -> list[tuple[Job, list[int]]] | None:
        """The next batch: one piece from each waiting job in turn, same n-best, within the token budget.

        Jobs served least so far go first (arrival order among equals): a request that just came is in
        the next batch, however many pieces of a large one are still waiting.
        """
        free = time.monotonic()  # the model is free from now: its last batch is answered
        with self.cond:
            while not self.jobs and not self.closing:
                self.cond.wait()
            if not self.jobs:
                return None
            # The window: where requests come together (the last batch held several, and this one came
            # within a window of it), the first of a batch waits a little for others to share it. One
            # alone (a client's next line, a user's) starts at once: nobody is coming to share its
            # batch, and the window would only add to its time (10 ms: most of a student's sentence).
            start = time.monotonic()
            end = start + self.wait if self.together and start - free < self.wait else start
            while self.queued_cost() < self.budget and (left := end - time.monotonic()) > 0:
                if self.closing:
                    break
                self.cond.wait(left)
            now, batch, lines, longest = time.monotonic(), [], 0, 0
            nbest = None
            for job in sorted(self.jobs, key=lambda j: j.served):
                if job.done() or job.deadline < now:  # answered (timed out or failed) or too late to help
                    self.drop(job, TimeoutError("the deadline passed before the model reached this request"))
                    continue
                if nbest is not None and job.nbest != nbest:
                    continue
                piece = job.pieces[0]
                size, top = self.piece_size(job, piece)
                cost = self.cost(lines + size, max(longest, top), job.nbest)  # the batch with this piece
                if batch and cost > self.budget:
                    continue
                nbest = job.nbest
                job.pieces.popleft()
                self.queued -= size  # no longer waiting: counted out before any answer can leave
                if job.served == 0:
                    self.metrics.queue_seconds.observe(now - job.submitted)
                job.served += 1
                if not job.pieces:
                    self.jobs.remove(job)
                batch.append((job, piece))
                lines, longest = lines + size, max(longest, top)
                if cost >= self.budget:
                    break
            self.metrics.set_queue(self.queued, self)
            self.active = [job for job, _ in batch]
            self.together = len(batch) > 1
            return batch

    def queued_cost(self) -> int:
        """The cost of what waits, piece by piece, counted only as far as one batch's budget."""
        total = 0
        for job in self.jobs:
            for piece in job.pieces:
                total += self.cost(*self.piece_size(job, piece), job.nbest)
                if total >= self.budget:
                    return total
        return total

    def drop(self, job: Job, error: Exception) -> None:
        """Take a job off the queue (lock held) and fail it unless it is answered already."""
        if job in self.jobs:
            self.jobs.remove(job)
        left = sum(len(p) for p in job.pieces)
        job.pieces.clear()
        self.queued -= left
        self.metrics.set_queue(self.queued, self)
        try:
            job.future.set_exception(error)
        except InvalidStateError:  # answered or given up on already
            pass

    def serve(self, batch: list[tuple[Job, list[int]]]) -> None:
        lines = sum(len(piece) for _, piece in batch)
        start = time.monotonic()
        try:
            finished = self.translate(batch)
        except Exception:  # one bad request must not fail its batch-mates: retry each alone
            finished = []
            for job, piece in batch:
                try:
                    finished += self.translate([(job, piece)])
                except Exception as e:
                    self.console.print(f"[red]a request failed:[/] {type(e).__name__}: {e}", highlight=False)
                    with self.cond:
                        self.drop(job, e)
        # Counted before the answers leave: a client that reads /metrics on its answer finds its batch.
        self.metrics.observe_batch(lines, time.monotonic() - start)
        for job in finished:
            settle(job, self.metrics)

    def translate(self, batch: list[tuple[Job, list[int]]]) -> list[Job]:
        """Translate a batch's pieces into their jobs' results: the jobs it completes (their last piece)."""
        finished = [job for job, _ in batch if not job.pieces]  # the earlier pieces were done before
        pairs = [(job, i) for job, piece in batch for i in piece if not job.done()]
        if not pairs:
            return finished
        nbest = batch[0][0].nbest  # alternatives: the same search, keeping more of the beam
        sources = {k: job.sources[i] for k, (job, i) in enumerate(pairs)}
        terms = {k: job.constraints[i] for k, (job, i) in enumerate(pairs) if i in (job.constraints or {})}
        given = {"constraints": terms} if terms else {}  # glossary terms (nmt.translate.terminology)
        results = self.translator.search_sources(len(pairs), sources, nbest=nbest, **given)
        for (job, i), hyps in zip(pairs, results, strict=True):
            job.results[i] = hyps
        return finished

    def stop(self) -> None:
        """Take no more batches: every request still waiting, those of the batch being translated
        included, is answered now that the server is shutting down (503). The worker ends after the
        batch it is in, so no torch operation outlives the process's last moments."""
        with self.cond:
            self.closing = True
            for job in [*self.jobs, *self.active]:
                self.drop(job, QueueFull("the server is shutting down"))
            self.cond.notify_all()

    def close(self, timeout: float) -> bool:
        """Stop, and wait up to `timeout` seconds for the worker to end: whether it did."""
        self.stop()
        self.thread.join(timeout)
        return not self.thread.is_alive()
