"""`dflash serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of the batched engine; the
Responses API (responses.py) and Anthropic's Messages API (messages.py) go through the same request preparation.

Request handlers stay on the event loop: they validate, tokenize, hand a job to the engine thread (worker.py) and
wait for it while watching for a client that went away. Up to --max-batch-size requests decode together; new ones
join the running batch at round boundaries. Streaming sends decoded text deltas that never contain a stop string,
not even the beginning of one (streaming.py).

fastapi, uvicorn and pydantic are imported lazily: `dflash --help` must work without the [serve] extra.
No `from __future__ import annotations` here: FastAPI reads the endpoints' annotations, and those refer to classes
built inside functions, which string annotations could not resolve.
"""

import argparse
import asyncio
import hmac
import logging
import os
import socket
import ssl
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from .. import __version__
from ..errors import UserError
from ..hub import DEFAULT_TARGET
from ..options import (add_method_arguments, add_reasoning_argument, add_target_arguments, add_tool_format_argument,
                       check_drafter_folders, method_options)
from .metrics import Metrics, MetricsMiddleware
from .schemas import (
    Exchange,
    check_fits,
    choice_configs,
    completion_prompt_ids,
    completion_prompts,
    merged_completions,
    usage_of,
    echoed_prompt,
    scores_only,
    openai_error,
    schemas,
    sse,
    truncated_prompt,
)
from ..prediction import prediction_ids
from ..reasoning import check_parser, thinking_of
from ..tools import encode_chat, tool_request, tool_style
from .messages import Messages
from .response_store import ResponseNotFound
from .responses import Responses
from .streaming import ChatChoiceStream, TextDeltas, failure_kind
from .worker import (
    DISCONNECT_POLL_S,
    END_OF_STREAM,
    BatchWorker,
    Job,
    ServerBusy,
    cancel,
    wait_for_results,
)

if TYPE_CHECKING:
    from fastapi import FastAPI, Request

    from ..tools import ToolRequest

log = logging.getLogger("dflash.server")

DEFAULT_MAX_TOKENS = 256  # when a request sets none: one client must not hold a row for a whole context
DEFAULT_MAX_BATCH = 8
DEFAULT_PREFIX_CACHE_MB = 256


class ModelNotFound(Exception):
    """The request names a model this server does not serve (HTTP 404, as OpenAI answers)."""


