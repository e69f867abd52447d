"""The engine thread: continuous batching behind the HTTP handlers.

One thread owns the engine (engine.py). Handlers on the event loop validate a request, then hand a `Job` over; at
the next round boundary the thread admits waiting jobs into the running batch (up to --max-batch-size rows), runs a
round for the whole batch, streams each job's new text, and resolves a job's future when it finishes. A job whose
client went away is dropped if it has not started, or stopped at the next round if it has. Nothing one job does
(a bad setting, a stop, a disconnect) touches the others in its batch.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, NamedTuple

if TYPE_CHECKING:
    from fastapi import Request

    from ..engine import Engine, GenerationConfig, GenerationResult, Sequence
    from ..logprobs import TokenLogprob
    from .metrics import Metrics
    from .streaming import TextDeltas

log = logging.getLogger("dflash.server")
DISCONNECT_POLL_S = 0.2  # how often a waiting handler checks whether its client is still there
IDLE_WAIT_S = 0.05
END_OF_STREAM = object()  # what the worker puts on a stream's queue after the last piece


class Piece(NamedTuple):
    """What a stream sends next: text, and the log-probabilities of the tokens since the last piece (None unless
    asked for). `prompt`: the prompt has been read, and `logprobs` are its tokens' (for `echo`). `generated`: how
    many tokens had been generated when the piece was cut (the engine's thread runs ahead of what was sent)."""

    text: str
    logprobs: "list[TokenLogprob] | None" = None
    prompt: bool = False
    generated: int = 0


class ServerBusy(Exception):
    """The queue is full; the client should retry later (HTTP 503)."""


@dataclass(eq=False)
class Job:
    prompt_ids: list[int]
    config: "GenerationConfig"
    deltas: "TextDeltas | None" = None  # set for streaming requests
    emit: Callable[[object], None] | None = None  # thread-safe sink for Pieces, then END_OF_STREAM
    echo: bool = False  # a stream that repeats the prompt: a prompt Piece comes first
    token_by_token: bool = False  # a piece per token, so each token's log-probability goes with the text it made
    cancelled: threading.Event = field(default_factory=threading.Event)
    queued_at: float = field(default_factory=time.perf_counter)
    started_at: float | None = None
    future: asyncio.Future | None = None
    loop: asyncio.AbstractEventLoop | None = None
    sequence: "Sequence | None" = None
    logprobs_sent: int = 0  # of the sequence's log-probabilities, how many went out with a piece

    @property
    def queue_s(self) -> float:
        return (self.started_at or self.queued_at) - self.queued_at

    def on_tokens(self, new_ids: list[int]) -> bool:
        """Called by the engine on its thread; returning False stops the generation."""
        if self.emit is not None:
            if self.echo and not self.deltas.ids:  # the prompt was read: its log-probabilities are known
                self.emit(Piece("", self.sequence.prompt_logprobs, prompt=True))
            for ids in ([token] for token in new_ids) if self.token_by_token else [new_ids]:
                piece = self.deltas.push(ids)
                if piece:
                    done = len(self.deltas.ids)
                    self.emit(Piece(piece, self._new_logprobs(upto=done), generated=done))
        return not self.cancelled.is_set()

    def _new_logprobs(self, upto: int | None = None) -> "list[TokenLogprob] | None":
        """The log-probabilities not sent yet, up to the `upto`-th generated token (those of tokens whose text a
        piece held back go with the next piece), without a stop token's: it is not text."""
        if self.config.logprobs is None:
            return None
        entries = self.sequence.logprobs[self.logprobs_sent:upto]
        self.logprobs_sent += len(entries)
        return [e for e in entries if e.token not in self.deltas.stop_ids]

    def resolve(self, result: "GenerationResult | None" = None, error: BaseException | None = None) -> None:
        """Hand the outcome to the waiting handler (from the engine thread); a stream also gets its end marker."""
        if self.emit is not None:
            if result is not None and error is None:
                tail, logprobs = self.deltas.finish(result.text), self._new_logprobs()
                if tail or logprobs:
                    self.emit(Piece(tail, logprobs, generated=len(self.deltas.ids)))
            self.emit(END_OF_STREAM)

        def settle() -> None:
            if self.future.done():
                return
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(result)

        self.loop.call_soon_threadsafe(settle)


class BatchWorker:
    """Runs the engine on its own thread; `submit` from the event loop, at most `max_queue` jobs in the server."""

    def __init__(self, engine: "Engine", metrics: "Metrics", max_queue: int):
        self.engine, self.metrics, self.max_queue = engine, metrics, max_queue
        self._incoming: deque[Job] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closing = False
        self._jobs: dict[object, Job] = {}  # engine sequence -> job (engine thread only)
        self._queued = 0  # waiting here or in the engine
        self._running = 0
        self._thread = threading.Thread(target=self._loop, name="dflash-engine", daemon=True)
        self._thread.start()

    @property
    def queued(self) -> int:
        return self._queued

    @property
    def running(self) -> int:
        return self._running

    def submit(self, jobs: list[Job]) -> list[asyncio.Future]:
        """Queue the jobs of one request (one per choice) together, or none of them when they do not all fit."""
        with self._lock:
            if self._queued + self._running + len(jobs) > self.max_queue:
                raise ServerBusy(f"the server is busy ({self._queued + self._running} requests queued or running); "
                                 "retry later")
            for job in jobs:
                job.loop = asyncio.get_running_loop()
                job.future = job.loop.create_future()
                self._incoming.append(job)
                self._queued += 1
        self._wake.set()
        return [job.future for job in jobs]

    # ---- the engine thread ---------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._closing:
            self._admit()
            if not self.engine.busy:
                self._wake.wait(IDLE_WAIT_S)
                self._wake.clear()
                continue
            self._cancel_abandoned()
            try:
                rows = len(self.engine.running)
                finished = self.engine.step()
                self.metrics.observe_pass(max(rows, len(self.engine.running)))
            except Exception as exc:  # noqa: BLE001 - a failed pass fails its batch, not the server
                log.exception("a batch failed")
                self._fail_all(exc)
                continue
            self._update_counts()
            for seq in finished:
                self.metrics.observe_generation(seq.result.stats)
                self._jobs.pop(seq).resolve(seq.result)

    def _admit(self) -> None:
        """Move waiting jobs into the engine while it has free rows (the rest wait here, where a job whose client
        leaves is dropped without ever running)."""
        free = self.engine.max_batch - len(self.engine.running) - len(self.engine.waiting)
        with self._lock:
            incoming = [self._incoming.popleft() for _ in range(min(free, len(self._incoming)))]
        for job in incoming:
            if job.cancelled.is_set():  # its client left while it waited
                with self._lock:
                    self._queued -= 1
                job.resolve(None)
                continue
            try:
                job.sequence = self.engine.submit(job.prompt_ids, job.config, job.on_tokens)
            except Exception as exc:  # noqa: BLE001 - checked by the handler already; if not, only this job fails
                with self._lock:
                    self._queued -= 1
                job.resolve(None, exc)
                continue
            self._jobs[job.sequence] = job
        self._update_counts()

    def _cancel_abandoned(self) -> None:
        for seq, job in list(self._jobs.items()):
            if job.cancelled.is_set():
                self.engine.cancel(seq)  # stops at this round's end; step() then hands it back as finished

    def _update_counts(self) -> None:
        running = len(self.engine.running)
        for seq in self.engine.running:
            job = self._jobs.get(seq)
            if job is not None and job.started_at is None:
                job.started_at = time.perf_counter()
        with self._lock:
            self._running = running
            self._queued = len(self._incoming) + len(self.engine.waiting)

    def _fail_all(self, exc: BaseException) -> None:
        from ..engine import Engine

        for job in self._jobs.values():
            job.resolve(None, exc)
        self._jobs.clear()
        old = self.engine
        budget = old.prefixes.budget_bytes if old.prefixes is not None else 0
        self.engine = Engine(old.target, old.proposer, old.max_batch, old.adaptive, old.timer, budget)
        self._update_counts()

    def close(self) -> None:
        self._closing = True
        self._wake.set()
        self._thread.join(timeout=10)
        for job in list(self._jobs.values()) + list(self._incoming):
            job.cancelled.set()
            if job.future is not None:
                job.resolve(None)


def cancel(jobs: list[Job], metrics: "Metrics") -> None:
    """The client went away: the engine thread drops each unfinished job if it is still queued, stops it after this
    round if it runs."""
    for job in jobs:
        if not job.future.done():
            job.cancelled.set()
            metrics.observe_cancel()


async def wait_for_results(jobs: list[Job], request: "Request", metrics: "Metrics"):
    """The jobs' results, or None when the client disconnected first (the jobs are then cancelled). A job that
    failed raises its error; the others are cancelled."""
    try:
        pending = {job.future for job in jobs}
        while pending:
            done, pending = await asyncio.wait(pending, timeout=DISCONNECT_POLL_S)
            for future in done:
                future.result()  # a failure ends the request now
            if pending and await request.is_disconnected():
                return None
        return [job.future.result() for job in jobs]
    finally:
        cancel(jobs, metrics)  # a no-op once the results are in
