"""Presence, frequency and repetition penalties: every method gives the tokens of a plain loop that penalises the
target's logits one step at a time, greedy and seeded, since a verify block counts its own drafts."""

import pytest
import torch

from conftest import ARCHS, OracleProposer, RandomProposer
from dflash.engine import Engine, GenerationConfig, SpeculativeDecoder
from dflash.errors import UserError
from dflash.methods.base import Proposer
from dflash.methods.dflash.proposer import DFlashProposer
from dflash.methods.ngram import NgramProposer
from dflash.sampling import SamplingConfig, penalized_logits
from test_engine import PROMPTS, make_drafter

MAX_NEW = 32
PENALTIES = [dict(presence_penalty=1.5), dict(frequency_penalty=0.7), dict(repetition_penalty=1.8),
             dict(presence_penalty=-0.5, frequency_penalty=0.4, repetition_penalty=1.3),
             dict(logit_bias={4: -100.0, 9: 2.5, 20: 1.5})]


def naive_penalised_greedy(target, prompt_ids, cfg: SamplingConfig, max_new=MAX_NEW) -> list[int]:
    """One transformers forward per token over the whole sequence, penalties applied token by token."""
    sequence = list(prompt_ids)
    for _ in range(max_new):
        with torch.no_grad():
            logits = target.model(torch.tensor([sequence])).logits[0, -1].float()
        generated = sequence[len(prompt_ids):]
        for token in set(sequence):
            if cfg.repetition_penalty != 1:
                value = logits[token]
                logits[token] = value / cfg.repetition_penalty if value > 0 else value * cfg.repetition_penalty
        for token in set(generated):
            logits[token] -= cfg.presence_penalty + cfg.frequency_penalty * generated.count(token)
        for token, bias in cfg.logit_bias.items():
            logits[token] += bias
        sequence.append(int(logits.argmax()))
    return sequence[len(prompt_ids):]


def proposers(target, reference, prompt_len):
    return {
        "ar": Proposer(), "ngram": NgramProposer(max_draft=7), "random": RandomProposer(target.vocab_size, 15),
        "oracle": OracleProposer(reference, prompt_len, 15), "dflash": DFlashProposer(make_drafter(target, 8), target),
    }


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("penalties", PENALTIES)
def test_penalised_greedy_equals_a_plain_penalised_loop_for_every_proposer(tiny_targets, arch, penalties):
    target = tiny_targets[arch]
    prompt_ids = target.encode_prompt(PROMPTS[2])  # where every arch's output changes with every penalty
    cfg = SamplingConfig(**penalties)
    expected = naive_penalised_greedy(target, prompt_ids, cfg)
    unpenalised = SpeculativeDecoder(target).generate(prompt_ids, GenerationConfig(MAX_NEW, ignore_eos=True))
    assert expected != unpenalised.tokens, "these penalties should change the output"
    config = GenerationConfig(MAX_NEW, sampling=cfg, ignore_eos=True)
    for name, proposer in proposers(target, expected, len(prompt_ids)).items():
        result = SpeculativeDecoder(target, proposer, adaptive=False).generate(prompt_ids, config)
        assert result.tokens == expected, f"{name} with {penalties}"


def test_repetition_penalty_equals_transformers_generate(tiny_targets):
    target = tiny_targets["qwen3"]
    prompt_ids = target.encode_prompt(PROMPTS[2])
    with torch.no_grad():
        hf = target.model.generate(torch.tensor([prompt_ids]), max_new_tokens=MAX_NEW, do_sample=False,
                                   repetition_penalty=1.8, eos_token_id=None, pad_token_id=0)
    config = GenerationConfig(MAX_NEW, sampling=SamplingConfig(repetition_penalty=1.8), ignore_eos=True)
    result = SpeculativeDecoder(target, RandomProposer(target.vocab_size, 15), adaptive=False).generate(prompt_ids,
                                                                                                        config)
    assert result.tokens == hf[0, len(prompt_ids):].tolist()


def test_seeded_penalised_sampling_is_the_same_for_every_method_and_in_a_batch(tiny_targets):
    target = tiny_targets["llama"]
    prompt_ids = target.encode_prompt(PROMPTS[0])
    cfg = SamplingConfig(temperature=1.0, top_k=20, seed=9, presence_penalty=0.8, frequency_penalty=0.3,
                         repetition_penalty=1.2)
    config = GenerationConfig(MAX_NEW, sampling=cfg, ignore_eos=True)
    reference = SpeculativeDecoder(target).generate(prompt_ids, config).tokens
    plain = GenerationConfig(MAX_NEW, sampling=SamplingConfig(temperature=1.0, top_k=20, seed=9), ignore_eos=True)
    assert reference != SpeculativeDecoder(target).generate(prompt_ids, plain).tokens
    for name, proposer in proposers(target, reference, len(prompt_ids)).items():
        result = SpeculativeDecoder(target, proposer, adaptive=False).generate(prompt_ids, config)
        assert result.tokens == reference, name
    engine = Engine(target, RandomProposer(target.vocab_size, 15), max_batch=2, adaptive=False)
    rows = [engine.submit(prompt_ids, config), engine.submit(target.encode_prompt(PROMPTS[2]), plain)]
    engine.run()
    assert rows[0].result.tokens == reference
    assert rows[1].result.tokens == SpeculativeDecoder(target).generate(target.encode_prompt(PROMPTS[2]), plain).tokens


