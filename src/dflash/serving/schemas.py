"""The OpenAI request bodies, their checks, and the response and stream-chunk shapes.

pydantic is imported lazily: `dflash --help` must work without the [serve] extra. No `from __future__ import
annotations` here: pydantic reads the request models' annotations, which name classes built inside `schemas()`.
"""

import copy
import functools
import json
import time
import uuid
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Callable

from ..errors import UserError
from ..jsonl import openai_role
from ..logprobs import MAX_TOP_LOGPROBS, token_bytes
from ..reasoning import split
from ..structured import one_constraint, vllm_format
from ..tools import reply_format

if TYPE_CHECKING:
    from ..engine import GenerationConfig, GenerationResult, GenerationStats
    from ..logprobs import TokenLogprob
    from ..tools import ToolRequest


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
        role: Literal["system", "developer", "user", "assistant", "tool"]
        content: str | list[TextPart] | None = None  # None: an assistant turn that only called tools
        tool_calls: list[dict] | None = None  # an assistant turn's calls (tools.py shows them to the target)
        tool_call_id: str | None = None  # a tool turn: the call it answers
        reasoning: str | None = None  # an assistant turn's thinking (vLLM's name; reasoning_content DeepSeek's)
        reasoning_content: str | None = None

        def as_dict(self) -> dict:
            if self.content is None and not (self.role == "assistant" and self.tool_calls):
                raise UserError(f"a {self.role} message needs its content")
            text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or ())
            message = {"role": openai_role(self.role), "content": text}  # `developer`: the system message
            extra = {"tool_calls": self.tool_calls, "tool_call_id": self.tool_call_id,
                     "reasoning_content": self.reasoning_content or self.reasoning}
            return {**message, **{k: v for k, v in extra.items() if v is not None}}

    class StreamOptions(BaseModel):
        include_usage: bool = False
        continuous_usage_stats: bool = False  # extension (as in vLLM): the usage so far in every chunk

    class JsonSchemaFormat(BaseModel):  # OpenAI's structured outputs: {"name", "schema", "strict", "description"}
        name: str = "response"
        schema_: dict = Field(alias="schema")
        strict: bool | None = None
        description: str | None = None

    class ResponseFormat(BaseModel):  # "text", "json_object" (JSON mode), "json_schema" (structured outputs), or
        # "structural_tag" (an extension, as in vLLM and SGLang: structural_tags.py)
        type: Literal["text", "json_object", "json_schema", "structural_tag"]
        json_schema: JsonSchemaFormat | None = None
        structures: list | None = None
        triggers: list | None = None
        format: dict | None = None  # xgrammar's newer layout of a structural tag

    class OpenAIFields(BaseModel):
        model_config = ConfigDict(extra="allow")  # kept to be named in the log (Service.prepared), then unused
        model: str | None = None
        max_tokens: int | None = None
        temperature: float = 1.0  # OpenAI's default; send 0 for greedy (lossless vs `dflash generate`)
        top_p: float = 1.0
        top_k: int = 0  # extension (as in vLLM); 0 = off
        min_p: float = 0.0  # extension (as in vLLM); 0 = off
        min_tokens: int = 0  # extension (as in vLLM): no stop token (EOS, stop_token_ids) before this many tokens
        truncate_prompt_tokens: int | None = None  # extension (as in vLLM): the prompt's last k tokens (-1: all fit)
        seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
        stop: str | list[str] | None = None
        n: int = 1
        stream: bool = False
        stream_options: StreamOptions | None = None
        ignore_eos: bool = False  # extension: fixed-length outputs for benchmarks
        stop_token_ids: list[int] | None = None  # extension (as in vLLM): token ids that end the generation too
        include_stop_str_in_output: bool = False  # extension (as in vLLM): the text keeps the stop string
        skip_special_tokens: bool = False  # extension (as in vLLM, where True is the default): no special tokens
        allowed_token_ids: list[int] | None = None  # extension (as in vLLM): the only tokens the output may have
        bad_words: list[str] | None = None  # extension (as in vLLM): words the output never completes
        presence_penalty: float = 0.0
        frequency_penalty: float = 0.0
        repetition_penalty: float = 1.0  # extension (as in vLLM and transformers); 1 = off
        logit_bias: dict[str, float] | None = None  # token id (as a string, as OpenAI sends it) -> bias
        user: str | None = None
        response_format: ResponseFormat | None = None
        # extensions (as in vLLM): {"regex": ...}, {"choice": [...]}, {"json": schema}, {"json_object": true} or
        # {"grammar": EBNF}; and vLLM's older fields for them
        structured_outputs: dict | None = None
        guided_regex: str | None = None
        guided_choice: list[str] | None = None
        guided_json: dict | str | None = None
        guided_grammar: str | None = None
        ebnf: str | None = None  # SGLang's name for a grammar
        regex: str | None = None  # SGLang's field for a regular expression
        tools: list | None = None  # chat's functions (tools.py); a completion's are refused
        tool_choice: str | dict | None = None
        parallel_tool_calls: bool = True
        prediction: dict | None = None  # OpenAI's Predicted Outputs: {"type": "content", "content": ...} (prediction.py)

    class TemplateFields(BaseModel):  # extensions (as in vLLM and SGLang): how the messages go through the template
        chat_template_kwargs: dict | None = None  # the template's own variables, e.g. {"enable_thinking": false}
        add_generation_prompt: bool = True
        continue_final_message: bool = False  # go on with the last assistant turn (a reply's start given)

        def template_options(self):
            from ..models.target import TemplateOptions

            return TemplateOptions(self.chat_template_kwargs or {}, self.add_generation_prompt,
                                   self.continue_final_message)

    class ChatRequest(OpenAIFields, TemplateFields):
        messages: list[ChatMessage] = Field(min_length=1)
        max_completion_tokens: int | None = None  # the newer name of max_tokens
        logprobs: bool = False
        top_logprobs: int | None = None

    class CompletionRequest(OpenAIFields):
        prompt: str | list[int] | list[str] | list[list[int]]  # several: a choice of each for each, prompt-major
        echo: bool = False
        suffix: str | None = None
        logprobs: int | None = None  # the legacy API's: how many most likely tokens beside the chosen one

    class ResponsesRequest(OpenAIFields, TemplateFields):  # the Responses API's own fields (responses.py)
        input: str | list
        instructions: str | None = None
        max_output_tokens: int | None = None
        text: dict | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}, ...}
        previous_response_id: str | None = None
        store: bool = True
        metadata: dict | None = None
        reasoning: dict | None = None
        top_logprobs: int | None = None  # with include's "message.output_text.logprobs" (responses.chat_form)
        include: list[str] | None = None
        background: bool = False
        truncation: str = "disabled"  # "auto": the conversation's oldest exchanges dropped until the reply has room
        logprobs: bool = False  # set by responses.chat_form; not the API's own

    class CountTokensRequest(OpenAIFields, TemplateFields):  # Anthropic's Messages API (messages.py)
        messages: list = Field(min_length=1)
        system: str | list | None = None
        thinking: dict | None = None  # {"type": "enabled" | "disabled", ...}: the template's enable_thinking
        tool_choice: dict | None = None

    class MessagesRequest(CountTokensRequest):
        max_tokens: int = Field(ge=1)  # required, as Anthropic's API has it
        stop_sequences: list[str] | None = None
        metadata: dict | None = None
        output_config: dict | None = None  # {"format": {"type": "json_schema", "schema": {...}}}: structured output

    class TokenizeRequest(TemplateFields):  # vLLM's /tokenize: a prompt, or chat messages through the template
        model_config = ConfigDict(extra="ignore")
        model: str | None = None
        prompt: str | None = None
        messages: list[ChatMessage] | None = None
        tools: list | None = None  # described in the system message, as a chat request's are
        tool_choice: str | dict | None = None

    class DetokenizeRequest(BaseModel):
        model_config = ConfigDict(extra="ignore")
        model: str | None = None
        tokens: list[int]

    return SimpleNamespace(ChatRequest=ChatRequest, CompletionRequest=CompletionRequest,
                           ResponsesRequest=ResponsesRequest, MessagesRequest=MessagesRequest,
                           CountTokensRequest=CountTokensRequest, TokenizeRequest=TokenizeRequest,
                           DetokenizeRequest=DetokenizeRequest, ResponseFormat=ResponseFormat,
                           JsonSchemaFormat=JsonSchemaFormat)


