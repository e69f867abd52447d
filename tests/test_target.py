"""The target adapter and our own forward (models/transformer.py) against transformers, the oracle: logits, the
layer-feature convention, KV-cache rollback, ragged batches, and the transformers fallback for other families."""

import pytest
import torch

from conftest import ARCHS, OracleProposer
from dflash.engine import GenerationConfig, SpeculativeDecoder
from dflash.methods.ngram import NgramProposer
from dflash.models.hf import HFEngine
from dflash.models.target import TargetModel
from dflash.models.transformer import Transformer
from dflash.testing import tiny_target

FAMILIES = ARCHS + ("qwen2",)


@pytest.fixture(scope="module")
def family_targets():
    return {arch: tiny_target(arch, logit_scale=4.0) for arch in FAMILIES}


@pytest.mark.parametrize("arch", FAMILIES)
def test_our_forward_equals_transformers(family_targets, arch):
    """Logits of a prefill and features (feature of layer i == HF output_hidden_states[i + 1])."""
    target = family_targets[arch]
    assert target.backend == "dflash" and isinstance(target.engine, Transformer)
    ids = torch.tensor([[5, 9, 11, 7, 20, 33, 41, 8, 12, 5, 9, 60, 3, 17, 22, 28, 31, 40, 44, 50]])
    layers = (0, 1, 2)
    out = target.forward(ids, None, layers)
    with torch.no_grad():
        ref = target.model(input_ids=ids, output_hidden_states=True)
    torch.testing.assert_close(out.logits, ref.logits.float(), rtol=1e-5, atol=1e-5)
    expected = torch.cat([ref.hidden_states[i + 1] for i in layers], dim=-1)
    torch.testing.assert_close(out.features, expected, rtol=1e-5, atol=1e-5)
    # a wrong offset (hidden_states[i]) must NOT match: guards the known off-by-one pitfall
    wrong = torch.cat([ref.hidden_states[i] for i in layers], dim=-1)
    assert not torch.allclose(out.features, wrong)
    last = target.forward(ids, None, (), logits_at="last").logits
    torch.testing.assert_close(last, out.logits[:, -1:])
    assert target.forward(ids, None, (1,), logits_at="none").logits is None


