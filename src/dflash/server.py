"""`dflash serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of the speculative decoder.

The engine is batch-1 and not thread-safe, so every generation runs on ONE worker thread, in arrival order (FIFO).
Request handlers stay on the event loop: they validate, tokenize, queue a job and wait for it while watching for a
client that went away (its job is dropped if still queued, or stopped after the current round if running).
Streaming sends decoded text deltas that never contain a stop string, not even the beginning of one.

fastapi, uvicorn and pydantic are imported lazily: `dflash --help` must work without the [serve] extra.
No `from __future__ import annotations` here: FastAPI reads the endpoints' annotations, and those refer to classes
built inside functions, which string annotations could not resolve.
"""

import argparse
import asyncio
import functools
import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Callable, Iterator

from .errors import UserError

if TYPE_CHECKING:
    from fastapi import FastAPI, Request

    from .engine import GenerationConfig, GenerationResult, GenerationStats, SpeculativeDecoder

log = logging.getLogger("dflash.server")

DEFAULT_MAX_TOKENS = 256  # when a request sets none: one client must not hold the single worker for a whole context
DISCONNECT_POLL_S = 0.2  # how often a waiting handler checks whether its client is still there
LATENCY_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")
GENERATION_ENDPOINTS = ENDPOINTS[:2]
END_OF_STREAM = object()  # what the worker puts on a stream's queue after the last text piece


class ServerBusy(Exception):
    """The queue is full; the client should retry later (HTTP 503)."""


class ModelNotFound(Exception):
    """The request names a model this server does not serve (HTTP 404, as OpenAI answers)."""


