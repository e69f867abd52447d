"""dflash.LLM: one prompt or many through one loaded target and method, each result the target's own output."""

import pytest
import torch

from dflash import LLM, GenerationConfig, SamplingParams, SpeculativeDecoder, UserError
from dflash.testing import tiny_target


def ar_tokens(prompts, max_new, chat=True):
    target = tiny_target("qwen2", logit_scale=4.0)  # LLM("tiny-qwen2")'s target
    decoder = SpeculativeDecoder(target)
    return [decoder.generate(target.encode_prompt(p, chat=chat), GenerationConfig(max_new_tokens=max_new)).tokens
            for p in prompts]


@pytest.mark.parametrize("method", ["ngram", "dflash+ngram"])
def test_one_prompt_or_many_give_plain_greedy_decodings_in_order(method):
    llm = LLM("tiny-qwen2", method, device="cpu", max_batch=2)
    prompts = ["w1 w2 w3", "w4 w5", "w6 w1 w6 w1", "w9"]
    expected = ar_tokens(prompts, 12)
    one = llm.generate(prompts[0], max_new_tokens=12)
    many = llm.generate(prompts, max_new_tokens=12)  # four prompts, two rows: continuous batching
    assert one.tokens == expected[0] and [r.tokens for r in many] == expected
    assert one.num_cached_tokens == 0 < many[0].num_cached_tokens  # vLLM's: its prompt again, from the prefix cache
    assert llm.reset_prefix_cache() and llm.generate(prompts[0], max_new_tokens=12).num_cached_tokens == 0
    assert len({tuple(t) for t in expected}) > 1  # the prompts' answers differ: order is checked
    assert [r.tokens for r in llm.generate(prompts, max_new_tokens=12, chat=False)] == ar_tokens(prompts, 12, False)


def test_chat_answers_the_messages_as_the_template_lays_them_out():
    llm = LLM("tiny-qwen2", "ngram", device="cpu")
    messages = [{"role": "system", "content": "w3"}, {"role": "user", "content": "w1 w2"},
                {"role": "assistant", "content": "w7"}, {"role": "user", "content": "w4"}]
    target = tiny_target("qwen2", logit_scale=4.0)
    expected = SpeculativeDecoder(target).generate(target.encode_messages(messages), GenerationConfig(max_new_tokens=9))
    assert llm.chat(messages, max_new_tokens=9).tokens == expected.tokens
    sent = []
    encode = llm.target.encode_messages
    llm.target.encode_messages = lambda ms, **kwargs: sent.append(ms) or encode(ms, **kwargs)
    developer = [{"role": "developer", "content": "w3"}, *messages[1:]]
    assert llm.chat(developer, max_new_tokens=9).tokens == expected.tokens and sent == [messages]
    from dflash.models.target import TemplateOptions

    bare = llm.chat(messages, max_new_tokens=9, add_generation_prompt=False)  # vLLM's: no assistant turn opened
    unopened = target.encode_messages(messages, options=TemplateOptions(add_generation_prompt=False))
    assert bare.prompt_token_ids == unopened != target.encode_messages(messages)


def test_many_conversations_are_each_ones_own_reply_in_order():
    llm = LLM("tiny-qwen2", "dflash+ngram", device="cpu", max_batch=2)
    conversations = [[{"role": "user", "content": text}] for text in ("w1 w2", "w4", "w6 w1 w6", "w3 w3")]
    alone = [llm.chat(conversation, max_new_tokens=10).tokens for conversation in conversations]
    together = llm.chat(conversations, max_new_tokens=10)  # four conversations, two rows: one continuous batch
    assert [result.tokens for result in together] == alone and len({tuple(t) for t in alone}) > 1
    assert all(result.content == result.text for result in together)