# ---- the app ----------------------------------------------------------------------------------------------------
@dataclass
class Service:
    """Everything a request handler needs: the model, the worker and the counters."""

    target: Any
    worker: BatchWorker
    metrics: Metrics
    model_names: tuple[str, ...]  # the ids clients may send (vLLM's --served-model-name); the first is the default
    default_max_tokens: int
    reasoning_parser: str | None = None  # a chat reply's thinking comes back apart (reasoning.py)
    sampling_defaults: dict = field(default_factory=dict)  # for the fields a request leaves out (--generation-config)
    ignored_fields: set = field(default_factory=set)  # request fields already logged as not read (note_ignored)

    @property
    def proposer(self):
        return self.worker.engine.proposer

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def check_model(self, requested: str | None) -> None:
        if requested is not None and requested not in self.model_names:
            served = " or ".join(map(repr, self.model_names))
            raise ModelNotFound(f"model {requested!r} is not served here; this server serves {served}")

    def note_ignored(self, body) -> None:
        """Log the fields a request sent that this server does not read (as vLLM does), each name once: a client
        that expects one to do something (`functions`, `audio`) learns why it did not."""
        unread = sorted(set(body.model_extra or {}) - self.ignored_fields)
        if unread:
            self.ignored_fields.update(unread)
            log.warning("requests' fields this server does not read, ignored: %s", ", ".join(unread))

    def choice_configs(self, body, tools: "ToolRequest | None" = None) -> list:
        """The engine's config of each of the request's choices, the model's sampling defaults in the fields it left
        out (as vLLM's --generation-config auto)."""
        for key, value in self.sampling_defaults.items():
            if key not in body.model_fields_set and key in type(body).model_fields:
                setattr(body, key, value)
        return choice_configs(body, self.default_max_tokens, self.worker.max_queue, self.target, tools)

    def answering_as(self, requested: str | None) -> str:
        """The model id a reply names: the one the request sent (one of the served names), else the first."""
        return requested if requested in self.model_names else self.model_name

    def prepared(self, body, prompt_ids: list[int], chat: bool,
                 tools: "ToolRequest | None" = None) -> tuple[list, Exchange]:
        """The engine's config for each of the request's choices and the request's exchange, its prompt checked to
        fit (chat, the Responses and the Messages APIs share them)."""
        self.note_ignored(body)
        configs = self.choice_configs(body, tools)
        check_fits(prompt_ids, self.worker.engine)
        reasoning = chat and self.reasoning_parser is not None
        thinking = thinking_of(self.target, prompt_ids, self.reasoning_parser if chat else None)
        prediction = prediction_ids(self.target.tokenizer, getattr(body, "prediction", None))
        # a grammar holds the answer after the thinking; a prediction's tokens are drafted where the output follows
        configs = [replace(config, thinking=thinking, prediction=prediction) for config in configs]
        exchange = Exchange(chat, self.answering_as(body.model), self.proposer.name, len(prompt_ids),
                            self.target.tokenizer, echo=echoed_prompt(self.target, body, prompt_ids),
                            scores_only=scores_only(body), tools=tools, reasoning=reasoning, thinking=thinking)
        return configs, exchange

    async def results(self, request: "Request", jobs: list[Job]):
        """The jobs' results once all are done, or a 499 response where the client went away first (nobody is
        listening any more; a status for the logs only)."""
        self.worker.submit(jobs)
        results = await wait_for_results(jobs, request, self.metrics)
        if results is None:
            from fastapi.responses import Response

            return Response(status_code=499)
        return results

    async def complete(self, request: "Request", body, prompt_ids: list[int], chat: bool,
                       tools: "ToolRequest | None" = None):
        prompt_ids = truncated_prompt(body, prompt_ids, self.worker.engine)
        configs, exchange = self.prepared(body, prompt_ids, chat, tools)
        if body.stream:
            return self.stream(request, body, [(prompt_ids, config, exchange) for config in configs])
        jobs = [Job(prompt_ids, config) for config in configs]
        results = await self.results(request, jobs)
        if not isinstance(results, list):
            return results
        return exchange.response(max(job.queue_s for job in jobs), results,
                                 configs[0].stop_ids(self.target.eos_token_ids))

    async def complete_many(self, request: "Request", body, prompts: list):
        """A completions request of several prompts (lm-eval's batches): each completed as a request of its own,
        all queued at once, answered together (merged_completions); streamed, every prompt's choices in one stream,
        choice j of prompt i at index i * n + j."""
        if len(prompts) * body.n > self.worker.max_queue:
            raise UserError(f"{len(prompts)} prompts x n={body.n} pass the server's queue of {self.worker.max_queue}")
        ids = [truncated_prompt(body, completion_prompt_ids(self.target, prompt), self.worker.engine)
               for prompt in prompts]  # all checked before any is queued
        for prompt_ids in ids:
            check_fits(prompt_ids, self.worker.engine)
        bodies = [body.model_copy(update={"prompt": prompt}) for prompt in prompts]  # each echoes its own
        if body.stream:
            return self.stream_many(request, bodies, ids)
        responses = await asyncio.gather(*(self.complete(request, one, prompt_ids, chat=False)
                                           for one, prompt_ids in zip(bodies, ids)))
        if any(not isinstance(response, dict) for response in responses):  # the client went away
            return next(response for response in responses if not isinstance(response, dict))
        return merged_completions(responses, body.n)

    def stream_many(self, request: "Request", bodies: list, ids: list[list[int]]):
        """One stream of several prompts' choices, each prompt's with an exchange of its own (what it echoes, its
        prompt's tokens), all under one id."""
        runs = []
        for one, prompt_ids in zip(bodies, ids):
            configs = self.choice_configs(one)
            exchange = Exchange(False, self.answering_as(one.model), self.proposer.name, len(prompt_ids),
                                self.target.tokenizer, echo=echoed_prompt(self.target, one, prompt_ids),
                                scores_only=scores_only(one))
            if runs:
                exchange.id, exchange.created = runs[0][2].id, runs[0][2].created
            runs += [(prompt_ids, config, exchange) for config in configs]
        return self.stream(request, bodies[0], runs)

    def stream(self, request: "Request", body, runs: list[tuple]):
        """One stream for all the request's choices, `runs` of (prompt ids, config, exchange) in index order: each
        chunk names its choice's index."""
        from fastapi.responses import StreamingResponse

        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue = asyncio.Queue()

        def sink(index: int):
            return lambda item: loop.call_soon_threadsafe(pieces.put_nowait, (index, item))

        jobs = [Job(prompt_ids, config, TextDeltas.of(self.target, config), emit=sink(i),
                    echo=exchange.echo is not None) for i, (prompt_ids, config, exchange) in enumerate(runs)]
        self.worker.submit(jobs)  # queued now, so a busy server answers 503 before the stream starts
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        if body.stream_options and body.stream_options.continuous_usage_stats:
            live = LiveUsage([exchange for _, _, exchange in runs])
            for _, _, exchange in runs:
                exchange.live_usage = live
        events = self.stream_events(request, jobs, pieces, [exchange for _, _, exchange in runs], include_usage)
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def stream_events(self, request, jobs: list[Job], pieces, exchanges: list[Exchange], include_usage: bool):
        exchange = exchanges[0]  # the request's identity: every choice's chunks carry its id
        live = None if exchange.scores_only else exchange.live_usage  # a LiveUsage; scores generate nothing
        try:
            if exchange.chat:  # OpenAI opens a chat stream with the role
                for index in range(len(jobs)):
                    yield exchange.chunk(None, delta={"role": "assistant", "content": ""}, index=index)
            results, streaming = [None] * len(jobs), len(jobs)
            choices = [ChatChoiceStream(exchange, index) for index in range(len(jobs))] if exchange.chat else None
            while streaming:
                if (item := await next_piece(pieces, request)) is None:
                    return  # the client went away; `finally` cancels the jobs
                index, piece = item
                if piece is not END_OF_STREAM:
                    if live is not None:
                        live.advance(index, piece.generated)
                    if piece.prompt:
                        yield exchanges[index].echo_chunk(index, piece.logprobs)
                    elif choices is not None:
                        for chunk in choices[index].piece(piece.text, piece.logprobs):
                            yield chunk
                    elif not exchange.scores_only:
                        yield exchanges[index].chunk(piece.text, index=index, logprobs=piece.logprobs)
                    continue
                try:
                    results[index] = result = await jobs[index].future
                except Exception as exc:  # the status line is long gone: report it the way OpenAI streams errors
                    yield sse({"error": {"message": str(exc), "type": failure_kind(exc, "streamed generation")}})
                    return
                streaming -= 1
                if live is not None:  # a stop token has no text, so no piece counted it
                    live.advance(index, result.stats.new_tokens)
                finish = "length" if exchange.scores_only else result.finish_reason
                if choices is not None:
                    for chunk in choices[index].finish(result):
                        yield chunk
                    finish = choices[index].finish_reason
                yield exchanges[index].chunk(None, finish, index=index,
                                             stop_reason=None if exchange.scores_only else result.stop_reason,
                                             dflash=exchanges[index].extension(jobs[index].queue_s, [result]))
            if include_usage:
                yield sse({**exchange.envelope(chunk=True), "choices": [], "usage": usage_of(exchanges, results)})
            yield sse("[DONE]")
        finally:
            cancel(jobs, self.metrics)  # a no-op when the generations finished


