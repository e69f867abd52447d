"""The verification loop: greedy outputs are token-identical for every proposer, sampling keeps the target's
distribution, stops and stats behave."""

import math
from dataclasses import replace

import pytest
import torch

from conftest import ARCHS, OracleProposer, RandomProposer
from dflash.engine import GenerationConfig, SpeculativeDecoder
from dflash.errors import UserError
from dflash.methods.base import Draft, MethodOptions, Proposer
from dflash.methods.dflash.drafter import DFlashConfig, DFlashDrafter
from dflash.methods.dflash.proposer import DFlashProposer
from dflash.methods.ngram import NgramProposer
from dflash.sampling import SamplingConfig, target_probs

PROMPTS = ["w1 w2 w3 w4 w5", "w7 w7 w7", "w20 w31 w9 w9 w40 w12 w3"]
MAX_NEW = 48


def make_drafter(target, block_size, mask_token_id=2, seed=0):
    cfg = DFlashConfig.for_target(target.config, target.vocab_size, mask_token_id, num_layers=1,
                                  block_size=block_size, num_features=2)
    return DFlashDrafter.untrained(cfg, seed).freeze()


def with_lookup(proposer, lookup):
    """`proposer` with a free lookup beside it, as NAME+ngram builds it"""
    proposer.lookup = lookup
    return proposer


def ar_tokens(target, prompt_ids, max_new=MAX_NEW):
    return SpeculativeDecoder(target).generate(prompt_ids, GenerationConfig(max_new_tokens=max_new, ignore_eos=True))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
def test_greedy_lossless_every_proposer(tiny_targets, arch, block_size):
    target = tiny_targets[arch]
    config = GenerationConfig(max_new_tokens=MAX_NEW, ignore_eos=True)
    drafter = make_drafter(target, block_size)
    for prompt in PROMPTS:
        ids = target.encode_prompt(prompt)
        reference = ar_tokens(target, ids)
        with torch.no_grad():
            hf = target.model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False,
                                       eos_token_id=None, pad_token_id=0)
        assert reference.tokens == hf[0, len(ids):].tolist(), "ar path differs from transformers generate"
        proposers = {
            "dflash": DFlashProposer(drafter, target),
            "oracle": OracleProposer(reference.tokens, len(ids), block_size - 1),
            "random": RandomProposer(target.vocab_size, block_size - 1),
            "ngram": NgramProposer(max_draft=block_size - 1),
            "dflash+ngram": with_lookup(DFlashProposer(drafter, target), NgramProposer(max_draft=block_size - 1)),
        }
        for name, proposer in proposers.items():
            result = SpeculativeDecoder(target, proposer).generate(ids, config)
            assert result.tokens == reference.tokens, f"{name} changed the greedy output"
            assert result.text == reference.text
        oracle = SpeculativeDecoder(target, proposers["oracle"], adaptive=False).generate(ids, config)
        # the oracle is always right: with whole blocks, every round but the last emits a full block
        assert oracle.stats.accept_lengths[:-1] == [block_size] * (oracle.stats.num_rounds - 1)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_lossless_in_bfloat16_through_our_kernels(arch, bf16_layout):
    """A bfloat16 target through our C layers, its weights widened or in pairs (AVX512-BF16): bfloat16 logits tie
    often, so any difference between a verify pass and the steps it stands for would change tokens."""
    from dflash.models.target import choose_kernels
    from dflash.testing import tiny_target

    target = tiny_target(arch, logit_scale=4.0)
    target.model.to(torch.bfloat16)
    choose_kernels(target, "native")
    config = GenerationConfig(max_new_tokens=MAX_NEW, ignore_eos=True)
    for block_size in (4, 16):
        for prompt in PROMPTS:
            ids = target.encode_prompt(prompt)
            reference = ar_tokens(target, ids)
            for proposer in (DFlashProposer(make_drafter(target, block_size).to(torch.bfloat16), target),
                             OracleProposer(reference.tokens, len(ids), block_size - 1),
                             RandomProposer(target.vocab_size, block_size - 1)):
                for adaptive in (True, False):
                    result = SpeculativeDecoder(target, proposer, adaptive=adaptive).generate(ids, config)
                    assert result.tokens == reference.tokens, f"{proposer.name} changed the greedy output"