@pytest.mark.parametrize("arch", FAMILIES)
@pytest.mark.parametrize("transformers", [False, True], ids=["ours", "transformers"])
@pytest.mark.filterwarnings("error::FutureWarning")  # the fallback passes its cache under the current keyword
def test_rollback_equals_fresh_forward(family_targets, arch, transformers):
    """After verifying a block and rejecting part of it, the cache equals a fresh prefill of the committed tokens;
    gemma3's 16-token sliding window is passed on purpose."""
    target = family_targets[arch]
    if transformers:
        target = TargetModel(target.model, target.tokenizer, target.name, prefer_transformers=True)
        assert target.backend == "transformers"
    torch.manual_seed(0)
    committed = torch.randint(5, 60, (1, 30)).tolist()[0]
    cache = target.new_cache()
    target.forward(torch.tensor([committed[:20]]), cache)
    for start, keep in ((20, 3), (23, 7)):  # two rounds: verify 8 tokens, keep only 3, then 7 of them
        block = committed[start : start + keep] + torch.randint(5, 60, (8 - keep,)).tolist()
        target.forward(torch.tensor([block]), cache)
        cache.truncate(start + keep)
    assert len(cache) == 30
    nxt = torch.tensor([[42, 17]])
    after_rollback = target.forward(nxt, cache, (1,))
    fresh = target.forward(torch.tensor([committed + [42, 17]]), None, (1,))
    torch.testing.assert_close(after_rollback.logits, fresh.logits[:, -2:], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(after_rollback.features, fresh.features[:, -2:], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", FAMILIES)
def test_ragged_batch_rows_equal_their_solo_runs(family_targets, arch):
    """Rows of one batch at different lengths (each row its own rollback) compute what each would alone."""
    target = family_targets[arch]
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, 60, (n,), generator=gen).tolist() for n in (7, 19, 12)]
    solo = []
    for p in prompts:
        cache = target.new_cache()
        target.forward(torch.tensor([p]), cache)
        solo.append(target.forward(torch.tensor([[9, 10, 11]]), cache, (1, 2)))
    batch = target.new_cache(batch=len(prompts))
    width = max(len(p) for p in prompts)
    padded = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
    first = target.forward(padded, batch, (), logits_at=torch.tensor([len(p) - 1 for p in prompts]))
    batch.set_lengths([len(p) for p in prompts])  # padding rolled back: rows now differ in length
    together = target.forward(torch.tensor([[9, 10, 11]] * 3), batch, (1, 2))
    for i, p in enumerate(prompts):
        alone = target.forward(torch.tensor([p]), None, (), logits_at="last").logits
        torch.testing.assert_close(first.logits[i], alone[0], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(together.logits[i], solo[i].logits[0], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(together.features[i], solo[i].features[0], atol=1e-5, rtol=1e-4)


def test_the_fallback_names_its_cache_as_the_models_forward_does():
    """transformers 5.2x renamed forward's `past_key_values` to `cache` (the old name warns, and goes in 5.40);
    remote code and older releases take `past_key_values`."""
    from dflash.models.hf import cache_keyword

    class New(torch.nn.Module):
        def forward(self, input_ids, cache=None, use_cache=None): ...

    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, use_cache=None): ...

    assert cache_keyword(New()) == "cache" and cache_keyword(Old()) == "past_key_values"


@pytest.mark.filterwarnings("error::FutureWarning")
def test_other_families_fall_back_to_transformers():
    """A family without our forward runs through transformers, losslessly, with its features."""
    from transformers import AutoModelForCausalLM, MistralConfig

    from dflash.testing import tiny_tokenizer

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                           eos_token_id=1, pad_token_id=0, bos_token_id=None, sliding_window=None)
    target = TargetModel(AutoModelForCausalLM.from_config(config), tiny_tokenizer(64), "tiny-mistral")
    assert target.backend == "transformers" and isinstance(target.engine, HFEngine)
    ids = target.encode_prompt("w3 w9 w9 w4")
    config = GenerationConfig(max_new_tokens=20, ignore_eos=True)
    reference = SpeculativeDecoder(target).generate(ids, config)
    with torch.no_grad():
        hf = target.model.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                                   pad_token_id=0)
    assert reference.tokens == hf[0, len(ids):].tolist()
    for proposer in (NgramProposer(max_draft=3), OracleProposer(reference.tokens, len(ids), 5)):
        assert SpeculativeDecoder(target, proposer).generate(ids, config).tokens == reference.tokens
    with pytest.raises(ValueError, match="one sequence at a time"):
        target.new_cache(batch=2)


def test_truncate_rejects_growth(family_targets):
    target = family_targets["llama"]
    cache = target.new_cache()
    target.forward(torch.tensor([[5, 6, 7]]), cache)
    with pytest.raises(ValueError):
        cache.truncate(4)


def test_cache_grows_past_its_first_capacity(family_targets):
    target = family_targets["qwen3"]
    ids = torch.randint(5, 60, (1, 40), generator=torch.Generator().manual_seed(2))
    cache = target.new_cache(capacity=8)
    for i in range(0, 40, 5):
        out = target.forward(ids[:, i : i + 5], cache)
    assert len(cache) == 40 and cache.capacity >= 40
    torch.testing.assert_close(out.logits, target.forward(ids).logits[:, -5:], atol=1e-5, rtol=1e-4)


def test_compiled_forwards_keep_their_own_timings():
    """Pass costs measured on the eager forward must not steer a compiled one (nor the reverse): the cache key
    names the mode, and the eager key stays what it was."""
    target = tiny_target("llama")
    eager = target.measurement_key("pass-costs")
    target.kernel_report = {**(target.kernel_report or {}), "compile_s": 12.0}
    compiled = target.measurement_key("pass-costs")
    assert compiled != eager and compiled.endswith(":compiled:pass-costs")
    assert eager.endswith("}:pass-costs") or eager.endswith("None:pass-costs")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: biases on q, k and v, fused too
