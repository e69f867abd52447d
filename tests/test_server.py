"""`dflash serve`: the real openai client against a uvicorn server on 127.0.0.1 with a tiny random model.

Every generated text is compared with SpeculativeDecoder run directly on the same target and proposer. References
are computed while the server is idle: the target is not thread-safe, and the server's worker owns it otherwise.
"""

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from dflash.engine import GenerationConfig, SpeculativeDecoder  # noqa: E402
from dflash.methods.base import Proposer  # noqa: E402
from dflash.methods.dflash.proposer import DFlashProposer, untrained_drafter  # noqa: E402
from dflash.sampling import SamplingConfig  # noqa: E402
from dflash.serving import BackgroundServer, create_app  # noqa: E402
from dflash.serving.streaming import TextDeltas  # noqa: E402

MODEL = "tiny-qwen3"  # qwen3's tiny random model gives varied text (tiny llama repeats one word)
MAX_TOKENS = 16
PROMPTS = [f"w{i} w{i + 3} w{i + 7} w{(2 * i + 11) % 59}" for i in range(16)]


@pytest.fixture(scope="module")
def target(tiny_targets):
    return tiny_targets["qwen3"]


@pytest.fixture(scope="module")
def proposer(target):
    return DFlashProposer(untrained_drafter(target, num_layers=1, block_size=4).freeze(), target)


@pytest.fixture(scope="module")
def reference(target, proposer):
    """reference(prompt_ids, ...) -> GenerationResult of the engine itself; call it only while the server idles."""
    decoder = SpeculativeDecoder(target, proposer)

    def run(prompt_ids, max_tokens=MAX_TOKENS, stop=(), temperature=0.0, seed=None, logprobs=None, **penalties):
        sampling = SamplingConfig(temperature=temperature, seed=seed, **penalties)
        return decoder.generate(prompt_ids, GenerationConfig(max_tokens, sampling, stop_strings=tuple(stop),
                                                             logprobs=logprobs))

    return run


@pytest.fixture(scope="module")
def chat_refs(target, reference):
    """Greedy references for every chat prompt, computed before the server starts."""
    return {p: reference(target.encode_messages([{"role": "user", "content": p}])) for p in PROMPTS}


@pytest.fixture(scope="module")
def url(target, proposer, chat_refs):
    with BackgroundServer(create_app(target, proposer, MODEL)) as base_url:
        yield base_url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def chat(client, prompt, **kwargs):
    kwargs.setdefault("max_tokens", MAX_TOKENS)
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], **kwargs)


def metrics(url) -> dict[str, float]:
    """The /metrics samples as {name{labels}: value}."""
    text = httpx.get(f"{url}/metrics").text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line[:1] != "#"}


# ---- plain, streaming, stop strings -----------------------------------------------------------------------------
def test_models_and_health(client, url):
    assert [m.id for m in client.models.list().data] == [MODEL]
    health = httpx.get(f"{url}/health").json()
    assert health["status"] == "ok" and health["method"] == "dflash"
    from dflash import __version__

    assert httpx.get(f"{url}/ping").json() == {"status": "ok"}
    assert httpx.get(f"{url}/version").json() == {"version": __version__}


def test_chat_equals_engine(client, target, chat_refs):
    prompt = PROMPTS[0]
    ref = chat_refs[prompt]
    response = chat(client, prompt)
    assert response.choices[0].message.content == ref.text
    assert response.choices[0].finish_reason == ref.finish_reason
    assert response.usage.prompt_tokens == len(target.encode_messages([{"role": "user", "content": prompt}]))
    assert response.usage.completion_tokens == len(ref.tokens)
    ext = response.model_extra["dflash"]
    assert ext["tau"] == pytest.approx(ref.stats.tau) and ext["rounds"] == ref.stats.num_rounds
    assert len(ext["per_position_acceptance"]) == 3
    only_likeliest = chat(client, prompt, temperature=1.0, extra_body={"min_p": 1.0})  # min_p 1: greedy's choices
    assert only_likeliest.choices[0].message.content == ref.text
    ends = {str(token): 100 for token in target.eos_token_ids}  # EOS first wherever it is allowed
    at_once = chat(client, prompt, logit_bias=ends)
    held = chat(client, prompt, logit_bias=ends, extra_body={"min_tokens": 5})
    assert at_once.usage.completion_tokens == 1 and held.usage.completion_tokens == 6  # 5 tokens, then the EOS
    assert held.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError, match="min_tokens"):
        chat(client, prompt, max_tokens=4, extra_body={"min_tokens": 5})


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (0.8, 7)])
def test_completion_equals_engine(client, target, reference, temperature, seed):
    """Raw prompts (no chat template); with a seed, sampling is reproducible and matches the engine too."""
    prompt = "w5 w9 w2 w33"
    ref = reference(target.encode_prompt(prompt, chat=False), temperature=temperature, seed=seed)
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                         temperature=temperature, seed=seed)
    assert response.choices[0].text == ref.text
    assert response.usage.completion_tokens == len(ref.tokens)


def test_stream_equals_non_stream(client, url, chat_refs):
    prompt = PROMPTS[1]
    chunks = list(chat(client, prompt, stream=True, stream_options={"include_usage": True}))
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert len([p for p in pieces if p]) > 1, "the text should arrive in several pieces"
    assert "".join(pieces) == chat_refs[prompt].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [chat_refs[prompt].finish_reason]
    assert chunks[-1].usage.completion_tokens == len(chat_refs[prompt].tokens)
    # the raw event stream ends with the OpenAI terminator
    body = {"model": MODEL, "prompt": "w1 w2", "max_tokens": 4, "stream": True, "temperature": 0}
    raw = httpx.post(f"{url}/v1/completions", json=body, timeout=60).text
    assert raw.endswith("data: [DONE]\n\n") and raw.count("data: [DONE]") == 1