@pytest.mark.parametrize("precision", ["bfloat16", "int8"])
def test_cheaper_drafter_beside_float32_target(tiny_targets, precision):
    """The drafter may run in a cheaper precision (bf16, or int8 weights): outputs stay those of the float32
    target."""
    from dflash.loading import build_proposer
    from dflash.models.kernels import FrozenLinear, int8_supported

    if precision == "int8" and not int8_supported(torch.randn(1)):
        pytest.skip("no fbgemm int8 kernel in this PyTorch build")
    target = tiny_targets["qwen3"]
    for method in ("dflash", "eagle3"):
        proposer, _ = build_proposer(method, target, MethodOptions(block_size=8, draft_dtype=precision))
        assert proposer.report["draft_dtype"] == precision
        if method == "dflash":  # the head's kernel is reported too: int8 with the int8 drafter's plan
            assert proposer.report["draft_head_kernel"] == ("int8" if precision == "int8" else
                                                            proposer.lm_head.kernel_for_rows(4))
        model = proposer.drafter if method == "dflash" else proposer.head
        assert next(model.parameters()).dtype == (torch.bfloat16 if precision == "bfloat16" else torch.float32)
        if precision == "int8":  # every product of the drafter (its LM head too) runs on int8 weights ...
            frozen = [m for m in model.modules() if isinstance(m, FrozenLinear) and m is not model.fast_fc]
            frozen += [proposer.lm_head] if method == "dflash" else []
            assert frozen and all(f.int8() is not None and f.plan.default == "int8" for f in frozen)
            # ... but the one reading the target's raw features, whose huge channels would swamp an int8 scale
            assert model.fast_fc.plan is target.kernel_plan
        for prompt in PROMPTS:
            ids = target.encode_prompt(prompt)
            config = GenerationConfig(max_new_tokens=32, ignore_eos=True)
            result = SpeculativeDecoder(target, proposer).generate(ids, config)
            assert result.tokens == ar_tokens(target, ids, 32).tokens


def test_generated_mask_token_is_kept(tiny_targets):
    """If the target itself generates the drafter's mask id, that token is real output and must stay."""
    target = tiny_targets["llama"]
    ids = target.encode_prompt(PROMPTS[0])
    reference = ar_tokens(target, ids)
    mask_id = reference.tokens[3]
    drafter = make_drafter(target, 8, mask_token_id=mask_id)
    result = SpeculativeDecoder(target, DFlashProposer(drafter, target)).generate(
        ids, GenerationConfig(max_new_tokens=MAX_NEW, ignore_eos=True))
    assert mask_id in result.tokens
    assert result.tokens == reference.tokens


def test_stats_from_known_rounds(tiny_targets):
    """An oracle that is right for exactly 2 tokens per round gives tau 3 and acceptance [1, 1, 0]."""
    target = tiny_targets["qwen3"]
    ids = target.encode_prompt(PROMPTS[0])
    reference = ar_tokens(target, ids, 30)

    class TwoRight(OracleProposer):
        def propose(self, sequence, limit=None, keep_going=None):
            known = super().propose(sequence).tokens
            return Draft(known[:2] + [(t + 1) % target.vocab_size for t in known[2:3]])

    result = SpeculativeDecoder(target, TwoRight(reference.tokens, len(ids), 3), adaptive=False).generate(
        ids, GenerationConfig(max_new_tokens=30, ignore_eos=True))
    stats = result.stats
    assert result.tokens == reference.tokens
    full_rounds = stats.accept_lengths[:-1]
    assert set(full_rounds) == {3}
    assert stats.per_position_acceptance[2] == 0.0
    assert stats.tau_histogram[2] >= len(full_rounds)
    assert stats.new_tokens == 30 and 1 + sum(stats.accept_lengths) >= 30


def test_stop_token_and_string_and_length(tiny_targets):
    target = tiny_targets["llama"]
    ids = target.encode_prompt(PROMPTS[2])
    reference = ar_tokens(target, ids)
    stop_id = reference.tokens[10]
    first = reference.tokens.index(stop_id)
    for proposer in (Proposer(), NgramProposer(), RandomProposer(target.vocab_size, 7)):
        decoder = SpeculativeDecoder(target, proposer)
        by_id = decoder.generate(ids, GenerationConfig(max_new_tokens=MAX_NEW, ignore_eos=True,
                                                       stop_token_ids=(stop_id,)))
        assert by_id.tokens == reference.tokens[: first + 1] and by_id.finish_reason == "stop"
        word = target.tokenizer.convert_ids_to_tokens(stop_id)
        by_string = decoder.generate(ids, GenerationConfig(max_new_tokens=MAX_NEW, ignore_eos=True,
                                                           stop_strings=(word,)))
        assert word not in by_string.text and by_string.finish_reason == "stop"
        assert by_string.tokens == reference.tokens[: first + 1]
        short = decoder.generate(ids, GenerationConfig(max_new_tokens=5, ignore_eos=True))
        assert short.tokens == reference.tokens[:5] and short.finish_reason == "length"