def test_log_probabilities_are_the_engines_own():
    llm = LLM("tiny-qwen2", "ngram", device="cpu")
    target = tiny_target("qwen2", logit_scale=4.0)
    expected = SpeculativeDecoder(target).generate(target.encode_prompt("w1 w2"),
                                                   GenerationConfig(max_new_tokens=8, logprobs=3))
    result = llm.generate("w1 w2", max_new_tokens=8, logprobs=3)
    assert [e.token for e in result.logprobs] == result.tokens == expected.tokens
    for mine, theirs in zip(result.logprobs, expected.logprobs):
        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4) and len(mine.top) == 3
        assert [t for t, _ in mine.top] == [t for t, _ in theirs.top]
        assert mine.top[0][0] == mine.token  # greedy: the chosen token is the likeliest
    chatted = llm.chat([{"role": "user", "content": "w1 w2"}], max_new_tokens=8, logprobs=0)
    assert [e.token for e in chatted.logprobs] == chatted.tokens and all(not e.top for e in chatted.logprobs)
    assert result.cumulative_logprob == pytest.approx(sum(e.logprob for e in expected.logprobs), abs=1e-3)
    assert llm.generate("w1 w2", max_new_tokens=8).logprobs is None
    assert llm.generate("w1 w2", max_new_tokens=8).cumulative_logprob is None
    prompt_ids = target.encode_prompt("w1 w2 w3", chat=False)  # vLLM's prompt_logprobs: the prompt scored
    scored = llm.generate("w1 w2 w3", SamplingParams(max_tokens=1, prompt_logprobs=2), chat=False)
    with torch.no_grad():
        expected = torch.log_softmax(target.model(torch.tensor([prompt_ids])).logits[0, :-1].float(), -1)
    assert [e.token for e in scored.prompt_logprobs] == prompt_ids[1:]
    for position, entry in enumerate(scored.prompt_logprobs):
        assert entry.logprob == pytest.approx(expected[position, entry.token].item(), abs=1e-4)
        assert [t for t, _ in entry.top] == expected[position].topk(2).indices.tolist()
    with pytest.raises(UserError, match="logprobs must be in"):
        llm.generate("w1", logprobs=21)


def test_sampling_with_a_seed_repeats_and_stop_strings_cut():
    llm = LLM("tiny-qwen2", "ngram", device="cpu")
    first, again = (llm.generate("w1 w2", max_new_tokens=16, temperature=1.0, seed=5) for _ in range(2))
    assert first.tokens == again.tokens
    greedy = llm.generate("w1 w2", max_new_tokens=16).tokens
    assert llm.generate("w1 w2", max_new_tokens=16, temperature=1.0, min_p=1.0).tokens == greedy  # the likeliest only
    whole = llm.generate("w1 w2", max_new_tokens=16).text
    word = whole.split()[2]
    cut = llm.generate("w1 w2", max_new_tokens=16, stop=(word,))
    assert cut.text == whole[:whole.index(word)] and cut.finish_reason == "stop"
    kept = llm.generate("w1 w2", max_new_tokens=16, stop=(word,), include_stop_str_in_output=True)
    assert kept.text == whole[:whole.index(word) + len(word)] and kept.tokens == cut.tokens
    assert cut.stop_reason == kept.stop_reason == word  # vLLM's stop_reason: what ended it
    plain = llm.generate("w1 w2", max_new_tokens=16)
    assert plain.stop_reason is None  # the length, or EOS
    stop_id = greedy[3]
    by_id = llm.generate("w1 w2", SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_id]))
    assert by_id.tokens == greedy[:greedy.index(stop_id) + 1] and by_id.stop_reason == stop_id
    allowed = sorted(set(greedy[::2]))  # vLLM's allowed_token_ids: the output holds only these
    held = llm.chat([{"role": "user", "content": "w1 w2"}], max_new_tokens=16, allowed_token_ids=allowed,
                    temperature=1.0, seed=3)
    assert set(held.tokens) <= set(allowed)
    barred = llm.generate("w1 w2", max_new_tokens=16, bad_words=[word])  # vLLM's bad_words
    before = whole.split().index(word)  # the words before its first are written as they were
    assert word not in barred.text.split() and barred.text.split()[:before] == whole.split()[:before]