class LiveUsage:
    """The usage of a stream so far (vLLM's continuous_usage_stats): every prompt's tokens, and the tokens generated
    up to the text sent. Counted from the pieces the stream has taken, not from the engine, whose thread runs ahead."""

    def __init__(self, exchanges: list[Exchange]):
        self.prompts = sum({id(exchange): exchange.prompt_tokens for exchange in exchanges}.values())
        self.generated = [0] * len(exchanges)  # by choice

    def advance(self, index: int, generated: int) -> None:
        self.generated[index] = max(self.generated[index], generated)

    def __call__(self) -> dict:
        done = sum(self.generated)
        return {"prompt_tokens": self.prompts, "completion_tokens": done, "total_tokens": self.prompts + done}


async def next_piece(pieces: asyncio.Queue, request: "Request"):
    """The next text piece (or END_OF_STREAM); None once the client has disconnected."""
    while True:
        try:
            return await asyncio.wait_for(pieces.get(), DISCONNECT_POLL_S)
        except TimeoutError:
            if await request.is_disconnected():
                return None


class ApiKeyMiddleware:
    """With an API key set, every endpoint but the probes (/health, /metrics, /ping, /version) wants `Authorization:
    Bearer KEY` (as OpenAI and vLLM's --api-key) or `x-api-key: KEY` (as Anthropic's clients send it); others get
    a 401."""

    OPEN = ("/health", "/metrics", "/ping", "/version")

    def __init__(self, app, api_key: str):
        self.app, self.bearer, self.key = app, f"Bearer {api_key}".encode(), api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.OPEN:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if hmac.compare_digest(headers.get(b"authorization", b""), self.bearer) or hmac.compare_digest(
                headers.get(b"x-api-key", b""), self.key):
            return await self.app(scope, receive, send)
        response = openai_error(401, "Incorrect API key provided: send it as `Authorization: Bearer KEY` (or "
                                "`x-api-key: KEY`)", kind="invalid_request_error", path=scope["path"])
        await response(scope, receive, send)