def test_weights_loaded_into_the_model_reach_our_forward(arch):
    """`model.load_state_dict(...)` after our forward was built: its fused products and their laid-out copies are
    made again from the loaded weights, so passes give bitwise what a target built on those weights gives (before,
    a loaded model kept running its old weights in the C layers)."""
    from dflash.models.target import choose_kernels
    from dflash.testing import tiny_target

    loaded, fresh = tiny_target(arch, logit_scale=4.0), tiny_target(arch, logit_scale=4.0)
    for target in (loaded, fresh):
        choose_kernels(target, "native")
    state = {name: value.clone() for name, value in loaded.model.state_dict().items()}
    for name in state:
        if name.endswith(("q_proj.weight", "up_proj.weight", "q_proj.bias")):
            state[name] = state[name] * 3 + 0.01
        if name.endswith(("lm_head.weight", "embed_tokens.weight")):  # the greedy screen's head (tied or not)
            state[name] = state[name].flip(0)
    ids = torch.tensor([[5, 9, 12, 7, 3]])
    for target in (loaded, fresh):
        target.screen_greedy = True
    before = loaded.forward(ids, loaded.new_cache()).logits
    loaded.greedy_of(loaded.forward(ids, loaded.new_cache(), logits_at="hidden").hidden)  # the screen, made
    loaded.model.load_state_dict(state)
    fresh.model.load_state_dict(state)
    after = loaded.forward(ids, loaded.new_cache()).logits
    assert not torch.equal(after, before)
    assert torch.equal(after, fresh.forward(ids, fresh.new_cache()).logits)
    assert loaded.screens
    greedy = loaded.greedy_of(loaded.forward(ids, loaded.new_cache(), logits_at="hidden").hidden)
    assert torch.equal(greedy, after.argmax(-1))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("part", ["q_proj.weight", "k_proj.weight", "v_proj.weight", "q_proj.bias", "o_proj.weight",
                                  "gate_proj.weight", "up_proj.weight", "down_proj.weight", "input_layernorm.weight",
                                  "post_attention_layernorm.weight", "model.norm.weight", "lm_head.weight",
                                  "embed_tokens.weight"])
def test_an_in_place_write_to_a_models_weight_reaches_our_forward(arch, part):
    """`param.mul_(...)` under no_grad on any of the model's weights after our forward was built (a merge of
    adapters, an edit) is seen by the next pass: it gives bitwise what a target built on the written weights gives.
    The fused products' source weights had been `.data` views with version counters of their own, so writes to
    q, k, v, gate and up went unseen by the C layers."""
    from dflash.models.target import choose_kernels
    from dflash.testing import tiny_target

    written, fresh = tiny_target(arch, logit_scale=4.0), tiny_target(arch, logit_scale=4.0)
    for target in (written, fresh):
        choose_kernels(target, "native")
        target.screen_greedy = True
    params = dict(written.model.named_parameters())
    names = [n for n in params if n.endswith(part) and (".layers.1." in n or not ".layers." in n)]
    if not names:
        pytest.skip(f"no {part} in {arch}")
    ids = torch.tensor([[5, 9, 12, 7, 3]])
    before = written.forward(ids, written.new_cache()).logits
    written.greedy_of(written.forward(ids, written.new_cache(), logits_at="hidden").hidden)  # the screen, made
    with torch.no_grad():
        params[names[0]].mul_(3).add_(0.01)
    fresh.model.load_state_dict(written.model.state_dict())
    after = written.forward(ids, written.new_cache()).logits
    assert not torch.equal(after, before)
    assert torch.equal(after, fresh.forward(ids, fresh.new_cache()).logits)
    greedy = written.greedy_of(written.forward(ids, written.new_cache(), logits_at="hidden").hidden)
    assert torch.equal(greedy, after.argmax(-1))


def test_feature_layers_out_of_range_are_a_users_error(tiny_targets):
    from dflash.errors import UserError

    target = tiny_targets["llama"]
    for layers, bad in [((0, 99), 99), ((-1, 1), -1), ((1, target.num_layers), target.num_layers)]:
        with pytest.raises(UserError, match=f"feature layer {bad} is out of range for a {target.num_layers}-layer"):
            target.forward(torch.tensor([[5, 6]]), None, layers)
    features = target.forward(torch.tensor([[5, 6]]), None, (0, target.num_layers - 1)).features
    assert features.shape == (1, 2, 2 * target.hidden_size)  # the first and last layers' outputs, side by side