def test_eos_stops_generation(tiny_targets):
    target = tiny_targets["gemma3"]
    for prompt in PROMPTS:
        ids = target.encode_prompt(prompt)
        full = ar_tokens(target, ids, 80)
        if 1 in full.tokens:  # tiny tokenizer's <eos>
            out = SpeculativeDecoder(target, NgramProposer()).generate(ids, GenerationConfig(max_new_tokens=80))
            assert out.tokens == full.tokens[: full.tokens.index(1) + 1] and out.finish_reason == "stop"
            assert "<eos>" not in out.text
            return
    pytest.skip("tiny gemma3 never produced <eos> for these prompts")


@pytest.mark.parametrize("bad", [
    dict(max_new_tokens=0), dict(sampling=SamplingConfig(temperature=-1)),
    dict(sampling=SamplingConfig(temperature=1, top_p=0)), dict(sampling=SamplingConfig(temperature=1, top_p=1.5)),
    dict(sampling=SamplingConfig(temperature=1, min_p=-0.1)), dict(sampling=SamplingConfig(temperature=1, min_p=2)),
])
def test_bad_generation_config(tiny_targets, bad):
    target = tiny_targets["llama"]
    with pytest.raises(UserError):
        SpeculativeDecoder(target).generate([3, 5], GenerationConfig(**bad))


def test_prompt_longer_than_context(tiny_targets):
    target = tiny_targets["llama"]
    with pytest.raises(UserError, match="context"):
        SpeculativeDecoder(target).generate([5] * (target.max_context + 1), GenerationConfig())
    with pytest.raises(UserError, match="empty"):
        SpeculativeDecoder(target).generate([], GenerationConfig())


def test_generation_never_passes_the_context(tiny_targets):
    target = tiny_targets["llama"]
    prompt = [5] * (target.max_context - 20)
    out = SpeculativeDecoder(target, NgramProposer(max_draft=7)).generate(
        prompt, GenerationConfig(max_new_tokens=100, ignore_eos=True))
    assert len(prompt) + len(out.tokens) <= target.max_context and out.finish_reason == "length"


# ---- sampling -----------------------------------------------------------------------------------------------------
def test_min_tokens_holds_the_stop_tokens_back_until_then(tiny_targets):
    """With EOS pushed to the top, a plain loop that masks it before the 6th new token is what every method gives,
    drafts that propose EOS early (the uncapped output) included; sampled, every method gives the seeded loop's."""
    target = tiny_targets["llama"]
    eos, prompt = list(target.eos_token_ids), [3, 5, 7, 11]
    pushed = {token: 8.0 for token in eos}
    uncapped = SpeculativeDecoder(target).generate(prompt, GenerationConfig(16, sampling=SamplingConfig(
        logit_bias=pushed)))
    assert uncapped.tokens[-1] in eos and len(uncapped.tokens) < 6
    ids, expected = list(prompt), []
    while len(expected) < 16 and (not expected or expected[-1] not in eos):
        logits = target.forward(torch.tensor([ids])).logits[0, -1].float().clone()
        logits[eos] += 8.0
        if len(expected) < 6:
            logits[eos] = float("-inf")
        expected.append(int(logits.argmax()))
        ids.append(expected[-1])
    for sampling in (SamplingConfig(logit_bias=pushed, min_tokens=6),
                     SamplingConfig(temperature=1.0, seed=3, logit_bias=pushed, min_tokens=6)):
        config = GenerationConfig(16, sampling=sampling)
        reference = SpeculativeDecoder(target).generate(prompt, config).tokens
        assert len(reference) >= 6 and not set(reference[:5]) & set(eos)
        if sampling.greedy:
            assert reference == expected
        for proposer in (NgramProposer(max_draft=7), OracleProposer(uncapped.tokens, len(prompt), 3)):
            assert SpeculativeDecoder(target, proposer).generate(prompt, config).tokens == reference
    held = SamplingConfig(min_tokens=6, held_back=tuple(eos))  # greedy rounds go back to plain argmax at the 6th
    assert held.penalized_after(5) and not held.penalized_after(6) and not SamplingConfig(min_tokens=6).penalized_after(0)
    assert replace(held, logit_bias=pushed).penalized_after(100)
    with pytest.raises(UserError, match="at most max_tokens"):
        SpeculativeDecoder(target).generate(prompt, GenerationConfig(4, sampling=SamplingConfig(min_tokens=6)))
    with pytest.raises(UserError, match="response format"):
        SpeculativeDecoder(target).generate(prompt, GenerationConfig(8, sampling=SamplingConfig(min_tokens=2),
                                                                     response_format="json_object"))