def create_app(target, proposer, model_name: str | list[str], *, default_max_tokens: int = DEFAULT_MAX_TOKENS,
               max_queue: int = 256, max_batch_size: int = DEFAULT_MAX_BATCH, adaptive: bool = True,
               prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB, api_key: str | None = None,
               tool_format: str = "auto", reasoning_parser: str | None = None,
               sampling_defaults: dict | None = None, allowed_origins: list[str] | None = None) -> "FastAPI":
    """The ASGI app serving `target` with `proposer` under the name `model_name` (or several names, the first the
    default): up to `max_batch_size` requests
    decode together (continuous batching), up to `max_queue` are accepted in all before answering 503; prompts'
    keys and values are kept up to `prefix_cache_mb` for prompts that start alike (prefixes.py); tool calls in
    `tool_format` (tools.tool_style); `reasoning_parser` "think" (or vLLM's names for it): chat replies' thinking
    apart from their answers (reasoning.py); `sampling_defaults`: temperature, top_p, ... for the requests that set
    none (TargetModel.sampling_defaults, the model's own); `allowed_origins`: the web pages' origins whose scripts
    may call it (CORS; ["*"] for any)."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.responses import Response

    from ..engine import Engine

    if target.backend == "transformers" and max_batch_size > 1:
        log.warning("%s runs through transformers: one request at a time", target.name)
        max_batch_size = 1
    engine = Engine(target, proposer, max_batch=max_batch_size, adaptive=adaptive,
                    prefix_cache_bytes=int(prefix_cache_mb * 2**20))
    holder: dict = {}
    names = (model_name,) if isinstance(model_name, str) else tuple(model_name)
    metrics = Metrics(proposer.max_draft + 1, queued=lambda: holder["worker"].queued,
                      running=lambda: holder["worker"].running, model_name=names[0])
    worker = holder["worker"] = BatchWorker(engine, metrics, max_queue)
    service = Service(target, worker, metrics, names, default_max_tokens, check_parser(reasoning_parser),
                      dict(sampling_defaults or {}))
    call_style = tool_style(target.tokenizer, tool_format)
    body_types = schemas()

    @asynccontextmanager
    async def lifespan(app):
        yield
        worker.close()

    app = FastAPI(title="dflash", version=__version__, lifespan=lifespan)
    app.state.service = service
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    if allowed_origins:  # outermost: a browser's preflight carries no API key, and a 401 must be readable too
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["*"], allow_headers=["*"])
    add_error_handlers(app)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: body_types.ChatRequest, request: Request):
        service.check_model(body.model)
        tools = tool_request(body.tools, body.tool_choice, body.parallel_tool_calls, call_style)
        prompt_ids = encode_chat(target, [m.as_dict() for m in body.messages], tools, body.template_options())
        return await service.complete(request, body, prompt_ids, chat=True, tools=tools)

    @app.post("/v1/completions")
    async def completions(body: body_types.CompletionRequest, request: Request):
        service.check_model(body.model)
        prompts = completion_prompts(body.prompt)
        if len(prompts) == 1:
            return await service.complete(request, body, completion_prompt_ids(target, prompts[0]), chat=False)
        return await service.complete_many(request, body, prompts)

    responses = Responses(service, call_style)

    @app.post("/v1/responses")
    async def create_response(body: body_types.ResponsesRequest, request: Request):
        return await responses.create(request, body)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, stream: bool = False, starting_after: int = -1):
        return responses.retrieve(response_id, stream, starting_after)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str):
        return responses.cancel(response_id)

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(response_id: str, order: str = "desc", limit: int = 20, after: str | None = None):
        return responses.input_items(response_id, order, limit, after)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        responses.store.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    messages = Messages(service, call_style)

    @app.post("/v1/messages")
    async def create_message(body: body_types.MessagesRequest, request: Request):
        return await messages.create(request, body)

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(body: body_types.CountTokensRequest):
        return messages.count_tokens(body)

    @app.post("/tokenize")
    async def tokenize(body: body_types.TokenizeRequest):
        service.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise UserError("send either prompt or messages")
        ids = (target.encode_prompt(body.prompt, chat=False) if body.prompt is not None
               else encode_chat(target, [m.as_dict() for m in body.messages],
                                tool_request(body.tools, body.tool_choice, style=call_style), body.template_options()))
        return {"tokens": ids, "count": len(ids), "max_model_len": target.max_context}

    @app.post("/detokenize")
    async def detokenize(body: body_types.DetokenizeRequest):
        service.check_model(body.model)
        completion_prompt_ids(target, body.tokens)  # the ids are checked as a prompt's are
        return {"prompt": target.decode(body.tokens)}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(service, name) for name in service.model_names]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        service.check_model(model_id)
        return model_card(service, model_id)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": service.model_name, "method": proposer.name, "queued": worker.queued,
                "running": worker.running, "max_batch_size": engine.max_batch}

    @app.get("/ping")  # what SageMaker-style load balancers and vLLM's clients probe
    async def ping():
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def model_card(service: Service, name: str) -> dict:
    """OpenAI's model object, with vLLM's max_model_len (clients size their prompts by it)."""
    return {"id": name, "object": "model", "created": 0, "owned_by": "dflash",
            "max_model_len": service.target.max_context,
            "dflash": {"method": service.proposer.name, "block_size": service.proposer.max_draft + 1,
                       "max_context": service.target.max_context, "max_batch_size": service.worker.engine.max_batch}}


def add_error_handlers(app) -> None:
    """OpenAI-style error bodies. Unparsable JSON is a 400 (as OpenAI answers); wrong field types stay pydantic's
    422, with its details kept next to the OpenAI `error` object."""
    from fastapi.encoders import jsonable_encoder
    from fastapi.exceptions import RequestValidationError

    @app.exception_handler(UserError)
    async def user_error(request, exc: UserError):
        return openai_error(400, str(exc), path=request.url.path)

    @app.exception_handler(ModelNotFound)
    async def model_not_found(request, exc: ModelNotFound):
        return openai_error(404, str(exc), path=request.url.path)

    @app.exception_handler(ResponseNotFound)
    async def response_not_found(request, exc: ResponseNotFound):
        return openai_error(404, str(exc), path=request.url.path)

    @app.exception_handler(ServerBusy)
    async def busy(request, exc: ServerBusy):
        return openai_error(503, str(exc), kind="server_busy", path=request.url.path)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            return openai_error(400, "the request body is not valid JSON", path=request.url.path)
        where = "; ".join(f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in errors)
        return openai_error(422, f"invalid request: {where}", path=request.url.path,
                            detail=jsonable_encoder(errors))

    @app.exception_handler(Exception)
    async def crashed(request, exc: Exception):
        log.exception("request failed")
        return openai_error(500, f"internal error: {exc.__class__.__name__}: {exc}", kind="server_error",
                            path=request.url.path)


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


def uvicorn_server(app, log_level: str = "info", **options):
    """`options`: uvicorn.Config's own (ssl_keyfile, ssl_certfile, root_path)."""
    import uvicorn

    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5, **options)
    return uvicorn.Server(config)