def test_bad_requests_are_user_errors_before_anything_runs():
    capped = LLM("tiny-qwen2", "ngram", device="cpu", max_model_len=64)  # vLLM's max_model_len
    with pytest.raises(UserError, match="context of 64"):
        capped.generate("w1 " * 70)
    llm = LLM("tiny-qwen2", "ngram", device="cpu")
    assert llm.target.max_context > 64  # the shared target has its own context again
    with pytest.raises(UserError, match="max_new_tokens"):
        llm.generate("w1", max_new_tokens=0)
    with pytest.raises(UserError, match="non-empty"):
        llm.generate(["w1", "  "])
    with pytest.raises(UserError, match="does not fit"):
        llm.generate(["w1", "w1 " * 5000])
    assert not llm.engine.busy  # the short prompt was not left queued
    with pytest.raises(UserError):
        LLM("tiny-nothing")


def test_vllm_style_calls_with_sampling_params():
    """Code written against vLLM's LLM: `llm.generate(prompts, SamplingParams(...))`, each result's
    `outputs[0].text` and `.token_ids`; the same outputs as our keywords give."""
    llm = LLM("tiny-qwen2", "ngram", device="cpu")
    greedy = llm.generate(["w1 w2", "w3"], SamplingParams(temperature=0, max_tokens=12), chat=False)
    plain = llm.generate(["w1 w2", "w3"], max_new_tokens=12, chat=False)
    assert [r.outputs[0].token_ids for r in greedy] == [r.tokens for r in plain]
    special = llm.target.tokenizer.decode  # vLLM's default leaves special tokens out of the text
    assert [r.outputs[0].text for r in greedy] == [special(r.tokens, skip_special_tokens=True) for r in plain]
    kept = llm.generate(["w1 w2", "w3"], SamplingParams(temperature=0, max_tokens=12, skip_special_tokens=False),
                        chat=False)
    assert [r.text for r in kept] == [r.text for r in plain] != [r.text for r in greedy]
    default = llm.generate("w1 w2", SamplingParams(seed=3))  # vLLM's defaults: temperature 1, 16 tokens
    assert default.tokens == llm.generate("w1 w2", max_new_tokens=16, temperature=1.0, seed=3).tokens
    word = plain[0].text.split()[3]
    cut = llm.chat([{"role": "user", "content": "w1"}], SamplingParams(temperature=0, stop=word, max_tokens=None))
    assert word not in cut.text and cut.finish_reason in ("stop", "length")
    with pytest.raises(UserError, match="not both: temperature"):
        llm.generate("w1", SamplingParams(), temperature=0.5)
    with pytest.raises(UserError, match="n must be a whole number"):
        llm.generate("w1", SamplingParams(n=0))


def test_n_outputs_a_prompt_as_vllm_seeds_them(capsys):
    """SamplingParams(n=3): each result holds three outputs, output i sampled with seed + i, the same tokens each
    gives alone; greedy ones are all the plain decoding."""
    llm = LLM("tiny-qwen2", "dflash+ngram", device="cpu", max_batch=2)
    results = llm.generate(["w1 w2", "w5"], SamplingParams(n=3, seed=7, max_tokens=10), use_tqdm=True)
    assert "6/6" in capsys.readouterr().err  # the bar counted every output
    for prompt, result in zip(["w1 w2", "w5"], results):
        assert len(result.outputs) == 3 and result.outputs[0] is result
        assert [o.index for o in result.outputs] == [0, 1, 2] and {o.prompt for o in result.outputs} == {prompt}
        assert result.prompt_token_ids == llm.target.encode_prompt(prompt)  # in the chat template
        alone = [llm.generate(prompt, SamplingParams(seed=7 + i, max_tokens=10)).tokens for i in range(3)]
        assert [output.tokens for output in result.outputs] == alone
        assert len({tuple(tokens) for tokens in alone}) > 1  # the seeds apart sample apart
    greedy = llm.chat([{"role": "user", "content": "w3"}], sampling_params=SamplingParams(n=2, temperature=0))
    assert [o.tokens for o in greedy.outputs] == [llm.chat([{"role": "user", "content": "w3"}], 16).tokens] * 2
    assert all(o.content == o.text for o in greedy.outputs)
    assert greedy.prompt == llm.target.decode(llm.target.encode_messages([{"role": "user", "content": "w3"}]))
    assert repr(greedy).count("GenerationResult(") == 1  # the other outputs stay out of its repr