@pytest.mark.parametrize("late", [False, True])
def test_continuous_usage_counts_the_text_sent(client, chat_refs, monkeypatch, late):
    """vLLM's continuous_usage_stats: every chunk has the usage up to its text. `late`: the stream starts reading
    after the engine has finished, as on a busy event loop; the counts must still follow the text, not the engine."""
    import asyncio

    from dflash.serving import app

    if late:
        first, next_piece = [True], app.next_piece

        async def after_the_engine(pieces, request):
            if first.pop() if first else False:
                await asyncio.sleep(0.5)  # the tiny model makes its 16 tokens in a few milliseconds
            return await next_piece(pieces, request)

        monkeypatch.setattr(app, "next_piece", after_the_engine)
    prompt = PROMPTS[1]
    live = list(chat(client, prompt, stream=True, stream_options={"include_usage": True,  # vLLM's extension
                                                                   "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in live]  # every chunk has the usage so far
    assert counts == sorted(counts) and counts[-1] == len(chat_refs[prompt].tokens) and 0 < counts[1] < counts[-1]
    assert counts[0] == 0  # the role chunk comes before any text
    assert len({c.usage.prompt_tokens for c in live}) == 1 and live[-1].usage.prompt_tokens > 0
    two = list(chat(client, prompt, stream=True, n=2, stream_options={"include_usage": True,
                                                                      "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in two]
    assert counts == sorted(counts) and counts[-1] == 2 * len(chat_refs[prompt].tokens)  # both choices, greedy


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_cut_the_text(client, target, reference, chat_refs, stream):
    """The stop string spans two tokens, so streaming must hold back the first one until the second decides."""
    prompt = PROMPTS[2]
    words = chat_refs[prompt].text.split(" ")
    stop = f"{words[4]} {words[5][:2]}"
    prompt_ids = target.encode_messages([{"role": "user", "content": prompt}])
    expected = reference(prompt_ids, stop=["w999", stop]).text
    assert expected == chat_refs[prompt].text[: chat_refs[prompt].text.find(stop)] and expected
    response = chat(client, prompt, stop=["w999", stop], stream=stream)
    if stream:
        chunks = [c for c in response if c.choices]
        pieces = [c.choices[0].delta.content or "" for c in chunks]
        assert all(stop not in p for p in pieces)
        text = "".join(pieces)
        reasons = [c.choices[0].model_extra.get("stop_reason") for c in chunks]
        assert reasons[-1] == stop and not any(reasons[:-1])  # vLLM's stop_reason, in the closing chunk
    else:
        assert response.choices[0].finish_reason == "stop"
        assert response.choices[0].model_extra["stop_reason"] == stop  # vLLM's: the stop string that ended it
        text = response.choices[0].message.content
    assert text == expected
    kept = chat(client, prompt, stop=["w999", stop], stream=stream, extra_body={"include_stop_str_in_output": True})
    kept = "".join(c.choices[0].delta.content or "" for c in kept if c.choices) if stream \
        else kept.choices[0].message.content
    assert kept == expected + stop  # vLLM's include_stop_str_in_output


@pytest.mark.parametrize("stream", [False, True])
def test_allowed_token_ids_hold_the_output(client, target, reference, stream):
    """vLLM's allowed_token_ids: the output is the engine's with every other token's logit at -inf, greedy and
    seeded; ids outside the vocabulary are refused."""
    prompt = PROMPTS[1]
    allowed = sorted(set(range(10, 40, 3)) | set(target.eos_token_ids))
    prompt_ids = target.encode_messages([{"role": "user", "content": prompt}])
    for temperature, seed in ((0.0, None), (0.9, 5)):
        ref = reference(prompt_ids, temperature=temperature, seed=seed, allowed_token_ids=tuple(allowed))
        assert set(ref.tokens) <= set(allowed) and ref.tokens
        response = chat(client, prompt, stream=stream, temperature=temperature, seed=seed,
                        extra_body={"allowed_token_ids": allowed})
        text = "".join(c.choices[0].delta.content or "" for c in response if c.choices) if stream \
            else response.choices[0].message.content
        assert text == ref.text
    for wrong in ([], [target.vocab_size]):
        with pytest.raises(openai.BadRequestError, match="allowed_token_ids"):
            chat(client, prompt, extra_body={"allowed_token_ids": wrong})


def test_bad_words_are_never_written(client, target, reference, chat_refs):
    """vLLM's bad_words: words of the greedy reply, barred, are not in the new reply, which is the engine's with
    their tokens barred (sampling.bad_word_ids)."""
    from dflash.sampling import bad_word_ids

    prompt = PROMPTS[1]
    words = chat_refs[prompt].text.split()[2:4]
    prompt_ids = target.encode_messages([{"role": "user", "content": prompt}])
    ref = reference(prompt_ids, bad_word_ids=bad_word_ids(target.tokenizer, words))
    reply = chat(client, prompt, extra_body={"bad_words": words}).choices[0].message.content
    assert reply == ref.text and not set(words) & set(reply.split())
    with pytest.raises(openai.BadRequestError, match="bad_words"):
        chat(client, prompt, extra_body={"bad_words": [" "]})


# ---- log-probabilities and several choices ----------------------------------------------------------------------
def test_chat_logprobs_are_the_engines_streamed_or_not(client, target, reference):
    prompt = PROMPTS[3]
    ref = reference(target.encode_messages([{"role": "user", "content": prompt}]), logprobs=3)
    whole = chat(client, prompt, logprobs=True, top_logprobs=3).choices[0].logprobs.content
    assert [item.token for item in whole] == target.tokenizer.convert_ids_to_tokens(ref.tokens)
    assert [item.logprob for item in whole] == pytest.approx([e.logprob for e in ref.logprobs], abs=1e-4)
    assert [bytes(item.bytes).decode() for item in whole] == [item.token for item in whole]
    for item, entry in zip(whole, ref.logprobs):
        assert [t.token for t in item.top_logprobs] == target.tokenizer.convert_ids_to_tokens([i for i, _ in entry.top])
        assert [t.logprob for t in item.top_logprobs] == pytest.approx([lp for _, lp in entry.top], abs=1e-4)
    chunks = [c for c in chat(client, prompt, logprobs=True, top_logprobs=3, stream=True) if c.choices]
    streamed = [item for c in chunks if c.choices[0].logprobs for item in c.choices[0].logprobs.content]
    assert [(i.token, i.logprob) for i in streamed] == [(i.token, i.logprob) for i in whole]
    assert chat(client, prompt).choices[0].logprobs is None  # only when asked


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_and_offsets(client, target, reference, stream):
    prompt = "w5 w9 w2 w33"
    ref = reference(target.encode_prompt(prompt, chat=False), logprobs=2)
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                         logprobs=2, stream=stream)
    parts = [c.choices[0].logprobs for c in response if c.choices[0].logprobs] if stream else [
        response.choices[0].logprobs]
    tokens = [t for part in parts for t in part.tokens]
    offsets = [o for part in parts for o in part.text_offset]
    assert tokens == target.tokenizer.convert_ids_to_tokens(ref.tokens)
    assert [lp for part in parts for lp in part.token_logprobs] == pytest.approx([e.logprob for e in ref.logprobs],
                                                                                 abs=1e-4)
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    tops = [top for part in parts for top in part.top_logprobs]
    assert [list(top) for top in tops] == [target.tokenizer.convert_ids_to_tokens([i for i, _ in e.top])
                                           for e in ref.logprobs]


def test_several_prompts_in_one_completions_request(client, target):
    """A list of prompts (texts, or lists of token ids), as lm-eval batches them: each prompt's choices in turn,
    each what a request of its own gives; usage summed; scoring with echo too; whole and streamed."""
    prompts = ["w5 w9 w2", "w1 w30 w12 w8", "w44"]
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0, n=2, seed=3)
             for p in prompts]
    for sent in (prompts, [target.encode_prompt(p, chat=False) for p in prompts]):
        together = client.completions.create(model=MODEL, prompt=sent, max_tokens=6, temperature=0, n=2, seed=3)
        assert [c.index for c in together.choices] == list(range(6))
        assert [c.text for c in together.choices] == [c.text for r in alone for c in r.choices]
        assert together.usage.prompt_tokens == sum(r.usage.prompt_tokens for r in alone)
        assert together.usage.completion_tokens == sum(r.usage.completion_tokens for r in alone)
        assert len(together.model_extra["dflash"]) == 3
    scored = client.completions.create(model=MODEL, prompt=prompts, max_tokens=0, echo=True, logprobs=1)
    assert [c.text for c in scored.choices] == prompts
    single = client.completions.create(model=MODEL, prompt=prompts[1], max_tokens=0, echo=True, logprobs=1)
    assert scored.choices[1].logprobs.token_logprobs == single.choices[0].logprobs.token_logprobs
    # streamed: every prompt's choices in one stream, each as it is alone, usage summed
    chunks = list(client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0, n=2, seed=3,
                                            stream=True, stream_options={"include_usage": True}))
    assert len({chunk.id for chunk in chunks}) == 1
    texts = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == k) for k in range(6)]
    assert texts == [c.text for r in alone for c in r.choices]
    assert chunks[-1].usage.completion_tokens == sum(r.usage.completion_tokens for r in alone)
    assert chunks[-1].usage.prompt_tokens == sum(r.usage.prompt_tokens for r in alone)
    echoed = list(client.completions.create(model=MODEL, prompt=prompts, max_tokens=0, echo=True, logprobs=1,
                                            stream=True))
    assert ["".join(c.choices[0].text for c in echoed if c.choices[0].index == k) for k in range(3)] == prompts
    for bad, fragment in [({"prompt": ["w1", "w1 " * 600]}, "at most"),
                          ({"prompt": [[1, 2], [10**6]]}, "token ids must be in")]:
        with pytest.raises(openai.BadRequestError, match=fragment):
            client.completions.create(model=MODEL, max_tokens=4, **bad)