# ---- metrics ----------------------------------------------------------------------------------------------------
class Metrics:
    """Counters behind GET /metrics, rendered in the Prometheus text format by hand (no extra dependency).
    Updated from the event loop and from the worker thread, hence the lock."""

    def __init__(self, block_size: int):
        self._lock = threading.Lock()
        self.requests: Counter = Counter()  # (endpoint, status) -> count
        self.cancelled = 0
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.rounds = 0
        self.round_tokens = 0  # tokens emitted by verify rounds (accepted drafts + bonus): the tau numerator
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.position_accepted = [0] * (block_size - 1)
        self.latency_buckets = [0] * len(LATENCY_BUCKETS_S)
        self.latency_sum = 0.0
        self.latency_count = 0
        self.ttft_sum = 0.0
        self.generations = 0

    def observe_request(self, path: str, status: int, seconds: float) -> None:
        endpoint = path if path in ENDPOINTS else "other"  # bounded label values, whatever clients send
        with self._lock:
            self.requests[endpoint, status] += 1
            if endpoint in GENERATION_ENDPOINTS:
                self.latency_sum += seconds
                self.latency_count += 1
                for i, bound in enumerate(LATENCY_BUCKETS_S):
                    self.latency_buckets[i] += seconds <= bound

    def observe_generation(self, stats: "GenerationStats") -> None:
        with self._lock:
            self.generations += 1
            self.prompt_tokens += stats.prompt_tokens
            self.generated_tokens += stats.new_tokens
            self.ttft_sum += stats.ttft_s
            self.rounds += stats.num_rounds
            self.round_tokens += sum(stats.accept_lengths)
            self.draft_tokens += sum(stats.draft_lengths)
            for emitted in stats.accept_lengths:
                accepted = emitted - 1
                self.accepted_tokens += accepted
                for k in range(min(accepted, len(self.position_accepted))):
                    self.position_accepted[k] += 1

    def observe_cancel(self) -> None:
        with self._lock:
            self.cancelled += 1

    def render(self, queued: int, running: int) -> str:
        with self._lock:
            return "\n".join(self._lines(queued, running)) + "\n"

    def _lines(self, queued: int, running: int) -> Iterator[str]:
        def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> Iterator[str]:
            yield f"# HELP {name} {help_text}"
            yield f"# TYPE {name} {kind}"
            for labels, value in samples:
                yield f"{name}{labels} {_number(value)}"

        rounds = max(1, self.rounds)
        requests = [(f'{{endpoint="{e}",status="{s}"}}', n) for (e, s), n in sorted(self.requests.items())]
        yield from metric("dflash_requests_total", "counter", "HTTP requests by endpoint and status.", requests)
        yield from metric("dflash_cancelled_requests_total", "counter",
                          "Generations dropped because the client disconnected.", [("", self.cancelled)])
        yield from metric("dflash_prompt_tokens_total", "counter", "Prompt tokens processed.",
                          [("", self.prompt_tokens)])
        yield from metric("dflash_generated_tokens_total", "counter", "Tokens generated.",
                          [("", self.generated_tokens)])
        yield from metric("dflash_verify_rounds_total", "counter", "Target verify rounds.", [("", self.rounds)])
        yield from metric("dflash_draft_tokens_total", "counter",
                          "Draft tokens proposed and verified.", [("", self.draft_tokens)])
        yield from metric("dflash_accepted_tokens_total", "counter", "Draft tokens accepted by the target.",
                          [("", self.accepted_tokens)])
        yield from metric("dflash_mean_tau", "gauge", "Mean tokens emitted per verify round, over all rounds.",
                          [("", self.round_tokens / rounds)])
        positions = [(f'{{position="{k + 1}"}}', n / rounds) for k, n in enumerate(self.position_accepted)]
        yield from metric("dflash_position_acceptance", "gauge",
                          "Fraction of verify rounds in which draft position k was accepted.", positions)
        yield from metric("dflash_queue_depth", "gauge", "Requests waiting for the worker.", [("", queued)])
        yield from metric("dflash_running_requests", "gauge", "Requests being generated (0 or 1).", [("", running)])
        buckets = [(f'{{le="{_number(b)}"}}', n) for b, n in zip(LATENCY_BUCKETS_S, self.latency_buckets, strict=True)]
        yield from metric("dflash_request_latency_seconds", "histogram",
                          "Completion request latency, queueing and streaming included.", [])
        for labels, n in buckets + [('{le="+Inf"}', self.latency_count)]:
            yield f"dflash_request_latency_seconds_bucket{labels} {n}"
        yield f"dflash_request_latency_seconds_sum {_number(self.latency_sum)}"
        yield f"dflash_request_latency_seconds_count {self.latency_count}"
        yield from metric("dflash_time_to_first_token_seconds", "summary", "Prefill time of each generation.", [])
        yield f"dflash_time_to_first_token_seconds_sum {_number(self.ttft_sum)}"
        yield f"dflash_time_to_first_token_seconds_count {self.generations}"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


# ---- streaming text ---------------------------------------------------------------------------------------------
class TextDeltas:
    """Turns a growing list of generated tokens into text pieces that are safe to send.

    Held back until more tokens decide: a completed stop string and everything after it, a tail that could still
    grow into a stop string, and a trailing partial UTF-8 character. A trailing stop token (EOS) is not text."""

    def __init__(self, decode: Callable[[list[int]], str], stop_strings: tuple[str, ...], stop_ids: set[int]):
        self.decode, self.stop_strings, self.stop_ids = decode, tuple(s for s in stop_strings if s), stop_ids
        self.ids: list[int] = []
        self.sent = ""

    def push(self, new_ids: list[int]) -> str:
        self.ids += new_ids
        ids = self.ids[:-1] if self.ids and self.ids[-1] in self.stop_ids else self.ids
        text = self.decode(ids)
        cut = min((text.find(s) for s in self.stop_strings if s in text), default=-1)
        text = text[:cut] if cut >= 0 else text[: len(text) - self._unsettled_tail(text)]
        return self._advance(text)

    def finish(self, final_text: str) -> str:
        """The rest of the engine's final text (which is already cut at stop strings)."""
        return self._advance(final_text)

    def _unsettled_tail(self, text: str) -> int:
        tail = len(text) - len(text.rstrip("\ufffd"))  # a character whose bytes are not all generated yet
        for stop in self.stop_strings:
            for k in range(min(len(stop) - 1, len(text)), tail, -1):
                if text.endswith(stop[:k]):
                    tail = k
                    break
        return tail

    def _advance(self, text: str) -> str:
        # Decoding more tokens can rewrite earlier text (a tokenizer's space clean-up); what was sent cannot be
        # taken back, so wait until the text extends what was sent again.
        if not text.startswith(self.sent):
            return ""
        piece, self.sent = text[len(self.sent):], text
        return piece


