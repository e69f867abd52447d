"""`dflash batch` on a file in OpenAI's batch format (as OpenAI's Batch API and vLLM's `run-batch` read it): each
line `{"custom_id": ..., "method": "POST", "url": "/v1/chat/completions", "body": {...}}`, answered with the line
OpenAI's batch output holds, `{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`.

Every body goes through the server's own handlers (serving/app.py, in this process, without a socket), so a line
gets exactly what `dflash serve` would answer: chat completions, completions, the Responses API or Anthropic's
Messages API, with every field those take (the command line's sampling options do not apply; --max-new-tokens is
the max_tokens of bodies that set none); a bad body is that line's 400, not the run's end. Up to twice
`--max-batch` requests are in flight, so the engine's continuous batch stays full. As with the other layouts,
answers are appended as they finish and the same command resumes an interrupted run (by custom_id)."""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from .batch import answered_ids, still_to_answer
from .errors import UserError
from .jsonl import iter_jsonl

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")


@dataclass
class BatchRequest:
    custom_id: str
    url: str
    body: dict


def is_openai_batch(path: Path) -> bool:
    """Whether the file's first row is in OpenAI's batch format (a custom_id and a body)."""
    if not path.is_file():
        return False
    for _, row in iter_jsonl(path):
        return isinstance(row, dict) and "custom_id" in row and "body" in row
    return False


def read_batch(path: Path) -> list[BatchRequest]:
    """Every line; UserError naming the line for a missing or repeated custom_id, a method other than POST, a url
    not served here, a body that is not an object, or a streamed one."""
    requests, seen = [], set()
    for line_no, row in iter_jsonl(path):
        where = f"{path}:{line_no}"
        if not isinstance(row, dict) or not isinstance(row.get("custom_id"), str) or not row["custom_id"]:
            raise UserError(f"{where}: every line of a batch needs its custom_id (a string)")
        custom_id = row["custom_id"]
        if custom_id in seen:
            raise UserError(f"{where} repeats the custom_id {custom_id!r}: they must be unique to resume a run")
        seen.add(custom_id)
        if row.get("method", "POST") != "POST":
            raise UserError(f"{where}: method must be POST, got {row.get('method')!r}")
        if row.get("url") not in URLS:
            raise UserError(f"{where}: url must be one of {', '.join(URLS)}, got {row.get('url')!r}")
        if not isinstance(row.get("body"), dict):
            raise UserError(f"{where}: body must be an object (the request's JSON)")
        if row["body"].get("stream") or row["body"].get("background"):
            raise UserError(f"{where}: a batch answers whole requests; leave out stream and background")
        requests.append(BatchRequest(custom_id, row["url"], row["body"]))
    if not requests:
        raise UserError(f"{path} holds no requests")
    return requests


def served_names(target_name: str, requests: list[BatchRequest]) -> list[str]:
    """The target's name, and every model the bodies name: a batch file written for another server's model runs
    on this one, each answer naming the model its body sent."""
    names = [target_name]
    for request in requests:
        model = request.body.get("model")
        if isinstance(model, str) and model not in names:
            names.append(model)
    return names


def output_line(request: BatchRequest, status: int, body) -> dict:
    """A line of OpenAI's batch output: the request's answer (a failed one's error body, with its status)."""
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": request.custom_id,
            "response": {"status_code": status, "request_id": f"req_{uuid.uuid4().hex}", "body": body},
            "error": None}


async def answer_all(app, todo: list[BatchRequest], in_flight: int, out, bar) -> tuple[int, int]:
    """Post every request to `app` (in this process), at most `in_flight` at once, each answer appended to `out`
    as it finishes; (answers written, those that failed)."""
    import httpx

    gate = asyncio.Semaphore(in_flight)
    written = failed = 0

    async def one(client, request: BatchRequest) -> None:
        nonlocal written, failed
        async with gate:
            reply = await client.post(request.url, json=request.body)
        out.write(json.dumps(output_line(request, reply.status_code, reply.json())) + "\n")
        out.flush()  # on disk as it finishes: a kill loses only the answers under way
        written, failed = written + 1, failed + (reply.status_code >= 400)
        bar.update(1)

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://dflash-batch", timeout=None) as client:
        await asyncio.gather(*(one(client, request) for request in todo))
    return written, failed


def run(args) -> int:
    """`dflash batch` on a batch file: the target loaded once and served in this process to every line."""
    from tqdm import tqdm

    from .generate import config_from_args, load_method
    from .loading import settle_heap
    from .options import kill_stops_like_ctrl_c

    try:
        from .serving import create_app
    except ImportError as exc:
        raise UserError(f"a batch file in OpenAI's format goes through the server's handlers, which need the serve "
                        f"extra (pip install 'dflash[serve]'): {exc}") from None
    requests, output = read_batch(Path(args.input)), Path(args.output)
    todo = still_to_answer(requests, output, lambda request: request.custom_id, key="custom_id")
    if not todo:
        return 0
    target, proposer = load_method(args, config_from_args(args))
    settle_heap()
    in_flight = 2 * args.max_batch
    app = create_app(target, proposer, served_names(args.target, requests), max_batch_size=args.max_batch,
                     max_queue=in_flight, default_max_tokens=args.max_new_tokens, adaptive=not args.whole_blocks,
                     tool_format=args.tool_format, reasoning_parser=args.reasoning_parser,
                     sampling_defaults=target.sampling_defaults)  # bodies as `dflash serve` answers them
    output.parent.mkdir(parents=True, exist_ok=True)
    start, written = time.perf_counter(), 0
    try:
        with kill_stops_like_ctrl_c(), output.open("a", encoding="utf-8") as out, \
                tqdm(total=len(todo), unit="request", disable=args.no_progress, file=sys.stderr) as bar:
            written, failed = asyncio.run(answer_all(app, todo, in_flight, out, bar))
    except KeyboardInterrupt:
        written = len({request.custom_id for request in todo} & answered_ids(output, "custom_id"))
        print(f"dflash batch: interrupted; {written} answers written to {output}, {len(todo) - written} to go: "
              "run the same command to continue", file=sys.stderr)
        return 130
    finally:
        app.state.service.worker.close()
    failures = f", {failed} of them errors (their status and body in the output)" if failed else ""
    print(f"[{args.method}] {written} answers{failures} in {time.perf_counter() - start:.1f} s, up to "
          f"{args.max_batch} at once; written to {output}", file=sys.stderr)
    return 0
