"""The shortest way in from Python: a target and a method loaded once, then `generate` for one prompt or many (run
as one continuous batch) and `chat` for a list of messages, as vLLM's `LLM` reads.

    from dflash import LLM
    llm = LLM("smollm2-135m")                      # the shipped drafter with prompt lookup, greedy by default
    print(llm.generate("What is 17 * 23?").text)
    for result in llm.generate(["Hi!", "Name a color."], max_new_tokens=32):
        print(result.text, result.stats.tau)

Every result is the target's own output (greedy: token-identical to plain decoding; sampled: the target's
distribution), with the acceptance and speed figures in `result.stats`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from .ebnf import grammar_format
from .engine import Engine, GenerationConfig, GenerationResult
from .errors import UserError
from .hub import DEFAULT_TARGET
from .jsonl import openai_role
from .loading import chat_template_given
from .logprobs import MAX_TOP_LOGPROBS
from .methods import registry
from .methods.base import MethodOptions
from .models.target import TargetModel, TemplateOptions
from .prediction import prediction_ids
from .reasoning import check_parser, split, thinking_of
from .regex_grammar import pattern_format
from .spec_metrics import Counter, SpecDecodeCounts, Vector
from .structural_tags import structural_tag_format
from .sampling import SamplingConfig, bad_word_ids
from .structured import one_constraint, vllm_format
from .tools import encode_chat, reply_format, tool_request, tool_style


UNBOUNDED = 2**31  # max_tokens None: as many as the context takes (the engine's budget caps every request)
DEFAULT_MAX_NEW_TOKENS = 128  # generate's and chat's, where no SamplingParams says otherwise


@dataclass
class StructuredOutputsParams:
    """vLLM's StructuredOutputsParams, in a SamplingParams' `structured_outputs`: one constraint on the output
    (`json` a JSON Schema, a `regex`, a `choice` of strings, an EBNF or Lark `grammar`, `json_object`, or a
    `structural_tag`). Its whitespace and fallback options are taken and change nothing here."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None


