"""Target adapter: the layer-feature convention and KV-cache rollback."""

import pytest
import torch

from conftest import ARCHS


@pytest.mark.parametrize("arch", ARCHS)
def test_features_are_layer_outputs(tiny_targets, arch):
    """Feature of layer i == HF output_hidden_states[i + 1] (index 0 is the embedding output)."""
    target = tiny_targets[arch]
    ids = torch.tensor([[5, 9, 11, 7, 20, 33]])
    layers = (0, 1, 2)
    out = target.forward(ids, None, layers)
    with torch.no_grad():
        ref = target.model(input_ids=ids, output_hidden_states=True)
    expected = torch.cat([ref.hidden_states[i + 1] for i in layers], dim=-1)
    torch.testing.assert_close(out.features, expected)
    torch.testing.assert_close(out.logits, ref.logits.float())
    # a wrong offset (hidden_states[i]) must NOT match: guards the known off-by-one pitfall
    wrong = torch.cat([ref.hidden_states[i] for i in layers], dim=-1)
    assert not torch.allclose(out.features, wrong)


@pytest.mark.parametrize("arch", ARCHS)
def test_rollback_equals_fresh_forward(tiny_targets, arch):
    """After verifying a block and rejecting part of it, the cache equals a fresh prefill of the committed tokens;
    gemma3's 16-token sliding window is passed on purpose."""
    target = tiny_targets[arch]
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


def test_truncate_rejects_growth(tiny_targets):
    target = tiny_targets["llama"]
    cache = target.new_cache()
    target.forward(torch.tensor([[5, 6, 7]]), cache)
    with pytest.raises(ValueError):
        cache.truncate(4)