def choice_configs(body, default_max_tokens: int, max_choices: int, target,
                   tools: "ToolRequest | None" = None) -> "list[GenerationConfig]":
    """The engine's config for each of the request's `n` choices (GenerationConfig.choices)."""
    if not 1 <= body.n <= max_choices:
        raise UserError(f"n must be in [1, {max_choices}] (the server's queue), got {body.n}")
    return generation_config(body, default_max_tokens, target, tools).choices(body.n)


def requested_logprobs(body) -> int | None:
    """How many most likely tokens to report beside each chosen one; None: no log-probabilities."""
    if hasattr(body, "top_logprobs"):  # chat: logprobs is a switch, top_logprobs the count
        if body.top_logprobs is not None and not body.logprobs:
            raise UserError("top_logprobs needs logprobs to be true")
        top, name = (body.top_logprobs or 0) if body.logprobs else None, "top_logprobs"
    else:
        top, name = getattr(body, "logprobs", None), "logprobs"  # the completions API's (Anthropic's has none)
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise UserError(f"{name} must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
    return top


def logit_bias(body, vocab_size: int) -> dict[int, float]:
    """OpenAI's logit_bias: token ids as strings -> biases in [-100, 100]."""
    bias = {}
    for key, value in (body.logit_bias or {}).items():
        if not key.strip().isdigit() or int(key) >= vocab_size:
            raise UserError(f"logit_bias keys must be token ids in [0, {vocab_size}), got {key!r}")
        bias[int(key)] = value
    return bias


def generation_config(body, default_max_tokens: int, target,
                      tools: "ToolRequest | None" = None) -> "GenerationConfig":
    """Check the OpenAI fields (errors name them as OpenAI does) and build the engine's config for `target`;
    `tools`: the request's (tools.tool_request), whose calls the reply's grammar holds."""
    from ..engine import GenerationConfig
    from ..sampling import SamplingConfig, bad_word_ids

    vocab_size = target.vocab_size

    max_tokens = getattr(body, "max_completion_tokens", None)
    max_tokens = body.max_tokens if max_tokens is None else max_tokens
    checks = [
        (max_tokens is None or max_tokens >= 1 or scores_only(body),
         f"max_tokens must be >= 1 (or 0 with echo, to score the prompt), got {max_tokens}"),
        (body.temperature >= 0, f"temperature must be >= 0, got {body.temperature}"),
        (0 < body.top_p <= 1, f"top_p must be in (0, 1], got {body.top_p}"),
        (body.top_k >= 0, f"top_k must be >= 0, got {body.top_k}"),
        (not getattr(body, "suffix", None), "suffix is not supported"),
        (body.response_format is None or (body.response_format.type == "json_schema")
         == (body.response_format.json_schema is not None),
         "response_format json_schema needs its json_schema: {\"name\": ..., \"schema\": {...}}"),
        (not body.tools or hasattr(body, "messages") or hasattr(body, "input"),
         "tools are for chat completions (/v1/chat/completions)"),
    ]
    for ok, message in checks:
        if not ok:
            raise UserError(message)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    allowed = tuple(body.allowed_token_ids or ())
    if any(not 0 <= t < vocab_size for t in allowed) or body.allowed_token_ids == []:
        raise UserError(f"allowed_token_ids must be token ids in [0, {vocab_size}), at least one, got "
                        f"{list(allowed)[:20]}")
    sampling = SamplingConfig(body.temperature, body.top_k, body.top_p, body.seed, body.presence_penalty,
                              body.frequency_penalty, body.repetition_penalty, logit_bias(body, vocab_size),
                              body.min_p, body.min_tokens, allowed_token_ids=allowed,
                              bad_word_ids=bad_word_ids(target.tokenizer, body.bad_words or ()))
    top = requested_logprobs(body)
    response_format, json_schema = reply_format(tools, *response_format_of(body))
    stop_ids = tuple(body.stop_token_ids or ())
    if any(not 0 <= t < vocab_size for t in stop_ids):
        raise UserError(f"stop_token_ids must be token ids in [0, {vocab_size}), got {list(stop_ids)}")
    config = GenerationConfig(
        # scoring alone still runs the prefill's step, whose token is dropped
        max_new_tokens=max(1, default_max_tokens if max_tokens is None else max_tokens), sampling=sampling,
        stop_strings=tuple(stop), stop_token_ids=stop_ids, include_stop_strings=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens,
        ignore_eos=body.ignore_eos, logprobs=top, prompt_logprobs=top if getattr(body, "echo", False) else None,
        response_format=response_format, json_schema=json_schema,
    )
    config.validate()
    return config


def response_format_of(body) -> tuple[str | None, dict | None]:
    """(response_format, json_schema) for GenerationConfig from OpenAI's `response_format`, or vLLM's structured
    outputs (one constraint in all)."""
    from ..structural_tags import structural_tag_format

    given = body.response_format
    openai_format = (None, None) if given is None else (
        given.type, given.json_schema.schema_ if given.json_schema is not None else None)
    if given is not None and given.json_schema is not None and given.json_schema.strict is not True:
        openai_format = (given.type, loosely_held(given.json_schema.schema_))
    if given is not None and given.type == "structural_tag":
        openai_format = structural_tag_format({"format": given.format} if given.format is not None else
                                              {"structures": given.structures, "triggers": given.triggers})
    return one_constraint(openai_format, structured_outputs_of(body), "structured_outputs (or guided_*)")


def loosely_held(schema):
    """A schema that is not strict (OpenAI enforces those not at all) held as far as a grammar can
    (grammar.enforceable: a pydantic HttpUrl's format uri dropped, ...); a root that is no object or array, or no
    schema at all, is refused as a strict one is."""
    from ..grammar import ANY_OBJECT_SCHEMA, enforceable

    if not isinstance(schema, dict):
        return schema
    held = enforceable(schema, roots=("object", "tagged", "array"))
    root_kind = schema.get("type") if isinstance(schema, dict) else None
    if held == ANY_OBJECT_SCHEMA and root_kind not in (None, "object"):
        return schema  # the grammar's own error names what is wrong
    return held


def structured_outputs_of(body) -> tuple[str | None, dict | None] | None:
    """vLLM's structured outputs of a request (structured.vllm_format); None where it sends none."""
    return vllm_format(body.structured_outputs, body.guided_regex, body.guided_choice, body.guided_json,
                       body.guided_grammar, body.ebnf, body.regex)


def completion_prompts(prompt) -> list:
    """A completions request's prompts, each text or token ids: one (text, or a list of token ids), or several (a
    list of texts, or a list of lists of token ids)."""
    if isinstance(prompt, str) or prompt and all(isinstance(t, int) for t in prompt):
        return [prompt]
    if not prompt:
        raise UserError("the prompt is empty")
    return list(prompt)


def completion_prompt_ids(target, prompt) -> list[int]:
    """One completions prompt's token ids (completion_prompts): text, or token ids."""
    if isinstance(prompt, str):
        return target.encode_prompt(prompt, chat=False)
    bad = [t for t in prompt if not 0 <= t < target.vocab_size]
    if bad:
        raise UserError(f"token ids must be in [0, {target.vocab_size}), got {bad[0]}")
    return list(prompt)


def merged_completions(responses: list[dict], n: int) -> dict:
    """One response for a request of several prompts: each prompt's choices in turn (choice j of prompt i at index
    i * n + j, as OpenAI numbers them), usage summed, the `dflash` figures of each prompt in a list."""
    merged = {key: value for key, value in responses[0].items() if key not in ("choices", "usage", "dflash")}
    merged["choices"] = [{**choice, "index": i * n + choice["index"]}
                         for i, response in enumerate(responses) for choice in response["choices"]]
    usage = summed_usage([response["usage"] for response in responses])
    return {**merged, "usage": usage, "dflash": [response["dflash"] for response in responses]}


def usage_of(exchanges: list["Exchange"], results: list) -> dict:
    """The usage of a stream's choices (`exchanges[k]` choice k's): each prompt's, summed over its prompts."""
    by_prompt: dict[int, tuple] = {}
    for exchange, result in zip(exchanges, results):
        by_prompt.setdefault(id(exchange), (exchange, []))[1].append(result)
    return summed_usage([exchange.usage(done) for exchange, done in by_prompt.values()])


def summed_usage(usages: list[dict]) -> dict:
    """Several prompts' usage as one: every count summed."""
    total = {key: sum(u[key] for u in usages) for key in ("prompt_tokens", "completion_tokens", "total_tokens")}
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    details = {key: sum(u["completion_tokens_details"][key] for u in usages)
               for key in ("accepted_prediction_tokens", "rejected_prediction_tokens")}
    return {**total, "prompt_tokens_details": {"cached_tokens": cached}, "completion_tokens_details": details}


def scores_only(body) -> bool:
    """A completion that only scores its prompt: `echo` with max_tokens 0."""
    return getattr(body, "echo", False) and body.max_tokens == 0


def echoed_prompt(target, body, prompt_ids: list[int]) -> tuple[str, list[int]] | None:
    """What a completion with `echo` repeats: the prompt's text as sent (decoded where it came as ids), its ids."""
    if not getattr(body, "echo", False):
        return None
    prompt = body.prompt
    text = prompt if isinstance(prompt, str) else prompt[0] if isinstance(prompt[0], str) else target.decode(prompt_ids)
    return text, prompt_ids


def truncated_prompt(body, prompt_ids: list[int], engine) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens (left truncation; -1: as many as the context takes
    with room for one verify block after them); the prompt itself where it is not set."""
    keep = getattr(body, "truncate_prompt_tokens", None)
    if keep is None:
        return prompt_ids
    if keep == 0 or keep < -1:
        raise UserError(f"truncate_prompt_tokens must be -1 (all that fit) or >= 1, got {keep}")
    return prompt_ids[-(engine.max_prompt_tokens if keep == -1 else keep):]


def check_fits(prompt_ids: list[int], engine) -> None:
    """Reject a prompt the engine would refuse, before it waits in the queue."""
    if not prompt_ids:
        raise UserError("the prompt is empty")
    engine.budget(prompt_ids)


# ---- responses --------------------------------------------------------------------------------------------------
@dataclass
class Exchange:
    """One request's identity, shared by its response and all its stream chunks. `tokenizer` spells out the tokens
    of log-probabilities; `echo`: the prompt's text and ids, which a completion with `echo` repeats first;
    `text_offsets` is where each choice's next token starts in its text (the completions API reports it)."""

    chat: bool
    model: str
    method: str
    prompt_tokens: int
    tokenizer: Any = None
    echo: tuple[str, list[int]] | None = None
    scores_only: bool = False  # echo with max_tokens 0: the prompt and its log-probabilities, nothing generated
    tools: "ToolRequest | None" = None  # a chat reply that may call tools: its calls are read from its text
    reasoning: bool = False  # a chat reply's thinking comes back apart (reasoning.py)
    thinking: str | None = None  # where the reply's thinking stands as the prompt leaves it (reasoning.thinking_state)
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    text_offsets: dict[int, int] = field(default_factory=dict)
    live_usage: Callable[[], dict] | None = None  # the stream's usage so far, for every chunk (continuous_usage_stats)

    def __post_init__(self):
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"

    def envelope(self, chunk: bool) -> dict:
        kind = "chat.completion" if self.chat else "text_completion"
        kind += ".chunk" if chunk and self.chat else ""
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def choice(self, text: str | None, finish_reason: str | None, chunk: bool, index: int = 0,
               logprobs: "list[TokenLogprob] | None" = None, stop_reason: int | str | None = None) -> dict:
        """One choice; `stop_reason` (vLLM's): the stop string or stop token id that ended it, else null."""
        shown = None if logprobs is None else self.logprobs(logprobs, index)
        ending = {"finish_reason": finish_reason, "stop_reason": stop_reason}
        if not self.chat:
            return {"index": index, "text": text or "", "logprobs": shown, **ending}
        if chunk:  # a delta without content is the closing chunk, which only carries the finish reason
            message = ("delta", {} if text is None else {"content": text})
        else:
            message = ("message", {"role": "assistant", "content": text or ""})
        return {"index": index, message[0]: message[1], "logprobs": shown, **ending}

    def thought_and_answer(self, text: str) -> tuple[str | None, str]:
        """A chat reply's thinking (None without the reasoning parser, or where it thought nothing) and its answer."""
        return split(text, self.thinking) if self.reasoning else (None, text)

    @staticmethod
    def thought(text: str) -> dict:
        """A message's (or delta's) thinking, under both names clients read: vLLM's and DeepSeek's."""
        return {"reasoning": text, "reasoning_content": text}

    def logprobs(self, entries: "list[TokenLogprob]", index: int, unscored: int | None = None) -> dict:
        """OpenAI's logprobs object: chat's list of tokens with their top alternatives, or the completions API's
        parallel lists (offsets continue across a stream's chunks). `unscored`: a token before the entries that has
        no log-probability (an echoed prompt's first)."""
        spelled = {}

        def spell(token_id: int) -> tuple[str, bytes]:
            if token_id not in spelled:
                raw = token_bytes(self.tokenizer, token_id)
                spelled[token_id] = (raw.decode("utf-8", errors="replace"), raw)
            return spelled[token_id]

        if self.chat:
            def item(token_id: int, logprob: float) -> dict:
                text, raw = spell(token_id)
                return {"token": text, "logprob": logprob, "bytes": list(raw)}

            content = [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                       for e in entries]
            return {"content": content, "refusal": None}
        first = [] if unscored is None else [spell(unscored)[0]]
        tokens = first + [spell(e.token)[0] for e in entries]
        offsets = []
        for token in tokens:
            offsets.append(self.text_offsets.get(index, 0))
            self.text_offsets[index] = offsets[-1] + len(token)
        return {"tokens": tokens, "token_logprobs": [None] * len(first) + [e.logprob for e in entries],
                "top_logprobs": [None] * len(first) + [{spell(t)[0]: lp for t, lp in e.top} for e in entries],
                "text_offset": offsets}

    def echo_chunk(self, index: int, prompt_logprobs: "list[TokenLogprob] | None") -> str:
        """A stream's first chunk for a choice that repeats its prompt."""
        text, ids = self.echo
        shown = None if prompt_logprobs is None else self.logprobs(prompt_logprobs, index, unscored=ids[0])
        return sse({**self.envelope(chunk=True), "choices": [
            {"index": index, "text": text, "logprobs": shown, "finish_reason": None}]})

    def usage(self, results: "list[GenerationResult]") -> dict:
        done = 0 if self.scores_only else sum(result.stats.new_tokens for result in results)
        cached = min(result.stats.cached_prompt_tokens for result in results)  # what no choice had to read
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": done,
                "total_tokens": self.prompt_tokens + done, "prompt_tokens_details": {"cached_tokens": cached},
                "completion_tokens_details": {  # a prediction's drafts the target took and refused (prediction.py)
                    "accepted_prediction_tokens": sum(result.stats.prediction_accepted for result in results),
                    "rejected_prediction_tokens": sum(result.stats.prediction_rejected for result in results)}}

    def extension(self, queue_s: float, results: "list[GenerationResult]") -> dict:
        """The `dflash` object: how speculative decoding went for this request (its choices' rounds together)."""
        stats = merged_stats([result.stats for result in results])
        return {
            "method": self.method, "tau": stats.tau, "rounds": stats.num_rounds,
            "per_position_acceptance": stats.per_position_acceptance,
            "draft_length_histogram": stats.draft_length_histogram, "queue_s": queue_s, "ttft_s": stats.ttft_s,
            "generation_s": stats.total_s,
        }

    def response(self, queue_s: float, results: "list[GenerationResult]", stop_ids: set[int]) -> dict:
        choices = [self.whole_choice(i, result, stop_ids) for i, result in enumerate(results)]
        return {**self.envelope(chunk=False), "choices": choices, "usage": self.usage(results),
                "dflash": self.extension(queue_s, results)}

    def whole_choice(self, index: int, result: "GenerationResult", stop_ids: set[int]) -> dict:
        """A choice of a whole response; with `echo`, the prompt's text and tokens come before the choice's; a reply
        of tool calls is a message of `tool_calls`."""
        thought, answer = self.thought_and_answer(result.text)
        choice = self.choice(answer, result.finish_reason, chunk=False, index=index,
                             stop_reason=None if self.scores_only else result.stop_reason)
        calls = self.tools.calls(answer) if self.tools is not None else None
        if calls is not None:
            choice["message"] = {"role": "assistant", "content": self.tools.content(answer), "tool_calls": calls}
            choice["finish_reason"] = "tool_calls"
        if thought is not None:
            choice["message"].update(content=choice["message"]["content"] or None, **self.thought(thought))
        entries = shown_logprobs(result.logprobs, stop_ids)
        if self.scores_only:
            choice["text"], choice["finish_reason"] = "", "length"
            entries = None if entries is None else []
        if self.echo is not None:
            text, ids = self.echo
            choice["text"] = text + choice["text"]
            if entries is not None:
                prompt = self.logprobs(result.prompt_logprobs, index, unscored=ids[0])
                generated = self.logprobs(entries, index)
                choice["logprobs"] = {key: prompt[key] + generated[key] for key in prompt}
        elif entries is not None:
            choice["logprobs"] = self.logprobs(entries, index)
        return choice

    def chunk(self, text: str | None, finish_reason: str | None = None, delta: dict | None = None, index: int = 0,
              logprobs: "list[TokenLogprob] | None" = None, stop_reason: int | str | None = None, **extra) -> str:
        choice = self.choice(text, finish_reason, chunk=True, index=index, logprobs=logprobs, stop_reason=stop_reason)
        if delta is not None:
            choice["delta"] = delta
        if self.live_usage is not None:
            extra.setdefault("usage", self.live_usage())
        return sse({**self.envelope(chunk=True), "choices": [choice], **extra})