def test_min_tokens_holds_stop_strings_back_until_then(byte_targets):
    """As vLLM checks them: a stop string that ends within the first min_tokens - 1 tokens' text ends nothing; the
    first that ends past it cuts the output, the same for every method and for the streamed text."""
    from dflash.engine import stop_string_at
    from dflash.serving.streaming import TextDeltas

    target = byte_targets["llama"]
    prompt = target.encode_prompt("Tell me.")
    free = SpeculativeDecoder(target).generate(prompt, GenerationConfig(40, ignore_eos=True))
    text = free.text
    stop = max(text[:8], key=text[:8].count)  # a character written several times early on
    where = [i for i, char in enumerate(text) if char == stop]
    assert len(where) >= 3
    later = 0
    for least in range(0, 10, 2):
        floor = len(target.decode(free.tokens[: least - 1])) if least > 1 else 0
        cut = next((i for i in where if i + 1 > floor), -1)  # the first occurrence that ends past the floor
        later += cut > where[0]
        config = GenerationConfig(40, sampling=SamplingConfig(min_tokens=least), stop_strings=(stop,), ignore_eos=True)
        results = [SpeculativeDecoder(target, proposer).generate(prompt, config)
                   for proposer in (None, NgramProposer(max_draft=7), OracleProposer(free.tokens, len(prompt), 5))]
        assert [r.text for r in results] == [text if cut < 0 else text[:cut]] * 3, least
        assert all(r.tokens == results[0].tokens for r in results)
        assert results[0].finish_reason == ("stop" if cut >= 0 else "length")
        deltas = TextDeltas.of(target, config)
        streamed = "".join(deltas.push([token]) for token in results[0].tokens) + deltas.finish(results[0].text)
        assert streamed == results[0].text
    assert later >= 1
    assert stop_string_at("abcabc", ["bc"], 0) == 1 and stop_string_at("abcabc", ["bc"], 3) == 4
    assert stop_string_at("abcabc", ["bc"], 2) == 1 and stop_string_at("abcabc", ["bc", "ca"], 3) == 2
    assert stop_string_at("abcabc", ["bc", "ca"], 4) == 4


def test_top_k_top_p_filtering():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    probs = target_probs(logits, SamplingConfig(temperature=1.0, top_k=3))
    assert (probs[0, 3:] == 0).all() and torch.isclose(probs.sum(), torch.tensor(1.0))
    full = logits.softmax(-1)[0]  # [0.636, 0.234, 0.086, ...]
    probs = target_probs(logits, SamplingConfig(temperature=1.0, top_p=0.8))
    assert (probs[0, :2] > 0).all() and (probs[0, 2:] == 0).all()  # 0.636 < 0.8 <= 0.636 + 0.234
    torch.testing.assert_close(probs[0, :2], full[:2] / full[:2].sum())
    probs = target_probs(logits, SamplingConfig(temperature=1.0, top_p=0.5))
    assert probs[0, 0] == 1.0  # the top token always stays
    probs = target_probs(logits, SamplingConfig(temperature=1.0, min_p=0.1))  # at least 0.0636: the first three
    assert (probs[0, 3:] == 0).all() and (probs[0, :3] > 0).all()
    torch.testing.assert_close(probs[0, :3], full[:3] / full[:3].sum())
    probs = target_probs(logits, SamplingConfig(temperature=1.0, min_p=1.0))
    assert probs[0, 0] == 1.0


def test_top_p_among_the_most_likely_tokens_drops_what_a_full_sort_drops():
    """top-p looks for the nucleus among the most likely tokens first, and sorts the whole vocabulary only where
    they hold less than top_p: the same tokens go as with a full sort, sharp rows, flat rows and mixed batches
    alike (a token whose rank starts within float rounding of top_p may go either way)."""
    from dflash.sampling import TOP_P_CANDIDATES, outside_top_p

    generator = torch.Generator().manual_seed(0)
    for scale, rows, vocab in ((4.0, 3, 3000), (0.05, 2, 3000), (1.0, 4, 3000), (2.5, 4, 10000), (1.5, 3, 10000)):
        logits = torch.randn(rows, vocab, generator=generator) * scale
        logits[0] *= 20 if scale < 1 else 1  # a sharp row beside flat ones: each is ranked as far as it needs
        for top_p in (0.3, 0.9, 0.999):
            ranked, order = torch.sort(logits, dim=-1, descending=True)
            probs = ranked.softmax(-1)
            before = probs.cumsum(-1) - probs
            expected = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, order, before >= top_p)
            unsure = torch.zeros_like(expected).scatter(-1, order, (before - top_p).abs() < 1e-5)
            dropped = outside_top_p(logits, top_p)
            assert ((dropped == expected) | unsure).all()
            assert (~dropped).sum(-1).min() >= 1
    assert TOP_P_CANDIDATES[0] < 3000 < TOP_P_CANDIDATES[1] < 10000  # both tiers, then a whole sort


