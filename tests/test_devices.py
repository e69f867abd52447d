"""The losslessness checks on every device this machine has: greedy output token-identical to transformers'
`generate` for every drafting method, rows of a batch equal to their solo outputs, seeded sampling the same for
every method, with the target, drafter and head moved onto the device (eager passes: tests/test_graphs.py and
tests/test_trees.py cover the graphed ones). On a CPU they run for one architecture, keeping the device handling
tested; on a CUDA machine (a lent GPU: scripts/lease/bench.sh runs this file) for every architecture."""

import pytest
import torch

from conftest import ARCHS, OracleProposer, RandomProposer
from dflash.engine import Engine, GenerationConfig, SpeculativeDecoder
from dflash.methods.dflash.proposer import DFlashProposer
from dflash.methods.eagle3.proposer import Eagle3Proposer
from dflash.methods.ngram import NgramProposer
from dflash.sampling import SamplingConfig
from dflash.testing import tiny_target
from test_batching import LENGTHS
from test_batching import PROMPTS as BATCH_PROMPTS
from test_eagle3 import fresh_head
from test_engine import PROMPTS, make_drafter, with_lookup

CASES = [("cpu", "llama")] + ([("cuda", arch) for arch in ARCHS] if torch.cuda.is_available() else [])
MAX_NEW = 40


@pytest.fixture(params=CASES, ids=[f"{device}-{arch}" for device, arch in CASES])
def target(request):
    """A tiny target of the case's architecture on the case's device."""
    device, arch = request.param
    made = tiny_target(arch, logit_scale=4.0)
    made.model.to(device)
    return made


def proposers(target, reference=None, prompt_len=0):
    """Every kind of drafting, its modules on the target's device: (name, proposer, adaptive)."""
    device = target.model.device
    drafter = make_drafter(target, 8).to(device)
    head = fresh_head(target, scale=0.3).to(device)  # sharp: its drafts are often right, often wrong
    made = [("dflash", DFlashProposer(drafter, target), True),
            ("dflash:whole", DFlashProposer(drafter, target), False),
            ("dflash+ngram", with_lookup(DFlashProposer(drafter, target), NgramProposer(max_draft=7)), True),
            ("eagle3", Eagle3Proposer(head, target, depth=5), True),
            ("ngram", NgramProposer(max_draft=5), True),
            ("random", RandomProposer(target.vocab_size, 6), False)]
    if reference is not None:
        made.append(("oracle", OracleProposer(reference, prompt_len, 7), False))
    return made


def test_the_target_is_on_the_case_device(target):
    device = target.model.device
    assert target.device.type == device.type
    ids = target.encode_prompt(PROMPTS[0])
    drafter = make_drafter(target, 8).to(device)
    assert next(drafter.parameters()).device.type == device.type
    assert SpeculativeDecoder(target, DFlashProposer(drafter, target)).generate(
        ids, GenerationConfig(max_new_tokens=4, ignore_eos=True)).tokens


def test_greedy_output_equals_transformers_generate_for_every_method(target):
    config = GenerationConfig(max_new_tokens=MAX_NEW, ignore_eos=True)
    for prompt in PROMPTS:
        ids = target.encode_prompt(prompt)
        reference = SpeculativeDecoder(target).generate(ids, config)
        with torch.no_grad():
            hf = target.model.generate(torch.tensor([ids], device=target.model.device), max_new_tokens=MAX_NEW,
                                       do_sample=False, eos_token_id=None, pad_token_id=0)
        assert reference.tokens == hf[0, len(ids):].tolist(), "ar differs from transformers generate"
        for name, proposer, adaptive in proposers(target, reference.tokens, len(ids)):
            result = SpeculativeDecoder(target, proposer, adaptive=adaptive).generate(ids, config)
            assert result.tokens == reference.tokens, f"{name} changed the greedy output"


def test_batched_rows_equal_their_solo_outputs(target):
    prompts = [target.encode_prompt(p) for p in BATCH_PROMPTS]
    configs = [GenerationConfig(max_new_tokens=n, ignore_eos=True) for n in LENGTHS]
    expected = [SpeculativeDecoder(target).generate(ids, c).tokens for ids, c in zip(prompts, configs)]
    for name, proposer, adaptive in proposers(target):
        engine = Engine(target, proposer, max_batch=3, adaptive=adaptive)
        seqs = [engine.submit(ids, c) for ids, c in zip(prompts, configs)]
        engine.run()
        assert [s.result.tokens for s in seqs] == expected, f"{name}: a batched row differs from its solo output"


def test_seeded_sampling_is_the_same_for_every_method(target):
    """With one seed every method samples exactly the tokens plain sampling does (the random number of position p
    depends on the seed and p alone), on the device as on the CPU."""
    ids = target.encode_prompt(PROMPTS[2])
    config = GenerationConfig(max_new_tokens=MAX_NEW, ignore_eos=True,
                              sampling=SamplingConfig(temperature=1.0, top_p=0.9, seed=11))
    reference = SpeculativeDecoder(target).generate(ids, config).tokens
    for name, proposer, adaptive in proposers(target, reference, len(ids)):
        result = SpeculativeDecoder(target, proposer, adaptive=adaptive).generate(ids, config)
        assert result.tokens == reference, f"{name} sampled other tokens than plain sampling"


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (1.0, 5)])
def test_allowed_and_barred_tokens_give_every_method_the_same_output(target, temperature, seed):
    """vLLM's allowed_token_ids and bad_words (sampling.py's masks) on the device: every method keeps plain
    decoding's tokens, each an allowed one, no barred word completed."""
    ids = target.encode_prompt(PROMPTS[1])
    free = SpeculativeDecoder(target).generate(ids, GenerationConfig(max_new_tokens=MAX_NEW, ignore_eos=True)).tokens
    allowed = tuple(sorted(set(range(5, target.vocab_size, 2)) | set(free)))
    words = ((free[3], free[4]), (free[7],))
    sampling = SamplingConfig(temperature=temperature, seed=seed, allowed_token_ids=allowed, bad_word_ids=words)
    config = GenerationConfig(max_new_tokens=MAX_NEW, ignore_eos=True, sampling=sampling)
    reference = SpeculativeDecoder(target).generate(ids, config).tokens
    assert set(reference) <= set(allowed) and words[1][0] not in reference
    assert all(pair != words[0] for pair in zip(reference, reference[1:]))
    for name, proposer, adaptive in proposers(target, reference, len(ids)):
        result = SpeculativeDecoder(target, proposer, adaptive=adaptive).generate(ids, config)
        assert result.tokens == reference, f"{name} changed the output under allowed and barred tokens"
