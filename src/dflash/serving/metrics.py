"""What GET /metrics shows, in the Prometheus text format (prometheus-client), one registry per app.

Updated from the event loop (requests) and from the engine thread (rounds, generations); prometheus-client's
metrics are thread-safe.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

from ..spec_metrics import drafted_rounds

if TYPE_CHECKING:
    from ..engine import GenerationStats

LATENCY_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/models", "/health",
             "/metrics", "/tokenize", "/detokenize", "/ping", "/version", "/v1/messages/count_tokens")
GENERATION_ENDPOINTS = ENDPOINTS[:4]
TTFT_BUCKETS_S = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Metrics:
    def __init__(self, block_size: int, queued: Callable[[], int], running: Callable[[], int],
                 model_name: str = "dflash"):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, Summary

        self.registry = registry = CollectorRegistry()
        # the process's resident memory, CPU seconds and open files, under Prometheus' standard names (where /proc is)
        ProcessCollector(registry=registry)
        self.requests = Counter("dflash_requests", "HTTP requests by endpoint and status.", ["endpoint", "status"],
                                registry=registry)
        self.cancelled = Counter("dflash_cancelled_requests", "Generations dropped because the client disconnected.",
                                 registry=registry)
        self.prompt_tokens = Counter("dflash_prompt_tokens", "Prompt tokens processed.", registry=registry)
        self.cached_prompt_tokens = Counter("dflash_cached_prompt_tokens", "Prompt tokens whose keys and values "
                                            "came from the prefix cache.", registry=registry)
        self.generated_tokens = Counter("dflash_generated_tokens", "Tokens generated.", registry=registry)
        self.rounds = Counter("dflash_verify_rounds", "Verify rounds, one per sequence per target pass.",
                              registry=registry)
        self.draft_tokens = Counter("dflash_draft_tokens", "Draft tokens verified.", registry=registry)
        self.lookup_rounds = Counter("dflash_lookup_rounds", "Verify rounds that took prompt lookup's drafts instead "
                                     "of the drafter's (NAME+ngram).", registry=registry)
        self.table_rounds = Counter("dflash_table_rounds", "Verify rounds whose drafts came from the target's "
                                    "continuation table (ngram, NAME+ngram).", registry=registry)
        self.prediction_tokens = Counter("dflash_prediction_tokens", "Drafts of requests' predictions (OpenAI's "
                                         "Predicted Outputs) the target verified, by outcome.", ["outcome"],
                                         registry=registry)
        self.accepted_tokens = Counter("dflash_accepted_tokens", "Draft tokens accepted by the target.",
                                       registry=registry)
        self.round_tokens = Histogram("dflash_tokens_per_round", "Tokens emitted per verify round (tau per round).",
                                      buckets=tuple(range(1, block_size + 1)), registry=registry)
        self.batch_size = Histogram("dflash_batch_size", "Sequences verified together per target pass.",
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=registry)
        Gauge("dflash_mean_tau", "Mean tokens emitted per verify round, over all rounds.", registry=registry
              ).set_function(self.mean_tau)
        self.position_accepted = [0] * (block_size - 1)
        self.total_rounds = self.total_round_tokens = 0  # plain sums behind the gauges above and below
        position = Gauge("dflash_position_acceptance", "Fraction of verify rounds in which draft position k was "
                         "accepted.", ["position"], registry=registry)
        for k in range(block_size - 1):
            position.labels(str(k + 1)).set_function(lambda k=k: self.position_accepted[k] / self._rounds())
        Gauge("dflash_queue_depth", "Requests waiting to join the batch.", registry=registry).set_function(queued)
        Gauge("dflash_running_requests", "Requests in the running batch.", registry=registry).set_function(running)
        self.latency = Histogram("dflash_request_latency_seconds", "Completion request latency, queueing and "
                                 "streaming included.", buckets=LATENCY_BUCKETS_S, registry=registry)
        self.ttft = Summary("dflash_time_to_first_token_seconds", "Prefill time of each generation.",
                            registry=registry)
        self.vllm = VllmMetrics(registry, model_name, block_size - 1, queued, running)

    def _rounds(self) -> float:
        return max(1, self.total_rounds)

    def mean_tau(self) -> float:
        return self.total_round_tokens / self._rounds()

    def observe_request(self, path: str, status: int, seconds: float) -> None:
        endpoint = path if path in ENDPOINTS else "other"  # bounded label values, whatever clients send
        self.requests.labels(endpoint, str(status)).inc()
        if endpoint in GENERATION_ENDPOINTS:
            self.latency.observe(seconds)
            self.vllm.latency.observe(seconds)

    def observe_pass(self, rows: int) -> None:
        self.batch_size.observe(rows)

    def observe_generation(self, stats: "GenerationStats") -> None:
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.cached_prompt_tokens.inc(stats.cached_prompt_tokens)
        self.generated_tokens.inc(stats.new_tokens)
        self.ttft.observe(stats.ttft_s)
        self.rounds.inc(stats.num_rounds)
        self.total_rounds += stats.num_rounds
        self.total_round_tokens += sum(stats.accept_lengths)
        self.draft_tokens.inc(sum(stats.draft_lengths))
        self.lookup_rounds.inc(stats.lookup_rounds)
        self.table_rounds.inc(stats.table_rounds)
        self.prediction_tokens.labels("accepted").inc(stats.prediction_accepted)
        self.prediction_tokens.labels("rejected").inc(stats.prediction_rejected)
        for emitted in stats.accept_lengths:
            self.round_tokens.observe(emitted)
            accepted = emitted - 1
            self.accepted_tokens.inc(accepted)
            for k in range(min(accepted, len(self.position_accepted))):
                self.position_accepted[k] += 1
        self.vllm.observe_generation(stats)

    def observe_cancel(self) -> None:
        self.cancelled.inc()

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class VllmMetrics:
    """The series vLLM's /metrics has under the same names (`vllm:`, labelled by model_name), so a dashboard built
    for vLLM's speculative decoding reads this server: its spec-decode counters (spec_metrics.py), token counters,
    request gauges and latency histograms."""

    def __init__(self, registry, model_name: str, positions: int, queued: Callable[[], int],
                 running: Callable[[], int]):
        from prometheus_client import Counter, Gauge, Histogram

        def counter(name: str, text: str):
            return Counter(name, text, ["model_name"], registry=registry).labels(model_name)

        self.drafts = counter("vllm:spec_decode_num_drafts", "Verify rounds that checked drafts.")
        self.draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.accepted = counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        per_position = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Rounds whose draft at this position "
                               "(from 0) was accepted.", ["model_name", "position"], registry=registry)
        self.per_position = [per_position.labels(model_name, str(k)) for k in range(positions)]
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        for name, text, read in (("vllm:num_requests_running", "Requests in the running batch.", running),
                                 ("vllm:num_requests_waiting", "Requests waiting to join the batch.", queued)):
            Gauge(name, text, ["model_name"], registry=registry).labels(model_name).set_function(read)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to the first token of each generation.",
                              ["model_name"], buckets=TTFT_BUCKETS_S, registry=registry).labels(model_name)
        self.latency = Histogram("vllm:e2e_request_latency_seconds", "Completion request latency.", ["model_name"],
                                 buckets=LATENCY_BUCKETS_S, registry=registry).labels(model_name)

    def observe_generation(self, stats: "GenerationStats") -> None:
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.generation_tokens.inc(stats.new_tokens)
        self.ttft.observe(stats.ttft_s)
        for drafted, accepted in drafted_rounds(stats):
            self.drafts.inc()
            self.draft_tokens.inc(drafted)
            self.accepted.inc(accepted)
            for k in range(min(accepted, len(self.per_position))):
                self.per_position[k].inc()


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
