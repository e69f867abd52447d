import gc
import importlib

import pytest
import torch

from dflash import threads
from dflash.methods.base import Draft, Proposer

# The commands' modules import generate's config_from_args by name, and tests patch it to bias a random model. Each
# is imported here, before any test: one first imported while a patch holds (the CLI imports every command) would
# keep the patched function for the rest of the session, and a later test's outputs would not be its own.
for command in ("dflash.batch", "dflash.chat", "dflash.openai_batch"):
    importlib.import_module(command)

# Tiny models gain nothing from a second thread, and on a busy CPU threads that wait for each other make every
# small op many times slower. The real-model tests raise this for themselves.
torch.set_num_threads(1)
threads.pin()  # and the engine keeps them: tests/test_threads.py tests the chooser itself
ARCHS = ("llama", "qwen3", "gemma3")


@pytest.fixture(autouse=True)
def unfrozen_heap():
    """The CLI's commands freeze what they loaded (loading.settle_heap); in this one long process a test's objects
    go back to the collector after it, or a later test's garbage could never be collected."""
    yield
    if gc.get_freeze_count():
        gc.unfreeze()


@pytest.fixture(autouse=True, scope="session")
def cuda_attention_chosen():
    """On a CUDA machine, the tiny targets' eager attention runs under a measured SDPA backend, as a loaded target's
    does (target.py, sdpa_backends.py): torch's default plans every fresh shape anew (SmolLM2's calls: 43-64 ms
    each on a lent H200, docs/data/h200_38), and decoding meets a fresh shape at every call, so eager tests on
    CUDA would pay that thousands of times."""
    if torch.cuda.is_available():
        from dflash.models import sdpa_backends

        # the tiny targets' heads (testing.tiny_config): 4 query heads, 2 key/value heads of 16
        sdpa_backends.choose(torch.device("cuda", torch.cuda.current_device()), torch.float32, 4, 2, 16)
    yield


@pytest.fixture(scope="session")
def tiny_targets():
    from dflash.testing import tiny_target

    return {arch: tiny_target(arch, logit_scale=4.0) for arch in ARCHS}


@pytest.fixture(scope="session")
def byte_targets():
    """Tiny targets with a byte-level tokenizer of 320 tokens, which can write JSON (structured output, tools)."""
    from dflash.testing import tiny_target

    return {arch: tiny_target(arch, vocab_size=320, logit_scale=4.0, tokenizer="bytes") for arch in ARCHS}


@pytest.fixture(scope="session")
def hermes_targets():
    """Byte-level tiny targets of two architectures whose chat template writes tool calls in <tool_call> tags."""
    from dflash.testing import tiny_target

    return {arch: tiny_target(arch, vocab_size=320, logit_scale=4.0, tokenizer="hermes") for arch in ARCHS[:2]}


class OracleProposer(Proposer):
    """Proposes the target's own (known) continuation: every draft is accepted."""

    name = "oracle"

    def __init__(self, reference: list[int], prompt_len: int, max_draft: int):
        self.reference, self.prompt_len, self.max_draft = reference, prompt_len, max_draft

    def propose(self, sequence, limit=None, keep_going=None):
        done = len(sequence) - self.prompt_len
        count = self.max_draft if limit is None else min(limit, self.max_draft)
        return Draft(self.reference[done : done + count])


class RandomProposer(Proposer):
    """Uniformly random drafts: almost everything is rejected, at random places."""

    name = "random"

    def __init__(self, vocab_size: int, max_draft: int, seed: int = 0):
        self.vocab_size, self.max_draft = vocab_size, max_draft
        self.generator = torch.Generator().manual_seed(seed)

    def propose(self, sequence, limit=None, keep_going=None):
        count = self.max_draft if limit is None else min(limit, self.max_draft)
        return Draft(torch.randint(0, self.vocab_size, (count,), generator=self.generator).tolist())


def pairs_run_here() -> bool:
    """Whether this build and CPU multiply bfloat16 in pairs (native.c, AVX512-BF16)."""
    from dflash.models import native

    lib = native.library()
    return lib is not None and bool(lib.dflash_bf16_pairs())