def test_echo_scores_the_prompt_as_lm_eval_asks(client, target, reference):
    """lm-eval's loglikelihood request: the prompt's tokens echoed with their log-probabilities (the first has
    none), then one generated token; streamed, the same figures arrive in pieces."""
    import torch

    prompt = "w5 w9 w2 w33 w7"
    prompt_ids = target.encode_prompt(prompt, chat=False)
    ref = reference(prompt_ids, max_tokens=3, logprobs=1)
    with torch.no_grad():
        logits = target.model(torch.tensor([prompt_ids])).logits[0, :-1].float()
    scored = torch.log_softmax(logits, -1).gather(-1, torch.tensor(prompt_ids[1:])[:, None])[:, 0].tolist()
    for sent, echoed in ((prompt_ids, target.decode(prompt_ids)), (prompt, prompt)):
        response = client.completions.create(model=MODEL, prompt=sent, max_tokens=3, temperature=0, logprobs=1,
                                             echo=True)
        choice = response.choices[0]
        assert choice.text == echoed + ref.text
        lp = choice.logprobs
        assert lp.tokens == target.tokenizer.convert_ids_to_tokens(prompt_ids + ref.tokens)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:] == pytest.approx(scored + [e.logprob for e in ref.logprobs], abs=1e-4)
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, logprobs=1,
                                            echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == prompt + ref.text
    parts = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == lp.tokens
    assert [x for p in parts for x in p.token_logprobs] == lp.token_logprobs
    assert [o for p in parts for o in p.text_offset] == lp.text_offset
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True)
    assert plain.choices[0].text == prompt + ref.text and plain.choices[0].logprobs is None
    # max_tokens 0: the prompt scored, nothing generated
    for stream in (False, True):
        response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, logprobs=1, echo=True,
                                             stream=stream, **({"stream_options": {"include_usage": True}}
                                                               if stream else {}))
        chunks = list(response) if stream else [response]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == prompt
        parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
        figures = [x for p in parts for x in p.token_logprobs]
        assert figures[0] is None and figures[1:] == pytest.approx(scored, abs=1e-4)
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError, match="0 with echo"):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=0)