@dataclass
class SamplingParams:
    """vLLM's SamplingParams, by its names and with its defaults (temperature 1, max_tokens 16, special tokens left
    out of the text), for code written against vLLM's LLM: `llm.generate(prompts, SamplingParams(temperature=0,
    max_tokens=64))`, each result's `outputs[0].text` as vLLM's RequestOutput reads. `n` outputs a prompt, in
    `result.outputs` (seeded ones with seed, seed + 1, ...)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or vLLM's -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: as many as the context takes
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # each prompt token's after the first, with that many alternatives
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | dict | None = None

    def config(self, tokenizer, response_format: str | None = None, json_schema: dict | None = None
               ) -> GenerationConfig:
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise UserError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")
        if not is_whole(self.n) or self.n < 1:
            raise UserError(f"SamplingParams.n must be a whole number >= 1, got {self.n!r}")
        if self.max_tokens is not None and not is_whole(self.max_tokens):
            raise UserError(f"max_tokens must be a whole number, got {self.max_tokens!r}")
        top_k = 0 if self.top_k == -1 else self.top_k
        sampling = SamplingConfig(self.temperature, top_k, self.top_p, self.seed, self.presence_penalty,
                                  self.frequency_penalty, self.repetition_penalty, dict(self.logit_bias or {}),
                                  self.min_p, self.min_tokens, allowed_token_ids=tuple(self.allowed_token_ids or ()),
                                  bad_word_ids=bad_word_ids(tokenizer, self.bad_words or ()))
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        structured = self.structured_outputs
        constraint = vllm_format(asdict(structured) if isinstance(structured, StructuredOutputsParams) else structured)
        response_format, json_schema = one_constraint((response_format, json_schema), constraint,
                                                      "structured_outputs")
        config = GenerationConfig(
            max_new_tokens=UNBOUNDED if self.max_tokens is None else self.max_tokens, sampling=sampling,
            stop_token_ids=tuple(self.stop_token_ids or ()), stop_strings=tuple(stop),
            include_stop_strings=self.include_stop_str_in_output, skip_special_tokens=self.skip_special_tokens,
            ignore_eos=self.ignore_eos, logprobs=self.logprobs, prompt_logprobs=self.prompt_logprobs,
            response_format="json_schema" if json_schema is not None and response_format is None else response_format,
            json_schema=json_schema)
        config.validate()
        return config


# generate's and chat's sampling keywords and their defaults: with a SamplingParams in their place, none may be set
KEYWORD_DEFAULTS = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": None, "stop": (),
                    "include_stop_str_in_output": False, "min_tokens": 0, "allowed_token_ids": None,
                    "bad_words": None, "logprobs": None}


class LLM:
    """`target`: a registry name, a Hugging Face folder, a .gguf file or a hub id, or a transformers model already
    loaded, as `dflash.wrap_target(model, tokenizer)` makes it (it runs in its own dtype and device); `method`: ar,
    ngram, dflash, eagle3, dflash+ngram or eagle3+ngram; `drafter`: a drafter folder (None: the one shipped for the
    target); `device` None: CUDA where present. `max_batch` prompts run at once; `prefix_cache_mb` keeps earlier
    prompts' keys and values for prompts that start alike (a chat's next turn). `tool_format`: how the target writes
    tool calls, "auto" (its chat template's <tool_call> tags where it has them, else "json"), "json" or "hermes";
    `reasoning_parser` "think" (or qwen3, deepseek_r1): a chat reply's <think>...</think> comes back apart, as
    `result.reasoning` beside `result.content`, and a response format or tools hold the answer after it.
    `max_model_len`: prompt and output together stay within that many tokens (vLLM's; default: the model's context).
    `draft_dtype`, `continuations`, `tree`: as the CLI's --draft-dtype (None: the target's dtype; "auto": the fastest
    for one sequence, timed once per machine, as the CLI's default; in a batch it need not be), --continuations (prompt
    lookup's table: a folder, or "none") and --tree (verify a tree of that many drafts). vLLM's `LLM(model=...,
    speculative_config={"method": "dflash", "model": FOLDER, "num_speculative_tokens": K})` reads the same: `model` is
    `target`, and speculative_config says the method, drafter and block size (K + 1)."""

    def __init__(self, target: "str | TargetModel | None" = None, method: str | None = None, *,
                 dtype: str = "float32",
                 device: str | None = None, drafter: str | None = None, block_size: int | None = None,
                 adaptive: bool = True, max_batch: int = 8, prefix_cache_mb: float = 256, tool_format: str = "auto",
                 reasoning_parser: str | None = None, max_model_len: int | None = None, model: str | None = None,
                 speculative_config: dict | None = None, draft_dtype: str | None = None,
                 continuations: str | None = None, tree: int | None = None):
        import torch

        from .loading import build_proposer, load_target_cached, settle_heap

        if target is not None and model is not None:
            raise UserError("give target or model (vLLM's name for it), not both")
        target = target or model or DEFAULT_TARGET
        if speculative_config is not None:
            if method is not None or drafter is not None or block_size is not None:
                raise UserError("speculative_config says the method, drafter and block size: give it or method, "
                                "drafter and block_size, not both")
            method, fields = registry.from_speculative_config(speculative_config)
        else:
            fields = {"drafter": drafter, "block_size": block_size}
        method = method or registry.DEFAULT_METHOD
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        options = MethodOptions(**fields, draft_dtype=draft_dtype, continuations=continuations, tree=tree)
        if isinstance(target, TargetModel):  # a model already loaded (models.target.wrap_target)
            self.target = target
        else:
            self.target = load_target_cached(target, dtype, device, release_plain=True)
        self.target.limit_context(max_model_len)
        self.tool_style = tool_style(self.target.tokenizer, tool_format)
        self.reasoning_parser = check_parser(reasoning_parser)
        self.proposer, self.note = build_proposer(method, self.target, options)  # note: an untrained drafter
        self.method, self.model_name = method, self.target.name
        self.counts = SpecDecodeCounts(self.proposer.max_draft)  # every output's rounds (get_metrics)
        self.engine = Engine(self.target, self.proposer, max_batch=max_batch, adaptive=adaptive,
                             prefix_cache_bytes=int(prefix_cache_mb * 2**20))
        settle_heap()

    def get_metrics(self) -> list[Counter | Vector]:
        """Acceptance over every output so far, as vLLM's LLM.get_metrics() lists it (vllm:spec_decode_num_drafts,
        _num_draft_tokens, _num_accepted_tokens, _num_accepted_tokens_per_pos; vllm:prompt_tokens,
        vllm:generation_tokens): a script written for vLLM's reads it once it imports Counter and Vector from
        dflash.spec_metrics. Mean acceptance length: 1 + accepted / drafts."""
        return self.counts.as_vllm_metrics(self.model_name)

    def reset_prefix_cache(self) -> bool:
        """Forget the prompts' keys and values kept so far (vLLM's), so the next prompts are read whole: a
        benchmark's cold start. False where there is no prefix cache (prefix_cache_mb 0) or a generation runs."""
        if self.engine.prefixes is None or self.engine.busy:
            return False
        self.engine.prefixes.clear()
        return True

    def get_tokenizer(self):
        """The target's tokenizer (vLLM's LLM.get_tokenizer), e.g. for its chat template or token ids."""
        return self.target.tokenizer

    def generate(self, prompts: "str | dict | list[str | dict]",
                 max_new_tokens: "int | SamplingParams | list[SamplingParams] | None" = None, *,
                 sampling_params: "SamplingParams | list[SamplingParams] | None" = None, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0, seed: int | None = None,
                 stop: tuple[str, ...] = (), include_stop_str_in_output: bool = False, min_tokens: int = 0,
                 allowed_token_ids: list[int] | None = None, bad_words: list[str] | None = None, chat: bool = True,
                 response_format: str | None = None, json_schema: dict | None = None,
                 regex: str | None = None, choice: list[str] | None = None, grammar: str | None = None,
                 structural_tag: dict | None = None, logprobs: int | None = None,
                 prediction: str | list[str] | None = None, use_tqdm: bool = False, streamer=None
                 ) -> GenerationResult | list[GenerationResult]:
        """One result for a prompt, a list in order for a list of prompts. A prompt is text, or vLLM's
        {"prompt": text} or {"prompt_token_ids": [...]} (token ids go in as they are). `max_new_tokens`: 128 by
        default; in its place, or as `sampling_params`, a SamplingParams (vLLM's names and defaults) may hold the
        sampling settings instead of the keywords below, or a list of one a prompt; its `n` > 1 gives each result
        that many `outputs`. `use_tqdm`: a progress bar over the outputs, on stderr. `streamer` (one prompt, one
        output): a callable given each piece of the text as it is committed (a stop string, or the start of one, never
        shows), or a transformers streamer (TextStreamer, TextIteratorStreamer: its put(ids) and end(), the prompt's
        ids first, as transformers' generate calls them).
        `chat`: wrap each text prompt in the chat template (where the tokenizer has one; vLLM's generate sends
        prompts raw: chat=False); `stop`: strings that end a generation (not included, unless
        `include_stop_str_in_output`); `allowed_token_ids`: the only tokens an output may have; `bad_words`:
        words an output never completes (both vLLM's);
        `response_format="json_object"`: every output is a JSON object (OpenAI's JSON mode); `json_schema`: every
        output is an object the schema allows; `regex`: every output matches it whole; `choice`: every output is one
        of these strings; `grammar`: every output is one this grammar allows (EBNF's `root ::= ...` or Lark's
        `start: ...`, ebnf.py); `structural_tag`: free text whose triggers open JSON documents between tags
        ({"structures": [{"begin", "schema", "end"}], "triggers": [...]}, vLLM's; structural_tags.py); `logprobs`
        (0-20): each token's log-probability and that many most likely alternatives, as `result.logprobs`. `min_p`:
        sample among the tokens at least min_p times as likely as the likeliest; `min_tokens`: no stop token (EOS)
        before that many new tokens; `prediction`: the text an output is expected to be, or one per prompt (OpenAI's
        Predicted Outputs: drafted where the output follows it; the output is the same)."""
        many = not isinstance(prompts, (str, dict))
        given = list(prompts) if many else [prompts]
        ids = [self._prompt_ids(prompt, chat) for prompt in given]
        response_format, json_schema = with_pattern(response_format, json_schema, regex, choice, grammar,
                                                    structural_tag)
        settings = self._settings(locals(), len(ids))
        configs = self._predicting(self._configs(settings, response_format, json_schema), prediction)
        texts = [prompt if isinstance(prompt, str) else prompt.get("prompt") for prompt in given]
        results = self._run(ids, configs, [params.n for params in settings], use_tqdm, streamer, texts)
        return results if many else results[0]

    def chat(self, messages: list[dict] | list[list[dict]],
             max_new_tokens: "int | SamplingParams | list[SamplingParams] | None" = None, *,
             sampling_params: "SamplingParams | list[SamplingParams] | None" = None, temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0, seed: int | None = None,
             stop: tuple[str, ...] = (), include_stop_str_in_output: bool = False, min_tokens: int = 0,
             allowed_token_ids: list[int] | None = None, bad_words: list[str] | None = None,
             response_format: str | None = None, json_schema: dict | None = None, regex: str | None = None,
             choice: list[str] | None = None, grammar: str | None = None, structural_tag: dict | None = None,
             tools: list | None = None, tool_choice: str | dict | None = None,
             parallel_tool_calls: bool = True, chat_template_kwargs: dict | None = None,
             continue_final_message: bool = False, add_generation_prompt: bool = True,
             chat_template: str | None = None, logprobs: int | None = None,
             prediction: str | list[str] | None = None, use_tqdm: bool = False, streamer=None
             ) -> GenerationResult | list[GenerationResult]:
        """The next assistant message after `messages` ({"role", "content"} dicts, OpenAI's layout; `developer` is the
        system message; assistant turns with `tool_calls` and `tool` turns with their results too); for a list of
        conversations, a list of results in order, all run as one continuous batch (as vLLM's `LLM.chat`). `tools`,
        `tool_choice`, `parallel_tool_calls`: OpenAI's (functions and custom tools); a reply that calls them has
        `result.tool_calls` (OpenAI's layout: a function's arguments as JSON text, a custom tool's input as text) beside
        its text (tools.py). `chat_template_kwargs`: the template's own variables (Qwen3's {"enable_thinking": False});
        `continue_final_message`: go on with the last assistant turn (the reply's start, written for the target) instead
        of opening a new one; `add_generation_prompt` False: the template's text ends with the last message, no
        assistant turn opened (vLLM's); `chat_template`: a Jinja template (the text, or a file) in place of the target's
        own for these conversations (vLLM's); `logprobs`, `prediction`, `structural_tag`, `include_stop_str_in_output`,
        `allowed_token_ids`, `bad_words`, `max_new_tokens`, `sampling_params` (one for all conversations, or a list of
        one each), `use_tqdm`: as generate's."""
        many = bool(messages) and isinstance(messages[0], list)
        conversations = list(messages) if many else [messages]
        request = tool_request(tools, tool_choice, parallel_tool_calls, self.tool_style)
        response_format, json_schema = reply_format(request, *with_pattern(response_format, json_schema, regex, choice,
                                                                            grammar, structural_tag))
        settings = self._settings(locals(), len(conversations))
        options = TemplateOptions(chat_template_kwargs or {}, add_generation_prompt and not continue_final_message,
                                  continue_final_message, chat_template_given(chat_template))
        prompts = [encode_chat(self.target, [{**m, "role": openai_role(m.get("role"))} for m in conversation],
                               request, options) for conversation in conversations]
        thinking = [thinking_of(self.target, prompt_ids, self.reasoning_parser) for prompt_ids in prompts]
        configs = self._predicting(self._configs(settings, response_format, json_schema), prediction)
        results = self._run(prompts, [replace(c, thinking=state) for c, state in zip(configs, thinking)],
                            [params.n for params in settings], use_tqdm, streamer)
        for result, state in zip(results, thinking):
            for output in result.outputs:
                output.reasoning, output.content = split(output.text, state)
                output.tool_calls = request.calls(output.content) if request is not None else None
        return results if many else results[0]

    def _prompt_ids(self, prompt, chat: bool) -> list[int]:
        """One prompt of generate's: text (in the chat template where `chat`), or vLLM's TextPrompt
        {"prompt": text} or TokensPrompt {"prompt_token_ids": [...]}."""
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not ids or not all(is_whole(t) for t in ids):
                raise UserError("prompt_token_ids must be a non-empty list of token ids")
            return list(ids)  # the engine checks they are in the vocabulary
        text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
        if not isinstance(text, str) or not text.strip():
            raise UserError('every prompt must be a non-empty string, {"prompt": text} or {"prompt_token_ids": ids}')
        return self.target.encode_prompt(text, chat=chat)

    def _settings(self, scope: dict, count: int) -> list[SamplingParams]:
        """The SamplingParams of each of `count` prompts from generate's or chat's settings (`scope`: their locals):
        vLLM's call (one SamplingParams, or a list of one a prompt, in max_new_tokens' place or as sampling_params),
        or the keywords with dflash's defaults (special tokens kept in the text)."""
        given = vllm_settings(scope["max_new_tokens"], scope["sampling_params"])
        if given is None:
            max_new = scope["max_new_tokens"]
            return [SamplingParams(max_tokens=DEFAULT_MAX_NEW_TOKENS if max_new is None else max_new,
                                   skip_special_tokens=False, **{name: scope[name] for name in KEYWORD_DEFAULTS})
                    ] * count
        keywords = [name for name, default in KEYWORD_DEFAULTS.items() if scope[name] != default]
        if keywords:
            raise UserError(f"sampling settings go in the SamplingParams or as keywords, not both: "
                            f"{', '.join(keywords)}")
        if isinstance(given, SamplingParams):
            return [given] * count
        if len(given) != count:
            raise UserError(f"{len(given)} SamplingParams for {count} prompts: give one, or one a prompt")
        return list(given)

    def _configs(self, settings: list[SamplingParams], response_format, json_schema) -> list[GenerationConfig]:
        """The engine's config of each prompt's settings, made once for settings that prompts share."""
        made = {}
        for params in settings:
            if id(params) not in made:
                made[id(params)] = self._config(params, response_format, json_schema)
        return [made[id(params)] for params in settings]

    def _config(self, params: SamplingParams, response_format, json_schema) -> GenerationConfig:
        """Every config generate and chat run with (tests push a random model's outputs here)."""
        return params.config(self.target.tokenizer, response_format, json_schema)

    def _streaming(self, streamer, prompt_ids: list[list[int]], configs: list[GenerationConfig], counts: list[int]):
        """(on_tokens, on_end) for a `streamer`, (None, None) without one; one prompt and one output only."""
        if streamer is None:
            return None, None
        if len(prompt_ids) != 1 or counts != [1]:
            raise UserError("a streamer takes one prompt and one output (n 1)")
        return streaming(streamer, self.target, prompt_ids[0], configs[0])

    def _predicting(self, configs: list[GenerationConfig], prediction) -> list[GenerationConfig]:
        """Each prompt's config with its prediction: the same for all, or a list of one each."""
        if isinstance(prediction, list) and all(isinstance(p, str) for p in prediction) and prediction:
            if len(prediction) != len(configs):
                raise UserError(f"prediction is a list of {len(prediction)} texts for {len(configs)} prompts: give "
                                "one each")
            return [replace(c, prediction=prediction_ids(self.target.tokenizer, p))
                    for c, p in zip(configs, prediction)]
        predicted = prediction_ids(self.target.tokenizer, prediction)
        return [replace(c, prediction=predicted) for c in configs]

    def _run(self, prompt_ids: list[list[int]], configs: list[GenerationConfig], counts: list[int],
             use_tqdm: bool = False, streamer=None, texts: list[str | None] | None = None) -> list[GenerationResult]:
        """Each prompt's result, its `counts[i]` outputs run in one continuous batch with every other prompt's;
        `texts`: the prompts as given, where they were text (vLLM's RequestOutput.prompt; else their ids decoded)."""
        from tqdm import tqdm

        for ids in prompt_ids:
            self.engine.budget(ids)  # a prompt too long for the context is refused before any runs
        on_tokens, on_end = self._streaming(streamer, prompt_ids, configs, counts)
        queued = []
        try:
            for ids, config, n in zip(prompt_ids, configs, counts):
                queued.append([self.engine.submit(ids, choice, on_tokens) for choice in config.choices(n)])
        except UserError:  # nothing of a refused call is left queued for the next
            for seq in (seq for outputs in queued for seq in outputs):
                self.engine.cancel(seq)
            raise
        with tqdm(total=sum(counts), unit="output", desc="generate", disable=not use_tqdm) as bar:
            self.engine.run(lambda finished: bar.update(len(finished)) if finished else None)
        if on_end is not None:
            on_end(queued[0][0].result)
        results = []
        for outputs, text in zip(queued, texts or [None] * len(queued)):
            first, *more = [seq.result for seq in outputs]
            first.more_outputs = more
            prompt = text if text is not None else self.target.decode(first.prompt_token_ids)  # chat's: the template's
            for index, output in enumerate(first.outputs):
                output.index, output.prompt = index, prompt
                self.counts.add(output.stats)
            results.append(first)
        return results