def exact_joint(target, prompt_ids, sampling, depth, support):
    """P(t1..t_depth) of plain sampling, by enumerating the target's filtered distributions."""
    joint = {}

    def walk(prefix, prob):
        if len(prefix) == depth:
            joint[tuple(prefix)] = prob
            return
        logits = target.forward(torch.tensor([prompt_ids + prefix])).logits[0, -1]
        probs = target_probs(logits[None], sampling)[0]
        for tok in torch.nonzero(probs > 0).flatten().tolist():
            walk(prefix + [tok], prob * probs[tok].item())

    walk([], 1.0)
    return joint


def chi_square_threshold(dof: int, z: float = 3.09) -> float:
    """Upper 0.1% point of chi-square(dof), Wilson-Hilferty approximation."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


@pytest.mark.parametrize("sampling", [
    SamplingConfig(temperature=1.0, top_k=3),
    SamplingConfig(temperature=0.7, top_p=0.6),
    SamplingConfig(temperature=1.3, top_k=4, top_p=0.8),
    SamplingConfig(temperature=1.0, min_p=0.6),
])
def test_sampling_matches_target_distribution(sampling):
    """The first 3 sampled tokens of speculative decoding (drafts that are often, not always, right) follow the
    exact joint distribution of plain sampling: chi-square test at the 0.1% level, fixed seeds."""
    from dflash.testing import tiny_target

    target = tiny_target("llama", vocab_size=16, logit_scale=1.5, seed=3)
    prompt = [3, 7, 9, 4]
    depth, runs = 3, 1500
    joint = exact_joint(target, prompt, sampling, depth, None)
    greedy = SpeculativeDecoder(target).generate(prompt, GenerationConfig(max_new_tokens=depth + 4, ignore_eos=True))

    for proposer in (OracleProposer(greedy.tokens, len(prompt), 3), Proposer()):
        counts = {}
        for seed in range(runs):
            cfg = GenerationConfig(max_new_tokens=depth, ignore_eos=True,
                                   sampling=replace(sampling, seed=seed))
            key = tuple(SpeculativeDecoder(target, proposer).generate(prompt, cfg).tokens)
            counts[key] = counts.get(key, 0) + 1
        assert set(counts) <= set(joint), "sampled a token the filtered distribution excludes"
        # merge rare outcomes so every cell's expected count is >= 5
        stat, dof, rare_obs, rare_exp = 0.0, -1, 0, 0.0
        for key, p in joint.items():
            expected, observed = p * runs, counts.get(key, 0)
            if expected < 5:
                rare_obs, rare_exp = rare_obs + observed, rare_exp + expected
                continue
            stat += (observed - expected) ** 2 / expected
            dof += 1
        if rare_exp > 0:
            stat += (rare_obs - rare_exp) ** 2 / rare_exp
            dof += 1
        assert dof >= 2
        assert stat < chi_square_threshold(dof), f"{proposer.name}: chi2 {stat:.1f} with {dof} dof"


def test_sampling_is_seedable(tiny_targets):
    target = tiny_targets["qwen3"]
    ids = target.encode_prompt(PROMPTS[1])
    cfg = GenerationConfig(max_new_tokens=20, ignore_eos=True, sampling=SamplingConfig(temperature=1.0, seed=7))
    decoder = SpeculativeDecoder(target, NgramProposer())
    assert decoder.generate(ids, cfg).tokens == decoder.generate(ids, cfg).tokens


@pytest.mark.parametrize("arch", ARCHS)
def test_seeded_sampling_is_the_same_for_every_method(tiny_targets, arch):
    """The random number of the token at position p depends only on (seed, p): with one seed, every proposer,
    whole blocks or adaptive, alone or batched, samples exactly the tokens plain sampling does."""
    from dflash.engine import Engine

    target = tiny_targets[arch]
    ids = target.encode_prompt(PROMPTS[2])
    config = GenerationConfig(max_new_tokens=40, ignore_eos=True,
                              sampling=SamplingConfig(temperature=1.0, top_p=0.9, seed=11))
    reference = SpeculativeDecoder(target).generate(ids, config).tokens
    for proposer in (NgramProposer(max_draft=5), DFlashProposer(make_drafter(target, 8), target),
                     RandomProposer(target.vocab_size, 6), OracleProposer(reference, len(ids), 7),
                     with_lookup(RandomProposer(target.vocab_size, 6), NgramProposer(max_draft=6))):
        for adaptive in (True, False):
            result = SpeculativeDecoder(target, proposer, adaptive=adaptive).generate(ids, config)
            assert result.tokens == reference, f"{proposer.name} adaptive={adaptive}"
    engine = Engine(target, NgramProposer(max_draft=3), max_batch=3)
    other = GenerationConfig(max_new_tokens=40, ignore_eos=True, sampling=SamplingConfig(temperature=1.0, seed=3))
    seqs = [engine.submit(ids, config), engine.submit(target.encode_prompt(PROMPTS[0]), other),
            engine.submit(ids, config)]
    engine.run()
    assert seqs[0].result.tokens == seqs[2].result.tokens == reference


class PartlyRightProposer(Proposer):
    """The target's own continuation for 0, 1, 2 or all of its tokens (each a quarter of the rounds), then wrong
    ones: mostly early rejections, as a real drafter's, the first position included, and sometimes none."""

    name = "partly-right"

    def __init__(self, reference: list[int], prompt_len: int, max_draft: int, vocab_size: int, seed: int = 0):
        self.reference, self.prompt_len, self.max_draft, self.vocab_size = reference, prompt_len, max_draft, vocab_size
        self.generator = torch.Generator().manual_seed(seed)

    def propose(self, sequence, limit=None, keep_going=None):
        done = len(sequence) - self.prompt_len
        count = self.max_draft if limit is None else min(limit, self.max_draft)
        right = [0, 1, 2, count][int(torch.randint(0, 4, (), generator=self.generator))]
        wrong = [(t + 1) % self.vocab_size for t in self.reference[done + right: done + count]]
        return Draft(self.reference[done: done + right] + wrong)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_deferred_logits_choose_what_full_logits_choose(tiny_targets, arch, monkeypatch):
    """A verify pass whose LM head runs in steps (the first FIRST_LOGITS positions, then the rest only for rows
    that accepted them all) picks the same tokens and accepts the same drafts as one head over every position, for
    greedy and seeded sampled rows batched together; and it leaves out the rows after early rejections. (Tiny
    targets are not timed, so their engines step the head in every wide round.)"""
    from dflash.engine import Engine

    target = tiny_targets[arch]
    assert target.defers_logits
    greedy = GenerationConfig(max_new_tokens=2 * MAX_NEW, ignore_eos=True)
    sampled = GenerationConfig(max_new_tokens=2 * MAX_NEW, ignore_eos=True,
                               sampling=SamplingConfig(temperature=1.0, top_k=20, seed=5))
    prompts = [target.encode_prompt(p) for p in PROMPTS]
    references = [SpeculativeDecoder(target).generate(ids, cfg).tokens
                  for ids, cfg in zip(prompts, (greedy, sampled, greedy))]
    head_rows = []  # the positions the LM head ran on, summed over rows, one entry per head
    logits_of, forward = target.logits_of, target.forward

    def counted_forward(ids, cache=None, layers=(), logits_at="all"):
        if isinstance(logits_at, str) and logits_at == "all":
            head_rows.append(ids.shape[0] * ids.shape[1])
        return forward(ids, cache, layers, logits_at=logits_at)

    monkeypatch.setattr(target, "logits_of", lambda h: head_rows.append(h.shape[0] * h.shape[1]) or logits_of(h))
    monkeypatch.setattr(target, "forward", counted_forward)

    def run():
        engine = Engine(target, PartlyRightProposer([], 0, 15, target.vocab_size), max_batch=3, adaptive=False)
        seqs = []
        for ids, cfg, ref in zip(prompts, (greedy, sampled, greedy), references):
            seq = engine.submit(ids, cfg)
            seq.proposer = PartlyRightProposer(ref, len(ids), 15, target.vocab_size, seed=len(seqs))
            seqs.append(seq)
        engine.run()
        return [(s.result.tokens, s.stats.accept_lengths) for s in seqs]

    deferred = run()
    assert [tokens for tokens, _ in deferred] == references
    assert min(min(lengths) for _, lengths in deferred) == 1 and max(max(lengths) for _, lengths in deferred) == 16
    rows_deferred, head_rows[:] = sum(head_rows), []
    monkeypatch.setattr(target, "defer_logits", False)
    assert run() == deferred
    # early rejections left the head's rows past FIRST_LOGITS out in most rounds (the full head: 3 x 16 a round)
    assert 0 < rows_deferred < 0.75 * sum(head_rows)


