"""Log-probabilities of emitted tokens: the target's own at every position, whatever proposed the drafts, in a
batch or alone, with logits deferred or not; asking for them changes no token."""

import pytest
import torch

from conftest import ARCHS, OracleProposer, OracleTree, RandomProposer
from dflash.engine import Engine, GenerationConfig, SpeculativeDecoder
from dflash.errors import UserError
from dflash.logprobs import byte_level_alphabet, token_bytes
from dflash.methods.base import Proposer
from dflash.methods.dflash.proposer import DFlashProposer
from dflash.methods.ngram import NgramProposer
from dflash.sampling import SamplingConfig
from test_engine import PROMPTS, make_drafter

MAX_NEW = 24
TOP = 5


def teacher_forced(target, prompt_ids, tokens) -> torch.Tensor:
    """log-softmax of transformers' logits at the positions that chose `tokens` [len(tokens), vocab]."""
    with torch.no_grad():
        logits = target.model(torch.tensor([prompt_ids + tokens])).logits[0].float()
    return torch.log_softmax(logits[len(prompt_ids) - 1: -1], dim=-1)


def assert_the_targets_own(target, prompt_ids, result, top=TOP):
    assert result.logprobs is not None and [lp.token for lp in result.logprobs] == result.tokens
    expected = teacher_forced(target, prompt_ids, result.tokens)
    chosen = torch.tensor([lp.logprob for lp in result.logprobs])
    torch.testing.assert_close(chosen, expected.gather(-1, torch.tensor(result.tokens)[:, None])[:, 0],
                               atol=2e-4, rtol=1e-4)
    values, ids = expected.topk(top, dim=-1)
    for position, lp in enumerate(result.logprobs):
        assert [t for t, _ in lp.top] == ids[position].tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in lp.top]), values[position], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=1.0, top_p=0.9, seed=3)])
def test_logprobs_are_the_targets_own_for_every_proposer(tiny_targets, arch, sampling):
    target = tiny_targets[arch]
    prompt_ids = target.encode_prompt(PROMPTS[2])
    plain = GenerationConfig(max_new_tokens=MAX_NEW, ignore_eos=True, sampling=sampling)
    asked = GenerationConfig(max_new_tokens=MAX_NEW, ignore_eos=True, sampling=sampling, logprobs=TOP)
    reference = SpeculativeDecoder(target).generate(prompt_ids, plain)
    assert reference.logprobs is None
    proposers = {
        "ar": Proposer(), "ngram": NgramProposer(max_draft=7), "random": RandomProposer(target.vocab_size, 15),
        "oracle": OracleProposer(reference.tokens, len(prompt_ids), 15),
        "dflash": DFlashProposer(make_drafter(target, 16), target),
        "oracle tree": OracleTree(reference.tokens, len(prompt_ids), 15, target.vocab_size),
    }
    for name, proposer in proposers.items():
        result = SpeculativeDecoder(target, proposer, adaptive=False).generate(prompt_ids, asked)
        assert result.tokens == reference.tokens, f"{name}: asking for logprobs changed the output"
        assert_the_targets_own(target, prompt_ids, result)


def test_logprobs_with_logits_at_every_position_and_without_alternatives(tiny_targets, monkeypatch):
    """A verify pass that computes every position's logits (no deferred head: transformers, CUDA graphs) gives
    the same figures; top 0 is the chosen tokens' alone."""
    target = tiny_targets["qwen3"]
    prompt_ids = target.encode_prompt(PROMPTS[0])
    config = GenerationConfig(max_new_tokens=MAX_NEW, ignore_eos=True, logprobs=TOP)
    proposer = RandomProposer(target.vocab_size, 15)
    deferred = SpeculativeDecoder(target, proposer, adaptive=False).generate(prompt_ids, config)
    monkeypatch.setattr(target, "defer_logits", False)
    whole = SpeculativeDecoder(target, proposer, adaptive=False).generate(prompt_ids, config)
    assert whole.tokens == deferred.tokens
    assert_the_targets_own(target, prompt_ids, whole)
    config.logprobs = 0
    bare = SpeculativeDecoder(target, proposer, adaptive=False).generate(prompt_ids, config)
    assert all(lp.top == [] for lp in bare.logprobs)
    assert [lp.logprob for lp in bare.logprobs] == pytest.approx([lp.logprob for lp in whole.logprobs], abs=2e-4)


