"""Continuous batching for the server: one thread steps the batches, requests join between steps.

A request waits in a FIFO queue until the batch has a free row (at most ``max_batch`` rows decode at once);
then its prompt is prefilled and it decodes with the others, one speculative step at a time, and leaves the
step it finishes, freeing its row for the next request. Method ``draft`` rows decode in a second batch over
the draft model alone; the thread steps both in turn. ``waiting`` and ``running`` mean what vLLM's
``num_requests_waiting`` and ``num_requests_running`` mean: queued, and in a batch.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pivotspec import api


@dataclass
class Job:
    """A request on its way through the scheduler; ``done`` gets the generation or the exception."""

    request: Any  # api.make_request's row
    done: Callable[[Any, BaseException | None], None]
    cancelled: threading.Event = field(default_factory=threading.Event)


class Scheduler:
    def __init__(self, pair: api.Pair, max_batch: int, on_change: Callable[[int, int], None] | None = None,
                 prefix_caching: bool = True):
        self.pair, self.max_batch, self.on_change = pair, max_batch, on_change
        self.prefix_caching = prefix_caching
        self.lanes: dict[bool, Any] = {}  # draft_only -> batch
        self.jobs: dict[int, Job] = {}  # id(request) -> job, for rows in a batch
        self.waiting: deque[Job] = deque()
        self.wake = threading.Condition()
        threading.Thread(target=self._run, name="pivotspec-batch", daemon=True).start()

    @property
    def running(self) -> int:
        return len(self.jobs)

    def queued(self) -> int:
        """Requests that will still wait once the free rows are filled at the next step boundary."""
        with self.wake:
            return max(0, len(self.waiting) - max(0, self.max_batch - self.running))

    def submit(self, job: Job) -> None:
        with self.wake:
            self.waiting.append(job)
            self._changed()
            self.wake.notify()

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change(len(self.waiting), self.running)

    def _lane(self, request: Any) -> Any:
        draft_only = request.method == "draft"
        if draft_only not in self.lanes:
            self.lanes[draft_only] = api.new_batch(self.pair, draft_only, self.prefix_caching)
        return self.lanes[draft_only]

    def _admit(self) -> None:
        """Move queued requests into a batch while rows are free (on the scheduler thread, between steps)."""
        while self.waiting and self.running < self.max_batch:
            with self.wake:
                job = self.waiting.popleft()
            if job.cancelled.is_set():  # its client left while it waited
                continue
            try:
                self._lane(job.request).add(job.request)
            except Exception as exc:  # a row that cannot start fails alone
                job.done(None, exc)
                continue
            self.jobs[id(job.request)] = job
        with self.wake:
            self._changed()

    def _run(self) -> None:
        while True:
            with self.wake:
                while not self.waiting and not self.jobs:
                    self.wake.wait()
            self._admit()
            for draft_only, batch in list(self.lanes.items()):
                if batch.rows:
                    self._step(draft_only, batch)

    def _step(self, draft_only: bool, batch: Any) -> None:
        try:
            finished = batch.step()
        except Exception as exc:  # every row of the batch fails; the next request starts a fresh batch
            failed = [self.jobs.pop(id(row.request)) for row in batch.rows]
            del self.lanes[draft_only]
            self._finish([(job, None) for job in failed], exc)
            return
        self._finish([(self.jobs.pop(id(row.request)), gen) for row, gen in finished], None)

    def _finish(self, done: list[tuple[Job, Any]], exc: Exception | None) -> None:
        """Answer finished jobs, after the gauges have counted them out: a client that reads /metrics as soon
        as its reply arrives must not still see its request running."""
        if done:
            with self.wake:
                self._changed()
        for job, gen in done:
            job.done(gen, exc)
