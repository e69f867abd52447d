"""The prefix cache: a prompt that starts like an earlier one reads only the rest, and every method's output stays
what it is without the cache; entries stay within their budget."""

import pytest
import torch

from conftest import ARCHS
from dflash.engine import Engine, GenerationConfig
from dflash.methods.base import Proposer
from dflash.methods.dflash.proposer import DFlashProposer
from dflash.methods.ngram import NgramProposer
from dflash.prefixes import PrefixCache
from test_engine import make_drafter

MAX_NEW = 24
SYSTEM = " ".join(f"w{i}" for i in range(10, 40))  # 30 words: past tiny gemma3's sliding window of 16


def prompts(target):
    """Prompts that share prefixes the way chat requests do: the same header, a conversation that grew, a repeat."""
    first = target.encode_prompt(f"{SYSTEM} w5 w6 w7")
    return [first, first + target.encode_prompt("w8 w9 w5 w6 w8", chat=False), first,
            target.encode_prompt(f"{SYSTEM} w50 w51"), target.encode_prompt("w3 w2 w1")]


def run(target, proposer, prompt_list, prefix_cache_bytes, max_batch=2, **config):
    engine = Engine(target, proposer, max_batch=max_batch, adaptive=False, prefix_cache_bytes=prefix_cache_bytes)
    results = []
    for ids in prompt_list:  # one after another, as requests arrive
        seq = engine.submit(ids, GenerationConfig(MAX_NEW, ignore_eos=True, **config))
        engine.run()
        results.append(seq.result)
    return engine, results


@pytest.mark.parametrize("arch", ARCHS)
def test_cached_prefixes_change_no_token_and_skip_reading_the_prefix(tiny_targets, arch, monkeypatch):
    target = tiny_targets[arch]
    read = []  # tokens each prefill ran through the target
    forward = target.forward

    def counted(ids, cache=None, layers=(), logits_at="all"):
        if logits_at != "hidden" or ids.shape[0] == 1:
            read.append(ids.shape[1])
        return forward(ids, cache, layers, logits_at=logits_at)

    started = []  # the target features each prompt's drafting starts from
    start = DFlashProposer.start
    monkeypatch.setattr(DFlashProposer, "start", lambda self, ids, f: started.append(f) or start(self, ids, f))
    proposers = {"ar": Proposer, "ngram": lambda: NgramProposer(max_draft=7),
                 "dflash": lambda: DFlashProposer(make_drafter(target, 8), target)}
    for name, make in proposers.items():
        _, plain = run(target, make(), prompts(target), 0)
        monkeypatch.setattr(target, "forward", counted)
        engine, cached = run(target, make(), prompts(target), 1 << 30)
        monkeypatch.setattr(target, "forward", forward)
        assert [r.tokens for r in cached] == [r.tokens for r in plain], name
        known = [r.stats.cached_prompt_tokens for r in cached]
        lengths = [len(ids) for ids in prompts(target)]
        assert known[0] == 0 and known[1] == lengths[0] and known[2] == lengths[0] - 1, known
        assert known[3] >= 30 and known[4] == 0
        assert engine.prefixes.hits == 3
        assert lengths[1] - lengths[0] in read  # the grown conversation read only its new turn
    plain_features, cached_features = started[:5], started[5:]
    for a, b in zip(plain_features, cached_features):  # the stored prefix's features, then the new ones
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)


def test_the_next_turn_reads_only_its_new_tokens(tiny_targets, monkeypatch):
    """A finished generation keeps its prompt and output (all but the pending last token, which never entered the
    cache), with the target features of both, so the next turn of the conversation skips them."""
    started = []
    start = DFlashProposer.start
    monkeypatch.setattr(DFlashProposer, "start", lambda self, ids, f: started.append(f) or start(self, ids, f))
    target = tiny_targets["gemma3"]
    first = prompts(target)[0]
    proposer = DFlashProposer(make_drafter(target, 8), target)
    engine, (answer,) = run(target, proposer, [first], 1 << 30)
    follow_up = first + answer.tokens + target.encode_prompt("w8 w9", chat=False)
    seq = engine.submit(follow_up, GenerationConfig(MAX_NEW, ignore_eos=True))
    engine.run()
    assert seq.stats.cached_prompt_tokens == len(first) + len(answer.tokens) - 1
    _, (plain,) = run(target, DFlashProposer(make_drafter(target, 8), target), [follow_up], 0)
    assert seq.result.tokens == plain.tokens and seq.stats.accept_lengths == plain.stats.accept_lengths
    torch.testing.assert_close(started[1], started[2], atol=1e-5, rtol=1e-4)  # cached follow-up vs plain