@pytest.mark.parametrize("stream", [False, True])
def test_several_choices_are_seeded_one_after_another(client, target, reference, stream):
    """n choices sample with seed, seed + 1, ...: each equals the engine's run with its seed."""
    prompt = "w5 w9 w2 w33"
    refs = [reference(target.encode_prompt(prompt, chat=False), temperature=1.0, seed=40 + i) for i in range(3)]
    assert len({tuple(r.tokens) for r in refs}) > 1, "the seeds should give different samples"
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=1.0,
                                         seed=40, n=3, stream=stream, **({"stream_options": {"include_usage": True}}
                                                                         if stream else {}))
    texts, finishes, usage = ["", "", ""], [None] * 3, None
    for chunk in (response if stream else [response]):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert texts == [r.text for r in refs] and finishes == [r.finish_reason for r in refs]
    assert usage.completion_tokens == sum(len(r.tokens) for r in refs)


def test_penalties_are_the_engines(client, target, reference):
    prompt = "w5 w9 w2 w33"
    penalties = dict(presence_penalty=1.2, frequency_penalty=0.5, repetition_penalty=1.3, logit_bias={7: 4.0})
    ref = reference(target.encode_prompt(prompt, chat=False), **penalties)
    assert ref.text != reference(target.encode_prompt(prompt, chat=False)).text
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                         presence_penalty=1.2, frequency_penalty=0.5, logit_bias={"7": 4.0},
                                         extra_body={"repetition_penalty": 1.3})
    assert response.choices[0].text == ref.text


def test_a_growing_conversation_reads_its_history_from_the_prefix_cache(client, url, target, reference):
    first = [{"role": "user", "content": "w3 w9 w27 w4 w8"}]
    answer = chat(client, first[0]["content"])
    turns = first + [{"role": "assistant", "content": answer.choices[0].message.content},
                     {"role": "user", "content": "w12 w5"}]
    ref = reference(target.encode_messages(turns))
    before = metrics(url).get("dflash_cached_prompt_tokens_total", 0)
    response = client.chat.completions.create(model=MODEL, messages=turns, max_tokens=MAX_TOKENS, temperature=0)
    assert response.choices[0].message.content == ref.text
    cached = response.usage.prompt_tokens_details.cached_tokens
    assert cached >= answer.usage.prompt_tokens and cached < response.usage.prompt_tokens
    assert metrics(url)["dflash_cached_prompt_tokens_total"] - before == cached


@pytest.mark.parametrize("stream", [False, True])
def test_stop_token_ids_end_the_text_before_the_token(client, target, chat_refs, stream):
    prompt = PROMPTS[5]
    ref = chat_refs[prompt]
    stop_id = ref.tokens[5]
    expected = target.decode(ref.tokens[: ref.tokens.index(stop_id)])
    response = chat(client, prompt, stream=stream, extra_body={"stop_token_ids": [stop_id]}, logprobs=True)
    if stream:
        chunks = [c for c in response if c.choices]
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
        logprobs = [item for c in chunks if c.choices[0].logprobs for item in c.choices[0].logprobs.content]
        reason = chunks[-1].choices[0].model_extra.get("stop_reason")
    else:
        text, finish = response.choices[0].message.content, [response.choices[0].finish_reason]
        logprobs = response.choices[0].logprobs.content
        reason = response.choices[0].model_extra["stop_reason"]
    assert text == expected and finish == ["stop"] and reason == stop_id  # vLLM's stop_reason: the stop id
    assert len(logprobs) == ref.tokens.index(stop_id)  # the stop token's is left out, as its text is


def test_an_api_key_guards_every_endpoint_but_the_probes(target, proposer):
    app = create_app(target, proposer, MODEL, api_key="sesame")
    with BackgroundServer(app) as base:
        keyed = openai.OpenAI(base_url=f"{base}/v1", api_key="sesame", max_retries=0, timeout=60)
        assert chat(keyed, PROMPTS[0]).choices[0].message.content
        wrong = openai.OpenAI(base_url=f"{base}/v1", api_key="open", max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError, match="Incorrect API key"):
            chat(wrong, PROMPTS[0])
        assert httpx.post(f"{base}/tokenize", json={"prompt": "w1"}).status_code == 401
        probes = ("health", "metrics", "ping", "version")
        assert all(httpx.get(f"{base}/{probe}").status_code == 200 for probe in probes)


def test_several_served_names_are_each_answered_as_sent(target, proposer):
    """--served-model-name with several names (as vLLM's): each is served and named back; others are not found."""
    app = create_app(target, proposer, [MODEL, "alias"])
    with BackgroundServer(app) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == [MODEL, "alias"]
        assert client.models.retrieve("alias").id == "alias"
        for name in (MODEL, "alias"):
            reply = client.chat.completions.create(model=name, messages=[{"role": "user", "content": PROMPTS[0]}],
                                                   max_tokens=4, temperature=0)
            assert reply.model == name
        plain = httpx.post(f"{base}/v1/completions", json={"prompt": "w1", "max_tokens": 2}).json()
        assert plain["model"] == MODEL  # none sent: the first name
        with pytest.raises(openai.NotFoundError, match="serves 'tiny-qwen3' or 'alias'"):
            client.chat.completions.create(model="other", messages=[{"role": "user", "content": "w1"}], max_tokens=2)