def test_vllm_prompts_and_one_sampling_params_a_prompt():
    """vLLM's call shapes: `sampling_params=`, a list of SamplingParams (one a prompt), {"prompt": text} and
    {"prompt_token_ids": ids} prompts (ids sent as they are)."""
    llm = LLM("tiny-qwen2", "ngram", device="cpu", max_batch=2)
    short, long = SamplingParams(temperature=0, max_tokens=4), SamplingParams(temperature=0, max_tokens=9)
    both = llm.generate(["w1 w2", {"prompt": "w4 w5"}], sampling_params=[short, long], chat=False)
    assert [r.tokens for r in both] == [ar_tokens(["w1 w2"], 4, False)[0], ar_tokens(["w4 w5"], 9, False)[0]]
    assert [len(r.tokens) for r in both] == [4, 9]
    ids = llm.target.encode_prompt("w6 w1", chat=False)
    by_ids = llm.generate({"prompt_token_ids": ids}, long, chat=True)  # ids are never wrapped in a template
    assert by_ids.tokens == ar_tokens(["w6 w1"], 9, chat=False)[0]
    assert by_ids.prompt_token_ids == ids and by_ids.prompt == llm.target.decode(ids)  # vLLM's RequestOutput's
    assert both[1].prompt == "w4 w5" and both[1].prompt_token_ids == llm.target.encode_prompt("w4 w5", chat=False)
    for call, message in [
            (lambda: llm.generate(["w1", "w2"], [short]), "1 SamplingParams for 2 prompts"),
            (lambda: llm.generate("w1", 8, sampling_params=short), "not both"),
            (lambda: llm.generate("w1", sampling_params=8), "must be a SamplingParams"),
            (lambda: llm.generate({"prompt_token_ids": [1, 10**6]}), r"the prompt must be token ids in \[0, 64\), "
                                                                      r"got \[1000000\]"),
            (lambda: llm.generate({"prompt_token_ids": ["w1"]}), "non-empty list of token ids"),
            (lambda: llm.generate({"text": "w1"}), "prompt_token_ids"),
            (lambda: llm.generate("w1", "12"), "max_tokens must be a whole number")]:
        with pytest.raises(UserError, match=message):
            call()
    with pytest.raises(UserError, match="the prompt must be token ids"):  # the second prompt is refused ...
        llm.generate(["w1", {"prompt_token_ids": [-1]}])
    assert not llm.engine.busy  # ... and the first is not left queued for the next call


def test_vllm_model_and_speculative_config():
    """LLM(model=..., speculative_config={...}) as vLLM's: the method, drafter and block size it says, and the
    target's own greedy tokens."""
    llm = LLM(model="tiny-qwen2", speculative_config={"method": "ngram", "num_speculative_tokens": 3}, device="cpu")
    assert llm.method == "ngram" and llm.proposer.max_draft == 3
    assert llm.generate("w1 w2", max_new_tokens=12).tokens == ar_tokens(["w1 w2"], 12)[0]
    drafted = LLM("tiny-qwen2", speculative_config={"method": "dflash+ngram", "num_speculative_tokens": 5,
                                                    "prompt_lookup_max": 3, "prompt_lookup_min": 2}, device="cpu")
    assert drafted.method == "dflash+ngram" and drafted.proposer.max_draft == 5
    assert (drafted.proposer.lookup.max_ngram, drafted.proposer.lookup.min_ngram) == (3, 2)  # vLLM's match lengths
    assert drafted.generate("w1 w2", max_new_tokens=12).tokens == ar_tokens(["w1 w2"], 12)[0]
    for kwargs, message in [({"model": "tiny-qwen2"}, "not both"),
                            ({"method": "ngram", "speculative_config": {"method": "ngram"}}, "not both"),
                            ({"speculative_config": {"method": "ar"}}, "method 'ar'"),
                            ({"speculative_config": ["dflash"]}, "a JSON object")]:
        with pytest.raises(UserError, match=message):
            LLM("tiny-qwen2", device="cpu", **kwargs)


