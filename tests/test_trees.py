"""Tree verification (trees.py): a tree pass computes at every node what a causal pass over the node's path does,
the accepted path's cache is what a chain would have left, and tree rounds change no output, greedy or seeded
sampled, alone or batched."""

import itertools
import math

import pytest
import torch

from conftest import ARCHS, OracleTree
from dflash import trees
from dflash.engine import Engine, GenerationConfig, SpeculativeDecoder
from dflash.errors import UserError
from dflash.methods.dflash.drafter import DFlashConfig, DFlashDrafter
from dflash.methods.dflash.proposer import DFlashProposer
from dflash.models.transformer import Transformer
from dflash.sampling import SamplingConfig

PROMPT = [5, 9, 12, 7, 3, 22, 40, 17, 8]
# a tree with branches at every depth, a deep path through later siblings, and a lone leaf at the end
PARENTS = [-1, 0, 0, 1, 2, 2, 4, 3, 6, 0, 8]
# a path of 20 with branches off it: past the tiny Gemma3's window of 16, its deep nodes' windows start among
# their own ancestors, its shallow ones' in the cache
DEEP = [-1] + list(range(20)) + [4, 14, 19, 20]


def causal_last_logits(target, ids):
    cache = target.new_cache(capacity=len(ids) + 1)
    return target.forward(torch.tensor([ids]), cache).logits[0, -1]


def test_best_first_keeps_the_most_probable_paths():
    generator = torch.Generator().manual_seed(0)
    candidates = [[(10 * d + k, float(p)) for k, p in enumerate(torch.rand(3, generator=generator).sort(
        descending=True).values)] for d in range(4)]
    tokens, parents, probabilities = trees.best_first(candidates, 12)
    paths = {}
    for i, (token, parent) in enumerate(zip(tokens, parents)):
        assert parent <= i  # a parent's block index comes before its child's (i + 1)
        paths[i + 1] = (paths[parent] if parent else ()) + (token,)
    every = {}
    for depth in range(1, 5):
        for picks in itertools.product(*(range(3) for _ in range(depth))):
            path = tuple(candidates[d][k][0] for d, k in enumerate(picks))
            every[path] = math.prod(candidates[d][k][1] for d, k in enumerate(picks))
    best = sorted(every, key=every.get, reverse=True)[:12]
    assert set(paths.values()) == set(best)
    assert probabilities == sorted(probabilities, reverse=True)
    assert probabilities == pytest.approx([every[paths[i + 1]] for i in range(12)])


def test_walk_descends_by_the_targets_tokens():
    tokens = [99, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4]
    chosen = {0: 5, 2: 7, 4: 9, 6: 2}  # node -> the target's token there
    path, bonus = trees.walk(PARENTS, tokens, lambda path: chosen.get(path[-1], 0))
    assert path == [0, 2, 4, 6, 8] and bonus == 0
    assert trees.walk(PARENTS, tokens, lambda path: 77) == ([0], 77)
    assert trees.visibility([-1, 0, 0, 1])[3] == 0b1011


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("in_c", [True, False])
def test_tree_pass_logits_equal_causal_passes_over_each_path(tiny_targets, arch, in_c, monkeypatch):
    """Every node's logits and features are those of a causal pass over the prompt and the node's path, through
    the C stack and through torch's layers (Gemma3's sliding window of 16 reached, as the context passes it)."""
    if not in_c:
        monkeypatch.setattr(Transformer, "_tree_in_c", lambda self, n, end: False)
    target = tiny_targets[arch]
    prompt = PROMPT + ([11] * 12 if arch == "gemma3" else [])
    tokens = [PROMPT[-1]] + [(3 * i + 1) % target.vocab_size for i in range(1, len(PARENTS))]
    cache = target.new_cache(capacity=64)
    target.forward(torch.tensor([prompt[:-1]]), cache)
    out = target.forward(torch.tensor([tokens]), cache, (1, 2), tree=torch.tensor([PARENTS]))
    for node in range(len(PARENTS)):
        path = [node]
        while PARENTS[path[-1]] > 0:
            path.append(PARENTS[path[-1]])
        ids = prompt[:-1] + [tokens[0]] + [tokens[k] for k in reversed(path) if k]
        chain = target.new_cache(capacity=len(ids) + 1)
        causal = target.forward(torch.tensor([ids]), chain, (1, 2))
        assert torch.allclose(out.logits[0, node], causal.logits[0, -1], atol=1e-4, rtol=1e-4), node
        assert torch.allclose(out.features[0, node], causal.features[0, -1], atol=1e-4, rtol=1e-4), node


