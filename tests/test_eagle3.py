"""The EAGLE-3 baseline: lossless through the shared engine, inference equals the training-time unroll, checkpoints
round-trip, and a short training run lifts acceptance far above an untrained head."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import ARCHS
from dflash.engine import GenerationConfig, SpeculativeDecoder
from dflash.errors import UserError
from dflash.methods.base import MethodOptions
from dflash.methods.eagle3.head import Eagle3Head, HiddenHalf, default_feature_layers
from dflash.corpus import frequent_tokens
from dflash.methods.eagle3.objective import Eagle3Objective, eagle3_loss, unroll
from dflash.methods.eagle3.proposer import Eagle3Proposer
from dflash.methods.eagle3.proposer import build as build_eagle3
from dflash.testing import tiny_target

PROMPTS = ["w1 w2 w3 w4 w5", "w7 w7 w7", "w20 w31 w9 w9 w40 w12 w3"]
FIRST_WORD = 5  # ids 0..4 are the tiny tokenizer's special tokens


def generate(target, proposer, ids, max_new=32):
    config = GenerationConfig(max_new_tokens=max_new, ignore_eos=True)
    return SpeculativeDecoder(target, proposer).generate(ids, config)


def build_eagle3_proposer(target, path=None):
    return build_eagle3(target, MethodOptions(drafter=path))


def fresh_head(target, scale=None, draft_vocab=None, seed=0):
    torch.manual_seed(seed)
    head = Eagle3Head.for_target(target, draft_vocab=draft_vocab, seed=seed)
    if scale is not None:  # a sharper random head: distinct argmaxes make equality checks meaningful
        with torch.no_grad():
            for p in head.parameters():
                if p.dim() == 2:
                    p.normal_(0, scale)
    return head


def test_default_feature_layers():
    assert default_feature_layers(30) == [2, 15, 27]
    assert default_feature_layers(36) == [2, 18, 33]
    assert all(0 <= i < 4 for i in default_feature_layers(4))
    assert all(0 <= i < 2 for i in default_feature_layers(2))


@pytest.mark.parametrize("arch", ARCHS)
def test_untrained_head_is_lossless(tiny_targets, arch):
    target = tiny_targets[arch]
    proposer, note = build_eagle3_proposer(target)
    assert "UNTRAINED" in note and proposer.max_draft == 7 and len(proposer.feature_layers) == 3
    for prompt in PROMPTS:
        ids = target.encode_prompt(prompt)
        assert generate(target, proposer, ids).tokens == generate(target, None, ids).tokens


def test_reduced_vocab_sharp_head_is_lossless(tiny_targets):
    target = tiny_targets["llama"]
    head = fresh_head(target, scale=0.3, draft_vocab=range(FIRST_WORD, 40))
    proposer = Eagle3Proposer(head, target, depth=5)
    for prompt in PROMPTS:
        ids = target.encode_prompt(prompt)
        result = generate(target, proposer, ids)
        assert result.tokens == generate(target, None, ids).tokens
        assert result.stats.block_size == 6


def test_chain_drafts_equal_training_unroll(tiny_targets):
    """The cached chain at inference (with rollback of speculative K/V) must be what the TTT unroll trains."""
    target = tiny_targets["qwen3"]
    head = fresh_head(target, scale=0.3)
    proposer = Eagle3Proposer(head, target)
    seq = torch.randint(FIRST_WORD, target.vocab_size, (24,), generator=torch.Generator().manual_seed(3)).tolist()
    features = target.forward(torch.tensor([seq]), None, head.feature_layers).features
    proposer.start(seq[:10], features[:, :10])
    last = 10  # position of the pending bonus token
    for accepted in (3, 1, 5, 0):
        drafts = proposer.propose(seq[: last + 1]).tokens
        teacher = seq[: last + 1] + drafts
        full = target.forward(torch.tensor([teacher]), None, head.feature_layers).features
        with torch.no_grad():
            embeds = target.embed_tokens(torch.tensor([teacher[1:]]))
            outputs = unroll(head, embeds, head.fuse(full[:, :-1]), steps=len(drafts))
        # the chain is rooted at pair last-1 (last committed feature + bonus); its step k sits at pair last-1+k
        expected = [int(head.draft_to_target(head.logits(outputs[k][0, last - 1 + k]).argmax())) for k in range(7)]
        assert drafts == expected
        # pretend `accepted` drafts were accepted: the bonus and them enter the cache with their target features
        proposer.commit(seq[last : last + accepted + 1], features[:, last : last + accepted + 1])
        last += accepted + 1


def test_save_load_round_trip(tiny_targets, tmp_path):
    target = tiny_targets["llama"]
    vocab = frequent_tokens([[7, 7, 9, 12], [9, 7, 3]], target.vocab_size, 16)
    assert len(vocab) == 16 and {3, 7, 9, 12} <= set(vocab)
    head = fresh_head(target, scale=0.3, draft_vocab=vocab)
    head.save(tmp_path / "head")
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["draft_vocab_size"] == 16 and config["target_layer_ids"] == list(head.feature_layers)
    loaded, note = build_eagle3_proposer(target, str(tmp_path / "head"))
    assert note is None
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.head.state_dict()[name], tensor), name
    drafted = loaded.head.draft_to_target(torch.arange(16))
    assert drafted.tolist() == vocab
    ids = target.encode_prompt(PROMPTS[2])
    a, b = generate(target, Eagle3Proposer(head, target), ids), generate(target, loaded, ids)
    assert a.tokens == b.tokens and a.stats.accept_lengths == b.stats.accept_lengths


def test_bad_checkpoints_are_user_errors(tiny_targets, tmp_path):
    target = tiny_targets["llama"]
    with pytest.raises(UserError, match="not found"):
        build_eagle3_proposer(target, str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="needs config.json"):
        build_eagle3_proposer(target, str(tmp_path / "empty"))
    other = tiny_target("llama", num_layers=2)
    fresh_head(target).save(tmp_path / "head")
    cfg = json.loads((tmp_path / "head" / "config.json").read_text())
    cfg["hidden_size"] = 32
    (tmp_path / "head" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError):
        build_eagle3_proposer(other, str(tmp_path / "head"))


def test_loss_weights_and_masks(tiny_targets):
    target = tiny_targets["llama"]
    head = fresh_head(target)
    ids = torch.randint(FIRST_WORD, target.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    loss, metrics = eagle3_loss(head, target, ids, loss_start=torch.tensor([4, 8]), steps=3)
    assert loss.requires_grad and torch.isfinite(loss)
    assert metrics["accuracy"].shape == (3,) and 1.0 <= float(metrics["tau"]) <= 4.0
    loss.backward()
    assert head.fc.weight.grad is not None and head.lm_head.weight.grad.abs().sum() > 0
    # no label anywhere: the loss is zero, never NaN
    none, _ = eagle3_loss(head, target, ids, loss_start=ids.shape[1], steps=3)
    assert float(none) == 0.0


def test_objective_interface(tiny_targets, tmp_path):
    """What the generic trainer calls: usable, loss(example, rng), evaluate, save."""
    target = tiny_targets["llama"]
    objective = Eagle3Objective(fresh_head(target), target, steps=3)
    ids = torch.randint(FIRST_WORD, target.vocab_size, (20,), generator=torch.Generator().manual_seed(1))
    example = SimpleNamespace(id="x", input_ids=ids.to(torch.int32), loss_start=6)
    assert objective.usable(example)
    assert not objective.usable(SimpleNamespace(id="y", input_ids=ids[:6], loss_start=6))
    loss, metrics = objective.loss(example, np.random.default_rng(0))
    loss.backward()
    assert set(metrics) == {"loss", "accuracy", "tau"} and not metrics["loss"].requires_grad
    record = objective.evaluate([example], [np.random.default_rng(0)])
    assert record["eval_tau"] >= 1.0 and len(record["eval_accuracy"]) == 3
    objective.save(tmp_path / "head", torch.bfloat16)
    loaded, _ = build_eagle3_proposer(target, str(tmp_path / "head"))
    assert loaded.head.d2t.dtype == torch.long and loaded.head.fc.weight.dtype == torch.float32


# ---- training lifts acceptance ----------------------------------------------------------------------------------
def counting_target():
    """A tiny target whose greedy continuation counts: w_k -> w_{k+1} (cycling over the word ids).
    The decoder layers write nothing into the residual stream, and lm_head row y holds the embedding of y's
    predecessor, so the argmax after token x is x + 1."""
    target = tiny_target("qwen3", logit_scale=1.0)
    model = target.model
    words = torch.arange(FIRST_WORD, target.vocab_size)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head = model.get_output_embeddings().weight
        head.zero_()
        head[words] = 10 * model.get_input_embeddings().weight[words.roll(1)]
    return target


def counting_sequences(n, length, generator, vocab_size=64):
    span = vocab_size - FIRST_WORD
    starts = torch.randint(0, span, (n, 1), generator=generator)
    return FIRST_WORD + (starts + torch.arange(length)) % span


def mean_tau(target, proposer, prompts, max_new=40):
    """Acceptance with every draft verified: the adaptive controller would verify fewer drafts where this machine's
    wider passes cost more, so its tau measures the machine as much as the head."""
    taus = []
    config = GenerationConfig(max_new_tokens=max_new, ignore_eos=True)
    for ids in prompts:
        result = SpeculativeDecoder(target, proposer, adaptive=False).generate(ids, config)
        assert result.tokens == generate(target, None, ids, max_new).tokens
        taus.append(result.stats.tau)
    return sum(taus) / len(taus)


def test_training_lifts_acceptance():
    torch.manual_seed(0)
    target = counting_target()
    generator = torch.Generator().manual_seed(0)
    prompts = counting_sequences(3, 4, generator).tolist()
    # the training data below is exactly the target's own greedy output, as `dflash data` would regenerate it
    span = target.vocab_size - FIRST_WORD
    continuation = generate(target, None, prompts[0], 8).tokens
    assert continuation == [FIRST_WORD + (prompts[0][-1] - FIRST_WORD + i) % span for i in range(1, 9)]

    head = fresh_head(target, seed=1)
    untrained = mean_tau(target, Eagle3Proposer(head, target), prompts)
    objective = Eagle3Objective(head, target, steps=7)
    optimizer = torch.optim.AdamW(head.parameters(), lr=3e-3)
    for _ in range(120):
        batch = counting_sequences(8, 20, generator)
        loss, metrics = eagle3_loss(head, target, batch, loss_start=4, steps=objective.steps)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    trained = mean_tau(target, Eagle3Proposer(head.eval(), target), prompts)
    assert untrained < 1.3
    assert trained > 4.0, (untrained, trained, metrics)


def head_on_our_kernels(dtype):
    """A tiny Llama target and a fresh head, both in `dtype`, frozen on our kernels (skips where there are none)."""
    from dflash.models import native
    from dflash.models.target import choose_kernels

    if native.library() is None:
        pytest.skip(f"no native kernels: {native.why_not}")
    target = tiny_target("llama", logit_scale=4.0)
    target.model.to(dtype)
    choose_kernels(target, "native")
    return target, fresh_head(target, scale=0.3).to(dtype).freeze(target.kernel_plan)


def random_cache(head, committed: int = 5, capacity: int = 10):
    """A head cache whose slots hold random keys and values (fixed seeds), `committed` of them counted."""
    cache = head.new_cache(32)
    cache.reserve(capacity)
    cache.keys.normal_(generator=torch.Generator().manual_seed(2))
    cache.values.normal_(generator=torch.Generator().manual_seed(3))
    cache.advance(committed)
    return cache


@pytest.mark.parametrize("pairs", [1, 3])  # a speculative pair; a round's first step over several real pairs
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_draft_step_runs_as_one_c_layer_and_matches_torchs(dtype, pairs, monkeypatch):
    """Pairs through native.c's standard layer (HiddenHalf: the embedding's half of q/k/v added to each token's
    q/k/v inside the layer, the rest a pre-norm layer over the hidden state) give the torch step's hidden states and
    keys and values, within rounding."""
    from dflash.models import native

    target, head = head_on_our_kernels(dtype)
    calls = []
    layer = native.layer
    monkeypatch.setattr(native, "layer", lambda *a, **k: calls.append(1) or layer(*a, **k))
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(1, pairs, target.hidden_size, generator=generator).to(dtype)
    embeds = target.embed_tokens(torch.tensor([[9, 14, 3][:pairs]]))
    outs, caches = [], []
    with torch.inference_mode():
        for in_c in (True, False):
            if not in_c:
                head.__dict__["_hidden_half"] = None
            cache = random_cache(head)
            outs.append(head.step(embeds, hidden, 6, cache).float())  # pairs past the committed 5
            caches.append((cache.keys[..., :6 + pairs, :].float(), cache.values[..., :6 + pairs, :].float()))
    assert calls == [1]  # the C step ran, and only for the first
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # of the largest value: bfloat16 rounds at 2^-8
    for ours, theirs in [outs] + list(zip(*caches)):
        assert (ours - theirs).abs().max() <= tolerance * theirs.abs().max()


def two_depths_of_a_tree(head, target, dtype, in_c: bool, generator_seed: int = 1):
    """A draft tree's first two depths through `tree_step` after 5 committed pairs (random cached keys/values): three
    nodes under the root at slots 5-7, then children of the second and third at slots 8-9, each seeing the committed
    pairs, its ancestors' slots and its own. Returns the five outputs and the cache's keys/values of slots 0-9."""
    generator = torch.Generator().manual_seed(generator_seed)
    root = torch.randn(1, 1, target.hidden_size, generator=generator).to(dtype)
    if not in_c:
        head.__dict__["_hidden_half"] = None
    cache = random_cache(head)
    seen = torch.zeros(3, 8, dtype=torch.bool)
    seen[:, :5] = True
    seen[[0, 1, 2], [5, 6, 7]] = True
    first = head.tree_step(target.embed_tokens(torch.tensor([[9, 14, 3]])), root.expand(1, 3, -1),
                           torch.full((3,), 5), 5, seen, cache)
    seen = torch.zeros(2, 10, dtype=torch.bool)
    seen[:, :5] = True
    seen[0, [6, 8]] = seen[1, [7, 9]] = True
    second = head.tree_step(target.embed_tokens(torch.tensor([[20, 11]])), first[:, 1:3], torch.full((2,), 6), 8,
                            seen, cache)
    return torch.cat([first, second], dim=1), (cache.keys[..., :10, :], cache.values[..., :10, :])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_trees_depth_runs_as_one_c_layer_and_matches_torchs(dtype, monkeypatch):
    """A dynamic tree's depth passes through native.c's layer, the earlier depths' nodes in the cache (a region of
    visibility bits that starts before the pass: tree_back), give the torch tree step's hidden states and keys and
    values within rounding; and each node's output is bitwise the C chain step's along its path (the same keys in
    the same order)."""
    from dflash.models import native

    target, head = head_on_our_kernels(dtype)
    calls = []
    layer = native.layer
    monkeypatch.setattr(native, "layer", lambda *a, **k: calls.append(k.get("tree") is not None) or layer(*a, **k))
    # torch's float32 product of several rows is not the rows' one by one (its blocking moves with them): the
    # embedding's half row by row, so that the comparison with chain steps below isolates the C layer's
    half, product = head.__dict__["_hidden_half"], HiddenHalf.embedding_rows
    monkeypatch.setattr(half, "embedding_rows", lambda normed: torch.cat(
        [product(half, normed[:, i: i + 1]) for i in range(normed.shape[1])], dim=1))
    with torch.inference_mode():
        ours, our_cache = two_depths_of_a_tree(head, target, dtype, in_c=True)
        assert calls == [True, True]
        # each node against the C chain step along its path: slots 5.. in path order, positions 5, 6
        root = torch.randn(1, 1, target.hidden_size, generator=torch.Generator().manual_seed(1)).to(dtype)
        for path, tokens, nodes in [((0,), [9], [0]), ((1, 3), [14, 20], [1, 3]), ((2, 4), [3, 11], [2, 4])]:
            cache = random_cache(head)
            hidden = root
            for depth, (token, node) in enumerate(zip(tokens, nodes)):
                hidden = head.step(target.embed_tokens(torch.tensor([[token]])), hidden, 5 + depth, cache)
                assert torch.equal(hidden[0, 0], ours[0, node]), (path, node)
        theirs, their_cache = two_depths_of_a_tree(head, target, dtype, in_c=False)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # of the largest value: bfloat16 rounds at 2^-8
    for a, b in [(ours, theirs)] + list(zip(our_cache, their_cache)):
        assert (a.float() - b.float()).abs().max() <= tolerance * b.float().abs().max()


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_trees_depths_in_c_are_bitwise_their_paths(dtype, seed, monkeypatch):
    """Random trees of 4-5 depths (2-8 nodes a depth, each under a random node of the depth before; up to 40 slots
    of tree region, the last depths' pass reaching far past its own tokens): every node's output from the C tree
    step is bitwise the C chain step's along its path."""
    target, head = head_on_our_kernels(dtype)
    half, product = head.__dict__["_hidden_half"], HiddenHalf.embedding_rows
    monkeypatch.setattr(half, "embedding_rows", lambda normed: torch.cat(  # row by row, as in the test above
        [product(half, normed[:, i: i + 1]) for i in range(normed.shape[1])], dim=1))
    generator = torch.Generator().manual_seed(seed)
    root = torch.randn(1, 1, target.hidden_size, generator=generator).to(dtype)
    committed = 5
    cache = random_cache(head, committed, capacity=committed + 48)
    parents, tokens, outputs, slots = [], [], [], []  # per node, in slot order
    frontier, slot = [-1], committed
    with torch.inference_mode():
        for depth in range(int(torch.randint(4, 6, (1,), generator=generator))):
            m = int(torch.randint(2, 9, (1,), generator=generator))
            under = [frontier[int(i)] for i in torch.randint(len(frontier), (m,), generator=generator)]
            ids = torch.randint(FIRST_WORD, target.vocab_size, (m,), generator=generator).tolist()
            seen = torch.zeros(m, slot + m, dtype=torch.bool)
            seen[:, :committed] = True
            for k, parent in enumerate(under):
                seen[k, slot + k] = True
                while parent >= 0:
                    seen[k, slots[parent]] = True
                    parent = parents[parent]
            hidden = torch.stack([root[0, 0] if p < 0 else outputs[p] for p in under])[None]
            out = head.tree_step(target.embed_tokens(torch.tensor([ids])), hidden,
                                 torch.full((m,), committed + depth), slot, seen, cache)
            frontier = list(range(len(parents), len(parents) + m))
            for k in range(m):
                parents.append(under[k]), tokens.append(ids[k]), outputs.append(out[0, k]), slots.append(slot + k)
            slot += m
        for node in range(len(parents)):
            path = [node]
            while parents[path[-1]] >= 0:
                path.append(parents[path[-1]])
            chain, hidden = random_cache(head, committed, capacity=committed + 48), root
            for depth, step_node in enumerate(reversed(path)):
                hidden = head.step(target.embed_tokens(torch.tensor([[tokens[step_node]]])), hidden,
                                   committed + depth, chain)
            assert torch.equal(hidden[0, 0], outputs[node]), (node, path)


@pytest.mark.parametrize("fastest", ["plan", "native", "vnni"])
def test_the_heads_product_takes_the_kernel_a_drafting_pass_measures_fastest(tmp_path, monkeypatch, fastest):
    """The head's shape (its draft vocabulary's rows) is one no plan measured (oneDNN's packed kernel took 0.67 ms of
    a 1.4 ms bfloat16 SmolLM2 draft): the plan's kernel, ours and int8 rows with VNNI are timed on whole drafting
    passes (the clock injected here), in turns, cached per machine; int8 plans are left alone."""
    from dflash.models import native
    from dflash.models.kernels import INT8, PACKED
    from dflash.methods.eagle3.proposer import settled_head

    if native.library() is None:
        pytest.skip(f"no native kernels: {native.why_not}")
    if fastest == "vnni" and not native.int8_vnni():
        pytest.skip("no AVX512-VNNI here")
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    target = tiny_target("llama", vocab_size=96, logit_scale=4.0)
    head = fresh_head(target, scale=0.3, draft_vocab=range(FIRST_WORD, 45)).freeze(PACKED)  # 40 rows: no plan's
    proposer = Eagle3Proposer(head, target)
    kernel = lambda: head.fast_head.kernel_for_rows(1)  # noqa: E731
    timed = []
    fake = lambda p, t: timed.append(kernel()) or (1.0 if kernel() == {"plan": "packed"}.get(fastest, fastest) else 2.0)  # noqa: E731
    settled_head(proposer, target, PACKED, "bfloat16", repeats=3, seconds=fake)
    candidates = ["packed", "native"] + (["vnni"] if native.int8_vnni() else [])
    assert timed == candidates * 3  # every candidate, in turns
    assert kernel() == {"plan": "packed"}.get(fastest, fastest)
    settled_head(proposer, target, PACKED, "bfloat16", repeats=3, seconds=fake)
    assert len(timed) == 3 * len(candidates)  # a second build reads the cache
    before = kernel()
    settled_head(proposer, target, INT8, "int8", seconds=fake)
    assert kernel() == before and len(timed) == 3 * len(candidates)


def test_target_ids_follow_the_draft_vocabulary(tiny_targets):
    """The kept list of target ids is draft_to_target's, and is made again when the draft vocabulary changes."""
    head = fresh_head(tiny_targets["llama"], draft_vocab=range(FIRST_WORD, 40))
    assert head.target_ids() == head.draft_to_target(torch.arange(35)).tolist() == list(range(FIRST_WORD, 40))
    head.set_draft_vocab(range(20, 55))
    assert head.target_ids() == list(range(20, 55))


def test_a_training_step_never_reads_the_device(tiny_targets):
    """The unrolled loss and its backward pass run with the head, the target's embeddings and the features on the
    meta device (shapes, no values), where any operation whose size or value the host must read from the device
    would fail: on a GPU each would stall the step. Labels and their rows come from the host (draft_labels)."""
    import types

    target = tiny_targets["llama"]
    head = fresh_head(target)
    target_ids = head.target_ids()  # kept while the vocabulary stands (read once, before training)
    head = head.to("meta")
    head.target_ids = lambda: target_ids
    width = target.config.hidden_size
    on_meta = types.SimpleNamespace(embed_tokens=torch.nn.Embedding(target.vocab_size, width, device="meta"))
    ids = torch.randint(FIRST_WORD, target.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    features = torch.empty(2, 16, len(head.feature_layers) * width, device="meta")
    loss, metrics = eagle3_loss(head, on_meta, ids, torch.tensor([4, 8]), features, steps=3)
    loss.backward()
    assert loss.device.type == "meta" and metrics["accuracy"].shape == (3,)
    assert all(p.grad is not None for p in head.parameters() if p.requires_grad)