# ---- the generation worker --------------------------------------------------------------------------------------
@dataclass(eq=False)
class Job:
    prompt_ids: list[int]
    config: "GenerationConfig"
    deltas: TextDeltas | None = None  # set for streaming requests
    emit: Callable[[object], None] | None = None  # thread-safe sink for text pieces and END_OF_STREAM
    cancelled: threading.Event = field(default_factory=threading.Event)
    queued_at: float = field(default_factory=time.perf_counter)
    started_at: float | None = None

    def on_tokens(self, new_ids: list[int]) -> bool:
        """Called by the engine on the worker thread; returning False stops the generation."""
        if self.emit is not None:
            piece = self.deltas.push(new_ids)
            if piece:
                self.emit(piece)
        return not self.cancelled.is_set()


class GenerationWorker:
    """Runs jobs one at a time, in submission order, on a single thread (the engine is batch-1, not thread-safe)."""

    def __init__(self, decoder: "SpeculativeDecoder", metrics: Metrics, max_queue: int):
        self.decoder, self.metrics, self.max_queue = decoder, metrics, max_queue
        # a one-thread executor is a FIFO queue plus a worker; cancelling a queued future removes the job unrun
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dflash-generate")
        self._jobs: set[Job] = set()  # submitted and not finished; touched only on the event loop

    @property
    def running(self) -> int:
        return sum(job.started_at is not None for job in self._jobs)

    @property
    def queued(self) -> int:
        return len(self._jobs) - self.running

    def submit(self, job: Job) -> asyncio.Future:
        if len(self._jobs) >= self.max_queue:
            raise ServerBusy(f"the server is busy ({len(self._jobs)} requests queued or running); retry later")
        future = asyncio.get_running_loop().run_in_executor(self._executor, self._execute, job)
        self._jobs.add(job)
        future.add_done_callback(lambda _: self._jobs.discard(job))
        return future

    def _execute(self, job: Job) -> "GenerationResult | None":
        if job.cancelled.is_set():
            return None
        job.started_at = time.perf_counter()
        try:
            result = self.decoder.generate(job.prompt_ids, job.config, job.on_tokens)
            self.metrics.observe_generation(result.stats)
            if job.emit is not None:
                tail = job.deltas.finish(result.text)
                if tail:
                    job.emit(tail)
            return result
        finally:
            if job.emit is not None:
                job.emit(END_OF_STREAM)

    def close(self) -> None:
        for job in list(self._jobs):
            job.cancelled.set()
        self._executor.shutdown(wait=False, cancel_futures=True)


def cancel(job: Job, future: asyncio.Future, metrics: Metrics) -> None:
    """The client went away: drop the job if it is still queued, stop it after this round if it runs."""
    if not future.done():
        job.cancelled.set()
        future.cancel()
        metrics.observe_cancel()


async def wait_for_result(job: Job, future: asyncio.Future, request: "Request", metrics: Metrics):
    """The job's result, or None when the client disconnected first (the job is then cancelled)."""
    try:
        while True:
            done, _ = await asyncio.wait({future}, timeout=DISCONNECT_POLL_S)
            if done:
                return future.result()
            if await request.is_disconnected():
                return None
    finally:
        cancel(job, future, metrics)  # a no-op once the result is in