def streaming(streamer, target, prompt_ids: list[int], config: GenerationConfig):
    """(on_tokens, on_end) that hand one generation to `streamer` as it goes: a transformers streamer gets ids
    (its put(), the prompt's first, then end()), a callable the text's pieces (serving.streaming.TextDeltas)."""
    if hasattr(streamer, "put") and hasattr(streamer, "end"):
        import torch

        streamer.put(torch.tensor([prompt_ids]))  # as transformers' generate does: skip_prompt skips this one

        def put(new_ids: list[int]) -> None:
            streamer.put(torch.tensor([new_ids]))

        return put, lambda result: streamer.end()
    if not callable(streamer):
        raise UserError("streamer must be a callable given each piece of text, or a transformers streamer (put, end)")
    from .serving.streaming import TextDeltas

    deltas = TextDeltas.of(target, config)

    def send(piece: str) -> None:
        if piece:
            streamer(piece)

    return (lambda new_ids: send(deltas.push(new_ids))), (lambda result: send(deltas.finish(result.text)))


def is_whole(value) -> bool:
    """An int, not a bool (True is an int to Python, not a token id or a count to a user)."""
    return isinstance(value, int) and not isinstance(value, bool)


def vllm_settings(max_new_tokens, sampling_params) -> "SamplingParams | list[SamplingParams] | None":
    """The SamplingParams a call gave, in max_new_tokens' place or as sampling_params (None: it gave keywords)."""
    def settings(value) -> bool:
        return isinstance(value, SamplingParams) or isinstance(value, (list, tuple)) and bool(value) and all(
            isinstance(params, SamplingParams) for params in value)

    if sampling_params is None:
        return max_new_tokens if settings(max_new_tokens) else None
    if max_new_tokens is not None:
        raise UserError("give max_new_tokens or sampling_params, not both")
    if not settings(sampling_params):
        raise UserError("sampling_params must be a SamplingParams, or a list of one a prompt")
    return sampling_params


def with_pattern(response_format: str | None, json_schema: dict | None, regex: str | None, choice: list | None,
                 grammar: str | None = None, structural_tag: dict | None = None) -> tuple[str | None, dict | None]:
    """(response_format, json_schema) of LLM's arguments: a regex, a choice, a grammar or a structural tag in their
    place where one is given."""
    given = [value for value in (regex if choice is None else choice, grammar, structural_tag) if value is not None]
    if len(given) > 1:
        raise UserError("send a regex, a choice, a grammar or a structural tag: one of them")
    pattern = grammar_format(grammar) if grammar is not None else structural_tag_format(structural_tag) \
        if structural_tag is not None else pattern_format(regex, choice)
    return one_constraint((response_format, json_schema), pattern, "a regex, choice, grammar or structural tag")
