"""Passes replayed as CUDA graphs (models/graphs.py), checked on CPU for everything but the capture: the graph-safe
forward (positions from a device tensor, scatter writes, attention over the whole capacity), widths padded to the
graph's, ragged rows, outputs that survive the next replay, graphs re-made when the cache's buffers change, and
generation through them token-identical to the eager engine."""

import pytest
import torch

from conftest import ARCHS, OracleProposer
from dflash.engine import Engine, GenerationConfig, SpeculativeDecoder
from dflash.errors import UserError
from dflash.methods.ngram import NgramProposer
from dflash.models.graphs import WIDTHS, padded_width
from dflash.testing import tiny_target
from test_batching import LENGTHS, PROMPTS, make_drafter_proposer

TOLERANCE = 1e-5  # float32, torch's kernels on both sides; attention over a longer (masked) key range


def twins(arch: str, device: str = "cpu"):
    """The same tiny target twice: eager, and through graphs (on a CPU replayed eagerly; on "cuda" captured)."""
    eager, graphed = tiny_target(arch, logit_scale=4.0), tiny_target(arch, logit_scale=4.0)
    for target in (eager, graphed):
        target.model.to(device)
    graphed.use_graphs(capacity=96, capture=False if device == "cpu" else None)
    return eager, graphed


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a - b).abs().max().item() <= TOLERANCE * max(1.0, b.abs().max().item())


def test_widths_pad_up_to_the_next_graph():
    assert [padded_width(n) for n in (1, 2, 3, 5, 8, 9, 17, 32)] == [1, 2, 4, 8, 8, 16, 32, 32]
    assert padded_width(max(WIDTHS) + 1) is None


@pytest.mark.parametrize("arch", ARCHS)
def test_graphed_passes_equal_the_eager_forward(arch):
    """Logits, features and cache lengths of steps and verify passes of every width (padded to the graph's) equal
    the eager forward's, past Gemma3's sliding window; one graph per (rows, width, feature layers)."""
    eager, graphed = twins(arch)
    ids = eager.encode_prompt("w20 w31 w9 w9 w40 w12 w3")
    caches = eager.new_cache(), graphed.new_cache()
    assert caches[1].capacity >= 96  # made at the graphs' capacity, so that it never grows under them
    for block in (ids, [5], [6, 7, 8], [9] * 5, [10] * 16, [11], [3] * 20):
        got = graphed.forward(torch.tensor([block]), caches[1], (2, 0))
        expected = eager.forward(torch.tensor([block]), caches[0], (2, 0))
        assert got.logits.shape == expected.logits.shape and got.features.shape == expected.features.shape
        assert close(got.logits, expected.logits) and close(got.features, expected.features)
        assert caches[0].lengths == caches[1].lengths
    assert graphed.graphs.captures == 5  # widths 8 (the prompt), 1, 4, 16, 32: the second 1-token pass reused one


def test_outputs_survive_the_next_replay():
    """The engine keeps a round's features (the drafter's context) past the next pass: what run returns must be
    a copy, not the graph's static output."""
    _, graphed = twins("llama")
    cache = graphed.new_cache()
    graphed.forward(torch.tensor([[5, 6, 7]]), cache, (1,))
    first = graphed.forward(torch.tensor([[8]]), cache, (1,))
    kept = first.features.clone()
    graphed.forward(torch.tensor([[9]]), cache, (1,))  # same graph, new inputs
    assert torch.equal(first.features, kept)


def test_ragged_rows_run_graphed():
    """Rows at different lengths write and attend at their own positions (a device tensor per token)."""
    eager, graphed = twins("qwen3")
    prompts = torch.tensor([[(5 * r + i) % 50 + 5 for i in range(9)] for r in range(3)])
    caches = eager.new_cache(batch=3), graphed.new_cache(batch=3)
    for target, cache in zip((eager, graphed), caches):
        target.forward(prompts, cache)
        cache.set_lengths([9, 6, 7])
    for block in ([[11, 12], [13, 14], [15, 16]], [[17], [18], [19]], [[20, 21, 22, 23, 24]] * 3):
        got = graphed.forward(torch.tensor(block), caches[1], (1,))
        expected = eager.forward(torch.tensor(block), caches[0], (1,))
        assert close(got.logits, expected.logits) and close(got.features, expected.features)
        assert caches[0].lengths == caches[1].lengths