# ---- request schemas --------------------------------------------------------------------------------------------
@functools.cache
def schemas() -> SimpleNamespace:
    """The request bodies (pydantic), built on first use so that pydantic stays an optional dependency.
    Unknown fields are ignored, as OpenAI clients send extras; known fields of the wrong type give a 422."""
    from typing import Literal

    from pydantic import BaseModel, ConfigDict, Field

    class TextPart(BaseModel):
        type: Literal["text"]
        text: str

    class ChatMessage(BaseModel):
        role: Literal["system", "developer", "user", "assistant"]
        content: str | list[TextPart]

        def as_dict(self) -> dict:
            text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
            return {"role": self.role, "content": text}

    class StreamOptions(BaseModel):
        include_usage: bool = False

    class OpenAIFields(BaseModel):
        model_config = ConfigDict(extra="ignore")
        model: str | None = None
        max_tokens: int | None = None
        temperature: float = 1.0  # OpenAI's default; send 0 for greedy (lossless vs `dflash generate`)
        top_p: float = 1.0
        top_k: int = 0  # extension (as in vLLM); 0 = off
        seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
        stop: str | list[str] | None = None
        n: int = 1
        stream: bool = False
        stream_options: StreamOptions | None = None
        ignore_eos: bool = False  # extension: fixed-length outputs for benchmarks
        presence_penalty: float = 0.0
        frequency_penalty: float = 0.0
        logprobs: bool | int | None = None
        user: str | None = None

    class ChatRequest(OpenAIFields):
        messages: list[ChatMessage] = Field(min_length=1)
        max_completion_tokens: int | None = None  # the newer name of max_tokens

    class CompletionRequest(OpenAIFields):
        prompt: str | list[int] | list[str]
        echo: bool = False
        suffix: str | None = None

    return SimpleNamespace(ChatRequest=ChatRequest, CompletionRequest=CompletionRequest)


def generation_config(body, default_max_tokens: int) -> "GenerationConfig":
    """Check the OpenAI fields (errors name them as OpenAI does) and build the engine's config."""
    from .engine import GenerationConfig
    from .sampling import SamplingConfig

    max_tokens = getattr(body, "max_completion_tokens", None)
    max_tokens = body.max_tokens if max_tokens is None else max_tokens
    checks = [
        (body.n == 1, f"n must be 1: this server generates one choice per request, got n={body.n}"),
        (max_tokens is None or max_tokens >= 1, f"max_tokens must be >= 1, got {max_tokens}"),
        (body.temperature >= 0, f"temperature must be >= 0, got {body.temperature}"),
        (0 < body.top_p <= 1, f"top_p must be in (0, 1], got {body.top_p}"),
        (body.top_k >= 0, f"top_k must be >= 0, got {body.top_k}"),
        (body.presence_penalty == 0 and body.frequency_penalty == 0, "presence/frequency penalties are not supported"),
        (not body.logprobs, "logprobs are not supported"),
        (not getattr(body, "echo", False) and not getattr(body, "suffix", None), "echo and suffix are not supported"),
    ]
    for ok, message in checks:
        if not ok:
            raise UserError(message)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    sampling = SamplingConfig(body.temperature, body.top_k, body.top_p, body.seed)
    config = GenerationConfig(
        max_new_tokens=max_tokens or default_max_tokens, sampling=sampling, stop_strings=tuple(stop),
        ignore_eos=body.ignore_eos,
    )
    config.validate()
    return config


def completion_prompt_ids(target, prompt) -> list[int]:
    """A completions prompt: text, a one-element list of text, or token ids."""
    if isinstance(prompt, str):
        return target.encode_prompt(prompt, chat=False)
    if prompt and all(isinstance(p, str) for p in prompt):
        if len(prompt) > 1:
            raise UserError(f"one prompt per request is supported, got {len(prompt)}")
        return target.encode_prompt(prompt[0], chat=False)
    bad = [t for t in prompt if not 0 <= t < target.vocab_size]
    if bad:
        raise UserError(f"token ids must be in [0, {target.vocab_size}), got {bad[0]}")
    return list(prompt)