def shown_logprobs(entries: "list[TokenLogprob] | None", stop_ids: set[int]) -> "list[TokenLogprob] | None":
    """The log-probabilities of a result's text: a stop token's is left out, as the token is."""
    return None if entries is None else [e for e in entries if e.token not in stop_ids]


def merged_stats(stats: "list[GenerationStats]") -> "GenerationStats":
    """One request's statistics over its choices: their rounds together, its first token and its end the last."""
    if len(stats) == 1:
        return stats[0]
    merged = copy.copy(stats[0])
    merged.accept_lengths = [a for s in stats for a in s.accept_lengths]
    merged.draft_lengths = [d for s in stats for d in s.draft_lengths]
    merged.new_tokens = sum(s.new_tokens for s in stats)
    merged.prediction_accepted = sum(s.prediction_accepted for s in stats)
    merged.prediction_rejected = sum(s.prediction_rejected for s in stats)
    merged.ttft_s, merged.total_s = max(s.ttft_s for s in stats), max(s.total_s for s in stats)
    return merged


def sse(payload: Any) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def event_sse(event: dict) -> str:
    """An event as a server-sent event named by its type (the Responses and Messages APIs' streams)."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


def openai_error(status: int, message: str, kind: str = "invalid_request_error", path: str = "", **extra):
    """An error body as OpenAI's API answers one; under /v1/messages, as Anthropic's does."""
    from fastapi.responses import JSONResponse

    if path.startswith("/v1/messages"):
        kind = ANTHROPIC_ERRORS.get(status, "api_error")
        return JSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status_code=status)
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}, **extra},
                        status_code=status)


ANTHROPIC_ERRORS = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                    422: "invalid_request_error", 503: "overloaded_error"}  # by HTTP status; others api_error