def amx_runs_here() -> bool:
    """Whether this build, CPU and OS run products in pairs through AMX tiles (native.c, AMX-BF16)."""
    from dflash.models import native

    lib = native.library()
    return lib is not None and bool(lib.dflash_amx())


def pairs_chain(x, weight):
    """VDPBF16PS's sums, as documented: for each pair of inputs, the odd one's product added first, then the even
    one's, each rounded to float32 (a product of two bfloat16 is exact in float32, so each step is an FMA)."""
    import torch

    xf, wf = x.float(), weight.float()
    acc = torch.zeros(x.shape[0], weight.shape[0])
    for j in range(0, weight.shape[1], 2):
        if j + 1 < weight.shape[1]:
            acc = acc + xf[:, j + 1: j + 2] * wf[:, j + 1][None]
        acc = acc + xf[:, j: j + 1] * wf[:, j][None]
    return acc


def wide_pass_and_steps(target, width: int):
    """(the logits of one pass of `width` tokens, those of the same tokens one step at a time), both after the same
    8-token prompt: a verify pass must give bitwise its steps for speculation to be lossless"""
    import torch

    prompt = target.encode_prompt("w20 w31 w9 w9 w40 w12 w3 w8")
    block = [(5 * i + 7) % 50 + 5 for i in range(width)]
    together, alone = target.new_cache(capacity=128), target.new_cache(capacity=128)
    target.forward(torch.tensor([prompt]), together)
    target.forward(torch.tensor([prompt]), alone)
    wide = target.forward(torch.tensor([block]), together).logits[0]
    return wide, torch.cat([target.forward(torch.tensor([[t]]), alone).logits[0] for t in block])


@pytest.fixture(params=["widened", "pairs", "amx"])
def bf16_layout(request):
    """bfloat16 weights laid out for the widening kernel, then in pairs summed by VDPBF16PS (where the CPU has
    AVX512-BF16), then in pairs through AMX tiles (where it has AMX); the layout and kernel in force for what the
    test lays out and runs, restored after."""
    from dflash.models import native

    if request.param == "pairs" and not pairs_run_here():
        pytest.skip("no AVX512-BF16 here: bfloat16 products in pairs do not run")
    if request.param == "amx" and not amx_runs_here():
        pytest.skip("no AMX here: products in pairs do not run through tiles")
    if native.library() is None:
        yield request.param
        return
    old = native.set_bf16_pairs(request.param != "widened"), native.set_amx(request.param == "amx")
    try:
        yield request.param
    finally:
        native.set_bf16_pairs(old[0])
        native.set_amx(old[1])


class OracleTree(Proposer):
    """Random trees that hold the target's known continuation as a path of random depth, its nodes among random
    siblings (before and after them), plus random branches: the accepted path skips slots at every depth."""

    name = "oracle-tree"

    def __init__(self, reference: list[int], prompt_len: int, nodes: int, vocab_size: int, seed: int = 0):
        self.reference, self.prompt_len, self.vocab = reference, prompt_len, vocab_size
        self.tree_nodes, self.max_draft = nodes, 8
        self.generator = torch.Generator().manual_seed(seed)

    def _random(self, high: int) -> int:
        return int(torch.randint(0, high, (), generator=self.generator))

    def propose(self, sequence, limit=None, keep_going=None):
        done = len(sequence) - self.prompt_len
        truth = self.reference[done: done + self._random(self.max_draft + 1)]
        tokens, parents, at = [], [], 0  # `at`: the block index of the path's last node (0: the bonus)
        for token in truth:
            if len(tokens) + 2 > self.tree_nodes:
                break
            decoys = self._random(3)
            first = self._random(decoys + 1)
            for k in range(decoys + 1):
                tokens.append(token if k == first else (token + 1 + k) % self.vocab)
                parents.append(at)
            at = len(tokens) - decoys + first
        while len(tokens) < self.tree_nodes:
            parents.append(self._random(len(tokens) + 1))
            tokens.append(self._random(self.vocab))
        return Draft(tokens, [0.5] * len(tokens), parents=parents)