def test_truncate_prompt_tokens_keeps_the_prompts_end(client, url, target, reference):
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens are what the target reads (-1: all that fit)."""
    messages = [{"role": "user", "content": PROMPTS[0]}]
    kept = target.encode_messages(messages)[-5:]
    expected = reference(kept)
    reply = chat(client, PROMPTS[0], extra_body={"truncate_prompt_tokens": 5})
    assert reply.usage.prompt_tokens == 5 and reply.choices[0].message.content == expected.text
    plain = httpx.post(f"{url}/v1/completions", json={"prompt": "w1 " * 2000, "max_tokens": 2,
                                                      "truncate_prompt_tokens": -1}).json()
    assert plain["usage"]["prompt_tokens"] < 2000 and plain["choices"][0]["finish_reason"] == "length"
    too_long = httpx.post(f"{url}/v1/completions", json={"prompt": "w1 " * 2000, "max_tokens": 2})
    assert too_long.status_code == 400 and "does not fit" in too_long.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens must be"):
        chat(client, PROMPTS[0], extra_body={"truncate_prompt_tokens": 0})


def test_tokenize_and_detokenize(url, target):
    messages = [{"role": "user", "content": "w1 w2"}]
    chat_ids = httpx.post(f"{url}/tokenize", json={"messages": messages}).json()
    assert chat_ids["tokens"] == target.encode_messages(messages) and chat_ids["count"] == len(chat_ids["tokens"])
    plain = httpx.post(f"{url}/tokenize", json={"model": MODEL, "prompt": "w1 w2"}).json()
    assert plain["tokens"] == target.encode_prompt("w1 w2", chat=False)
    assert httpx.post(f"{url}/detokenize", json={"tokens": plain["tokens"]}).json() == {"prompt": "w1 w2"}
    for path, body in (("/tokenize", {}), ("/detokenize", {"tokens": [64]})):
        answer = httpx.post(f"{url}{path}", json=body)
        assert answer.status_code == 400 and "error" in answer.json()


def test_greedy_choices_are_all_the_same(client, chat_refs):
    response = chat(client, PROMPTS[4], n=2)
    assert [c.index for c in response.choices] == [0, 1]
    assert [c.message.content for c in response.choices] == [chat_refs[PROMPTS[4]].text] * 2
    assert response.model_extra["dflash"]["rounds"] == 2 * chat_refs[PROMPTS[4]].stats.num_rounds


def test_text_deltas_hold_back_a_possible_stop_string():
    words = {0: "a", 1: "<eos>", 2: "b", 3: "c", 4: "d"}
    deltas = TextDeltas(lambda ids: " ".join(words[i] for i in ids), stop_strings=("b c",), stop_ids={1})
    assert deltas.push([0]) == "a"
    assert deltas.push([2]) == " "  # "b" may be the start of "b c": held back
    assert deltas.push([3]) == ""  # it was: nothing of the stop string is ever sent
    assert deltas.finish("a ") == ""
    plain = TextDeltas(lambda ids: " ".join(words[i] for i in ids), stop_strings=("b c",), stop_ids={1})
    assert [plain.push([0]), plain.push([2]), plain.push([4, 1])] == ["a", " ", "b d"]  # EOS is not text


# ---- concurrency ------------------------------------------------------------------------------------------------
def test_concurrent_requests_are_all_correct(client, chat_refs, url):
    """16 clients at once, half of them streaming: every answer equals the engine's own output."""

    def ask(i: int) -> str:
        prompt = PROMPTS[i]
        if i % 2:
            return "".join(c.choices[0].delta.content or "" for c in chat(client, prompt, stream=True))
        return chat(client, prompt).choices[0].message.content

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(ask, range(len(PROMPTS))))
    assert answers == [chat_refs[p].text for p in PROMPTS]
    assert httpx.get(f"{url}/health").json()["queued"] == 0


def test_requests_share_the_batch(target, proposer, chat_refs):
    """With room for 4, concurrent requests decode together (the batch-size histogram saw rows of 4) and each
    answer is still its own solo output."""
    app = create_app(target, proposer, MODEL, max_batch_size=4)
    with BackgroundServer(app) as base:
        local = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda p: chat(local, p).choices[0].message.content, PROMPTS[:8]))
        samples = metrics(base)
    assert answers == [chat_refs[p].text for p in PROMPTS[:8]]
    assert samples['dflash_batch_size_bucket{le="2.0"}'] < samples["dflash_batch_size_count"]  # wider passes ran
    assert samples['dflash_batch_size_bucket{le="4.0"}'] == samples["dflash_batch_size_count"]  # never over 4


def test_a_full_server_answers_503_not_a_hang(target, proposer):
    app = create_app(target, SlowProposer(), MODEL, max_batch_size=1, max_queue=2)
    body = {"model": MODEL, "prompt": "w3 w4", "max_tokens": 200, "ignore_eos": True}
    with BackgroundServer(app) as base, httpx.Client(timeout=60) as http:
        with open_stream(http, base) as first, httpx.Client(timeout=60) as other, open_stream(other, base) as second:
            assert first.status_code == second.status_code == 200
            busy = httpx.post(f"{base}/v1/completions", json=body, timeout=10)
            assert busy.status_code == 503 and "busy" in busy.json()["error"]["message"]


# ---- bad input --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, error, fragment", [
    ({"n": 0}, "BadRequestError", "n must be in [1, "),
    ({"n": 999}, "BadRequestError", "n must be in [1, 256]"),
    ({"top_logprobs": 2}, "BadRequestError", "top_logprobs needs logprobs"),
    ({"presence_penalty": 2.5}, "BadRequestError", "presence_penalty must be in [-2, 2]"),
    ({"extra_body": {"repetition_penalty": 0}}, "BadRequestError", "repetition_penalty must be > 0"),
    ({"logit_bias": {"64": 5}}, "BadRequestError", "logit_bias keys must be token ids in [0, 64)"),
    ({"logit_bias": {"5": 200}}, "BadRequestError", "biases in [-100, 100]"),
    ({"extra_body": {"stop_token_ids": [-1]}}, "BadRequestError", "stop_token_ids must be token ids"),
    ({"logprobs": True, "top_logprobs": 21}, "BadRequestError", "top_logprobs must be in [0, 20]"),
    ({"max_tokens": -3}, "BadRequestError", "max_tokens must be >= 1"),
    ({"temperature": -1}, "BadRequestError", "temperature"),
    ({"top_p": 0}, "BadRequestError", "top_p"),
    ({"top_p": 1.5}, "BadRequestError", "top_p"),
    ({"model": "gpt-4"}, "NotFoundError", "not served here"),
    ({"max_tokens": "many"}, "UnprocessableEntityError", "max_tokens"),
    ({"stop": 5}, "UnprocessableEntityError", "stop"),
    ({"messages": []}, "UnprocessableEntityError", "messages"),
    ({"messages": [{"role": "wizard", "content": "w1"}]}, "UnprocessableEntityError", "role"),
])
def test_bad_requests_get_clear_errors(client, kwargs, error, fragment):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "w1"}], "max_tokens": 2, **kwargs}
    with pytest.raises(getattr(openai, error)) as info:
        client.chat.completions.create(**body)
    assert fragment in info.value.message
    assert info.value.body["type"] == "invalid_request_error"