def test_vllm_structured_outputs_params_constrain_as_the_keywords_do():
    """SamplingParams(structured_outputs=StructuredOutputsParams(...)) (vLLM's; or a dict): the same outputs as
    generate's own regex and choice keywords; beside a keyword constraint, refused."""
    import re

    from dflash import StructuredOutputsParams

    llm = LLM("tiny-qwen2-bytes", "ngram", device="cpu")  # constrained output needs a byte-level tokenizer
    assert llm.get_tokenizer() is llm.target.tokenizer
    choice = ["red", "green", "blue"]
    params = SamplingParams(temperature=1.0, seed=2, max_tokens=20,
                            structured_outputs=StructuredOutputsParams(choice=choice, disable_any_whitespace=True))
    chosen = llm.generate(["Hi?", "Colour?"], params)
    assert [r.tokens for r in chosen] == [r.tokens for r in llm.generate(
        ["Hi?", "Colour?"], 20, temperature=1.0, seed=2, choice=choice)]
    assert all(r.outputs[0].text in choice for r in chosen)
    as_dict = llm.generate("Hi?", SamplingParams(temperature=0, max_tokens=20, structured_outputs={"regex": "[ab]{3}"}))
    assert re.fullmatch("[ab]{3}", as_dict.text) and as_dict.tokens == llm.generate("Hi?", 20, regex="[ab]{3}").tokens
    with pytest.raises(UserError, match="structured_outputs"):
        llm.generate("Hi?", SamplingParams(structured_outputs={"regex": "a"}), choice=choice)
    with pytest.raises(UserError, match="one constraint"):
        llm.generate("Hi?", SamplingParams(structured_outputs=StructuredOutputsParams(regex="a", choice=choice)))