def test_logprobs_in_a_batch_belong_to_their_rows(tiny_targets):
    """Rows that ask and rows that do not share one pass; each gets its own solo figures, cut where it stops."""
    target = tiny_targets["gemma3"]
    prompts = [target.encode_prompt(p) for p in PROMPTS]
    configs = [GenerationConfig(max_new_tokens=MAX_NEW, ignore_eos=True, logprobs=3),
               GenerationConfig(max_new_tokens=MAX_NEW, ignore_eos=True),
               GenerationConfig(max_new_tokens=9, ignore_eos=True, logprobs=0,
                                sampling=SamplingConfig(temperature=0.8, seed=11))]
    engine = Engine(target, RandomProposer(target.vocab_size, 15), max_batch=3, adaptive=False)  # a deferred head
    seqs = [engine.submit(ids, cfg) for ids, cfg in zip(prompts, configs)]
    engine.run()
    for ids, cfg, seq in zip(prompts, configs, seqs):
        solo = SpeculativeDecoder(target).generate(ids, cfg)
        assert seq.result.tokens == solo.tokens
        if cfg.logprobs is None:
            assert seq.result.logprobs is None
            continue
        assert len(seq.result.logprobs) == len(seq.result.tokens)
        assert_the_targets_own(target, ids, seq.result, top=cfg.logprobs)


def test_logprobs_stop_with_the_output(tiny_targets):
    target = tiny_targets["llama"]
    prompt_ids = target.encode_prompt(PROMPTS[2])
    reference = SpeculativeDecoder(target).generate(prompt_ids, GenerationConfig(MAX_NEW, ignore_eos=True))
    stop_id = reference.tokens[6]
    config = GenerationConfig(MAX_NEW, ignore_eos=True, stop_token_ids=(stop_id,), logprobs=1)
    result = SpeculativeDecoder(target, RandomProposer(target.vocab_size, 7)).generate(prompt_ids, config)
    assert result.finish_reason == "stop" and result.tokens[-1] == stop_id
    assert [lp.token for lp in result.logprobs] == result.tokens


@pytest.mark.parametrize("deferred", [True, False])
def test_prompt_logprobs_score_the_prompt_in_chunks(tiny_targets, monkeypatch, deferred):
    """The prompt's own tokens after the first, as a scoring client (lm-eval's loglikelihood) reads them."""
    from dflash import engine

    target = tiny_targets["qwen3"]
    monkeypatch.setattr(engine, "PROMPT_LOGITS_CHUNK", 3)
    monkeypatch.setattr(target, "defer_logits", deferred)
    prompt_ids = target.encode_prompt(PROMPTS[2])
    plain = SpeculativeDecoder(target).generate(prompt_ids, GenerationConfig(MAX_NEW, ignore_eos=True))
    result = SpeculativeDecoder(target, NgramProposer(max_draft=7)).generate(
        prompt_ids, GenerationConfig(MAX_NEW, ignore_eos=True, prompt_logprobs=2))
    assert result.tokens == plain.tokens and result.logprobs is None
    assert [lp.token for lp in result.prompt_logprobs] == prompt_ids[1:]
    with torch.no_grad():
        logits = target.model(torch.tensor([prompt_ids])).logits[0, :-1].float()
    expected = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(torch.tensor([lp.logprob for lp in result.prompt_logprobs]),
                               expected.gather(-1, torch.tensor(prompt_ids[1:])[:, None])[:, 0], atol=2e-4, rtol=1e-4)
    assert [[t for t, _ in lp.top] for lp in result.prompt_logprobs] == expected.topk(2, dim=-1).indices.tolist()


@pytest.mark.parametrize("bad", [-1, 21])
def test_too_many_top_logprobs_is_a_clear_error(tiny_targets, bad):
    with pytest.raises(UserError, match="top logprobs"):
        SpeculativeDecoder(tiny_targets["llama"]).generate([3, 5], GenerationConfig(logprobs=bad))


class FakeTokenizer:
    """Token pieces as a tokenizer spells them; `byte_level`: its decoder is GPT-2's byte-level one."""

    def __init__(self, pieces: dict[int, str], byte_level: bool):
        self.pieces = pieces
        decoder = type("ByteLevel" if byte_level else "Metaspace", (), {})()
        self.backend_tokenizer = type("Backend", (), {"decoder": decoder})()

    def convert_ids_to_tokens(self, token_id):
        return self.pieces.get(token_id)  # None past the vocabulary, as transformers' tokenizers answer

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.pieces[i] for i in ids).replace("\u2581", " ")


def test_token_bytes_spell_byte_level_and_byte_fallback_tokens():
    """A token may hold part of a UTF-8 character: its bytes come from the tokenizer's spelling of bytes."""
    assert sorted(byte_level_alphabet().values()) == list(range(256))
    byte_level = FakeTokenizer({0: "\u0120w\u00c3\u00a9", 1: "\u0120\u00f0\u0141\u013a", 2: "<0xE2>"}, True)
    assert token_bytes(byte_level, 0) == " w\u00e9".encode()
    assert token_bytes(byte_level, 1) == " \U0001f600".encode()[:4]  # the first three bytes of the emoji
    assert token_bytes(byte_level, 2) == b"<0xE2>"  # in a byte-level vocabulary that is text
    fallback = FakeTokenizer({0: "<0xE2>", 1: "\u2581word"}, False)
    assert token_bytes(fallback, 0) == bytes([0xE2])
    assert token_bytes(fallback, 1) == b" word"
    for tokenizer in (byte_level, fallback):  # a model's padded rows past the tokenizer's vocabulary spell nothing
        assert token_bytes(tokenizer, 99) == b""