def test_a_grown_cache_gets_new_graphs():
    """Graphs point at the cache's buffers: when a cache outgrows its capacity its buffers are new, and so are the
    graphs that run on it (the old ones would write into freed memory)."""
    eager, graphed = twins("llama")
    caches = eager.new_cache(), graphed.new_cache()
    prompt = torch.tensor([list(range(5, 20))])
    for target, cache in zip((eager, graphed), caches):
        target.forward(prompt, cache)
    graphed.forward(torch.tensor([[5]]), caches[1])
    eager.forward(torch.tensor([[5]]), caches[0])
    made = graphed.graphs.captures
    caches[1].reserve(caches[1].capacity + 1)  # new buffers
    got = graphed.forward(torch.tensor([[6]]), caches[1])
    assert graphed.graphs.captures == made + 1
    assert close(got.logits, eager.forward(torch.tensor([[6]]), caches[0]).logits)


def test_passes_a_graph_cannot_take_run_eagerly():
    """Wider than any graph, or a padded width past the cache's capacity: the eager forward, no graph made."""
    _, graphed = twins("llama")
    cache = graphed.new_cache(capacity=40)
    graphed.forward(torch.tensor([[5 + i % 40 for i in range(70)]]), cache)  # 70 tokens: wider than 64
    assert graphed.graphs.captures == 0
    small = graphed.engine.new_cache(capacity=8)  # no room for a padded 4-token pass after 5 tokens
    graphed.forward(torch.tensor([[5, 6, 7, 8, 9]]), small)
    assert graphed.graphs.captures == 1  # the 5-token prefill (width 8) fits exactly
    graphed.forward(torch.tensor([[5, 6, 7]]), small)
    assert graphed.graphs.captures == 1 and small.lengths == [8]


@pytest.mark.parametrize("arch", ARCHS)
def test_generation_through_graphs_is_token_identical(arch):
    """Plain, n-gram, DFlash and whole-block oracle decoding, batched with rows joining and leaving, give the
    eager engine's tokens when every step and verify pass replays a graph."""
    eager, graphed = twins(arch)
    prompts = [eager.encode_prompt(p) for p in PROMPTS]
    config = [GenerationConfig(max_new_tokens=n, ignore_eos=True) for n in LENGTHS]
    expected = [SpeculativeDecoder(eager).generate(ids, c).tokens for ids, c in zip(prompts, config)]
    for name, proposer in (("ar", None), ("ngram", NgramProposer(max_draft=5)),
                           ("dflash", make_drafter_proposer(graphed))):
        engine = Engine(graphed, proposer, max_batch=3)
        seqs = [engine.submit(ids, c) for ids, c in zip(prompts, config)]
        engine.run()
        assert [s.result.tokens for s in seqs] == expected, name
    oracle = SpeculativeDecoder(graphed, OracleProposer(expected[2], len(prompts[2]), 7), adaptive=False)
    assert oracle.generate(prompts[2], config[2]).tokens == expected[2]
    assert graphed.graphs.captures > 0