@pytest.mark.parametrize("arch", ARCHS)
def test_a_tree_wider_than_a_verify_pass_runs_in_c_and_matches(tiny_targets, arch, monkeypatch):
    """40 nodes (more than the 16 tokens a chain's verify pass runs in C; wider than Gemma3's tiny window of 16):
    the C stack's answer, every node equal to the torch layers' tree pass."""
    from dflash.models import native

    target = tiny_targets[arch]
    parents = [-1] + [(i - 1) // 3 for i in range(1, 40)]
    tokens = [PROMPT[-1]] + [(5 * i + 3) % target.vocab_size for i in range(1, 40)]
    outs, calls = [], []
    stack = native.stack
    monkeypatch.setattr(native, "stack", lambda h, *a, **k: calls.append(h.shape[1]) or stack(h, *a, **k))
    for in_c in (True, False):
        if not in_c:
            monkeypatch.setattr(Transformer, "_tree_in_c", lambda self, n, end: False)
        cache = target.new_cache(capacity=64)
        target.forward(torch.tensor([PROMPT[:-1]]), cache)
        outs.append(target.forward(torch.tensor([tokens]), cache, (1,), tree=torch.tensor([parents])))
    if native.library() is not None:
        assert calls.count(40) == 1  # the first tree pass went to C (and came back: no torch fallback)
    assert torch.allclose(outs[0].logits, outs[1].logits, atol=1e-4, rtol=1e-4)
    assert torch.allclose(outs[0].features, outs[1].features, atol=1e-4, rtol=1e-4)


def test_tree_pass_in_bfloat16_matches_the_causal_pass():
    """The C stack's bfloat16 tree pass (in pairs where the CPU has them) against a causal pass over one path."""
    from dflash.models.target import TargetModel
    from dflash.testing import NATIVE, tiny_target

    tiny = tiny_target("llama", logit_scale=4.0)
    target = TargetModel(model=tiny.model.to(torch.bfloat16), tokenizer=tiny.tokenizer, name="tiny-llama-bf16",
                         measure=False, kernel_plan=NATIVE)
    tokens = [PROMPT[-1]] + [(5 * i) % target.vocab_size for i in range(1, len(PARENTS))]
    cache = target.new_cache(capacity=64)
    target.forward(torch.tensor([PROMPT[:-1]]), cache)
    logits = target.forward(torch.tensor([tokens]), cache, tree=torch.tensor([PARENTS])).logits
    causal = causal_last_logits(target, PROMPT[:-1] + [tokens[0], tokens[2], tokens[4], tokens[6]])
    assert (logits[0, 6] - causal).abs().max() < 0.03 * causal.abs().max()


@pytest.mark.parametrize("context", [4, 5, 30])  # the cache's keys end inside a pair of keys or not; 8 at a time
@pytest.mark.parametrize("layout", ["float32", "bfloat16", "bfloat16-pairs", "bfloat16-amx"])
@pytest.mark.parametrize("arch,parents", [("llama", PARENTS), ("gemma3", PARENTS), ("gemma3", DEEP)],
                         ids=["llama", "gemma3", "gemma3-deep"])
def test_every_node_of_a_tree_pass_gives_bitwise_the_logits_of_steps_along_its_path(arch, parents, layout, context):
    """Why tree rounds stay lossless in bfloat16, where near-ties are common: each node's attention sums its keys
    (the cache's, then its ancestors' and its own) in the lanes and pairs a step reading them in a chain uses, so
    its logits are bitwise those of stepping its path one token at a time. Before, a bfloat16 SmolLM2 gave other
    greedy tokens than `ar` through `dflash:tree15` in 3 of 3 GSM8K answers. Gemma3's sliding window (16 here)
    counts from each node's own place in its chain: past it, the C stack had handed tree passes to torch's
    layers, whose sums are not a step's."""
    from dflash.models import native
    from dflash.models.target import TargetModel
    from dflash.testing import NATIVE, tiny_target

    if layout == "bfloat16-pairs" and not (native.library() is not None and native.library().dflash_bf16_pairs()):
        pytest.skip("no AVX512-BF16 here")
    if layout == "bfloat16-amx" and not (native.library() is not None and native.library().dflash_amx()):
        pytest.skip("no AMX here")
    in_pairs = layout in ("bfloat16-pairs", "bfloat16-amx")  # -amx: products and attention through tiles
    old = (native.set_bf16_pairs(in_pairs), native.set_amx(layout == "bfloat16-amx")) \
        if native.library() is not None else None
    try:
        tiny = tiny_target(arch, logit_scale=4.0, hidden_size=256)  # 4 heads of 64: value sums in pairs or tiles
        dtype = torch.float32 if layout == "float32" else torch.bfloat16
        target = TargetModel(model=tiny.model.to(dtype), tokenizer=tiny.tokenizer, name=f"tiny-{arch}-{layout}",
                             measure=False, kernel_plan=NATIVE)
        prompt = (PROMPT * 4)[:context]
        tokens = [(5 * i + 3) % target.vocab_size for i in range(len(parents))]
        cache = target.new_cache(capacity=64)
        target.forward(torch.tensor([prompt]), cache)
        stack = native.stack
        with pytest.MonkeyPatch.context() as patch:
            calls = []
            patch.setattr(native, "stack", lambda h, *a, **k: calls.append(h.shape[1]) or stack(h, *a, **k))
            tree = target.forward(torch.tensor([tokens]), cache, tree=torch.tensor([parents])).logits[0]
        if native.library() is not None:
            assert calls == [len(parents)]  # through the C stack, not torch's layers
        for node in range(len(parents)):
            path = [node]
            while parents[path[-1]] >= 0:
                path.append(parents[path[-1]])
            steps = target.new_cache(capacity=64)
            target.forward(torch.tensor([prompt]), steps)
            for k in reversed(path):
                logits = target.forward(torch.tensor([[tokens[k]]]), steps).logits[0, -1]
            assert torch.equal(tree[node], logits), f"node {node}"
    finally:
        if old is not None:
            native.set_bf16_pairs(old[0])
            native.set_amx(old[1])


@pytest.mark.parametrize("arch", ARCHS)
def test_kept_path_leaves_the_cache_a_chain_would(tiny_targets, arch):
    target = tiny_targets[arch]
    tokens = [PROMPT[-1]] + [(7 * i + 2) % target.vocab_size for i in range(1, len(PARENTS))]
    cache = target.new_cache(capacity=64)
    target.forward(torch.tensor([PROMPT[:-1]]), cache)
    start = len(cache)
    target.forward(torch.tensor([tokens]), cache, tree=torch.tensor([PARENTS]))
    path = [0, 2, 4, 6, 8, 10]
    cache.keep_path(0, start, path)
    cache.truncate(start + len(path))
    ids = PROMPT[:-1] + [tokens[k] for k in path]
    chain = target.new_cache(capacity=64)
    target.forward(torch.tensor([ids]), chain)
    step = torch.tensor([[13]])
    assert torch.allclose(target.forward(step, cache).logits, target.forward(step, chain).logits, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("sampling", [None, SamplingConfig(temperature=1.0, top_p=0.9, seed=11)])
def test_tree_rounds_change_no_output(tiny_targets, arch, sampling):
    """Greedy and seeded sampled outputs are plain decoding's with trees that hold the answer at random places,
    alone and in a batch beside a chain-drafting row; the trees are accepted deep (the moved cache is right)."""
    target = tiny_targets[arch]
    config = GenerationConfig(max_new_tokens=40, ignore_eos=True, sampling=sampling or SamplingConfig())
    reference = SpeculativeDecoder(target).generate(PROMPT, config).tokens
    result = SpeculativeDecoder(target, OracleTree(reference, len(PROMPT), 15, target.vocab_size),
                                adaptive=False).generate(PROMPT, config)
    assert result.tokens == reference
    assert result.stats.tau > 2.5
    other = [3, 4, 5]
    other_reference = SpeculativeDecoder(target).generate(other, config).tokens
    engine = Engine(target, OracleTree(reference, len(PROMPT), 15, target.vocab_size, seed=1), max_batch=3,
                    adaptive=False)
    seqs = [engine.submit(PROMPT, config), engine.submit(other, config), engine.submit(PROMPT, config)]
    for seq, ref in zip(seqs, (reference, other_reference, reference)):  # each row its own oracle
        seq.proposer = OracleTree(ref, len(seq.prompt_ids), 7 + 8 * (seq is seqs[1]), target.vocab_size)
    engine.run()
    assert [s.result.tokens for s in seqs] == [reference, other_reference, reference]


@pytest.mark.parametrize("arch", ARCHS)
def test_dflash_tree_drafts_change_no_output(tiny_targets, arch):
    target = tiny_targets[arch]
    cfg = DFlashConfig.for_target(target.config, target.vocab_size, 2, num_layers=1, block_size=8, num_features=2)
    drafter = DFlashDrafter.untrained(cfg, 0).freeze()
    config = GenerationConfig(max_new_tokens=30, ignore_eos=True)
    reference = SpeculativeDecoder(target).generate(PROMPT, config).tokens
    proposer = DFlashProposer(drafter, target, tree=20)
    result = SpeculativeDecoder(target, proposer, adaptive=False).generate(PROMPT, config)
    assert result.tokens == reference
    assert result.stats.draft_lengths and set(result.stats.draft_lengths) == {20}
    assert result.stats.draft_length_histogram[20] == result.stats.num_rounds  # more nodes than a block's drafts
    assert proposer.setup_report()["tree_nodes"] == 20
    assert SpeculativeDecoder(target, proposer).generate(PROMPT, config).tokens == reference
    proposer.start(PROMPT, target.forward(torch.tensor([PROMPT]), None, proposer.feature_layers).features)
    draft = proposer.propose(PROMPT + [reference[0]])
    assert len(draft.tokens) == 20 and all(0 <= p <= i for i, p in enumerate(draft.parents))
    assert draft.confidence == sorted(draft.confidence, reverse=True)
    with pytest.raises(UserError, match="1 to 63"):
        DFlashProposer(drafter, target, tree=64)


def test_tree_calibration_learns_and_prices_nodes_as_their_paths_chances():
    from dflash.control import CostModel, DraftController, TreeCalibration

    calibration = TreeCalibration()
    assert calibration.probability(0.3) == pytest.approx(0.3)  # the prior: the drafter's own path probability
    for i in range(200):  # paths the drafter gives 0.3 are accepted half the time, those it gives 0.02 never
        calibration.observe([0.3, 0.02], {1} if i % 2 else set())
    assert calibration.probability(0.3) == pytest.approx(0.5, abs=0.01)
    assert calibration.probability(0.02) < 0.001
    chances = calibration.chances([0.3, 0.3, 0.02])
    assert math.prod(chances[:2]) == pytest.approx(calibration.probability(0.3))  # Q_2 = c_1 c_2
    costs = CostModel()
    costs.seed({1: 1.0, 2: 1.1, 4: 1.2, 8: 1.4, 16: 1.8})
    costs.observe(1, 0.020)
    controller = DraftController(15, costs, tree_calibration=TreeCalibration())
    controller.rate = 1 / 0.020
    # best-first path probabilities: two likely nodes, then a tail that costs more than it brings
    nodes = [0.9, 0.6, 0.5, 0.3] + [0.01] * 11
    chosen = controller.choose(nodes, 15, tree=True)
    assert 2 <= chosen <= 4
    assert controller.chosen_value == pytest.approx(
        sum(nodes[:chosen]) - controller.rate * (costs.cost(chosen + 1) - costs.cost(1)))
    assert DraftController(15, costs, whole_blocks=True).choose(nodes, 15, tree=True) == 15


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_adaptive_trees_choose_their_size_and_change_no_output(tiny_targets, arch):
    """With the costs known (a fake clock that makes every token of a pass cost), the controller verifies a
    prefix of each tree, never more nodes than it drafted, and the output stays plain decoding's."""
    from test_control import FakeClock

    target = tiny_targets[arch]
    config = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    reference = SpeculativeDecoder(target).generate(PROMPT, config).tokens
    proposer = OracleTree(reference, len(PROMPT), 31, target.vocab_size)
    clock = FakeClock(base=0.010, per_token=0.004, draft=0.001)
    with pytest.MonkeyPatch.context() as monkeypatch:
        clock.install(monkeypatch, target, proposer)
        decoder = SpeculativeDecoder(target, proposer, timer=clock)
        decoder.engine.costs.seed({1: 1.0, 2: 1.4, 4: 2.2, 8: 3.8, 16: 7.0})
        result = decoder.generate(PROMPT, config)
    assert result.tokens == reference
    lengths = result.stats.draft_lengths
    assert max(lengths) <= 31 and min(lengths) < 31  # some rounds verified part of their tree


@pytest.mark.parametrize("arch", ARCHS)
def test_graphed_tree_passes_equal_the_eager_ones(arch):
    """A tree pass through the CUDA-graph path (replayed eagerly here: its device-side mask, depth positions and
    slot writes), padded to the graph's width, past Gemma3's window, gives the eager tree pass's logits and
    features, and tree rounds through graphs change no output."""
    from test_graphs import twins

    eager, graphed = twins(arch)
    prompt = PROMPT + [11] * 12
    tokens = [prompt[-1]] + [(3 * i + 1) % eager.vocab_size for i in range(1, len(PARENTS))]
    caches = eager.new_cache(capacity=96), graphed.new_cache()
    for target, cache in zip((eager, graphed), caches):
        target.forward(torch.tensor([prompt[:-1]]), cache)
    outs = [target.forward(torch.tensor([tokens]), cache, (1, 2), tree=torch.tensor([PARENTS]))
            for target, cache in zip((eager, graphed), caches)]
    assert graphed.graphs.captures == 2  # the prompt's pass and the tree's (width 16, its own graph)
    assert torch.allclose(outs[0].logits, outs[1].logits, atol=1e-5)
    assert torch.allclose(outs[0].features, outs[1].features, atol=1e-5)
    assert caches[0].lengths == caches[1].lengths
    config = GenerationConfig(max_new_tokens=30, ignore_eos=True)
    reference = SpeculativeDecoder(eager).generate(PROMPT, config).tokens
    tree = OracleTree(reference, len(PROMPT), 12, eager.vocab_size)
    result = SpeculativeDecoder(graphed, tree, adaptive=False).generate(PROMPT, config)
    assert result.tokens == reference and result.stats.tau > 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (captures real graphs)")
@pytest.mark.parametrize("arch", ARCHS)
def test_captured_tree_graphs_on_cuda_change_no_output(arch):
    from test_graphs import twins

    eager, graphed = twins(arch, "cuda")
    config = GenerationConfig(max_new_tokens=30, ignore_eos=True)
    reference = SpeculativeDecoder(eager).generate(PROMPT, config).tokens
    for target in (eager, graphed):
        tree = OracleTree(reference, len(PROMPT), 12, target.vocab_size)
        result = SpeculativeDecoder(target, tree, adaptive=False).generate(PROMPT, config)
        assert result.tokens == reference and result.stats.tau > 2
    assert graphed.graphs.captures and all(g.graph is not None for g in graphed.graphs.graphs.values())


@pytest.mark.parametrize("arch", ARCHS)
def test_eagle3_dynamic_trees_change_no_output_and_hold_the_chain(tiny_targets, arch):
    """EAGLE-3's dynamic tree (its expanded nodes run through the head together, each seeing its own ancestors):
    the output is plain decoding's, whole or adaptive; the tree is best first with parents before children; and
    it holds the chain's first two drafts as a path, the second as the first's likeliest child (the chain's second
    draft comes from the head's pass over the first, which the tree runs beside other nodes under a tree mask)."""
    from test_eagle3 import fresh_head
    from dflash.methods.eagle3.proposer import Eagle3Proposer

    target = tiny_targets[arch]
    head = fresh_head(target, scale=0.3)
    config = GenerationConfig(max_new_tokens=30, ignore_eos=True)
    reference = SpeculativeDecoder(target).generate(PROMPT, config).tokens
    for adaptive in (False, True):
        tree = Eagle3Proposer(head, target, depth=4, tree=20)
        assert SpeculativeDecoder(target, tree, adaptive=adaptive).generate(PROMPT, config).tokens == reference
    features = target.forward(torch.tensor([PROMPT]), None, head.feature_layers).features
    chain, tree = Eagle3Proposer(head, target, depth=2), Eagle3Proposer(head, target, depth=2, tree=63)
    drafts = {}
    for name, proposer in (("chain", chain), ("tree", tree)):
        proposer.start(PROMPT, features)
        drafts[name] = proposer.propose(PROMPT + [reference[0]])
    grown = drafts["tree"]
    assert all(0 <= p <= i for i, p in enumerate(grown.parents))
    assert grown.confidence == sorted(grown.confidence, reverse=True)
    first, second = drafts["chain"].tokens
    at = grown.tokens.index(first) + 1  # its block index
    assert grown.parents[at - 1] == 0
    children = [(t, c) for t, p, c in zip(grown.tokens, grown.parents, grown.confidence) if p == at]  # best first
    assert children[0][0] == second
    assert children[0][1] == pytest.approx(math.prod(drafts["chain"].confidence), rel=1e-5)  # the same head pass


def test_dflash_trees_in_a_batch_change_no_output(tiny_targets):
    """Rows of a batch draft their trees in one drafter pass (propose_batch) and verify them in one target pass."""
    target = tiny_targets["qwen3"]
    cfg = DFlashConfig.for_target(target.config, target.vocab_size, 2, num_layers=1, block_size=8, num_features=2)
    drafter = DFlashDrafter.untrained(cfg, 0).freeze()
    config = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    prompts = [PROMPT, [3, 4, 5], PROMPT[:4]]
    references = [SpeculativeDecoder(target).generate(p, config).tokens for p in prompts]
    engine = Engine(target, DFlashProposer(drafter, target, tree=10), max_batch=3, adaptive=False)
    seqs = [engine.submit(p, config) for p in prompts]
    engine.run()
    assert [s.result.tokens for s in seqs] == references
    assert all(set(s.result.stats.draft_lengths) == {10} for s in seqs)


def test_a_dynamic_tree_stops_growing_where_a_depth_does_not_pay(tiny_targets):
    from test_eagle3 import fresh_head
    from dflash.control import CostModel, DraftController
    from dflash.methods.eagle3.proposer import TREE_TOP_K, Eagle3Proposer

    costs = CostModel()
    costs.seed({1: 1.0, 2: 1.1, 4: 1.2, 8: 1.4, 16: 1.8})
    costs.observe(1, 0.020)
    costs.observe_drafting(0.007)
    controller = DraftController(7, costs)
    controller.rate = 1 / 0.020
    assert controller.keep_growing(0.9, 1) and not controller.keep_growing(0.01, 1)
    assert DraftController(7, costs, whole_blocks=True).keep_growing(0.01, 1)
    target = tiny_targets["llama"]
    head = fresh_head(target, scale=0.3)
    features = target.forward(torch.tensor([PROMPT]), None, head.feature_layers).features
    asked = []
    for stop_at in (1, 2):
        proposer = Eagle3Proposer(head, target, depth=5, tree=40)
        proposer.start(PROMPT, features)
        draft = proposer.propose(PROMPT + [7], keep_going=lambda p, depth: asked.append(p) or depth < stop_at)
        depth_of = {0: 0}
        for i, parent in enumerate(draft.parents):
            depth_of[i + 1] = depth_of[parent] + 1
        assert max(depth_of.values()) == stop_at and len(draft.tokens) == min(40, TREE_TOP_K ** stop_at)
    assert all(0 < p <= 1 for p in asked)  # the likeliest leaf's path probability


def test_greedy_and_sampled_rows_of_one_tree_round(tiny_targets):
    """A batch mixing greedy and seeded sampled rows (no screen: greedy rows argmax their logits, sampled ones
    read logits only at the nodes their walk visits) gives each row plain decoding's tokens."""
    target = tiny_targets["llama"]
    greedy = GenerationConfig(max_new_tokens=30, ignore_eos=True)
    sampled = GenerationConfig(max_new_tokens=30, ignore_eos=True,
                               sampling=SamplingConfig(temperature=1.0, top_k=20, seed=5))
    references = [SpeculativeDecoder(target).generate(PROMPT, c).tokens for c in (greedy, sampled)]
    engine = Engine(target, OracleTree(references[0], len(PROMPT), 15, target.vocab_size), max_batch=2,
                    adaptive=False)
    seqs = [engine.submit(PROMPT, greedy), engine.submit(PROMPT, sampled)]
    for seq, reference in zip(seqs, references):
        seq.proposer = OracleTree(reference, len(PROMPT), 15, target.vocab_size)
    engine.run()
    assert [s.result.tokens for s in seqs] == references
    assert all(s.result.stats.tau > 2 for s in seqs)
