"""The OpenAI request bodies, their checks, and the response and stream-chunk shapes.

pydantic is imported lazily: `dflash --help` must work without the [serve] extra. No `from __future__ import
annotations` here: pydantic reads the request models' annotations, which name classes built inside `schemas()`.
"""

import functools
import json
import time
import uuid
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from ..errors import UserError

if TYPE_CHECKING:
    from ..engine import GenerationConfig, GenerationResult


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
    from ..engine import GenerationConfig
    from ..sampling import SamplingConfig

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


def check_fits(prompt_ids: list[int], engine) -> None:
    """Reject a prompt the engine would refuse, before it waits in the queue."""
    if not prompt_ids:
        raise UserError("the prompt is empty")
    engine.budget(prompt_ids)


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

    def extension(self, queue_s: float, result: "GenerationResult") -> dict:
        """The `dflash` object: how speculative decoding went for this request."""
        stats = result.stats
        return {
            "method": self.method, "tau": stats.tau, "rounds": stats.num_rounds,
            "per_position_acceptance": stats.per_position_acceptance,
            "draft_length_histogram": stats.draft_length_histogram, "queue_s": queue_s, "ttft_s": stats.ttft_s,
            "generation_s": stats.total_s,
        }

    def response(self, queue_s: float, result: "GenerationResult") -> dict:
        return {
            **self.envelope(chunk=False), "choices": [self.choice(result.text, result.finish_reason, chunk=False)],
            "usage": self.usage(result), "dflash": self.extension(queue_s, result),
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