def test_one_sequence_at_a_time_keeps_its_prefixes_too(tiny_targets):
    from dflash.engine import SpeculativeDecoder

    target = tiny_targets["llama"]
    decoder = SpeculativeDecoder(target, NgramProposer(max_draft=7), prefix_cache_bytes=1 << 30)
    first, again = (decoder.generate(ids, GenerationConfig(MAX_NEW, ignore_eos=True)) for ids in prompts(target)[:2])
    assert first.stats.cached_prompt_tokens == 0 and again.stats.cached_prompt_tokens == len(prompts(target)[0])


def test_prompt_logprobs_read_the_whole_prompt(tiny_targets):
    target = tiny_targets["qwen3"]
    ids = prompts(target)[0]
    _, results = run(target, Proposer(), [ids, ids], 1 << 30, prompt_logprobs=1)
    assert [r.stats.cached_prompt_tokens for r in results] == [0, 0]
    assert len(results[1].prompt_logprobs) == len(ids) - 1


def test_entries_stay_within_the_budget_least_recently_used_first():
    def kv(n):  # keys or values of n positions: 16 bytes each
        return torch.ones(1, 1, n, 4)

    entry = 2 * 5 * 16  # five positions of keys and values
    small = PrefixCache(budget_bytes=entry - 1)
    small.store([1, 9, 9, 9, 9], kv(5), kv(5), None)
    assert not small.entries  # one entry over the whole budget is not kept
    cache = PrefixCache(budget_bytes=3 * entry)
    for first in (1, 2, 3, 4):
        cache.store([first, 9, 9, 9, 9], kv(5), kv(5), None)
    assert [e.tokens[0] for e in cache.entries.values()] == [2, 3, 4] and cache.nbytes <= cache.budget_bytes
    assert cache.longest([2, 9, 9, 9, 9, 7])[1] == 5  # 2 is now the most recently used
    cache.store([5, 9, 9, 9, 9], kv(5), kv(5), None)
    assert [e.tokens[0] for e in cache.entries.values()] == [4, 2, 5]
    cache.store([2, 9, 9, 9], kv(4), kv(4), None)  # held already, within a longer entry
    assert [e.tokens[0] for e in cache.entries.values()] == [4, 5, 2]
    cache.store([5, 9, 9, 9, 9, 8], kv(6), kv(6), None)  # an extension replaces its prefix; 4 makes room
    assert [e.tokens for e in cache.entries.values()] == [[2, 9, 9, 9, 9], [5, 9, 9, 9, 9, 8]]
    assert cache.longest([4, 9, 9, 9, 9]) is None and cache.longest([2, 9, 9]) is None  # gone; under MIN_PREFIX


def test_a_prefix_read_into_a_row_another_prompt_used_changes_no_token(tiny_targets):
    """Requests one after another in a batch of one reuse its row: the stored prefix's keys and values are copied
    over another prompt's, and the rest of the prompt and the generation read only those, so the tokens are those
    of a run without prefix caching, and so are their log-probabilities."""
    target = tiny_targets["llama"]
    first = prompts(target)[0]
    other = target.encode_prompt(" ".join(f"w{41 + i % 19}" for i in range(40)))
    order = [first, other, first]
    _, plain = run(target, Proposer(), order, 0, max_batch=1, logprobs=0)
    _, cached = run(target, Proposer(), order, 1 << 30, max_batch=1, logprobs=0)
    assert [r.tokens for r in cached] == [r.tokens for r in plain]
    assert cached[2].stats.cached_prompt_tokens > 30
    for a, b in zip(cached[2].logprobs, plain[2].logprobs):  # not only the argmax: the distributions
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