def test_rounds_that_accept_past_the_first_logits_stop_the_stepped_head(tiny_targets, monkeypatch):
    """Where most wide rounds need logits past FIRST_LOGITS (a drafter that is always right), stepping would read
    the head twice in most rounds: once that has happened in more rounds than the measured saving allows, the
    engine goes back to one head over every position, and the output stays the target's."""
    from dflash.engine import FIRST_LOGITS, OVERRUN_SMOOTHING

    target = tiny_targets["qwen3"]
    monkeypatch.setattr(target, "screen_greedy", False)  # the float32 head's logits, as sampled rounds read them
    ids = target.encode_prompt(PROMPTS[0])
    reference = ar_tokens(target, ids, 96).tokens
    decoder = SpeculativeDecoder(target, OracleProposer(reference, len(ids), 15), adaptive=False)
    decoder.engine.head_saving = 0.3  # as if measured: rounds needing the second step must stay under 30%
    steps = []
    logits_of = target.logits_of
    monkeypatch.setattr(target, "logits_of", lambda h: steps.append(h.shape[1]) or logits_of(h))
    result = decoder.generate(ids, GenerationConfig(max_new_tokens=96, ignore_eos=True))
    assert result.tokens == reference
    # the EMA of overrunning rounds passes 0.3 after ceil(log(0.7) / log(1 - w)) of them; each took both steps
    switch = math.ceil(math.log(0.7) / math.log(1 - OVERRUN_SMOOTHING))
    assert steps == [FIRST_LOGITS, 16 - FIRST_LOGITS] * switch
    assert decoder.engine.head_overrun > 0.3


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_greedy_rounds_read_the_screen_and_keep_the_heads_tokens(tiny_targets, monkeypatch, arch):
    """Greedy rounds take their tokens from the head's screen (FIRST_SCREENED positions, then the rest for rows that
    accepted them all), never from the float32 logits, and emit what the float32 head's argmax emits, for a drafter
    that is right, partly right and wrong."""
    from dflash.engine import FIRST_SCREENED

    target = tiny_targets[arch]
    assert target.can_screen
    ids = target.encode_prompt(PROMPTS[1])
    monkeypatch.setattr(target, "screen_greedy", False)
    reference = ar_tokens(target, ids, 48).tokens
    config = GenerationConfig(max_new_tokens=48, ignore_eos=True)
    unscreened = [SpeculativeDecoder(target, PartlyRightProposer(reference, len(ids), 7, target.vocab_size, seed=s),
                                     adaptive=False).generate(ids, config) for s in range(3)]
    monkeypatch.setattr(target, "screen_greedy", True)
    screened_rows, logits_calls = [], []
    greedy_of, logits_of = target.greedy_of, target.logits_of
    monkeypatch.setattr(target, "greedy_of", lambda h: screened_rows.append(h.shape[1]) or greedy_of(h))
    monkeypatch.setattr(target, "logits_of", lambda h: logits_calls.append(h.shape[1]) or logits_of(h))
    assert ar_tokens(target, ids, 48).tokens == reference
    for seed, before in enumerate(unscreened):
        proposer = PartlyRightProposer(reference, len(ids), 7, target.vocab_size, seed=seed)
        result = SpeculativeDecoder(target, proposer, adaptive=False).generate(ids, config)
        assert result.tokens == before.tokens == reference
        assert result.stats.accept_lengths == before.stats.accept_lengths
    assert logits_calls == [] and max(screened_rows) == FIRST_SCREENED and 8 - FIRST_SCREENED in screened_rows