def check_fits(prompt_ids: list[int], decoder) -> None:
    """Reject a prompt the engine would refuse, before it waits in the queue."""
    if not prompt_ids:
        raise UserError("the prompt is empty")
    decoder.budget(prompt_ids)


# ---- responses --------------------------------------------------------------------------------------------------
@dataclass
class Exchange:
    """One request's identity, shared by its response and all its stream chunks."""

    chat: bool
    model: str
    method: str
    prompt_tokens: int
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"

    def envelope(self, chunk: bool) -> dict:
        kind = "chat.completion" if self.chat else "text_completion"
        kind += ".chunk" if chunk and self.chat else ""
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def choice(self, text: str | None, finish_reason: str | None, chunk: bool) -> dict:
        if not self.chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        if chunk:  # a delta without content is the closing chunk, which only carries the finish reason
            message = ("delta", {} if text is None else {"content": text})
        else:
            message = ("message", {"role": "assistant", "content": text or ""})
        return {"index": 0, message[0]: message[1], "logprobs": None, "finish_reason": finish_reason}

    def usage(self, result: "GenerationResult") -> dict:
        done = result.stats.new_tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": done,
                "total_tokens": self.prompt_tokens + done}

    def extension(self, job: Job, result: "GenerationResult") -> dict:
        """The `dflash` object: how speculative decoding went for this request."""
        stats = result.stats
        return {
            "method": self.method, "tau": stats.tau, "rounds": stats.num_rounds,
            "per_position_acceptance": stats.per_position_acceptance,
            "queue_s": (job.started_at or job.queued_at) - job.queued_at, "ttft_s": stats.ttft_s,
            "generation_s": stats.total_s,
        }

    def response(self, job: Job, result: "GenerationResult") -> dict:
        return {
            **self.envelope(chunk=False), "choices": [self.choice(result.text, result.finish_reason, chunk=False)],
            "usage": self.usage(result), "dflash": self.extension(job, result),
        }

    def chunk(self, text: str | None, finish_reason: str | None = None, delta: dict | None = None, **extra) -> str:
        choice = self.choice(text, finish_reason, chunk=True)
        if delta is not None:
            choice["delta"] = delta
        return sse({**self.envelope(chunk=True), "choices": [choice], **extra})


def sse(payload: Any) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def openai_error(status: int, message: str, kind: str = "invalid_request_error", **extra):
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}, **extra},
                        status_code=status)