class BackgroundServer:
    """Serves `app` on a background thread, for tests and the load test: `with BackgroundServer(app) as url:`."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning", **options):
        self.sock = listen(host, port)
        self.server = uvicorn_server(app, log_level, **options)
        bound = self.sock.getsockname()
        scheme = "https" if options.get("ssl_certfile") else "http"
        self.url = f"{scheme}://{host if ':' not in host else f'[{host}]'}:{bound[1]}"
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
    p.add_argument("model", nargs="?", default=None,
                   help="the target, as `vllm serve MODEL` reads it (the same as --target)")
    add_target_arguments(p)
    add_method_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 exposes it to the network)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model ids clients may send, the first the one replies name where a request sends none "
                        "(as vLLM's; e.g. a name your client is set to ask for; default: --target)")
    p.add_argument("--default-max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help="max_tokens for requests that set none")
    p.add_argument("--max-batch-size", "--max-num-seqs", type=int, default=DEFAULT_MAX_BATCH,
                   help=f"requests decoded together in one target pass (continuous batching; default "
                        f"{DEFAULT_MAX_BATCH}); more takes more memory for the KV cache")
    p.add_argument("--max-queue", type=int, default=256, help="requests queued or running before answering 503")
    p.add_argument("--prefix-cache-mb", type=float, default=DEFAULT_PREFIX_CACHE_MB,
                   help="memory for keys and values of earlier prompts, so a prompt that starts like one of them "
                        "(a chat's history, a shared system prompt, n choices) reads only the rest "
                        f"(default {DEFAULT_PREFIX_CACHE_MB}; 0 = off)")
    p.add_argument("--api-key", default=os.environ.get("DFLASH_API_KEY"),
                   help="require `Authorization: Bearer KEY` on every endpoint but /health, /metrics, /ping and "
                        "/version (default: $DFLASH_API_KEY; unset = open)")
    add_tool_format_argument(p)
    add_reasoning_argument(p)
    p.add_argument("--generation-config", default="auto", choices=["auto", "none"],
                   help="auto: the sampling settings the model's generation_config.json sets (temperature, top_p, "
                        "top_k, min_p, repetition_penalty) are the defaults of requests that leave them out, as "
                        "vLLM's --generation-config auto; none: OpenAI's defaults (temperature 1, top_p 1)")
    p.add_argument("--max-model-len", type=int, default=None, metavar="TOKENS",
                   help="prompt and output together stay within this many tokens, as vLLM's (a cap on each "
                        "request's cache memory; longer prompts get a 400; default: the model's context)")
    p.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                   help="web pages whose scripts may call the server (CORS), e.g. http://localhost:3000, or * for "
                        "any (default: none)")
    p.add_argument("--ssl-keyfile", default=None, metavar="FILE", help="serve HTTPS with this private key ...")
    p.add_argument("--ssl-certfile", default=None, metavar="FILE", help="... and this certificate (PEM files)")
    p.add_argument("--root-path", default="", metavar="PATH",
                   help="the path prefix a proxy in front serves the server under (and strips), e.g. /dflash "
                        "(default: none)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def run(args) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ModuleNotFoundError as exc:
        raise UserError(f"`dflash serve` needs {exc.name}: pip install 'dflash[serve]'") from exc
    from ..engine import GenerationConfig, SpeculativeDecoder
    from ..loading import build_proposer, settle_heap, target_from_args

    if args.default_max_tokens < 1 or args.max_queue < 1 or args.max_batch_size < 1:
        raise UserError("--default-max-tokens, --max-queue and --max-batch-size must be >= 1")
    if args.prefix_cache_mb < 0:
        raise UserError("--prefix-cache-mb must be >= 0")
    tls = tls_options(args.ssl_keyfile, args.ssl_certfile)
    if args.model is not None:
        if args.target != DEFAULT_TARGET:
            raise UserError(f"give the model ({args.model}) or --target ({args.target}), not both")
        args.target = args.model
    check_drafter_folders(args.drafter, [args.method])
    options = method_options(args, args.method)
    sock = listen(args.host, args.port)  # fail fast on a taken port, before loading the model
    target = target_from_args(args, many_rows=True, release_plain=True)
    target.limit_context(args.max_model_len)
    proposer, note = build_proposer(args.method, target, options)
    if note:
        print(f"[dflash] {note}", file=sys.stderr)
    settle_heap()
    warm_up = GenerationConfig(max_new_tokens=4)
    SpeculativeDecoder(target, proposer).generate(target.encode_prompt("Hello", chat=True), warm_up)
    names = args.served_model_name or [args.target]
    defaults = target.sampling_defaults if args.generation_config == "auto" else {}
    if defaults:
        print(f"[dflash] requests that leave them out sample with the model's own {defaults} "
              "(generation_config.json; --generation-config none for OpenAI's defaults)", file=sys.stderr)
    app = create_app(target, proposer, names, default_max_tokens=args.default_max_tokens, max_queue=args.max_queue,
                     max_batch_size=args.max_batch_size, adaptive=not args.whole_blocks,
                     prefix_cache_mb=args.prefix_cache_mb, api_key=args.api_key, tool_format=args.tool_format,
                     reasoning_parser=args.reasoning_parser, sampling_defaults=defaults,
                     allowed_origins=args.allowed_origins)
    port = sock.getsockname()[1]
    served = " / ".join(map(repr, names))
    scheme = "https" if tls else "http"
    print(f"[dflash] serving {served} ({args.method}) at {scheme}://{args.host}:{port}{args.root_path}/v1",
          file=sys.stderr)
    uvicorn_server(app, args.log_level, root_path=args.root_path, **tls).run(sockets=[sock])
    return 0


def tls_options(keyfile: str | None, certfile: str | None) -> dict:
    """uvicorn's options for HTTPS, checked before the model loads: both files or neither."""
    if (keyfile is None) != (certfile is None):
        raise UserError("HTTPS needs both --ssl-keyfile and --ssl-certfile")
    if keyfile is None:
        return {}
    for flag, path in (("--ssl-keyfile", keyfile), ("--ssl-certfile", certfile)):
        if not os.path.isfile(path):
            raise UserError(f"{flag} {path}: no such file")
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile)
    except ssl.SSLError as exc:
        raise UserError(f"--ssl-certfile {certfile} and --ssl-keyfile {keyfile} are not a PEM certificate and its "
                        f"key: {exc}") from None
    return {"ssl_keyfile": keyfile, "ssl_certfile": certfile}