def test_prompt_lookup_finds_the_latest_match_as_a_plain_search_does():
    """ngram searches the tokens as 4-byte words in C; a byte match that straddles two tokens must not count. Token
    values whose bytes repeat (0, 1, 256, 65536, ...) make such straddling matches common."""
    import random

    def plain(sequence, max_draft, max_ngram):
        for n in range(min(max_ngram, len(sequence) - 1), 0, -1):
            tail = sequence[-n:]
            for start in range(len(sequence) - n - 1, -1, -1):
                if sequence[start: start + n] == tail:
                    return sequence[start + n: start + n + max_draft]
        return []

    rng = random.Random(0)
    values = [0, 1, 256, 257, 65536, 65537, 16777216, 16777472, 49151]
    proposers = {n: NgramProposer(max_draft=5, max_ngram=n) for n in (3, 5, 8)}
    for _ in range(3000):
        sequence = [rng.choice(values[: rng.randint(2, len(values))]) for _ in range(rng.randint(1, 40))]
        for n, proposer in proposers.items():
            assert proposer.propose(sequence).tokens == plain(sequence, 5, n), (n, sequence)
    proposer = NgramProposer(max_draft=5)
    # 65536's bytes (00 00 01 00) occur in those of [0, 1] (00 00 00 00 01 00 00 00), across the two tokens only
    assert proposer.propose([0, 1, 65536]).tokens == []
    assert proposer.propose([7, 8, 9, 7, 8], limit=2).tokens == [9, 7]