# ---- the app ----------------------------------------------------------------------------------------------------
@dataclass
class Service:
    """Everything a request handler needs: the model, the worker and the counters."""

    target: Any
    worker: GenerationWorker
    metrics: Metrics
    model_name: str
    default_max_tokens: int

    @property
    def proposer(self):
        return self.worker.decoder.proposer

    def check_model(self, requested: str | None) -> None:
        if requested is not None and requested != self.model_name:
            raise ModelNotFound(f"model {requested!r} is not served here; this server serves {self.model_name!r}")

    async def complete(self, request: "Request", body, prompt_ids: list[int], chat: bool):
        config = generation_config(body, self.default_max_tokens)
        check_fits(prompt_ids, self.worker.decoder)
        exchange = Exchange(chat, self.model_name, self.proposer.name, len(prompt_ids))
        if body.stream:
            return self.stream(request, body, prompt_ids, config, exchange)
        job = Job(prompt_ids, config)
        result = await wait_for_result(job, self.worker.submit(job), request, self.metrics)
        if result is None:  # nobody is listening any more; a status for the logs only
            from fastapi.responses import Response

            return Response(status_code=499)
        return exchange.response(job, result)

    def stream(self, request: "Request", body, prompt_ids, config, exchange: Exchange):
        from fastapi.responses import StreamingResponse

        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue = asyncio.Queue()
        stop_ids = set() if config.ignore_eos else set(self.target.eos_token_ids)
        deltas = TextDeltas(self.target.decode, config.stop_strings, stop_ids)
        job = Job(prompt_ids, config, deltas, emit=lambda item: loop.call_soon_threadsafe(pieces.put_nowait, item))
        future = self.worker.submit(job)  # queued now, so a busy server answers 503 before the stream starts
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = self.stream_events(request, job, future, pieces, exchange, include_usage)
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def stream_events(self, request, job, future, pieces, exchange: Exchange, include_usage: bool):
        try:
            if exchange.chat:  # OpenAI opens a chat stream with the role
                yield exchange.chunk(None, delta={"role": "assistant", "content": ""})
            while (piece := await next_piece(pieces, request)) is not END_OF_STREAM:
                if piece is None:
                    return  # the client went away; `finally` cancels the job
                yield exchange.chunk(piece)
            try:
                result = await future
            except Exception as exc:  # the status line is long gone: report it the way OpenAI streams errors
                if not isinstance(exc, UserError):
                    log.exception("streamed generation failed")
                kind = "invalid_request_error" if isinstance(exc, UserError) else "server_error"
                yield sse({"error": {"message": str(exc), "type": kind}})
                return
            yield exchange.chunk(None, result.finish_reason, dflash=exchange.extension(job, result))
            if include_usage:
                yield sse({**exchange.envelope(chunk=True), "choices": [], "usage": exchange.usage(result)})
            yield sse("[DONE]")
        finally:
            cancel(job, future, self.metrics)  # a no-op when the generation finished


async def next_piece(pieces: asyncio.Queue, request: "Request"):
    """The next text piece (or END_OF_STREAM); None once the client has disconnected."""
    while True:
        try:
            return await asyncio.wait_for(pieces.get(), DISCONNECT_POLL_S)
        except TimeoutError:
            if await request.is_disconnected():
                return None


