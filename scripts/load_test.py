"""Load test for `dflash serve`: aggregate tokens/s, p50/p95 latency, errors and tau per method and concurrency,
on loopback only, with the `openai`-style chat endpoint.

Each concurrency level sends level x --requests-per-stream requests, at most `level` at a time, bounded by
--time-limit (seconds per level); nothing leaves 127.0.0.1.

    # one in-process server per method (continuous batching up to --max-batch-size), all up at once; each level
    # runs the methods in turn, --repeats times in alternating order, and the table keeps each one's median
    python scripts/load_test.py --target smollm2-135m --methods ar,ngram,dflash+ngram --concurrency 1,4,8,16 \
        --max-tokens 32 --requests-per-stream 4 --repeats 3 --out load.json
    # the prefix cache's worth: each method served with and without it, side by side (labels METHOD@SIZEMB)
    python scripts/load_test.py --target smollm2-135m --methods ar,dflash+ngram --prefix-cache-mb 0,256 \
        --concurrency 1,8 --max-tokens 32 --requests-per-stream 4 --repeats 2
    # or load a server that is already running (`dflash serve ...`) on this machine
    python scripts/load_test.py --url http://127.0.0.1:8000 --concurrency 1,8

Requests are greedy chat completions with ignore_eos, so every method generates exactly --max-tokens tokens and the
methods do the same work.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass
from urllib.parse import urlparse

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass
class LoadResult:
    method: str
    concurrency: int
    requests: int
    completed: int
    errors: int
    skipped: int  # not sent: the time limit came first
    wall_s: float
    requests_per_s: float
    latency_p50_s: float
    latency_p95_s: float
    tokens_per_s: float
    mean_tau: float


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def prompts_for(model: str, count: int) -> list[str]:
    if model.startswith("tiny-"):  # the tiny word-level tokenizer only knows w0..w58
        return [f"w{i % 59} w{(i + 3) % 59} w{(i + 7) % 59} w{(2 * i + 11) % 59}" for i in range(count)]
    topics = ["rivers", "bread", "chess", "volcanoes", "bicycles", "owls", "glass", "tides"]
    return [f"Write a few sentences about {topics[i % len(topics)]} (request {i})." for i in range(count)]


async def one_request(http, model: str, prompt: str, max_tokens: int, deadline: float) -> dict:
    body = {
        "model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
        "temperature": 0, "ignore_eos": True,
    }
    start = time.perf_counter()
    try:
        response = await http.post("/v1/chat/completions", json=body, timeout=max(1.0, deadline - time.monotonic()))
        response.raise_for_status()
        payload = response.json()
    except Exception as exc:  # a load test reports failures, it does not stop at the first one
        return {"ok": False, "error": f"{exc.__class__.__name__}: {exc}"}
    ext = payload.get("dflash", {})
    return {
        "ok": True, "latency_s": time.perf_counter() - start, "tokens": payload["usage"]["completion_tokens"],
        "rounds": ext.get("rounds", 0), "round_tokens": ext.get("tau", 0) * ext.get("rounds", 0),
    }


async def run_load(url: str, model: str, method: str, args, concurrency: int) -> LoadResult:
    import httpx

    deadline = time.monotonic() + args.time_limit
    requests = concurrency * args.requests_per_stream
    prompts = prompts_for(model, requests)
    gate = asyncio.Semaphore(concurrency)

    async def gated(http, prompt: str) -> dict | None:
        async with gate:
            if time.monotonic() >= deadline:
                return None
            return await one_request(http, model, prompt, args.max_tokens, deadline)

    async with httpx.AsyncClient(base_url=url, timeout=args.time_limit) as http:
        await one_request(http, model, prompts[0], 4, deadline)  # warm-up, not measured
        start = time.perf_counter()
        outcomes = await asyncio.gather(*(gated(http, p) for p in prompts))
        wall = time.perf_counter() - start
    done = [o for o in outcomes if o and o["ok"]]
    failed = [o for o in outcomes if o and not o["ok"]]
    for failure in failed[:3]:
        print(f"[load_test] {method}: {failure['error']}", file=sys.stderr)
    latencies = [o["latency_s"] for o in done]
    rounds = sum(o["rounds"] for o in done)
    return LoadResult(
        method=method, concurrency=concurrency, requests=requests, completed=len(done), errors=len(failed),
        skipped=outcomes.count(None), wall_s=wall, requests_per_s=len(done) / wall,
        latency_p50_s=percentile(latencies, 50), latency_p95_s=percentile(latencies, 95),
        tokens_per_s=sum(o["tokens"] for o in done) / wall,
        mean_tau=sum(o["round_tokens"] for o in done) / max(1, rounds),
    )


def in_process(args) -> list[LoadResult]:
    """One server per method on 127.0.0.1, all sharing one loaded target and all up at once, so that each level runs
    the methods back to back, --repeats times, in alternating order: this machine's speed drifts within minutes,
    and only methods measured side by side compare."""
    import contextlib

    import torch

    from dflash.loading import build_proposer, load_target_cached
    from dflash.methods.base import MethodOptions
    from dflash.serving import BackgroundServer, create_app

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    target = load_target_cached(args.target, args.dtype, args.device)
    methods = args.methods.split(",")
    results = []
    with contextlib.ExitStack() as servers:
        urls = {}
        budgets = [float(mb) for mb in str(args.prefix_cache_mb).split(",")]
        for method in methods:
            drafter = args.drafter if method == "dflash" else None
            options = MethodOptions(drafter=drafter, block_size=args.block_size, draft_dtype="auto")
            for mb in budgets:  # each server its own proposer: an engine's drafting state is its own
                proposer, note = build_proposer(method, target, options)
                if note:
                    print(f"[load_test] {method}: {note}", file=sys.stderr)
                app = create_app(target, proposer, args.target, max_batch_size=args.max_batch_size,
                                 max_queue=args.max_queue, prefix_cache_mb=mb)
                label = method if len(budgets) == 1 else f"{method}@{mb:g}MB"
                urls[label] = servers.enter_context(BackgroundServer(app))
        labels = list(urls)
        for level in args.levels:
            for repeat in range(args.repeats):
                for label in labels if repeat % 2 == 0 else labels[::-1]:
                    results.append(asyncio.run(run_load(urls[label], args.target, label, args, level)))
                    print_row(results[-1], results)
    return results


def medians(results: list[LoadResult]) -> list[LoadResult]:
    """One row per method and level: the repeat with the median tokens/s."""
    groups: dict[tuple[str, int], list[LoadResult]] = {}
    for r in results:
        groups.setdefault((r.method, r.concurrency), []).append(r)
    return [sorted(g, key=lambda r: r.tokens_per_s)[(len(g) - 1) // 2] for g in groups.values()]


def against_url(args) -> list[LoadResult]:
    import httpx

    host = urlparse(args.url).hostname
    if host not in LOOPBACK:
        raise SystemExit(f"load_test: only loopback servers may be loaded ({', '.join(LOOPBACK)}), got {host!r}")
    card = httpx.get(f"{args.url}/v1/models", timeout=10).json()["data"][0]
    method = card.get("dflash", {}).get("method", "unknown")
    return [asyncio.run(run_load(args.url, card["id"], method, args, level)) for level in args.levels]


HEADER = (f"{'method':<20} {'streams':>7} {'done':>5} {'err':>4} {'req/s':>7} {'p50 s':>7} {'p95 s':>7} {'tok/s':>8} "
          f"{'x 1 stream':>10} {'tau':>5}")


def print_row(r: LoadResult, results: list[LoadResult]) -> None:
    single = next((x for x in results if x.method == r.method and x.concurrency == 1), None)
    ratio = f"{r.tokens_per_s / single.tokens_per_s:.2f}x" if single and single.tokens_per_s else "-"
    print(f"{r.method:<20} {r.concurrency:>7} {r.completed:>5} {r.errors:>4} {r.requests_per_s:>7.2f} "
          f"{r.latency_p50_s:>7.3f} {r.latency_p95_s:>7.3f} {r.tokens_per_s:>8.1f} {ratio:>10} {r.mean_tau:>5.2f}",
          flush=True)


def print_table(results: list[LoadResult]) -> None:
    print(HEADER)
    for r in results:
        print_row(r, results)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default=None, help="a running server on loopback (default: start one per method)")
    p.add_argument("--target", default="tiny-qwen3")
    p.add_argument("--drafter", default=None)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--methods", default="ar,dflash", help="comma-separated, for in-process servers")
    p.add_argument("--repeats", type=int, default=1, help="in-process servers: runs of each level, methods in "
                   "alternating order; the table keeps each method's median (default 1)")
    p.add_argument("--requests-per-stream", type=int, default=2, help="requests per concurrent stream (default 2)")
    p.add_argument("--concurrency", default="1,4,8", help="comma-separated stream counts (default 1,4,8)")
    p.add_argument("--max-batch-size", type=int, default=16, help="in-process servers: rows decoded together")
    p.add_argument("--max-queue", type=int, default=256, help="in-process servers: requests accepted in all")
    p.add_argument("--prefix-cache-mb", default="256", help="in-process servers: the prefix cache's memory; a "
                   "comma-separated list runs a server per method and size, side by side (e.g. 0,256)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--time-limit", type=float, default=300, help="seconds per concurrency level; later requests "
                   "are skipped")
    p.add_argument("--torch-threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    p.add_argument("--out", default="load_test.json")
    args = p.parse_args(argv)
    try:
        args.levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    except ValueError:
        p.error(f"--concurrency takes comma-separated integers, got {args.concurrency!r}")
    if min([args.repeats, args.requests_per_stream, args.max_tokens, *args.levels]) < 1 or args.time_limit <= 0:
        p.error("--repeats, --requests-per-stream, --concurrency, --max-tokens and --time-limit must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(HEADER, flush=True)
    results = against_url(args) if args.url else in_process(args)
    table = medians(results)
    print()
    print_table(table)
    report = {"command": " ".join(["python", *sys.argv]), "config": vars(args), "results": [asdict(r) for r in table],
              "runs": [asdict(r) for r in results]}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"[load_test] wrote {args.out}", file=sys.stderr)
    return 0 if all(r.errors == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