def test_too_long_prompt_and_broken_json_then_still_serving(client, url, chat_refs):
    with pytest.raises(openai.BadRequestError, match="at most"):
        client.completions.create(model=MODEL, prompt="w1 " * 600, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="at most"):
        client.completions.create(model=MODEL, prompt="w1 " * 600, max_tokens=2, stream=True)
    for raw in (b'{"model": "tiny-qwen3", "prompt": ', b"\xff\xfe", b"[1, 2]"):
        response = httpx.post(f"{url}/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert response.status_code in (400, 422), response.text
        assert "error" in response.json()
    assert chat(client, PROMPTS[0]).choices[0].message.content == chat_refs[PROMPTS[0]].text


# ---- disconnects ------------------------------------------------------------------------------------------------
class SlowProposer(Proposer):
    """Plain decoding that sleeps every round, so an uncancelled long request would hold the worker for seconds.
    With no drafts the engine never asks it to propose, only to skip: both sleep (the target alone may be fast
    enough to finish 480 tokens within the client's timeout)."""

    def propose(self, sequence, limit=None, keep_going=None):
        time.sleep(0.025)
        return super().propose(sequence, limit)

    def skip(self):
        time.sleep(0.025)
        super().skip()


def open_stream(http: httpx.Client, base: str):
    body = {"model": MODEL, "prompt": "w3 w4", "max_tokens": 480, "stream": True, "ignore_eos": True}
    return http.stream("POST", f"{base}/v1/completions", json=body)


def test_disconnected_clients_free_their_slot(target):
    """A client that leaves mid-stream stops its generation, one that leaves while queued is never run, and one
    that gives up on a plain request stops it too. Otherwise the next request would wait >= 480 x 25 ms for each
    abandoned generation."""
    app = create_app(target, SlowProposer(), MODEL, max_batch_size=1)  # one row: the second request waits
    with BackgroundServer(app) as base, httpx.Client(timeout=60) as http:
        with open_stream(http, base) as running:
            lines = running.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))  # the first piece of text came
            with httpx.Client(timeout=60) as other, open_stream(other, base) as queued:
                assert queued.status_code == 200
                assert httpx.get(f"{base}/health").json()["queued"] == 1
        long_plain = {"model": MODEL, "prompt": "w3 w4", "max_tokens": 480, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            http.post(f"{base}/v1/completions", json=long_plain, timeout=0.5)
        start = time.perf_counter()
        body = {"model": MODEL, "prompt": "w1", "max_tokens": 3, "temperature": 0}
        assert http.post(f"{base}/v1/completions", json=body).json()["usage"]["completion_tokens"] >= 1
        assert time.perf_counter() - start < 5
        samples = metrics(base)
        assert samples["dflash_cancelled_requests_total"] == 3
        assert samples["dflash_time_to_first_token_seconds_count"] == 3  # the queued stream never ran
        assert samples["dflash_generated_tokens_total"] < 480


# ---- metrics ----------------------------------------------------------------------------------------------------
def test_metrics_count_the_rounds_of_each_source_of_drafts():
    from dflash.engine import GenerationStats
    from dflash.serving.metrics import Metrics

    m = Metrics(block_size=4, queued=lambda: 0, running=lambda: 0)
    m.observe_generation(GenerationStats(new_tokens=9, accept_lengths=[3, 1, 2, 3], draft_lengths=[3, 1, 2, 3],
                                         lookup_rounds=3, table_rounds=2))
    sample = m.registry.get_sample_value
    assert sample("dflash_lookup_rounds_total") == 3 and sample("dflash_table_rounds_total") == 2
    assert sample("dflash_verify_rounds_total") == 4
    # vLLM's names: a round that drafted nothing is no draft; accepted = emitted - 1; positions from 0
    m.observe_generation(GenerationStats(prompt_tokens=5, new_tokens=4, accept_lengths=[1, 3], draft_lengths=[0, 2]))
    model = {"model_name": "dflash"}
    assert sample("vllm:spec_decode_num_drafts_total", model) == 4 + 1
    assert sample("vllm:spec_decode_num_draft_tokens_total", model) == 9 + 2
    assert sample("vllm:spec_decode_num_accepted_tokens_total", model) == 5 + 2
    assert [sample("vllm:spec_decode_num_accepted_tokens_per_pos_total", {**model, "position": str(k)})
            for k in range(3)] == [3 + 1, 2 + 1, 0]
    assert sample("vllm:prompt_tokens_total", model) == 5 and sample("vllm:generation_tokens_total", model) == 13
    assert sample("vllm:time_to_first_token_seconds_count", model) == 2


def test_metrics_are_prometheus_text(client, url):
    chat(client, PROMPTS[3])
    samples = metrics(url)
    assert samples['dflash_requests_total{endpoint="/v1/chat/completions",status="200"}'] >= 1
    assert samples["dflash_generated_tokens_total"] > 0
    assert 0 <= samples["dflash_draft_tokens_total"] <= 3 * samples["dflash_verify_rounds_total"]  # adaptive
    assert samples["dflash_mean_tau"] >= 1
    for name in ("dflash_lookup_rounds_total", "dflash_table_rounds_total"):
        assert 0 <= samples[name] <= samples["dflash_verify_rounds_total"]
    for k in (1, 2, 3):
        assert 0 <= samples[f'dflash_position_acceptance{{position="{k}"}}'] <= 1
    model = f'model_name="{MODEL}"'  # vLLM's series, by its names: what its dashboards read
    drafts = samples[f"vllm:spec_decode_num_drafts_total{{{model}}}"]
    assert drafts <= samples["dflash_verify_rounds_total"]
    assert samples[f"vllm:spec_decode_num_draft_tokens_total{{{model}}}"] == samples["dflash_draft_tokens_total"]
    assert samples[f"vllm:spec_decode_num_accepted_tokens_total{{{model}}}"] == samples["dflash_accepted_tokens_total"]
    per_position = [samples[f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{model},position="{k}"}}']
                    for k in range(3)]
    assert drafts >= per_position[0] >= per_position[1] >= per_position[2]
    assert samples[f"vllm:generation_tokens_total{{{model}}}"] == samples["dflash_generated_tokens_total"]
    assert samples[f"vllm:num_requests_running{{{model}}}"] == 0
    latency = samples[f"vllm:e2e_request_latency_seconds_count{{{model}}}"]
    assert latency == samples["dflash_request_latency_seconds_count"]
    count = samples["dflash_request_latency_seconds_count"]
    assert samples['dflash_request_latency_seconds_bucket{le="+Inf"}'] == count > 0
    if Path("/proc/self/stat").exists():  # Prometheus' process metrics: the server's own resident memory
        resident = int(re.search(r"VmRSS:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) << 10
        assert resident / 2 <= samples["process_resident_memory_bytes"] <= 2 * resident  # the server runs in this process
    assert json.loads(json.dumps(samples))  # plain numbers only



def test_a_developer_message_is_the_system_message():
    """OpenAI's `developer` role opens the conversation as `system` does: chat templates know only that one
    (SmolLM2's put its own default system message before a `developer` turn)"""
    from dflash.serving.schemas import schemas

    developer = {"role": "developer", "content": [{"type": "text", "text": "d"}]}
    body = schemas().ChatRequest(model=MODEL, messages=[developer, {"role": "user", "content": "u"}])
    assert [m.as_dict() for m in body.messages] == [{"role": "system", "content": "d"},
                                                    {"role": "user", "content": "u"}]


def test_the_models_sampling_defaults_fill_what_a_request_leaves_out(target, proposer, reference):
    """As vLLM's --generation-config auto: the model's generation_config.json settings (here greedy's temperature 0,
    then top-k 1) are the defaults of requests that send none; a request's own settings win."""
    prompt = PROMPTS[2]
    ids = target.encode_messages([{"role": "user", "content": prompt}])
    greedy, seeded = reference(ids).text, reference(ids, temperature=1.0, seed=3).text
    assert greedy != seeded
    for defaults in ({"temperature": 0.0}, {"top_k": 1}):
        with BackgroundServer(create_app(target, proposer, "tiny", sampling_defaults=defaults)) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)

            def ask(**kwargs):
                return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                                      max_tokens=MAX_TOKENS, **kwargs).choices[0].message.content

            assert ask(seed=3) == greedy  # the default holds
            if "temperature" in defaults:
                assert ask(temperature=1.0, seed=3) == seeded  # the request's own temperature wins
    config = target.model.generation_config
    old = config.temperature, config.top_k
    try:
        config.temperature, config.top_k = 0.6, 20
        assert target.sampling_defaults == {"temperature": 0.6, "top_k": 20}
    finally:
        config.temperature, config.top_k = old
    assert target.sampling_defaults == {}