def test_get_metrics_counts_acceptance_by_vllms_names():
    """LLM.get_metrics() as vLLM's offline spec-decode example reads it: drafts are rounds that drafted, accepted
    tokens their accepted drafts, position k's counter the rounds whose draft k was accepted."""
    from dflash.spec_metrics import Counter, SpecDecodeCounts, Vector, drafted_rounds
    from dflash.engine import GenerationStats

    counts = SpecDecodeCounts(3)
    counts.add(GenerationStats(prompt_tokens=4, new_tokens=11, accept_lengths=[3, 1, 2, 4, 1],
                               draft_lengths=[3, 0, 2, 3, 2]))
    assert (counts.num_drafts, counts.num_draft_tokens, counts.num_accepted_tokens) == (4, 10, 6)
    assert counts.accepted_per_pos == [3, 2, 1] and counts.mean_acceptance_length == 2.5
    llm = LLM("tiny-qwen2", "ngram", device="cpu", max_batch=2)
    results = llm.generate(["w1 w2 w1 w2 w1", "w4 w5 w4 w5"], max_new_tokens=16)
    by_name = {m.name: m for m in llm.get_metrics()}
    assert all(m.labels == {"model_name": "tiny-qwen2"} for m in by_name.values())
    rounds = [r for result in results for r in drafted_rounds(result.stats)]
    assert isinstance(by_name["vllm:spec_decode_num_drafts"], Counter)
    assert by_name["vllm:spec_decode_num_drafts"].value == len(rounds) > 0
    assert by_name["vllm:spec_decode_num_accepted_tokens"].value == sum(a for _, a in rounds) > 0
    assert by_name["vllm:spec_decode_num_draft_tokens"].value == sum(d for d, _ in rounds)
    per_position = by_name["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert isinstance(per_position, Vector) and len(per_position.values) == llm.proposer.max_draft
    assert per_position.values[0] == sum(a >= 1 for _, a in rounds)
    assert by_name["vllm:generation_tokens"].value == sum(len(r.tokens) for r in results)
    assert by_name["vllm:prompt_tokens"].value == sum(len(r.prompt_token_ids) for r in results)
    llm.generate("w1", max_new_tokens=4)  # counted on: totals over every call
    assert {m.name: m for m in llm.get_metrics()}["vllm:generation_tokens"].value > \
        by_name["vllm:generation_tokens"].value


def test_method_options_as_the_command_lines():
    """draft_dtype, continuations and tree, as --draft-dtype, --continuations and --tree: a tree of drafts and a
    bfloat16 drafter still give the target's greedy tokens; continuations="none" leaves prompt lookup no table."""
    expected = ar_tokens(["w1 w2", "w6 w1 w6"], 12)
    tree = LLM("tiny-qwen2", "dflash", device="cpu", tree=6, draft_dtype="bfloat16")
    assert tree.proposer.tree_nodes == 6 and tree.proposer.report["draft_dtype"] == "bfloat16"
    assert [r.tokens for r in tree.generate(["w1 w2", "w6 w1 w6"], max_new_tokens=12)] == expected
    lookup = LLM("tiny-qwen2", "ngram", device="cpu", continuations="none")
    assert lookup.proposer.table is None and lookup.proposer.report["continuation_table"] == "none"
    with pytest.raises(UserError, match="a tree has 1 to 63"):
        LLM("tiny-qwen2", "dflash", device="cpu", tree=0)


def test_a_model_already_loaded_runs_through_wrap_target():
    """A transformers user's model and tokenizer in memory: wrap_target makes them a target (our forward, its weights
    shared), LLM runs it, and the outputs are the plain greedy decodings."""
    from dflash import wrap_target
    from dflash.testing import tiny_target

    loaded = tiny_target("qwen2", logit_scale=4.0)  # LLM("tiny-qwen2")'s model, as a user would hold it
    target = wrap_target(loaded.model, loaded.tokenizer, name="mine")
    llm = LLM(target, "dflash+ngram", device="cpu", max_batch=2)
    assert llm.target is target and target.engine is not None
    prompts = ["w1 w2", "w6 w1 w6"]
    assert [r.tokens for r in llm.generate(prompts, max_new_tokens=12)] == ar_tokens(prompts, 12)
    assert {m.labels["model_name"] for m in llm.get_metrics()} == {"mine"}
    with pytest.raises(UserError, match="takes a transformers causal LM"):
        wrap_target("smollm2-135m", loaded.tokenizer)


def test_a_streamer_gets_the_text_as_it_is_committed():
    """`streamer`: a callable gets pieces that join into the result's text, a stop string never among them; a
    transformers TextStreamer (put, end) prints what transformers' generate would have it print."""
    from transformers import TextStreamer

    llm = LLM("tiny-qwen2", "ngram", device="cpu")
    pieces = []
    whole = llm.generate("w1 w2", max_new_tokens=16, streamer=pieces.append)
    assert "".join(pieces) == whole.text and len(pieces) > 1
    word = whole.text.split()[3]
    cut_pieces = []
    cut = llm.chat([{"role": "user", "content": "w1 w2"}], 16, stop=(word,), streamer=cut_pieces.append)
    assert "".join(cut_pieces) == cut.text and word not in "".join(cut_pieces)

    class Printed(TextStreamer):
        def on_finalized_text(self, text: str, stream_end: bool = False):
            self.printed = getattr(self, "printed", "") + text

    printed = Printed(llm.get_tokenizer(), skip_prompt=True)
    result = llm.generate("w1 w2", max_new_tokens=16, streamer=printed)
    assert printed.printed.strip() == llm.get_tokenizer().decode(result.tokens).strip()
    for call in (lambda: llm.generate(["w1", "w2"], 4, streamer=print),
                 lambda: llm.generate("w1", SamplingParams(n=2), streamer=print),
                 lambda: llm.generate("w1", 4, streamer="stdout")):
        with pytest.raises(UserError, match="streamer"):
            call()
    assert not llm.engine.busy