def test_a_generation_reads_the_weights_versions_once_and_sees_writes_made_before_it(monkeypatch):
    """Inside a generation (TargetModel.weights_held: the engine's run) the C stack checks the weights' versions at
    the first pass only; a weight written in place between two generations reaches the second one, which gives
    bitwise what a target built on the written weights gives; outside a generation every pass checks."""
    from dflash.engine import GenerationConfig, SpeculativeDecoder
    from dflash.methods.base import Proposer
    from dflash.models import native
    from dflash.models.target import choose_kernels
    from dflash.models.transformer import ProductsUnchanged
    from dflash.testing import tiny_target

    if native.library() is None:
        pytest.skip(f"no native kernels: {native.why_not}")
    written, fresh = tiny_target("llama", logit_scale=4.0), tiny_target("llama", logit_scale=4.0)
    for target in (written, fresh):
        choose_kernels(target, "native")
    asked = []
    holds = ProductsUnchanged.holds
    monkeypatch.setattr(ProductsUnchanged, "holds", lambda self, versions=True: asked.append(versions) or holds(
        self, versions))
    config = GenerationConfig(max_new_tokens=6, ignore_eos=True)
    prompt = [5, 9, 12, 7, 3]
    written.forward(torch.tensor([prompt]), written.new_cache())  # the stack's arguments made, outside a window
    asked.clear()
    before = SpeculativeDecoder(written, Proposer()).generate(prompt, config).tokens
    assert asked[0] is True and len(asked) > 3 and not any(asked[1:])  # once, then taken as read
    assert written.engine.versions_held is None  # the window closed
    with torch.no_grad():
        written.model.model.layers[1].mlp.down_proj.weight.mul_(-3.0)
        written.model.lm_head.weight.mul_(2.0)
    fresh.model.load_state_dict(written.model.state_dict())
    after = SpeculativeDecoder(written, Proposer()).generate(prompt, config).tokens
    assert after == SpeculativeDecoder(fresh, Proposer()).generate(prompt, config).tokens
    assert after != before
    cache = written.new_cache()
    for token in prompt:  # steps, as the generation's last passes were (the stack's arguments are kept by width)
        written.forward(torch.tensor([[token]]), cache)
    assert asked[-len(prompt):] == [True] * len(prompt)  # outside a generation: every pass


@pytest.mark.parametrize("arch", FAMILIES)
def test_a_fresh_prefill_attends_causally_and_equals_the_masked_pass(family_targets, arch, monkeypatch):
    """A prompt into an empty cache runs SDPA's causal kernel (no mask of bools), except on sliding-window layers
    the prompt outruns (tiny Gemma3: window 16); after a cached prefix the mask stays. Logits, features and the
    cache's keys and values are bitwise those of the same pass given masks of bools."""
    from dflash.models import sdpa_backends
    from dflash.models.layers import causal_mask

    target = family_targets[arch]
    ids = torch.randint(1, 60, (2, 40), generator=torch.Generator().manual_seed(3))
    seen = []
    real = sdpa_backends.attention

    def recording(q, keys, values, mask, *args, **kwargs):
        seen.append(mask if mask is sdpa_backends.CAUSAL else None if mask is None else tuple(mask.shape))
        return real(q, keys, values, mask, *args, **kwargs)

    def run():
        cache = target.new_cache(2, 48)
        out = target.forward(ids, cache, (0, 2))
        return out, cache

    monkeypatch.setattr(sdpa_backends, "attention", recording)
    causal, causal_cache = run()
    windows = [layer.window for layer in target.engine.layers]
    assert seen == [sdpa_backends.CAUSAL if w is None or w >= 40 else (2, 1, 40, 40) for w in windows]
    if arch == "gemma3":
        assert None not in windows and any(w < 40 for w in windows)
    after_prompt = torch.tensor([[40, 41], [40, 41]])  # two more tokens a row after the cached prompt
    assert Transformer._mask(after_prompt, [40, 40], 2, 42, None).shape == (2, 1, 2, 42)
    monkeypatch.setattr(Transformer, "_mask", staticmethod(lambda positions, starts, n, end, w:
                                                           causal_mask(positions, end, w)))
    masked, masked_cache = run()
    torch.testing.assert_close(causal.logits, masked.logits, rtol=0, atol=0)
    torch.testing.assert_close(causal.features, masked.features, rtol=0, atol=0)
    for a, b in ((causal_cache.keys, masked_cache.keys), (causal_cache.values, masked_cache.values)):
        assert torch.equal(a[..., :40, :], b[..., :40, :])