def test_the_longest_match_wins_and_labels_its_drafts():
    """A match of the last five tokens beats a later match of the last three (its copy is surer), and the drafts
    carry the match's length, by which the controller calibrates them apart; none longer than MAX_MATCH is sought."""
    from dflash.methods import ngram

    five = [1, 2, 3, 4, 5]
    sequence = five + [60, 61] + [9, 4, 5] + [70, 71] + [3, 4, 5] + [80] + five
    draft = NgramProposer(max_draft=2, max_ngram=5).propose(sequence)
    assert (draft.tokens, draft.label) == ([60, 61], 5)
    draft = NgramProposer(max_draft=2, max_ngram=3).propose(sequence)
    assert (draft.tokens, draft.label) == ([80, 1], 3)  # the latest 3-token match
    assert NgramProposer().max_ngram == ngram.MAX_MATCH == 5


def test_stop_strings_far_into_a_long_output(byte_targets):
    """A stop string first written hundreds of tokens in (where the output's text is decoded only at its end,
    detokenize.py) cuts the output where decoding the whole output finds it, for the engine and the streamed text;
    after it where the config keeps it (include_stop_str_in_output)."""
    from dflash.serving.streaming import TextDeltas

    target = byte_targets["llama"]
    prompt = target.encode_prompt("Go on.")
    sampled = SamplingConfig(temperature=1.0, seed=3)  # random bytes: partial characters, invalid UTF-8
    free = SpeculativeDecoder(target).generate(prompt, GenerationConfig(400, ignore_eos=True, sampling=sampled))
    text = free.text
    late = [text[i: i + 2] for i in range(len(text) // 2, len(text) - 2)
            if text[i: i + 2].isascii() and text[i: i + 2].isprintable() and text[i: i + 2] not in text[: i + 1]]
    assert late, "no two printable characters first written in the output's second half"
    stop = late[0]
    cut = text.index(stop)
    for least, include in ((0, False), (150, False), (0, True)):
        config = GenerationConfig(400, sampling=replace(sampled, min_tokens=least), stop_strings=(stop,),
                                  ignore_eos=True, include_stop_strings=include)
        for proposer in (None, NgramProposer(max_draft=7)):
            result = SpeculativeDecoder(target, proposer).generate(prompt, config)
            assert result.text == text[: cut + len(stop) * include] and result.finish_reason == "stop"
            assert result.tokens == free.tokens[: len(result.tokens)] and len(result.tokens) > 100
        deltas = TextDeltas.of(target, config)
        pieces = [deltas.push(result.tokens[i: i + 3]) for i in range(0, len(result.tokens), 3)]
        assert "".join(pieces) + deltas.finish(result.text) == result.text
        assert deltas.text.settled  # the streamed text was decoded at its end too


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_allowed_token_ids_hold_every_method_to_the_same_output(tiny_targets, arch):
    """vLLM's allowed_token_ids: greedy, the argmax of the target's logits over the allowed tokens at every step
    (checked against the target's own forward), and the same tokens through every proposer; sampled with a seed,
    the same sequence through every proposer, each token an allowed one."""
    target = tiny_targets[arch]
    ids = target.encode_prompt(PROMPTS[0])
    allowed = tuple(range(7, 40, 2))
    proposers = (Proposer(), NgramProposer(max_draft=7), RandomProposer(target.vocab_size, 7))
    greedy = GenerationConfig(MAX_NEW, ignore_eos=True, sampling=SamplingConfig(allowed_token_ids=allowed))
    results = [SpeculativeDecoder(target, p).generate(ids, greedy).tokens for p in proposers]
    assert results == [results[0]] * 3
    mask = torch.full((target.vocab_size,), float("-inf"))
    mask[list(allowed)] = 0
    context = list(ids)
    with torch.no_grad():
        for token in results[0]:
            logits = target.model(torch.tensor([context])).logits[0, -1].float()
            assert token == int((logits + mask).argmax())
            context.append(token)
    sampled = replace(greedy, sampling=SamplingConfig(temperature=1.0, seed=11, allowed_token_ids=allowed))
    results = [SpeculativeDecoder(target, p).generate(ids, sampled).tokens for p in proposers]
    assert results == [results[0]] * 3 and set(results[0]) <= set(allowed)
    assert len(set(results[0])) > 3  # sampled, not one token over and over
    decoder = SpeculativeDecoder(target)
    with pytest.raises(UserError, match="allowed_token_ids"):
        decoder.generate(ids, replace(greedy, sampling=SamplingConfig(allowed_token_ids=(target.vocab_size,))))
    eos = tuple(target.eos_token_ids)
    with pytest.raises(UserError, match="min_tokens"):
        decoder.generate(ids, GenerationConfig(8, sampling=SamplingConfig(min_tokens=2, allowed_token_ids=eos)))
    with pytest.raises(UserError, match="response format"):
        decoder.generate(ids, replace(greedy, response_format="json_object"))
