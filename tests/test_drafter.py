"""The DFlash drafter: architecture facts, public checkpoint format, fit checks."""

import json

import pytest
import torch

from dflash.errors import UserError
from dflash.loading import build_proposer
from dflash.methods.base import MethodOptions
from dflash.methods.dflash.drafter import DFlashConfig, DFlashDrafter, default_target_layer_ids


def tiny_drafter(target, layers=2, block_size=8, mask_token_id=2):
    cfg = DFlashConfig.for_target(target.config, target.vocab_size, mask_token_id, num_layers=layers,
                                  block_size=block_size, num_features=3)
    return DFlashDrafter.untrained(cfg)


def test_default_feature_layers():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(30, 5) == [1, 8, 14, 20, 27]
    assert default_target_layer_ids(30, 1) == [15]


def test_public_weight_names(tiny_targets):
    drafter = tiny_drafter(tiny_targets["llama"], layers=2)
    per_layer = ["input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
                 "mlp.up_proj.weight", "mlp.down_proj.weight"] + [
        f"self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")]
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{i}.{name}" for i in range(2) for name in per_layer}
    assert set(drafter.state_dict()) == expected  # no embedding, no lm_head, nothing extra


def test_save_load_round_trip(tiny_targets, tmp_path):
    target = tiny_targets["qwen3"]
    drafter = tiny_drafter(target)
    drafter.save(tmp_path, dtype=None)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"] == {"mask_token_id": 2, "target_layer_ids": drafter.config.target_layer_ids}
    assert cfg["block_size"] == 8 and cfg["num_hidden_layers"] == 2 and len(cfg["layer_types"]) == 2
    loaded = DFlashDrafter.load(tmp_path)
    for name, tensor in drafter.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor, rtol=0, atol=0)
    drafter.save(tmp_path / "bf16")  # shipped form
    assert DFlashDrafter.load(tmp_path / "bf16").fc.weight.dtype == torch.float32