def test_prompts_go_to_the_c_stack_up_to_where_its_ratio_to_torch_reaches_one():
    """Up to where the line through the C stack's time over torch's at the last length it won at and the first it
    lost at reaches 1; where it won at every length, along the line through the last two, once 1024 was timed."""
    from dflash.models.target import prompts_in_c_from

    def medians(c64, c384, c1024=None):
        timed = {"c64": c64, "torch64": 1.0, "c384": c384, "torch384": 1.0}
        return timed if c1024 is None else {**timed, "c1024": c1024, "torch1024": 1.0}

    assert prompts_in_c_from(medians(0.8, 0.9)) == 1 << 30  # won at both, 1024 not timed: every length
    assert prompts_in_c_from(medians(0.8, 0.9, 1.1)) == 704  # 384 + 0.1 / 0.2 x 640
    assert prompts_in_c_from(medians(0.8, 0.9, 0.95)) == 1664  # still winning at 1024: 1024 + 0.05 / 0.05 x 640
    assert prompts_in_c_from(medians(0.8, 0.9, 0.85)) == 1 << 30  # winning by more as prompts grow: every length
    assert prompts_in_c_from(medians(0.8, 1.1)) == 277  # 64 + 0.2 / 0.3 x 320
    assert prompts_in_c_from(medians(1.1, 0.9)) == 0  # lost at the shortest: none
    assert prompts_in_c_from(medians(1.0, 1.0)) == 0  # a tie keeps torch's layers


def test_prompts_take_the_pass_length_that_measured_fastest_held_to_a_scores_budget():
    """The longest timed prompt's fastest pass length, the shorter on a tie; a pass after a long context is halved
    while its attention scores (tokens x heads x positions, float32) would pass SCORES_BUDGET, down to 64."""
    from dflash.models.target import prompt_chunk_from
    from dflash.models.transformer import SCORES_BUDGET

    assert prompt_chunk_from({"c384@64": 1.0, "c384@256": 0.8}) == 256
    assert prompt_chunk_from({"c384@64": 0.9, "c384@256": 0.95}) == 64
    assert prompt_chunk_from({"c384@64": 1.0, "c384@256": 1.0}) == 64
    engine = tiny_target("llama").engine
    engine.prompt_chunk = 256
    heads = engine.heads
    assert engine._chunk_at(0) == 256
    assert engine._chunk_at(SCORES_BUDGET // (4 * heads * 256) - 256) == 256
    assert engine._chunk_at(SCORES_BUDGET // (4 * heads * 256) - 255) == 128
    assert engine._chunk_at(10 ** 9) == 64


def test_the_prompt_path_is_measured_once_per_machine_and_can_be_turned_off(tmp_path, monkeypatch):
    """choose_prompts_in_c times real prompts both ways through this target's own forward, caches the choice per
    machine (a second load reads it) and reports it; DFLASH_PROMPTS_IN_C=0 keeps prompts in torch's layers."""
    from dflash.models import target as target_module
    from dflash.models.target import LONG_PROMPT, PROMPT_LENGTHS, choose_prompts_in_c

    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    target = tiny_target("llama")
    timed = []

    def medians(calls, repeats):
        for name, call in calls.items():
            call()  # each way really runs its prompt
            timed.append((name, target.engine.prompts_in_c_up_to, target.engine.prompt_chunk))
        # C wins at 64 and, in passes of 256, at 384 too
        return {name: 0.5 if name in (f"c{PROMPT_LENGTHS[0]}", f"c{PROMPT_LENGTHS[1]}@256") else 1.0
                for name in calls}

    monkeypatch.setattr(target_module, "interleaved_medians", medians)
    # the cache's staleness check times a step of each target: a tiny one's 0.1 ms varies by more than its margin
    monkeypatch.setattr(target_module, "time_pass", lambda *args, **kwargs: 1.0)
    choose_prompts_in_c(target)
    # won at 64 and 384 (ratio 0.5), so a long prompt timed too (1024, or the tiny target's 512 positions), where it
    # tied: up to where 0.5 rises to 1, that length
    long_prompt = min(LONG_PROMPT, target.max_context)
    assert target.engine.prompts_in_c_up_to == long_prompt == target.kernel_report["prompts_in_c_up_to"]
    assert target.engine.prompt_chunk == 256 == target.kernel_report["prompt_chunk"]
    short, long = PROMPT_LENGTHS
    assert sorted(timed) == sorted([(f"torch{short}", 0, 64), (f"torch{long}", 0, 64), (f"c{short}", 1 << 30, 64)]
                                   + [(f"c{long}@{chunk}", 1 << 30, chunk) for chunk in (64, 256)]
                                   + [(f"torch{long_prompt}", 0, 64), (f"c{long_prompt}", 1 << 30, 256)])
    timed.clear()
    again = tiny_target("llama")
    choose_prompts_in_c(again)
    assert not timed and again.engine.prompts_in_c_up_to == long_prompt and again.engine.prompt_chunk == 256
    monkeypatch.setenv("DFLASH_PROMPTS_IN_C", "0")
    choose_prompts_in_c(again)
    assert again.engine.prompts_in_c_up_to == 0