def create_app(target, proposer, model_name: str, *, default_max_tokens: int = DEFAULT_MAX_TOKENS,
               max_queue: int = 256) -> "FastAPI":
    """The ASGI app serving `target` with `proposer` under the name `model_name`."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.responses import PlainTextResponse

    from .engine import SpeculativeDecoder

    metrics = Metrics(block_size=proposer.max_draft + 1)
    worker = GenerationWorker(SpeculativeDecoder(target, proposer), metrics, max_queue)
    service = Service(target, worker, metrics, model_name, default_max_tokens)
    body_types = schemas()

    @asynccontextmanager
    async def lifespan(app):
        yield
        worker.close()

    app = FastAPI(title="dflash", version="0.1.0", lifespan=lifespan)
    app.state.service = service
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    add_error_handlers(app)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: body_types.ChatRequest, request: Request):
        service.check_model(body.model)
        prompt_ids = target.encode_messages([m.as_dict() for m in body.messages])
        return await service.complete(request, body, prompt_ids, chat=True)

    @app.post("/v1/completions")
    async def completions(body: body_types.CompletionRequest, request: Request):
        service.check_model(body.model)
        prompt_ids = completion_prompt_ids(target, body.prompt)
        return await service.complete(request, body, prompt_ids, chat=False)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(service)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        service.check_model(model_id)
        return model_card(service)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, "method": proposer.name, "queued": worker.queued,
                "running": worker.running}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(worker.queued, worker.running),
                                 media_type="text/plain; version=0.0.4")

    return app


def model_card(service: Service) -> dict:
    return {"id": service.model_name, "object": "model", "created": 0, "owned_by": "dflash",
            "dflash": {"method": service.proposer.name, "block_size": service.proposer.max_draft + 1,
                       "max_context": service.target.max_context}}


def add_error_handlers(app) -> None:
    """OpenAI-style error bodies. Unparsable JSON is a 400 (as OpenAI answers); wrong field types stay pydantic's
    422, with its details kept next to the OpenAI `error` object."""
    from fastapi.encoders import jsonable_encoder
    from fastapi.exceptions import RequestValidationError

    @app.exception_handler(UserError)
    async def user_error(request, exc: UserError):
        return openai_error(400, str(exc))

    @app.exception_handler(ModelNotFound)
    async def model_not_found(request, exc: ModelNotFound):
        return openai_error(404, str(exc))

    @app.exception_handler(ServerBusy)
    async def busy(request, exc: ServerBusy):
        return openai_error(503, str(exc), kind="server_busy")

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            return openai_error(400, "the request body is not valid JSON")
        where = "; ".join(f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in errors)
        return openai_error(422, f"invalid request: {where}", detail=jsonable_encoder(errors))

    @app.exception_handler(Exception)
    async def crashed(request, exc: Exception):
        log.exception("request failed")
        return openai_error(500, f"internal error: {exc.__class__.__name__}: {exc}", kind="server_error")


class MetricsMiddleware:
    """Counts every request by endpoint and status (validation failures included) and times completions until
    their last byte, which for a stream is well after the handler returned."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), 500

        async def send_and_note(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            self.metrics.observe_request(scope["path"], status, time.perf_counter() - start)


# ---- running it -------------------------------------------------------------------------------------------------
def listen(host: str, port: int) -> socket.socket:
    """A listening socket, or a one-line UserError (port taken, bad host) instead of uvicorn's exit."""
    if not 0 <= port <= 65535:
        raise UserError(f"port must be in [0, 65535], got {port}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as exc:
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        raise UserError(f"cannot listen on {host}:{port}: {reason}") from exc


def uvicorn_server(app, log_level: str = "info"):
    import uvicorn

    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5)
    return uvicorn.Server(config)


class BackgroundServer:
    """Serves `app` on a background thread, for tests and the load test: `with BackgroundServer(app) as url:`."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.sock = listen(host, port)
        self.server = uvicorn_server(app, log_level)
        bound = self.sock.getsockname()
        self.url = f"http://{host if ':' not in host else f'[{host}]'}:{bound[1]}"
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self.url

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.sock.close()


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .cli import add_method_arguments, add_target_arguments

    add_target_arguments(p)
    add_method_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 exposes it to the network)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: --target)")
    p.add_argument("--default-max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help="max_tokens for requests that set none")
    p.add_argument("--max-queue", type=int, default=256, help="requests queued or running before answering 503")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def run(args) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ModuleNotFoundError as exc:
        raise UserError(f"`dflash serve` needs {exc.name}: pip install 'dflash[serve]'") from exc
    from .cli import method_options
    from .engine import GenerationConfig, SpeculativeDecoder
    from .loading import build_proposer, load_target_cached

    if args.default_max_tokens < 1 or args.max_queue < 1:
        raise UserError("--default-max-tokens and --max-queue must be >= 1")
    options = method_options(args, args.method)
    sock = listen(args.host, args.port)  # fail fast on a taken port, before loading the model
    target = load_target_cached(args.target, args.dtype, args.device, args.kernels)
    proposer, note = build_proposer(args.method, target, options)
    if note:
        print(f"[dflash] {note}", file=sys.stderr)
    warm_up = GenerationConfig(max_new_tokens=4)
    SpeculativeDecoder(target, proposer).generate(target.encode_prompt("Hello", chat=True), warm_up)
    name = args.served_model_name or args.target
    app = create_app(target, proposer, name, default_max_tokens=args.default_max_tokens, max_queue=args.max_queue)
    port = sock.getsockname()[1]
    print(f"[dflash] serving {name!r} ({args.method}) at http://{args.host}:{port}/v1", file=sys.stderr)
    uvicorn_server(app, args.log_level).run(sockets=[sock])
    return 0