def test_loads_foreign_config_keys(tiny_targets, tmp_path):
    """A config written by another implementation (extra keys, rope_parameters) loads and keeps its extras."""
    drafter = tiny_drafter(tiny_targets["llama"])
    drafter.save(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["torch_dtype"] = "bfloat16"
    cfg["rope_parameters"] = {"rope_theta": cfg.pop("rope_theta"), "rope_type": "default"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    loaded = DFlashDrafter.load(tmp_path)
    assert loaded.config.rope_theta == drafter.config.rope_theta
    assert loaded.config.to_hf_dict()["torch_dtype"] == "bfloat16"


def test_mismatch_errors(tiny_targets, tmp_path):
    llama, qwen = tiny_targets["llama"], tiny_targets["qwen3"]
    drafter = tiny_drafter(llama)
    drafter.config.target_layer_ids = [0, 9]
    with pytest.raises(UserError, match="out of range"):
        drafter.check_fits(llama)
    drafter = tiny_drafter(llama, mask_token_id=10_000)
    with pytest.raises(UserError, match="mask token"):
        drafter.check_fits(llama)
    from dflash.testing import tiny_target

    wide = tiny_target("llama", vocab_size=80)
    with pytest.raises(UserError, match="vocab"):
        tiny_drafter(llama).check_fits(wide)
    tiny_drafter(qwen).save(tmp_path / "ok")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    (tmp_path / "broken" / "model.safetensors").write_bytes(b"junk")
    with pytest.raises(UserError):
        DFlashDrafter.load(tmp_path / "broken")
    with pytest.raises(UserError, match="not a drafter folder"):
        DFlashDrafter.load(tmp_path / "missing")
    reshaped = json.loads((tmp_path / "ok" / "config.json").read_text())
    reshaped["intermediate_size"] += 8  # weights on disk no longer fit the config: an error, not a traceback
    (tmp_path / "ok" / "config.json").write_text(json.dumps(reshaped))
    with pytest.raises(UserError, match="do not match"):
        DFlashDrafter.load(tmp_path / "ok")
    (tmp_path / "ok" / "model.safetensors").write_bytes(b"\x00" * 10)
    with pytest.raises(UserError, match="corrupt"):
        DFlashDrafter.load(tmp_path / "ok")
    with pytest.raises(UserError, match="not found"):
        build_proposer("dflash", llama, MethodOptions(drafter=str(tmp_path / "nowhere")))


def run_block(drafter, target, block, start, features, cache=None, ctx_from=0):
    embeds = target.embed_tokens(torch.tensor([block]))
    positions = torch.arange(start, start + len(block))[None]
    ctx_positions = torch.arange(ctx_from, ctx_from + features.shape[1])[None]
    with torch.no_grad():
        return drafter(embeds, positions, features, ctx_positions, cache=cache)


def test_incremental_context_cache_matches_full(tiny_targets):
    """Feeding context in pieces through the cache == giving all context at once."""
    target = tiny_targets["gemma3"]
    drafter = tiny_drafter(target)
    ids = torch.randint(5, 60, (1, 24))
    feats = target.forward(ids, None, tuple(drafter.config.target_layer_ids)).features
    block = [7] + [2] * 7
    full = run_block(drafter, target, block, 24, feats)
    cache = drafter.new_cache()
    run_block(drafter, target, block, 10, feats[:, :10], cache)
    run_block(drafter, target, block, 17, feats[:, 10:17], cache, ctx_from=10)
    incremental = run_block(drafter, target, block, 24, feats[:, 17:], cache, ctx_from=17)
    torch.testing.assert_close(incremental, full, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_drafting_pass_reads_rope_from_the_table(tiny_targets, dtype):
    """A drafting pass's consecutive positions take their cos/sin from the rotary's table: bitwise what computing
    them gives, anywhere in a long context; other positions are computed as before."""
    drafter = tiny_drafter(tiny_targets["llama"])
    for positions in (torch.arange(0, 16)[None], torch.arange(300, 316)[None], torch.arange(5, 6)[None]):
        table, computed = drafter.rope_of(positions, dtype, from_table=True), drafter.rotary(positions, dtype)
        assert all(torch.equal(a, b) for a, b in zip(table, computed))
    scattered = torch.tensor([[3, 9, 4]])
    assert all(torch.equal(a, b) for a, b in zip(drafter.rope_of(scattered, dtype, from_table=True),
                                                  drafter.rotary(scattered, dtype)))
    assert drafter.rope_of(torch.empty(1, 0, dtype=torch.long), dtype, from_table=True)[0].shape[1] == 0


def test_block_is_bidirectional_and_context_matters(tiny_targets):
    target = tiny_targets["llama"]
    drafter = tiny_drafter(target)
    feats = torch.randn(1, 12, 3 * target.hidden_size)
    base = run_block(drafter, target, [7, 2, 2, 2], 12, feats)
    later_changed = run_block(drafter, target, [7, 2, 2, 9], 12, feats)
    assert not torch.allclose(base[0, 0], later_changed[0, 0])  # position 0 sees position 3
    ctx_changed = feats.clone()
    ctx_changed[0, 3] += 1.0
    assert not torch.allclose(base, run_block(drafter, target, [7, 2, 2, 2], 12, ctx_changed))


def test_draft_vocabulary_file(tiny_targets, tmp_path):
    drafter = tiny_drafter(tiny_targets["llama"])
    drafter.draft_vocab = [9, 5, 7]
    drafter.save(tmp_path / "d")
    assert DFlashDrafter.load(tmp_path / "d").draft_vocab == [5, 7, 9]
    (tmp_path / "d" / "draft_vocab.json").write_text('{"token_ids": [1, 999]}')
    with pytest.raises(UserError, match="token ids"):
        DFlashDrafter.load(tmp_path / "d")
    (tmp_path / "d" / "draft_vocab.json").write_text("[1, 2")
    with pytest.raises(UserError, match="draft vocabulary"):
        DFlashDrafter.load(tmp_path / "d")


def test_drafting_vocabulary_takes_in_the_prompts_tokens(tiny_targets):
    """A drafter with a draft vocabulary scores those LM-head rows plus the tokens of the prompt at hand."""
    from dflash.methods.dflash.proposer import DFlashProposer

    target = tiny_targets["qwen3"]
    drafter = tiny_drafter(target)
    drafter.draft_vocab = [5, 6, 7]
    proposer = DFlashProposer(drafter.freeze(), target)
    assert proposer.vocab_ids.tolist() == [5, 6, 7]
    prompt = [3, 40, 41, 7]
    features = target.forward(torch.tensor([prompt]), None, proposer.feature_layers).features
    proposer.start(prompt, features)
    assert proposer.vocab_ids.tolist() == [5, 6, 7, 3, 40, 41]  # the base head's rows, then the prompt's
    draft = proposer.propose(prompt + [9])
    assert set(draft.tokens) <= {3, 5, 6, 7, 40, 41} and len(draft.tokens) == drafter.config.block_size - 1