def test_graphs_need_cuda_and_our_forward():
    target = tiny_target("llama")
    with pytest.raises(UserError, match="CUDA"):
        target.use_graphs()  # capture asked for on a CPU target
    from dflash.models.target import TargetModel

    fallback = TargetModel(target.model, target.tokenizer, "tiny", prefer_transformers=True, measure=False)
    with pytest.raises(UserError, match="transformers"):
        fallback.use_graphs(capture=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (captures real graphs)")
@pytest.mark.parametrize("arch", ARCHS)
def test_captured_graphs_on_cuda_equal_the_eager_forward(arch):
    """The same passes as above, with real CUDA graphs: captured once per shape, replayed after."""
    eager, graphed = twins(arch, "cuda")
    assert_batched_graphs_keep_the_tokens(eager, graphed)


def assert_batched_graphs_keep_the_tokens(eager, graphed):
    """Plain and n-gram decoding of three prompts, two rows at a time through `graphed`'s captured graphs, give
    `eager`'s tokens, and every graph kept was captured."""
    prompts = [eager.encode_prompt(p) for p in PROMPTS[:3]]
    config = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    for proposer in (None, NgramProposer(max_draft=5)):
        expected = [SpeculativeDecoder(eager, proposer).generate(ids, config).tokens for ids in prompts]
        engine = Engine(graphed, proposer, max_batch=2)
        seqs = [engine.submit(ids, config) for ids in prompts]
        engine.run()
        assert [s.result.tokens for s in seqs] == expected
    assert all(g.graph is not None for g in graphed.graphs.graphs.values())


def test_graphs_are_on_by_default_only_where_they_can_run(monkeypatch):
    """The default (--cuda-graphs unset) of generate and bench: on for a CUDA target through our forward; off on a
    CPU or through transformers' forward (compiled or not: --compile then fuses the graphed passes); --cuda-graphs /
    --no-cuda-graphs decide otherwise."""
    import argparse

    from dflash.options import add_target_arguments
    from dflash.loading import graphs_by_default, load_target_cached
    from dflash.models.target import TargetModel

    target = tiny_target("llama")
    assert not graphs_by_default(target)  # a CPU target
    assert load_target_cached("tiny-llama").graphs is None
    fallback = TargetModel(target.model, target.tokenizer, "tiny", prefer_transformers=True, measure=False)
    monkeypatch.setattr(TargetModel, "device", property(lambda self: torch.device("cuda", 0)))
    assert graphs_by_default(target)
    assert not graphs_by_default(fallback)
    parser = argparse.ArgumentParser()
    add_target_arguments(parser)
    assert parser.parse_args([]).cuda_graphs is None
    assert parser.parse_args(["--cuda-graphs"]).cuda_graphs is True
    assert parser.parse_args(["--no-cuda-graphs"]).cuda_graphs is False


def test_commands_that_batch_graph_only_when_asked(monkeypatch):
    """serve, data and train (target_from_args(many_rows=True)) leave graphs off unless --cuda-graphs asks."""
    import argparse

    from dflash import loading

    asked = []
    monkeypatch.setattr(loading, "load_target_cached", lambda *args: asked.append(args[5]))  # cuda_graphs
    for graphs in (None, True, False):
        args = argparse.Namespace(target="tiny-llama", dtype="float32", device="cpu", kernels="auto", compile=False,
                                  cuda_graphs=graphs)
        loading.target_from_args(args)
        loading.target_from_args(args, many_rows=True)
    assert asked == [None, False, True, True, False, False]  # None: graphs_by_default decides


def test_the_drafters_graphed_pass_equals_its_eager_pass():
    """DFlashDrafter.forward_static (context padded to a graph width, its padding past the block) computes what
    forward with a cache computes, round after round, and leaves the cache holding the same keys."""
    from dflash.methods.dflash.graphs import DrafterGraphs
    from test_engine import make_drafter

    target = tiny_target("llama", logit_scale=4.0)
    drafter = make_drafter(target, 8)
    features = torch.randn(1, 30, len(drafter.config.target_layer_ids) * target.hidden_size)
    blocks = torch.randn(3, 1, 8, target.hidden_size)
    eager, static = drafter.new_cache(capacity=96), drafter.new_cache(capacity=96)
    graphs = DrafterGraphs(drafter, capture=False)
    with torch.inference_mode():
        drafter(blocks[0], torch.arange(20, 28)[None], features[:, :20], torch.arange(20)[None], cache=eager)
        drafter(blocks[0], torch.arange(20, 28)[None], features[:, :20], torch.arange(20)[None], cache=static)
        for block, (begin, end) in zip(blocks[1:], ((20, 23), (23, 30))):  # 3 new context tokens, then 7
            expected = drafter(block, torch.arange(end, end + 8)[None], features[:, begin:end],
                               torch.arange(begin, end)[None], cache=eager)
            assert graphs.handles(end - begin, static, 8)
            got = graphs.run(block, features[:, begin:end], static)
            assert close(got, expected) and static.lengths == eager.lengths == [end]
            assert close(static.keys[:, :, :, :end], eager.keys[:, :, :, :end])
    assert graphs.captures == 2  # widths 4 and 8
    assert not graphs.handles(40, static, 8)  # wider than any graph: the eager pass


def test_generation_with_the_drafter_graphed_is_token_identical_and_reuses_its_graphs():
    """One sequence after another through a graphed target: the DFlash proposer drafts through its graphs, keeps its
    cache (so the second sequence captures nothing new), and the tokens equal the eager engine's."""
    eager, graphed = twins("llama")
    prompts = [eager.encode_prompt(p) for p in PROMPTS[:2]]
    config = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    expected = [SpeculativeDecoder(eager).generate(ids, config).tokens for ids in prompts]
    proposer = make_drafter_proposer(graphed)
    decoder = SpeculativeDecoder(graphed, proposer, adaptive=False)
    assert decoder.generate(prompts[0], config).tokens == expected[0]
    made = proposer.graphs.captures
    assert made > 0
    assert decoder.generate(prompts[1], config).tokens == expected[1]
    assert proposer.graphs.captures == made


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (captures real graphs)")
def test_captured_drafter_graphs_on_cuda_keep_generation_identical():
    """The DFlash drafter's pass captured for real beside the target's: the tokens of the eager engine."""
    eager, graphed = (tiny_target("llama", logit_scale=4.0) for _ in range(2))
    for target in (eager, graphed):
        target.model.to("cuda")
    graphed.use_graphs(capacity=96)
    prompts = [eager.encode_prompt(p) for p in PROMPTS[:2]]
    config = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    expected = [SpeculativeDecoder(eager).generate(ids, config).tokens for ids in prompts]
    from dflash.methods.dflash.proposer import DFlashProposer
    from test_engine import make_drafter

    proposer = DFlashProposer(make_drafter(graphed, 8).to("cuda"), graphed)
    decoder = SpeculativeDecoder(graphed, proposer, adaptive=False)
    assert [decoder.generate(ids, config).tokens for ids in prompts] == expected
    assert proposer.graphs.captures > 0
    assert all(g.graph is not None for g in proposer.graphs.graphs.values())


def test_a_batch_runs_at_a_padded_row_count_in_its_free_rows():
    """Three rows of a four-row batch replay the four-row graph (the free row at length 0, its output dropped) and
    commit the eager engine's tokens; a view without free rows after it is never widened."""
    eager, graphed = twins("llama")
    prompts = [eager.encode_prompt(p) for p in PROMPTS[:3]]
    config = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    expected = [SpeculativeDecoder(eager).generate(ids, config).tokens for ids in prompts]
    engine = Engine(graphed, NgramProposer(max_draft=3), max_batch=4)
    seqs = [engine.submit(ids, config) for ids in prompts]
    engine.run()
    assert [s.result.tokens for s in seqs] == expected
    row_counts = {key[4] for key in graphed.graphs.graphs}
    assert 4 in row_counts and 3 not in row_counts
    cache = graphed.new_cache(batch=4)
    assert cache.view(0, 3).widened(4) is None  # not known to be free
    assert cache.view(0, 3, spare_after=True).widened(8) is None  # past the cache
    wide = cache.view(0, 3, spare_after=True).widened(4)
    assert wide.batch == 4 and wide.lengths == [0, 0, 0, 0]


def test_compiled_graphed_passes_equal_the_eager_forward_and_compile_once_a_width():
    """--compile on a graphed target (TargetModel.compile_graphs): the graphed pass's layers run through
    torch.compile (inductor; on CUDA the graphs capture its kernels), one compile per width shared by every layer;
    its logits equal the eager forward's and generation is token-identical (on a CPU replayed eagerly, compiled)."""
    import torch._dynamo
    from dflash.models.kernels import PLAIN


    eager, graphed = twins("llama")
    graphed.use_kernels(PLAIN)  # torch's products, which inductor traces (our C kernels would break its graph)
    with pytest.raises(UserError):
        tiny_target("llama").compile_graphs()  # no graphs to compile
    graphed.compile_graphs()
    assert "compiled:graphs:" in graphed.measurement_key("pass-costs")
    assert torch._dynamo.config.recompile_limit >= len(WIDTHS) * 8  # every width at every padded row count
    torch._dynamo.reset()
    prompt = eager.encode_prompt(PROMPTS[0])
    config = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    expected = SpeculativeDecoder(eager).generate(prompt, config).tokens
    assert SpeculativeDecoder(graphed).generate(prompt, config).tokens == expected
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # the steps' width, for all four layers
    ids = torch.tensor([prompt[:3]])
    cache_eager, cache_graphed = eager.new_cache(capacity=96), graphed.new_cache(capacity=96)
    want = eager.forward(ids, cache_eager).logits
    got = graphed.forward(ids, cache_graphed).logits  # a 3-token pass: the graph of width 4, compiled anew
    assert close(got, want) and torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
    proposer = make_drafter_proposer(graphed)  # a DFlash drafter beside it: its graphed pass compiled too
    proposer.drafter.use_plan(PLAIN)  # as on a GPU: torch's products (oneDNN's packed ones are opaque to inductor)
    assert proposer.graphs.compiled
    drafted = SpeculativeDecoder(graphed, proposer, adaptive=False).generate(prompt, config)
    assert drafted.tokens == expected and torch._dynamo.utils.counters["stats"]["unique_graphs"] > 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (captures real graphs)")
@pytest.mark.parametrize("arch", ARCHS)
def test_captured_compiled_graphs_on_cuda_keep_generation_identical(arch):
    """--compile on a CUDA target: inductor's kernels captured in the graphs, batched rows and drafts included,
    give the eager engine's tokens."""
    eager, graphed = twins(arch, "cuda")
    graphed.compile_graphs()
    assert_batched_graphs_keep_the_tokens(eager, graphed)


def test_a_bench_reports_the_graphs_captured_and_what_capturing_them_took(monkeypatch):
    """Each kept set of graphs counts its captures and the seconds they took (compiles included: they happen in the
    capture's warm-up calls); `dflash bench` reports the target's and its drafters' (results.json and results.md)."""
    import time

    from dflash.bench import graph_captures
    from dflash.bench_report import graph_capture_lines
    from dflash.bench_runners import EngineRunner
    from dflash.models.graphs import CapturedCall
    from dflash.sampling import SamplingConfig

    class Recorded:  # what a captured CUDA graph offers the replay
        def replay(self):
            pass

        def pool(self):
            return None

    def capture(self, pool):  # a capture's warm-up: the call runs (eagerly here), taking its time
        time.sleep(0.02)
        self.outputs = self.run(**self.inputs)
        self.graph = Recorded()

    monkeypatch.setattr(CapturedCall, "_capture", capture)
    eager, graphed = twins("llama")
    assert graph_captures(eager, {}) is None  # no graphs, nothing to report
    graphed.graphs.capture = True  # the graphs made from now on capture (through the stand-in above)
    proposer = make_drafter_proposer(graphed)
    runner = EngineRunner("dflash", graphed, proposer, SamplingConfig(), adaptive=False)
    runner.generate(graphed.encode_prompt(PROMPTS[0]), 12, True)
    report = graph_captures(graphed, {"ar": EngineRunner("ar", graphed, NgramProposer(), SamplingConfig()),
                                      "dflash": runner})
    target, (drafter,) = report["target"], report["drafters"]
    assert target["graphs"] == graphed.graphs.captures >= 1 and drafter["graphs"] == proposer.graphs.captures >= 1
    assert target["capture_seconds"] >= 0.02 * target["graphs"] and drafter["capture_seconds"] >= 0.02
    line = graph_capture_lines(report)[0]
    assert line.startswith(f"CUDA graphs captured (compiles included): target {target['graphs']} in")