def test_fields_this_server_does_not_read_are_named_in_the_log(client, caplog):
    """As vLLM logs them: a client that sends OpenAI's legacy `functions` learns from the log why nothing called."""
    import logging

    with caplog.at_level(logging.WARNING, logger="dflash.server"):
        reply = chat(client, PROMPTS[0], extra_body={"functions": [{"name": "f", "parameters": {}}], "x_custom": 1})
    assert reply.choices[0].message.content is not None
    assert any("functions, x_custom" in record.getMessage() for record in caplog.records)


def test_allowed_origins_answer_a_browsers_preflight_before_the_api_key(target, proposer):
    """--allowed-origins (CORS, as vLLM's): a page of an allowed origin may call the server (its preflight needs no
    key, and even a 401 is readable there); other origins get no CORS headers, and without the option none do."""
    page = {"Origin": "http://ui.example"}
    preflight = {**page, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    app = create_app(target, proposer, MODEL, api_key="sesame", allowed_origins=["http://ui.example"])
    with BackgroundServer(app) as base:
        answer = httpx.options(f"{base}/v1/chat/completions", headers=preflight)
        assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "http://ui.example"
        refused = httpx.get(f"{base}/v1/models", headers=page)
        assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "http://ui.example"
        keyed = httpx.get(f"{base}/v1/models", headers={**page, "Authorization": "Bearer sesame"})
        assert keyed.status_code == 200 and keyed.headers["access-control-allow-origin"] == "http://ui.example"
        other = httpx.get(f"{base}/health", headers={"Origin": "http://elsewhere.example"})
        assert "access-control-allow-origin" not in other.headers
    with BackgroundServer(create_app(target, proposer, MODEL)) as base:
        assert "access-control-allow-origin" not in httpx.get(f"{base}/health", headers=page).headers


def test_https_with_a_key_and_certificate(target, proposer, tmp_path):
    """--ssl-keyfile and --ssl-certfile: the server answers over TLS with that certificate; a missing or broken pair
    is a one-line error before the model loads (tls_options)."""
    import shutil
    import ssl
    import subprocess

    from dflash.errors import UserError
    from dflash.serving.app import tls_options

    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    options = tls_options(str(key), str(cert))
    with BackgroundServer(create_app(target, proposer, MODEL), **options) as base:
        assert base.startswith("https://")
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60,
                               http_client=httpx.Client(verify=ssl.create_default_context(cafile=str(cert))))
        assert chat(client, PROMPTS[0]).choices[0].message.content
        with pytest.raises(httpx.ConnectError):  # a client that does not trust the certificate
            httpx.get(f"{base}/health")
    for given, message in (((str(key), None), "both"), (("/nope.pem", str(cert)), "no such file"),
                           ((str(cert), str(cert)), "not a PEM certificate and its key")):
        with pytest.raises(UserError, match=message):
            tls_options(*given)