def test_a_block_counts_its_own_drafts():
    """Position j of a block is penalised for the drafts before it, not after."""
    logits = torch.zeros(3, 5)
    cfg = SamplingConfig(presence_penalty=1.0, frequency_penalty=0.5)
    out = penalized_logits(logits, cfg, history=[4, 2, 2], prompt_len=1, block=[3, 3])
    assert out[0].tolist() == [0, 0, -2.0, 0, 0]  # 2 generated twice; the prompt's 4 does not count
    assert out[1].tolist() == [0, 0, -2.0, -1.5, 0]
    assert out[2].tolist() == [0, 0, -2.0, -2.0, 0]
    rep = penalized_logits(torch.tensor([[2.0, -2.0, 2.0, 2.0, -2.0]]), SamplingConfig(repetition_penalty=2.0),
                           history=[4, 0], prompt_len=1, block=[])
    assert rep.tolist() == [[1.0, -2.0, 2.0, 2.0, -4.0]]  # prompt and output tokens alike


@pytest.mark.parametrize("bad, message", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(logit_bias={3: 101}), "logit_bias"),
])
def test_bad_penalties_are_clear_errors(tiny_targets, bad, message):
    with pytest.raises(UserError, match=message):
        SpeculativeDecoder(tiny_targets["llama"]).generate([3, 5], GenerationConfig(sampling=SamplingConfig(**bad)))


def test_bad_words_bar_the_token_that_would_complete_them():
    """vLLM's bad_words: a word's last token is barred at a position whose generated tokens before it (a block's
    drafts included, the prompt's not) are the rest of the word; a one-token word everywhere."""
    cfg = SamplingConfig(bad_word_ids=((5, 6), (7,), (1, 2, 3)))
    out = penalized_logits(torch.zeros(4, 10), cfg, history=[5, 9, 1, 2], prompt_len=1, block=[5, 1, 2])
    barred = [torch.isinf(row).nonzero().flatten().tolist() for row in out]
    assert barred == [[3, 7], [6, 7], [7], [3, 7]]
    out = penalized_logits(torch.zeros(1, 10), cfg, history=[1, 2], prompt_len=2, block=[])
    assert torch.isinf(out[0]).nonzero().flatten().tolist() == [7]  # the prompt's "1 2" is not the output's


def test_allowed_tokens_mask_follows_the_config_it_belongs_to():
    """The allowed tokens' mask is made once per config, and a config copied with other allowed tokens makes its
    own (the engine copies a request's config to fill in its held-back stop tokens)."""
    from dataclasses import replace

    first = SamplingConfig(allowed_token_ids=(1, 2))
    assert (~first.barred_by_allowed(10, "cpu")).nonzero().flatten().tolist() == [1, 2]
    other = replace(first, allowed_token_ids=(3,))
    assert (~other.barred_by_allowed(10, "cpu")).nonzero().flatten().tolist() == [3]
    out = penalized_logits(torch.zeros(1, 10), other, history=[0], prompt_len=1, block=[])
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [3]


@pytest.mark.parametrize("arch", ARCHS)
def test_bad_words_give_every_proposer_a_plain_loops_output(tiny_targets, arch):
    """Greedy with bad words: the tokens of a plain loop that bars them token by token, through every proposer;
    the output never spells one."""
    target = tiny_targets[arch]
    prompt_ids = target.encode_prompt(PROMPTS[2])
    free = SpeculativeDecoder(target).generate(prompt_ids, GenerationConfig(MAX_NEW, ignore_eos=True)).tokens
    words = ((free[4], free[5]), (free[9],))  # a pair the free output writes, and one of its tokens
    sequence = list(prompt_ids)
    for _ in range(MAX_NEW):
        with torch.no_grad():
            logits = target.model(torch.tensor([sequence])).logits[0, -1].float()
        generated = sequence[len(prompt_ids):]
        for word in words:
            if len(generated) >= len(word) - 1 and tuple(generated[len(generated) - len(word) + 1:]) == word[:-1]:
                logits[word[-1]] = float("-inf")
        sequence.append(int(logits.argmax()))
    expected = sequence[len(prompt_ids):]
    assert expected != free and words[1][0] not in expected
    assert all((a, b) != words[0] for a, b in zip(expected, expected[1:]))
    config = GenerationConfig(MAX_NEW, sampling=SamplingConfig(bad_word_ids=words), ignore_eos=True)
    for name, proposer in proposers(target, expected, len(prompt_ids)).items():
        result = SpeculativeDecoder(target, proposer, adaptive=False).generate(prompt_ids, config)
        assert result.tokens == expected, name