def test_serve_refuses_half_a_tls_pair_before_the_model_loads(capsys, monkeypatch):
    import dflash.loading
    from dflash.cli import main

    def no_loading(*_, **__):
        raise AssertionError("the target loaded before the options were checked")

    monkeypatch.setattr(dflash.loading, "target_from_args", no_loading)
    code = main(["serve", "--target", "tiny-llama", "--port", "0", "--ssl-keyfile", "key.pem"])
    err = capsys.readouterr().err
    assert code == 2 and "HTTPS needs both --ssl-keyfile and --ssl-certfile" in err and "Traceback" not in err


def test_a_root_path_is_the_prefix_a_proxy_serves_it_under(target, proposer):
    """--root-path (uvicorn's): the proxy strips its prefix, so the routes stay where they are, and the pages the
    server writes (its API docs) link under the prefix."""
    with BackgroundServer(create_app(target, proposer, MODEL), root_path="/dflash") as base:
        assert httpx.get(f"{base}/v1/models").json()["data"][0]["id"] == MODEL
        assert "/dflash/openapi.json" in httpx.get(f"{base}/docs").text


def test_max_model_len_caps_prompt_and_output_together(target, proposer):
    """--max-model-len (vLLM's): a shorter context than the model's, for every request: a prompt that does not fit
    gets a 400, an output stops where prompt and output fill it, /tokenize says the cap; None gives the model's back."""
    from dflash.errors import UserError

    native = target.max_context
    target.limit_context(96)
    try:
        with BackgroundServer(create_app(target, proposer, MODEL)) as base:
            assert httpx.post(f"{base}/tokenize", json={"prompt": "w1"}).json()["max_model_len"] == 96
            assert httpx.get(f"{base}/v1/models").json()["data"][0]["max_model_len"] == 96  # vLLM's model card
            long = httpx.post(f"{base}/v1/completions", json={"prompt": "w1 " * 100, "max_tokens": 4})
            assert long.status_code == 400 and "context of 96" in long.text
            prompt = "w1 " * 60
            filled = httpx.post(f"{base}/v1/completions", json={"prompt": prompt, "max_tokens": 500, "temperature": 0,
                                                                "ignore_eos": True}).json()
            assert filled["choices"][0]["finish_reason"] == "length"
            assert 60 + filled["usage"]["completion_tokens"] <= 96 < 60 + 500
    finally:
        target.limit_context(None)
    assert target.max_context == native
    for wrong in (8, native + 1):
        with pytest.raises(UserError, match="max_model_len must be in"):
            target.limit_context(wrong)
    assert target.max_context == native


@pytest.mark.parametrize("stream", [False, True])
def test_skip_special_tokens_leaves_them_out_of_the_text(client, target, reference, stream):
    """vLLM's skip_special_tokens (its default; here kept unless asked): the text is the tokens decoded without
    their special tokens, and stop strings are looked for in that text."""
    prompt = PROMPTS[0]
    mask = target.tokenizer.convert_tokens_to_ids("<mask>")
    sampled = dict(temperature=1.0, seed=3, max_tokens=24, logit_bias={str(mask): 1.0},
                   extra_body={"ignore_eos": True})
    prompt_ids = target.encode_messages([{"role": "user", "content": prompt}])
    ref = reference(prompt_ids, max_tokens=24, temperature=1.0, seed=3, logit_bias={mask: 1.0})
    kept = target.tokenizer.decode(ref.tokens, skip_special_tokens=False)
    left_out = target.tokenizer.decode(ref.tokens, skip_special_tokens=True)
    assert "<mask>" in kept and "<" not in left_out

    def text(**more):
        extra = {**sampled["extra_body"], **more.pop("extra_body", {})}
        response = chat(client, prompt, stream=stream, **{**sampled, "extra_body": extra}, **more)
        if stream:
            return "".join(c.choices[0].delta.content or "" for c in response if c.choices)
        return response.choices[0].message.content

    assert text() == kept
    assert text(extra_body={"skip_special_tokens": True}) == left_out
    stop = left_out.split()[5]  # a word whose text moves when the special tokens go
    cut = text(extra_body={"skip_special_tokens": True}, stop=[stop])
    assert cut == left_out[: left_out.index(stop)]


def test_serve_reads_vllm_serves_command_line(capsys, monkeypatch):
    """`dflash serve MODEL --speculative-config JSON`, as `vllm serve` is called: the model is the target, the config
    the method and block size; a model beside --target is refused."""
    import dflash.loading
    from dflash.cli import main
    from dflash.errors import UserError

    seen = []

    def loading(args, **_):
        seen.append((args.target, args.method, args.block_size))
        raise UserError("loaded")

    monkeypatch.setattr(dflash.loading, "target_from_args", loading)
    config = '{"method": "ngram", "num_speculative_tokens": 5}'
    assert main(["serve", "tiny-llama", "--port", "0", "--speculative-config", config]) == 2
    assert seen == [("tiny-llama", "ngram", 6)] and "loaded" in capsys.readouterr().err
    assert main(["serve", "tiny-llama", "--target", "tiny-qwen2", "--port", "0"]) == 2
    assert "not both" in capsys.readouterr().err and len(seen) == 1
    from dflash.cli import build_parser

    args = build_parser().parse_args(["serve", "--model", "tiny-qwen2", "--max-num-seqs", "4"])
    assert (args.target, args.max_batch_size) == ("tiny-qwen2", 4)  # vLLM's flag names
