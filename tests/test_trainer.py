"""`dflash train`: block construction, mask, labels, loss weights, learning, losslessness, exact resume."""

from __future__ import annotations

import json
import math
import random
import shutil

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dflash import trainer
from dflash.engine import GenerationConfig
from dflash.methods.dflash.objective import (
    IGNORE,
    DFlashObjective,
    accept_lengths,
    anchor_candidates,
    block_attention_mask,
    build_block_batch,
    default_gamma,
    position_weights,
    linear_cross_entropy,
    sample_anchors,
)
from dflash.cli import build_parser
from dflash.methods.dflash.attention import BlockLayout, block_sparse_attention
from dflash.methods.dflash.drafter import DFlashConfig, DFlashDrafter
from dflash.errors import UserError
from dflash.testing import tiny_target
from dflash.train_config import TrainConfig

MASK_ID = 2
WORDS = range(5, 64)  # the tiny tokenizer's ordinary words; 0..4 are special


def counting_records(count: int, seed: int = 0) -> list[dict]:
    """Prompt of random words, then a response that counts w_i -> w_{i+1} (mod the word range)."""
    rng = random.Random(seed)
    records = []
    for i in range(count):
        prompt_len, response_len, start = rng.randint(3, 8), rng.randint(20, 40), rng.randrange(len(WORDS))
        prompt = [3] + [rng.choice(WORDS) for _ in range(prompt_len - 1)]
        response = [WORDS[(start + j) % len(WORDS)] for j in range(response_len)]
        records.append({"id": f"count-{i}", "input_ids": prompt + response, "loss_start": prompt_len})
    return records


def write_shards(folder, records, shards: int = 2):
    folder.mkdir(parents=True, exist_ok=True)
    for s in range(shards):
        lines = [json.dumps(r) for r in records[s::shards]]
        (folder / f"shard-{s:05d}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def tiny_drafter(target, num_layers: int = 1, block_size: int = 4, seed: int = 0) -> DFlashDrafter:
    cfg = DFlashConfig.for_target(target.config, target.vocab_size, MASK_ID, num_layers=num_layers,
                                  block_size=block_size, num_features=2)
    return DFlashDrafter.untrained(cfg, seed)


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", logit_scale=4.0)


# ---- masks, blocks, labels -------------------------------------------------------------------------------------------
def brute_force_mask(anchors: list[int], seq_len: int, block_size: int) -> torch.Tensor:
    n = len(anchors)
    mask = torch.zeros(n * block_size, seq_len + n * block_size, dtype=torch.bool)
    for q in range(n * block_size):
        block = q // block_size
        for key in range(seq_len + n * block_size):
            if key < seq_len:
                mask[q, key] = key < anchors[block]
            else:
                mask[q, key] = (key - seq_len) // block_size == block
    return mask


def test_mask_matches_brute_force():
    seq_len, block_size = 23, 4
    anchors = [1, 5, 6, 14, 21]
    mask = block_attention_mask(torch.tensor(anchors), seq_len, block_size)
    assert torch.equal(mask, brute_force_mask(anchors, seq_len, block_size))
    for i, a in enumerate(anchors):
        rows = mask[i * block_size : (i + 1) * block_size]
        assert not rows[:, a].any(), "the anchor's own feature must not be visible (< not <=)"
        assert rows[:, a - 1].all()
        assert not rows[:, a + 1 : seq_len].any()
        own = slice(seq_len + i * block_size, seq_len + (i + 1) * block_size)
        assert rows[:, own].all(), "a block sees itself bidirectionally"
        assert rows[:, seq_len:].sum() == block_size * block_size, "blocks are blind to each other"


def test_block_inputs_and_labels_are_same_position():
    input_ids = torch.arange(10, 30)  # token at position p is 10 + p
    anchors = torch.tensor([3, 9, 17, 18])
    batch = build_block_batch(input_ids, anchors, block_size=4, mask_token_id=MASK_ID)
    assert batch.block_ids[:, 0].tolist() == [13, 19, 27, 28]
    assert (batch.block_ids[:, 1:] == MASK_ID).all()
    assert batch.positions.tolist()[0] == [3, 4, 5, 6]
    for i, a in enumerate(anchors.tolist()):
        assert batch.labels[i, 0] == IGNORE  # the given anchor token is not predicted
        for k in range(1, 4):
            expected = int(input_ids[a + k]) if a + k < len(input_ids) else IGNORE
            assert batch.labels[i, k] == expected, (a, k)
    assert batch.labels[3].tolist() == [IGNORE, 29, IGNORE, IGNORE]


def test_sample_anchors_inside_response_and_reseeded():
    rng = np.random.default_rng(0)
    anchors = sample_anchors(seq_len=100, loss_start=40, num=16, rng=rng)
    assert len(anchors) == 16 and len(set(anchors.tolist())) == 16
    assert anchors.tolist() == sorted(anchors.tolist())
    assert anchors.min() >= 40 and anchors.max() < 99
    again = sample_anchors(100, 40, 16, np.random.default_rng(0))
    assert torch.equal(anchors, again)
    assert not torch.equal(anchors, sample_anchors(100, 40, 16, rng))  # the next epoch's draw differs
    assert sample_anchors(100, 95, 512, rng).tolist() == [95, 96, 97, 98]  # capped by what is available


# ---- loss weights ----------------------------------------------------------------------------------------------------
def test_default_gamma_follows_the_paper():
    assert default_gamma(16) == 7 and default_gamma(10) == 5 and default_gamma(8) == 4
    assert default_gamma(12) == pytest.approx(5 + 2 / 3)


def test_position_weights_and_normalised_loss():
    w = position_weights(4, gamma=2.0)
    assert w.tolist() == pytest.approx([0.0, 1.0, math.exp(-0.5), math.exp(-1.0)])
    # two blocks of size 4; the first block's last label falls past the end of the sequence
    torch.manual_seed(0)
    logits = torch.randn(5, 7)
    labels = torch.tensor([3, 5, 1, 2, 6])  # positions (block, k): (0,1) (0,2) (1,1) (1,2) (1,3)
    weights = torch.tensor([1.0, math.exp(-0.5), 1.0, math.exp(-0.5), math.exp(-1.0)])
    ce = [-torch.log_softmax(logits[i], -1)[labels[i]].item() for i in range(5)]
    w1, w2, w3 = 1.0, 0.6065306597126334, 0.36787944117144233
    expected = (w1 * ce[0] + w2 * ce[1] + w1 * ce[2] + w2 * ce[3] + w3 * ce[4]) / (2 * w1 + 2 * w2 + w3)
    loss, predictions = linear_cross_entropy(logits, torch.eye(7), labels, weights)  # identity head: logits
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert torch.equal(predictions, logits.argmax(-1))


@pytest.mark.parametrize("rows", [3, 700, 1100])  # inside one chunk, and across 512-row chunk boundaries
def test_chunked_cross_entropy_matches_autograd(rows):
    torch.manual_seed(rows)
    hidden = torch.randn(rows, 16, dtype=torch.float64, requires_grad=True)
    head = torch.randn(50, 16, dtype=torch.float64)
    labels, weights = torch.randint(0, 50, (rows,)), torch.rand(rows, dtype=torch.float64)
    loss, predictions = linear_cross_entropy(hidden, head, labels, weights)
    loss.backward()
    reference = hidden.detach().clone().requires_grad_(True)
    logits = reference @ head.t()
    ce = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    expected = (ce * weights).sum() / weights.sum()
    expected.backward()
    torch.testing.assert_close(loss, expected.float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(hidden.grad, reference.grad, rtol=1e-6, atol=1e-8)
    assert torch.equal(predictions, logits.argmax(-1))
    with torch.no_grad():  # evaluation: same loss, no gradient work
        assert linear_cross_entropy(hidden, head, labels, weights)[0].item() == pytest.approx(loss.item())


@pytest.mark.parametrize("scale", [1.0, 60.0])  # 60: labels hundreds of logits below the argmax (p underflows)
def test_cross_entropy_over_bfloat16_products_keeps_float32_statistics(scale):
    """With the head in bfloat16 (a GPU step under autocast) the logits come out in bfloat16 and are never copied to
    float32; the loss is still the float64 cross-entropy of those same logits to float32 precision, even where a
    label's probability underflows float32, and the gradient is it to bfloat16's rounding."""
    torch.manual_seed(int(scale))
    rows, vocab = 300, 50
    hidden = (torch.randn(rows, 16) * scale).requires_grad_()
    head = torch.randn(vocab, 16).bfloat16()
    labels, weights = torch.randint(0, vocab, (rows,)), torch.rand(rows)
    loss, predictions = linear_cross_entropy(hidden, head, labels, weights)
    loss.backward()
    logits = (hidden.detach().bfloat16() @ head.t()).double().requires_grad_()  # the products the loss saw
    ce = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    expected = (ce * weights.double()).sum() / weights.double().sum()
    expected.backward()
    assert torch.isfinite(loss) and ce.max() > (100 if scale > 1 else 0)
    torch.testing.assert_close(loss.double(), expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(predictions, logits.argmax(-1))
    reference = logits.grad @ head.double()
    torch.testing.assert_close(hidden.grad.double(), reference, rtol=2e-2, atol=2e-2 * reference.abs().max().item())


def gradient_tolerance(dtype) -> dict:
    """A loss chunk's logits' gradient, compared across kernels: stored in `dtype`, so bf16's rounding is the bound."""
    return dict(rtol=1e-2, atol=1e-3) if dtype != torch.float32 else dict(rtol=1e-5, atol=1e-7)


def test_compiled_loss_terms_equal_the_eager_ones():
    """The `compiled` kernel's loss chunk (torch.compile of hard_label_terms, dynamic shapes) gives the eager loss,
    argmax and logits' gradient, for float32 and bfloat16 logits and chunks of different sizes."""
    from dflash.methods.dflash.objective import compiled_terms, hard_label_terms

    torch.manual_seed(0)
    for rows, vocab, dtype in ((37, 50, torch.float32), (61, 72, torch.float32), (45, 64, torch.bfloat16)):
        logits = (torch.randn(rows, vocab) * 5).to(dtype)
        logits[:, -3:] = float("-inf")  # padding columns, as LinearCrossEntropy sets them
        labels, weights = torch.randint(0, vocab - 3, (rows,)), torch.rand(rows)
        eager = hard_label_terms(logits.clone(), labels, weights, weights.sum(), dtype, True)
        compiled = compiled_terms()(logits.clone(), labels, weights, weights.sum(), dtype, True)
        torch.testing.assert_close(compiled[0], eager[0], rtol=1e-5, atol=1e-5)
        assert torch.equal(compiled[1], eager[1])
        torch.testing.assert_close(compiled[2].float(), eager[2].float(), **gradient_tolerance(dtype))



def test_compiled_soft_label_terms_equal_the_eager_ones():
    """Self-distillation's chunk through torch.compile (the `compiled` kernel with --loss kl) gives the eager loss,
    argmax and logits' gradient; and the eager one is KL(teacher || drafter) with its exact gradient."""
    from dflash.methods.dflash.objective import compiled_terms, soft_label_terms

    torch.manual_seed(1)
    for rows, vocab, dtype in ((37, 50, torch.float32), (61, 72, torch.float32), (45, 64, torch.bfloat16)):
        logits, teacher = (torch.randn(rows, vocab) * 5).to(dtype), (torch.randn(rows, vocab) * 3).to(dtype)
        weights = torch.rand(rows)
        eager = soft_label_terms(logits.clone(), teacher, weights, weights.sum(), dtype, True)
        compiled = compiled_terms(soft=True)(logits.clone(), teacher, weights, weights.sum(), dtype, True)
        torch.testing.assert_close(compiled[0], eager[0], rtol=1e-5, atol=1e-5)
        assert torch.equal(compiled[1], eager[1])
        torch.testing.assert_close(compiled[2].float(), eager[2].float(), **gradient_tolerance(dtype))
        exact = logits.double().requires_grad_(True)
        teacher_log = teacher.double().log_softmax(-1)
        kl = ((teacher_log.exp() * (teacher_log - exact.log_softmax(-1))).sum(-1) * weights.double()).sum()
        kl.backward()
        torch.testing.assert_close(eager[0].double(), kl.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(eager[2].double(), exact.grad / weights.sum().double(), **gradient_tolerance(dtype))


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_block_sparse_attention_equals_dense_mask(kv_heads):
    """The sparse training attention is SDPA under the dense block mask, in the output and in every gradient."""
    torch.manual_seed(kv_heads)
    seq_len, size, heads, dim = 23, 4, 4, 8
    anchors = torch.tensor([1, 5, 6, 14, 21])
    n = len(anchors) * size
    tensors = [torch.randn(2, h, length, dim, dtype=torch.float64, requires_grad=True)
               for h, length in ((heads, n), (kv_heads, seq_len), (kv_heads, seq_len), (kv_heads, n), (kv_heads, n))]
    q, ctx_k, ctx_v, k, v = tensors
    sparse = block_sparse_attention(q, ctx_k, ctx_v, k, v, BlockLayout(anchors, size))
    mask = block_attention_mask(anchors, seq_len, size)
    dense = torch.nn.functional.scaled_dot_product_attention(
        q, torch.cat([ctx_k, k], 2), torch.cat([ctx_v, v], 2), attn_mask=mask, enable_gqa=kv_heads != heads)
    torch.testing.assert_close(sparse, dense)
    grad = torch.randn_like(dense)
    sparse_grads = torch.autograd.grad(sparse, tensors, grad)
    dense_grads = torch.autograd.grad(dense, tensors, grad)
    for a, b in zip(sparse_grads, dense_grads):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("rows", [3, 700])
def test_distillation_loss_is_kl_to_the_target_and_matches_autograd(rows):
    """Self-distillation: the loss is KL(target || drafter) at each row's own position, weighted; exact gradient."""
    torch.manual_seed(rows)
    hidden = torch.randn(rows, 16, dtype=torch.float64, requires_grad=True)
    head = torch.randn(50, 16, dtype=torch.float64)
    teacher_logits = torch.randn(9, 50, dtype=torch.float64) * 3
    teacher_rows = torch.randint(0, 9, (rows,))
    labels, weights = torch.randint(0, 50, (rows,)), torch.rand(rows, dtype=torch.float64)
    loss, _ = linear_cross_entropy(hidden, head, labels, weights, teacher_logits, teacher_rows)
    loss.backward()
    reference = hidden.detach().clone().requires_grad_(True)
    drafter_log = (reference @ head.t()).log_softmax(-1)
    teacher_log = teacher_logits[teacher_rows].log_softmax(-1)
    kl = (teacher_log.exp() * (teacher_log - drafter_log)).sum(-1)
    expected = (kl * weights).sum() / weights.sum()
    expected.backward()
    torch.testing.assert_close(loss, expected.float(), rtol=1e-6, atol=1e-6)
    # the loss runs in float32: its gradient agrees to float32 sums over the vocabulary (rtol 1e-6 failed on an AVX-512 CPU)
    torch.testing.assert_close(hidden.grad, reference.grad, rtol=1e-5, atol=1e-7)
    self_taught = linear_cross_entropy(hidden, head, labels, weights, (hidden @ head.t()).detach(),
                                       torch.arange(rows))[0]
    assert abs(self_taught.item()) < 1e-6  # a drafter already equal to its teacher has nothing left to learn


@pytest.mark.parametrize("distill", [False, True])
def test_loss_over_the_draft_vocabulary(distill):
    """`vocab` scores only the rows drafting scores: the loss is the full-vocabulary loss with every other column
    removed (the teacher renormalised over the kept ones), labels outside the vocabulary add nothing and count as
    misses, predictions are token ids, and the gradient is exact."""
    from dflash.methods.dflash.objective import block_loss

    torch.manual_seed(3)
    nblocks, size, dim, vocab_size = 5, 4, 16, 50
    hidden = torch.randn(nblocks, size, dim, dtype=torch.float64, requires_grad=True)
    head = torch.nn.Linear(dim, vocab_size, bias=False).double()
    vocab = torch.tensor(sorted(random.Random(0).sample(range(vocab_size), 20)))
    inside = vocab[torch.randint(0, 20, (nblocks, size))]
    outside = torch.tensor([t for t in range(vocab_size) if t not in set(vocab.tolist())])[:nblocks]
    labels = inside.clone()
    labels[:, 2] = outside  # every block's second prediction is a token drafting cannot propose
    labels[:, 0] = IGNORE
    weights = position_weights(size, 2.0).double()
    teacher_logits = torch.randn(30, vocab_size, dtype=torch.float64) * 3 if distill else None
    teacher_rows = torch.randint(0, 30, (nblocks, size)) if distill else None
    result = block_loss(hidden, labels, head, weights, teacher_logits, teacher_rows, vocab=vocab)
    result.loss.backward()

    reference = hidden.detach().clone().requires_grad_(True)
    kept = (labels != IGNORE) & torch.isin(labels, vocab)
    log_probs = (reference @ head.weight.t())[..., vocab].log_softmax(-1)[kept]
    if distill:
        teacher_log = teacher_logits[teacher_rows[kept]][:, vocab].log_softmax(-1)
        row_loss = (teacher_log.exp() * (teacher_log - log_probs)).sum(-1)
    else:
        columns = torch.searchsorted(vocab, labels[kept])
        row_loss = -log_probs.gather(1, columns[:, None])[:, 0]
    row_weights = weights.expand_as(labels)[kept]
    expected = (row_loss * row_weights).sum() / row_weights.sum()
    expected.backward()
    torch.testing.assert_close(result.loss, expected.float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(hidden.grad, reference.grad, rtol=1e-6, atol=1e-8)
    assert result.weight_sum.item() == pytest.approx(row_weights.sum().item())
    assert not result.correct[:, 1].any()  # block position 2: outside the vocabulary, never right
    predicted = vocab[(reference @ head.weight.t())[..., vocab].argmax(-1)]
    assert torch.equal(result.correct, ((predicted == labels) & (labels != IGNORE))[:, 1:])


def test_loss_vocabulary_is_what_drafting_scores(target):
    """The draft vocabulary plus the sequence's prompt tokens (DFlashProposer scores the same rows), sorted; the
    whole vocabulary with loss_vocab='full' or a drafter without a draft vocabulary."""
    drafter = tiny_drafter(target)
    objective = DFlashObjective(drafter, target, anchors_per_seq=8)
    input_ids = torch.tensor([3, 40, 7, 40, 9, 10, 11])
    assert objective.vocab_for(input_ids, 4) is None
    drafter.draft_vocab = [9, 5, 6]
    assert objective.vocab_for(input_ids, 4).tolist() == [3, 5, 6, 7, 9, 40]
    drafter.draft_vocab = [5]  # a new vocabulary (prepare_new sets it after the objective exists) is picked up
    assert objective.vocab_for(input_ids, 2).tolist() == [3, 5, 40]
    assert DFlashObjective(drafter, target, 8, loss_vocab="full").vocab_for(input_ids, 4) is None


def test_checkpoints_from_before_loss_vocab_resume_on_the_full_vocabulary(tmp_path):
    saved = TrainConfig(eval_every=10)
    values = json.loads(saved.to_json())
    del values["loss_vocab"]
    (tmp_path / trainer.CONFIG_FILE).write_text(json.dumps(values))
    (tmp_path / trainer.STATE_FILE).write_bytes(b"")
    assert trainer.read_checkpoint_config(tmp_path).loss_vocab == "full"
    assert TrainConfig().loss_vocab == "draft"
    with pytest.raises(UserError, match="loss_vocab"):
        TrainConfig(loss_vocab="rows").validate()


@pytest.mark.parametrize("distill", [False, True])
def test_a_step_never_reads_the_device(target, distill):
    """The drafter pass, the loss and the backward pass of several sequences run with the drafter, the target's
    embeddings and head and the features on the meta device, which holds shapes but no values: any operation whose
    size or value the host must read from the device (a boolean index, unique, item: each a full stop of a GPU's queue)
    would fail there. Labels, loss rows and vocabularies are worked out on the host instead (block_loss)."""
    import types

    width = target.config.hidden_size
    cfg = DFlashConfig.for_target(target.config, target.vocab_size, MASK_ID, num_layers=2, block_size=4,
                                  num_features=2)
    drafter = DFlashDrafter.untrained(cfg).to("meta")
    drafter.draft_vocab = list(range(0, target.vocab_size, 2))
    on_meta = types.SimpleNamespace(
        device=torch.device("meta"), max_context=4096, lm_head=torch.nn.Linear(width, 64, bias=False, device="meta"),
        embed_tokens=torch.nn.Embedding(target.vocab_size, width, device="meta"))
    objective = DFlashObjective(drafter, on_meta, anchors_per_seq=8, distill=distill)
    sequences = [torch.tensor(record["input_ids"]) for record in counting_records(2)]
    starts = [8, 8]
    anchors = [sample_anchors(len(seq), 8, 8, np.random.default_rng(i)) for i, seq in enumerate(sequences)]
    length = max(len(seq) for seq in sequences)
    features = torch.empty(2, length, 2 * width, device="meta")
    logits = torch.empty(2, length, target.vocab_size, device="meta") if distill else None
    results = objective.blocks_results(sequences, anchors, starts, context=(features, logits))
    sum(result.loss for result in results).backward()
    assert all(p.grad is not None and p.grad.device.type == "meta" for p in drafter.parameters())
    assert [r.correct.shape for r in results] == [(len(a), 3) for a in anchors]


class MisalignedProducts(TorchDispatchMode):
    """Records the matrix products with an operand whose rows (or batches) do not start on 16-byte boundaries."""

    def __init__(self):
        super().__init__()
        self.found = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in ("mm", "bmm", "addmm", "baddbmm"):
            tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
            if any(stride * t.element_size() % 16 for t in tensors for stride in t.stride() if stride != 1):
                self.found.append((func.overloadpacket.__name__, [tuple(t.shape) for t in tensors]))
        return out


@pytest.mark.parametrize("distill", [False, True])
def test_a_bfloat16_pass_gives_its_products_aligned_operands(target, distill):
    """The context is padded to a multiple of 8 positions and the loss's head to a multiple of 8 rows, so on a GPU
    every product of a bfloat16 training pass (drafter, attention, loss, backward) can run on the tensor-core
    kernels: with rows of an odd length (a 29-token sequence, a head of the draft vocabulary plus a prompt's tokens)
    cuBLAS falls back to older, slower ones. Self-distillation's too (its teacher's rows padded alike). On the meta
    device, for the shapes alone."""
    import types

    width, vocab = target.config.hidden_size, target.vocab_size
    cfg = DFlashConfig.for_target(target.config, vocab, MASK_ID, num_layers=2, block_size=8, num_features=2)
    drafter = DFlashDrafter.untrained(cfg).to("meta").to(torch.bfloat16)
    drafter.draft_vocab = list(range(0, vocab, 2))
    on_meta = types.SimpleNamespace(
        device=torch.device("meta"), max_context=4096,
        lm_head=torch.nn.Linear(width, vocab, bias=False, device="meta", dtype=torch.bfloat16),
        embed_tokens=torch.nn.Embedding(vocab, width, device="meta", dtype=torch.bfloat16))
    objective = DFlashObjective(drafter, on_meta, anchors_per_seq=5, distill=distill)
    sequences = [torch.tensor(record["input_ids"][:length]) for record, length in zip(counting_records(2), (29, 23))]
    anchors = [sample_anchors(len(seq), 4, 5, np.random.default_rng(i)) for i, seq in enumerate(sequences)]
    length = objective.padded(sequences).shape[1]
    assert length == 32
    features = torch.empty(2, length, 2 * width, device="meta", dtype=torch.bfloat16)
    logits = torch.empty(2, length, vocab, device="meta", dtype=torch.bfloat16) if distill else None
    with MisalignedProducts() as products:
        results = objective.blocks_results(sequences, anchors, [4, 4], context=(features, logits))
        sum(result.loss for result in results).backward()
    assert products.found == []


# ---- the drafter pass ------------------------------------------------------------------------------------------------
def test_training_pass_equals_inference_per_block(target):
    """Every block of the one sparse-mask pass gives the hidden states the drafter computes at inference time
    from the context before its anchor: the mask, positions and feature alignment agree with decoding."""
    drafter = tiny_drafter(target, num_layers=2, block_size=4).eval()
    objective = DFlashObjective(drafter, target, anchors_per_seq=8)
    input_ids = torch.tensor(counting_records(1)[0]["input_ids"])
    anchors = torch.tensor([4, 9, 10, 20])
    batch = build_block_batch(input_ids, anchors, 4, MASK_ID)
    features = objective.target_pass(input_ids[None])[0]
    with torch.no_grad():
        embeds = target.embed_tokens(batch.block_ids.reshape(1, -1))
        together = drafter(embeds, batch.positions.reshape(1, -1), features,
                           torch.arange(len(input_ids))[None], mask=batch.layout).view(4, 4, -1)
        for i, a in enumerate(anchors.tolist()):
            alone = drafter(target.embed_tokens(batch.block_ids[i : i + 1]), batch.positions[i : i + 1],
                            features[:, :a], torch.arange(a)[None])
            torch.testing.assert_close(together[i], alone[0], atol=1e-5, rtol=1e-5)


def grads_of(drafter) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in drafter.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("distill", [False, True])
def test_sequences_in_one_pass_equal_one_at_a_time(arch, distill):
    """`losses` over sequences of different lengths and anchor counts in ONE target and drafter pass gives each
    sequence the loss, metrics and gradient it gets alone: padding (longer sequences, blocks without labels)
    reaches no real block. A padding block that saw another block, or a row that saw another row's context, would
    move them."""
    target = tiny_target(arch, logit_scale=4.0)
    drafter = tiny_drafter(target, num_layers=2, block_size=4, seed=1)
    drafter.draft_vocab = list(range(5, 40))  # the loss over a draft vocabulary plus each sequence's prompt
    objective = DFlashObjective(drafter, target, anchors_per_seq=12, distill=distill)
    records = counting_records(3, seed=2)
    examples = [trainer.example_of(r) for r in records]
    assert len({len(r["input_ids"]) for r in records}) == 3
    alone = []
    for example in examples:
        drafter.zero_grad(set_to_none=True)
        loss, metrics = objective.loss(example, np.random.default_rng(7))
        loss.backward()
        alone.append((loss.detach(), metrics, grads_of(drafter)))
    short = trainer.example_of({**records[0], "input_ids": records[0]["input_ids"][:14]})  # 1-8 anchors only
    drafter.zero_grad(set_to_none=True)
    together = objective.losses(examples + [short], [np.random.default_rng(7) for _ in range(4)])
    together[0][0].backward()  # the first sequence's gradient, from the shared pass
    first = grads_of(drafter)
    for (loss, metrics), (loss_alone, metrics_alone, _) in zip(together, alone):
        torch.testing.assert_close(loss.detach(), loss_alone, atol=1e-5, rtol=1e-5)
        for name in metrics_alone:
            torch.testing.assert_close(metrics[name], metrics_alone[name], atol=1e-5, rtol=1e-5)
    assert first.keys() == alone[0][2].keys()
    for name in first:
        torch.testing.assert_close(first[name], alone[0][2][name], atol=1e-6, rtol=1e-4)
    loss_short, _ = objective.loss(short, np.random.default_rng(7))
    torch.testing.assert_close(together[3][0].detach(), loss_short.detach(), atol=1e-5, rtol=1e-5)


def test_runs_at_several_sequences_per_pass_follow_the_same_curve(resume_runs, tmp_path):
    """--seqs-per-pass 2 trains the same weights as one sequence per pass, to rounding; the trainer's choice is
    one on a CPU, and the option belongs to dflash."""
    root, data = resume_runs
    out = tmp_path / "paired"
    assert trainer.run(train_args(data, out, "--save-every", "100", "--seqs-per-pass", "2")) == 0
    straight, paired = checkpoint_weights(root / "straight", 8), checkpoint_weights(out, 8)
    for name in straight:
        torch.testing.assert_close(paired[name], straight[name], atol=1e-4, rtol=1e-3)  # Adam amplifies rounding
    config = TrainConfig.from_file(out / trainer.CONFIG_FILE)
    assert config.seqs_per_pass == 2
    with pytest.raises(UserError, match="seqs_per_pass must be >= 0"):
        TrainConfig(seqs_per_pass=-1).validate()
    with pytest.raises(UserError, match="applies to --method dflash only"):
        trainer.run(build_parser().parse_args(eagle3_argv(data, tmp_path / "e", "--seqs-per-pass", "2")))


def test_automatic_sequences_per_pass(target, monkeypatch):
    """auto: one on a CPU; on a GPU the faster of one and a step's share (capped by a pass's activations), timed
    at the first step on gradients that are thrown away: the step then computes what it would have."""
    examples = [trainer.example_of(r) for r in counting_records(8, seed=3)]

    def new_trainer(**options):
        drafter = tiny_drafter(target, num_layers=1, block_size=4, seed=2)
        objective = DFlashObjective(drafter, target, anchors_per_seq=16)
        config = TrainConfig(grad_accum=4, lr=1e-2, **options)
        return trainer.Trainer(objective, config, "unused", examples, [], progress=False)

    run = new_trainer()
    assert run.per_pass == 1 and run.objective.activations_per_sequence == 16 * 4 * 64
    assert new_trainer(seqs_per_pass=3).per_pass == 3
    for budget, choices in ((1 << 26, [1, 4]), (16 * 4 * 64 * 3, [1, 3]), (10, [1])):
        monkeypatch.setattr(trainer, "PASS_ACTIVATIONS", budget)
        assert run.pass_choices() == choices
    monkeypatch.undo()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)  # the timing on a CPU, as on a GPU
    timed, plain = new_trainer(), new_trainer()
    timed.per_pass = None
    indices = [5, 1, 6, 2]
    measured = timed.train_step(indices)
    expected = plain.train_step(indices)
    assert timed.per_pass in (1, 4)
    # gradients left over from the timing would have doubled the norm (Adam's first step would hide them)
    torch.testing.assert_close(measured["grad_norm"], expected["grad_norm"], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(measured["loss"], expected["loss"], atol=1e-6, rtol=1e-5)
    for ours, theirs in zip(timed.params, plain.params):
        # Adam's first step divides each gradient by its own size, so where one sits near Adam's eps, sums in another
        # order move that weight by a small share of lr (1e-2): 1.2e-5 on one weight of 8192 on an AVX-512 CPU
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    # on a GPU shared with other runs the wider pass may not fit: it is left out, and the run goes on at one
    squeezed, said = new_trainer(), []
    squeezed.per_pass, squeezed.say, timed_accumulate = None, said.append, squeezed.timed_accumulate

    def out_of_memory_when_wide(indices, per_pass):
        if per_pass > 1:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return timed_accumulate(indices, per_pass)

    monkeypatch.setattr(squeezed, "timed_accumulate", out_of_memory_when_wide)
    torch.testing.assert_close(squeezed.train_step(indices)["loss"], expected["loss"], atol=1e-6, rtol=1e-5)
    assert squeezed.per_pass == 1 and "[dflash] 4 sequences a pass ran out of GPU memory here, left out" in said
    assert any(line.startswith("[dflash] sequences per pass: 1 (1: ") and "4: left out" in line for line in said)
    # several processes agree: process 0's timing, unless any of them had to leave a choice out
    from dflash.distributed import World

    class SecondOfTwo(World):  # process 1 of 2, whose sums add what process 0 sends
        def sum_(self, tensors):
            tensors[0] += sent

    squeezed.world = SecondOfTwo(rank=1, size=2, local_rank=1)
    for sent, choice, left_out, agreed in ((torch.tensor([4.0, 0.0]), 1, False, 4),  # process 0 timed 4 faster
                                           (torch.tensor([4.0, 0.0]), 1, True, 1),  # 4 did not fit here
                                           (torch.tensor([1.0, 1.0]), 4, False, 1)):  # nor there
        assert squeezed.agreed_choice(choice, left_out, floor=1) == agreed


def test_trained_drafter_predicts_and_stays_lossless(target, tmp_path):
    from dflash.engine import GenerationConfig, SpeculativeDecoder
    from dflash.methods.dflash.proposer import DFlashProposer

    examples = [trainer.example_of(r) for r in counting_records(48)]
    train, heldout = trainer.split_heldout(examples, 0.1)
    drafter = tiny_drafter(target, num_layers=1, block_size=4)
    objective = DFlashObjective(drafter, target, anchors_per_seq=64)
    config = TrainConfig(num_layers=1, block_size=4, epochs=4, lr=3e-3, eval_every=10_000,
                                 save_every=10_000, log_every=50)
    run = trainer.Trainer(objective, config, tmp_path, train, heldout, progress=False)
    untrained_tau = run.evaluate()["eval_tau"]
    run.fit()
    trained_tau = run.evaluate()["eval_tau"]
    assert untrained_tau < 1.3
    print(f"surrogate tau: untrained {untrained_tau:.2f}, trained {trained_tau:.2f} (block size 4)")
    assert trained_tau > 3.0, (untrained_tau, trained_tau)
    assert (tmp_path / "final" / "model.safetensors").is_file()

    # drafts are only proposals: greedy output is the target's own, token for token
    exported = DFlashDrafter.load(tmp_path / "final")
    generation = GenerationConfig(max_new_tokens=24)
    for prompt in ([3, 9, 10, 11, 12], [3, 40, 7, 41, 42, 43]):
        ar = SpeculativeDecoder(target).generate(prompt, generation)
        spec = SpeculativeDecoder(target, DFlashProposer(exported.freeze(), target)).generate(prompt, generation)
        assert spec.tokens == ar.tokens


OWN_GREEDY = GenerationConfig(max_new_tokens=30, ignore_eos=True)


@pytest.fixture(scope="module")
def own_greedy(target, tmp_path_factory):
    """The target's own greedy responses (as `dflash data` makes them), 30 to train on and 6 held out, and the
    folder of a one-layer block-4 drafter trained on them: it predicts some of them, not all."""
    from dflash.engine import SpeculativeDecoder

    plain, rng, examples = SpeculativeDecoder(target), random.Random(7), []
    for i in range(36):
        prompt = [3] + [rng.choice(WORDS) for _ in range(rng.randint(2, 7))]
        tokens = plain.generate(prompt, OWN_GREEDY).tokens
        examples.append(trainer.Example(f"own-{i}", torch.tensor(prompt + tokens, dtype=torch.int32), len(prompt)))
    train, heldout = examples[:30], examples[30:]
    out = tmp_path_factory.mktemp("own-greedy")
    objective = DFlashObjective(tiny_drafter(target, num_layers=1, block_size=4), target, anchors_per_seq=64)
    config = TrainConfig(num_layers=1, block_size=4, epochs=12, lr=3e-3, eval_every=10_000,
                                 save_every=10_000, log_every=50)
    trainer.Trainer(objective, config, out, train, heldout, progress=False).fit()
    return train, heldout, out / "final"


def test_decode_rounds_equal_decoding(target, own_greedy):
    """The held-out decode tau is exact: on responses the target generated greedily, blocks at every position in one
    training pass, walked round by round (`decode_rounds`), give the accept lengths of whole-block decoding."""
    from dflash.engine import SpeculativeDecoder
    from dflash.methods.dflash.proposer import DFlashProposer

    _, heldout, folder = own_greedy
    drafter = DFlashDrafter.load(folder)
    objective = DFlashObjective(drafter, target, anchors_per_seq=64)
    decoder = SpeculativeDecoder(target, DFlashProposer(drafter.freeze(), target), adaptive=False)
    walked, decoded = [], []
    for example in heldout:
        prompt = example.input_ids[: example.loss_start].tolist()
        ids = example.input_ids.long()
        walked += [objective.decoded_rounds([ids], [example.loss_start], objective.target_pass(ids[None]))]
        decoded.append(decoder.generate(prompt, OWN_GREEDY).stats.accept_lengths)
    assert sum(map(len, decoded)) < 0.8 * 30 * len(heldout)  # the drafter predicts some of it: not a trivial walk
    assert walked == decoded
    assert all(sum(rounds) == 29 for rounds in decoded)  # tau counts committed tokens: the first came from the prefill


def test_evaluation_in_shared_passes_gives_the_same_figures(target, own_greedy):
    """The held-out evaluation with several sequences a pass (as a GPU run evaluates: groups of 4 and 2 here) gives
    the figures of one sequence a pass: blocks never see each other, and padding comes after every position."""
    _, heldout, folder = own_greedy
    objective = DFlashObjective(DFlashDrafter.load(folder, dtype=torch.float32), target, anchors_per_seq=16)

    def rngs():
        return [np.random.default_rng([0, trainer.EVAL_STREAM, i]) for i in range(len(heldout))]

    alone, shared = objective.evaluate(heldout, rngs()), objective.evaluate(heldout, rngs(), per_pass=4)
    assert alone.keys() == shared.keys()
    for name in alone:
        assert shared[name] == pytest.approx(alone[name], rel=1e-5), name
    assert alone["eval_decode_tau"] > 1.0 and alone["eval_tau"] > 1.0  # it predicts some: not a trivial match


@pytest.mark.parametrize("window", [64, 12])
def test_decoded_anchors_are_where_decoding_starts_blocks(target, own_greedy, window):
    """--anchors decoded trains the blocks decoding would start: in a window of anchors_per_seq positions (all of a
    shorter response), each block starts where the previous one's committed tokens end, and the loss is that of
    those blocks."""
    train, _, folder = own_greedy
    drafter = DFlashDrafter.load(folder, dtype=torch.float32)
    objective = DFlashObjective(drafter, target, anchors_per_seq=window, anchor_policy="decoded")
    examples = train[:4]
    sequences = [objective.sequence(e.input_ids) for e in examples]
    starts = [e.loss_start for e in examples]
    rngs = [np.random.default_rng([0, i]) for i in range(len(examples))]
    context = objective.target_pass(objective.padded(sequences))
    anchor_sets = objective.decoded_anchors(sequences, starts, rngs, context)
    spaced = False
    for seq, start, anchors in zip(sequences, starts, anchor_sets):
        candidates = anchor_candidates(seq.shape[0], start)
        first = int(anchors[0])
        if window >= len(candidates):
            assert first == start  # the whole response: decoding's own first block
        assert candidates.start <= first and int(anchors[-1]) < min(candidates.stop, first + window)
        end = min(candidates.stop, first + window)
        lengths = accept_lengths(objective.blocks_result(seq, torch.arange(first, end), start).correct)
        at, expected = first, []
        while at < end:
            expected.append(at)
            at += min(int(lengths[at - first]), end - at)
        assert anchors.tolist() == expected
        spaced |= len(expected) < min(window, len(candidates))
    assert spaced  # some block accepted drafts: decoding skipped positions

    rngs = [np.random.default_rng([0, i]) for i in range(len(examples))]
    losses = objective.losses(examples, rngs)
    for (loss, _), seq, start, anchors in zip(losses, sequences, starts, anchor_sets):
        torch.testing.assert_close(loss, objective.blocks_result(seq, anchors, start).loss)


def test_decoded_anchors_resume_exactly(tmp_path):
    data = write_shards(tmp_path / "data", counting_records(10, seed=1))
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert trainer.run(train_args(data, straight, "--anchors", "decoded", "--save-every", "100")) == 0
    assert trainer.run(train_args(data, split, "--anchors", "decoded", "--save-every", "100", "--max-steps", "5")) == 0
    assert trainer.run(train_args(data, split, "--anchors", "decoded", "--resume", "--save-every", "100")) == 0
    first, second = checkpoint_weights(straight, 8), checkpoint_weights(split, 8)
    for name in first:
        torch.testing.assert_close(second[name], first[name], atol=1e-6, rtol=1e-5)
    with pytest.raises(UserError, match="anchors must be uniform or decoded"):
        TrainConfig().replace({"anchors": "every"})


# ---- a time limit (--minutes) ----------------------------------------------------------------------------------------
def timed_trainer(target, tmp_path, step_seconds, finish_by, fit_schedule=True, eval_seconds=None, eval_every=10_000):
    """A trainer whose clock advances only by its steps, step_seconds(step) each, and by its evaluations (of two
    held-out sequences), eval_seconds each."""
    examples = [trainer.example_of(r) for r in counting_records(14)]
    heldout = examples[12:] if eval_seconds is not None else []
    objective = DFlashObjective(tiny_drafter(target, num_layers=1, block_size=4), target, anchors_per_seq=8)
    config = TrainConfig(num_layers=1, block_size=4, epochs=50, lr=3e-3, eval_every=eval_every,
                                 save_every=10_000, log_every=1)
    run = trainer.Trainer(objective, config, tmp_path, examples[:12], heldout, progress=False, finish_by=finish_by,
                          fit_schedule=fit_schedule)
    now = [0.0]
    run.clock = lambda: now[0]
    step, evaluate = run.train_step, objective.evaluate

    def timed_step(indices):
        now[0] += step_seconds(run.state.step + 1)
        return step(indices)

    def timed_evaluation(*args, **kwargs):
        now[0] += eval_seconds
        return evaluate(*args, **kwargs)

    run.train_step, objective.evaluate = timed_step, timed_evaluation
    return run, now


def test_a_time_limit_fits_the_schedule_to_the_pace(target, tmp_path):
    """At 1 s a step from a clock at 0 and 100 s allowed, the pace timed between steps 16 and 48 leaves
    0.92 x (100 - 48 - 15 s for the final save) = 34 more steps: the warmup and cosine end at step 82, where the
    learning rate reaches zero, and the saved config says so (a resumed run keeps that schedule)."""
    run, now = timed_trainer(target, tmp_path, lambda step: 1.0, finish_by=100.0)
    assert run.total_steps == 50 * 12
    (tmp_path / trainer.CONFIG_FILE).write_text(run.config.to_json())
    run.fit()
    assert run.state.step == run.total_steps == 82 and now[0] == 82.0
    assert run.warmup_steps == round(0.04 * 82)
    assert run.scheduler.get_last_lr()[0] == pytest.approx(0.0, abs=1e-12)
    saved = TrainConfig.from_file(tmp_path / trainer.CONFIG_FILE)
    assert saved.schedule_steps == saved.max_steps == 82
    assert trainer.read_checkpoint_config(trainer.checkpoint_dirs(tmp_path)[-1]).schedule_steps == 82


def test_a_time_limit_stops_a_run_that_slows_down(target, tmp_path):
    """Steps that take 5 s from step 61 on: the look after step 65 (at 85 s) sees that the next one would end past
    100 s less the final save's 15, so the run stops there and still writes its final drafter. Without
    fit_schedule (a resumed run, or a given length) the schedule stays as it was."""
    run, now = timed_trainer(target, tmp_path, lambda step: 1.0 if step <= 60 else 5.0, finish_by=100.0,
                             fit_schedule=False)
    run.fit()
    assert run.state.step == 65 and now[0] == 85.0
    assert run.total_steps == 50 * 12 and run.config.schedule_steps is None
    assert (tmp_path / "final" / "model.safetensors").is_file()


def test_a_time_limit_counts_the_evaluations_it_times(target, tmp_path):
    """1 s a step, and 10 s for each evaluation, every 10 steps. The pace between steps 16 and 48 leaves out the
    three evaluations inside (1 s a step, not 1.9), and the run times one more at step 48 (88 s -> 98 s): at
    1 + 10 / 10 s a step, 0.92 x (200 - 98 - 15) s hold 40 more steps. The run ends at step 88, its final evaluation
    inside the 15 s kept back for the end."""
    run, now = timed_trainer(target, tmp_path, lambda step: 1.0, finish_by=200.0, eval_seconds=10.0, eval_every=10)
    run.fit()
    assert run.state.step == run.total_steps == 88 and now[0] == 88 + 10 * 10 <= 200
    evaluated = [r["step"] for r in map(json.loads, (tmp_path / "log.jsonl").read_text().splitlines())
                 if "eval_tau" in r]
    assert evaluated == [10, 20, 30, 40, 48, 50, 60, 70, 80, 88]


@pytest.mark.parametrize("max_steps, profiled", [("8", "steps 5-7"), ("6", "steps 5-6")])
def test_profile_of_a_few_steps(resume_runs, tmp_path, max_steps, profiled):
    """--profile writes torch.profiler's table of steps 5-7 (here, on a CPU, by the host's time), or of the steps
    from 5 on where the run ends sooner, and trains as it would have."""
    root, data = resume_runs
    assert trainer.run(train_args(data, tmp_path / "out", "--profile", "--max-steps", max_steps)) == 0
    table = (tmp_path / "out" / trainer.PROFILE_FILE).read_text()
    assert table.startswith(profiled) and "by the host's own time" in table and "aten::" in table
    assert "device's own time" not in table
    if max_steps == "8":  # the weights of the unprofiled run of the same 8 steps
        profiled_weights, plain = checkpoint_weights(tmp_path / "out", 8), checkpoint_weights(root / "straight", 8)
        for name in plain:
            torch.testing.assert_close(profiled_weights[name], plain[name], atol=1e-6, rtol=1e-5)


def test_a_time_limit_leaves_the_profile_out_of_the_pace(target, tmp_path):
    """A profile whose tables take 40 s after step 7 (47 s -> 87 s on the clock) does not make 1-s steps look like
    5-s ones: the look after step 10 goes on, and at step 48 (88 s) 0.92 x (110 - 88 - 15) s fit 6 more steps."""
    run, now = timed_trainer(target, tmp_path, lambda step: 1.0, finish_by=110.0)
    run.config = run.config.replace({"log_every": 10})

    class SlowTables:
        def start(self, device, step):
            pass

        def finish(self, step):
            now[0] += 40.0 if step == 7 else 0.0

    run.profile = SlowTables()
    run.fit()
    assert run.state.step == run.total_steps == 54 and now[0] == 94.0


def test_minutes_must_be_positive(tmp_path):
    with pytest.raises(UserError, match="--minutes must be > 0"):
        trainer.run(train_args(tmp_path / "data.jsonl", tmp_path / "out", "--minutes", "0"))


# ---- the command: resume, checkpoints, config ------------------------------------------------------------------------
def train_argv(data, out, *extra):
    return ["train", "--target", "tiny-llama", "--data", str(data), "--out", str(out), "--no-progress",
            "--num-layers", "1", "--block-size", "4", "--num-features", "2", "--epochs", "2", "--grad-accum", "2",
            "--eval-fraction", "0.2", "--eval-every", "3", "--log-every", "1", "--anchors-per-seq", "16",
            "--lr", "3e-3", *extra]


def train_args(data, out, *extra):
    return build_parser().parse_args(train_argv(data, out, *extra))


def checkpoint_weights(out, step: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(out / "checkpoints" / f"step-{step:06d}" / "model.safetensors"))


@pytest.fixture(scope="module")
def resume_runs(tmp_path_factory):
    """10 sequences -> 8 train, 2 per step: 4 steps per epoch, 8 in all. Straight vs stop at 5 (mid-epoch) + resume."""
    root = tmp_path_factory.mktemp("resume")
    data = write_shards(root / "data", counting_records(10, seed=1))
    assert trainer.run(train_args(data, root / "straight", "--save-every", "100")) == 0
    assert trainer.run(train_args(data, root / "split", "--save-every", "100", "--max-steps", "5")) == 0
    assert sorted(p.name for p in trainer.checkpoint_dirs(root / "split")) == ["step-000005"]
    assert trainer.run(train_args(data, root / "split", "--resume", "--save-every", "100")) == 0
    return root, data


def test_resume_continues_exactly(resume_runs):
    root, _ = resume_runs
    straight, split = checkpoint_weights(root / "straight", 8), checkpoint_weights(root / "split", 8)
    assert straight.keys() == split.keys()
    for name in straight:
        torch.testing.assert_close(split[name], straight[name], atol=1e-6, rtol=1e-5)
    assert not torch.equal(straight["fc.weight"], checkpoint_weights(root / "split", 5)["fc.weight"])
    logs = [[json.loads(line) for line in (root / run / "log.jsonl").read_text().splitlines()]
            for run in ("straight", "split")]
    last_losses = [[r["loss"] for r in log if "loss" in r and r["step"] > 5] for log in logs]
    assert len(last_losses[0]) == 3
    assert last_losses[0] == pytest.approx(last_losses[1], rel=1e-5)
    evals = [r for r in logs[0] if "eval_tau" in r]
    assert [r["step"] for r in evals] == [3, 6, 8]


def test_bad_checkpoints_are_user_errors(resume_runs, tmp_path):
    root, data = resume_runs
    source = root / "split" / "checkpoints" / "step-000008"

    def resume_from(mutate):
        folder = tmp_path / f"ckpt-{len(list(tmp_path.iterdir()))}"
        shutil.copytree(source, folder)
        mutate(folder)
        with pytest.raises(UserError) as info:
            trainer.run(train_args(data, tmp_path / "out", "--resume", str(folder)))
        return str(info.value)

    def truncate(name):
        return lambda folder: (folder / name).write_bytes((folder / name).read_bytes()[:200])

    assert "corrupt" in resume_from(truncate("trainer_state.pt"))
    assert "corrupt" in resume_from(truncate("model.safetensors"))

    def other_shape(folder):  # a 2-layer drafter where the run trained a 1-layer one
        target = tiny_target("llama")
        tiny_drafter(target, num_layers=2).save(folder, dtype=torch.float32)

    assert "mismatched" in resume_from(other_shape)

    def other_weights(folder):  # weights whose shapes contradict config.json
        from safetensors.torch import load_file, save_file

        state = load_file(str(folder / "model.safetensors"))
        state["fc.weight"] = state["fc.weight"][:, :10].contiguous()
        save_file(state, str(folder / "model.safetensors"))

    assert "do not match" in resume_from(other_weights)
    with pytest.raises(UserError, match="cannot change lr"):
        trainer.run(train_args(data, tmp_path / "out", "--resume", str(source), "--lr", "1e-3"))
    with pytest.raises(UserError, match="no checkpoint"):
        trainer.run(train_args(data, tmp_path / "empty", "--resume"))


def test_interrupted_save_is_never_latest(tmp_path):
    complete = tmp_path / "checkpoints" / "step-000004"
    complete.mkdir(parents=True)
    (complete / trainer.STATE_FILE).write_bytes(b"x")
    (tmp_path / "checkpoints" / ".tmp-step-000009-123").mkdir()  # what a crash mid-save leaves
    assert trainer.resolve_checkpoint("latest", tmp_path) == complete


def test_config_round_trips_and_rejects_bad_values():
    config = TrainConfig(lr=1e-3, gamma=5.0, max_steps=7)
    assert TrainConfig.from_dict(json.loads(config.to_json())) == config
    with pytest.raises(UserError, match="unknown training option"):
        TrainConfig.from_dict({"learning_rate": 1e-3})
    with pytest.raises(UserError, match="must be a number"):
        TrainConfig.from_dict({"epochs": "six"})
    with pytest.raises(UserError, match="epochs must be >= 1"):
        config.replace({"epochs": 0})
    with pytest.raises(UserError, match="warmup_ratio"):
        config.replace({"warmup_ratio": 1.5})


def test_bad_data_is_a_user_error(tmp_path):
    (tmp_path / "shard-00000.jsonl").write_text('{"id": "a", "input_ids": [1, 2, 3], "loss_start": 1}\n{"id": "b"}\n')
    with pytest.raises(UserError, match="shard-00000.jsonl:2"):
        trainer.load_examples(tmp_path)
    with pytest.raises(UserError, match="not found"):
        trainer.load_examples(tmp_path / "missing")
    prompts = tmp_path / "prompts.jsonl"  # what a user may well try first: the prompts, not the target's answers
    prompts.write_text('{"prompt": "What is 2 + 2?"}\n')
    with pytest.raises(UserError, match=r"prompts.jsonl:1: a prompt, not a training record .* dflash data --input"):
        trainer.load_examples(prompts)


def test_plot_of_the_log(resume_runs, tmp_path):
    root, _ = resume_runs
    png = tmp_path / "curves.png"
    if trainer.write_plot(root / "straight" / "log.jsonl", png):  # False (with a note) without matplotlib
        assert png.stat().st_size > 1000


# ---- --method eagle3: the same loop, schedule, checkpoints and resume for the EAGLE-3 head ------------------------
def eagle3_argv(data, out, *extra):
    return ["train", "--method", "eagle3", "--target", "tiny-llama", "--data", str(data), "--out", str(out),
            "--no-progress", "--block-size", "4", "--draft-vocab", "40", "--epochs", "2", "--grad-accum", "2",
            "--eval-fraction", "0.2", "--eval-every", "3", "--log-every", "1", "--lr", "3e-3", "--save-every", "100",
            *extra]


@pytest.fixture(scope="module")
def eagle3_runs(tmp_path_factory):
    """As resume_runs, through `dflash.cli.main`: 8 steps straight vs stop at 5 (mid-epoch) + resume, which leaves
    --method out (a resumed run keeps its checkpoint's method)."""
    from dflash.cli import main

    root = tmp_path_factory.mktemp("eagle3")
    data = write_shards(root / "data", counting_records(10, seed=1))
    assert main(eagle3_argv(data, root / "straight")) == 0
    assert main(eagle3_argv(data, root / "split", "--max-steps", "5")) == 0
    resume = [a for a in eagle3_argv(data, root / "split", "--resume") if a not in ("--method", "eagle3")]
    assert main(resume) == 0
    return root, data


def test_eagle3_resume_continues_exactly(eagle3_runs):
    from dflash.corpus import frequent_tokens

    root, data = eagle3_runs
    straight, split = checkpoint_weights(root / "straight", 8), checkpoint_weights(root / "split", 8)
    assert straight.keys() == split.keys() and "midlayer.self_attn.q_proj.weight" in straight
    for name in straight:
        torch.testing.assert_close(split[name], straight[name], atol=1e-6, rtol=1e-5)
    assert not torch.equal(straight["fc.weight"], checkpoint_weights(root / "split", 5)["fc.weight"])
    config = TrainConfig.from_file(root / "split" / "checkpoints" / "step-000008" / trainer.CONFIG_FILE)
    assert (config.method, config.num_layers, config.num_features, config.block_size, config.draft_vocab) == (
        "eagle3", 1, 3, 4, 40)
    state = torch.load(root / "split" / "checkpoints" / "step-000008" / trainer.STATE_FILE, weights_only=True)
    assert state["objective"] == "eagle3" and state["step"] == 8
    # the draft vocabulary: the 40 most frequent response tokens of the TRAINING sequences (held-out ones excluded)
    train, _ = trainer.split_heldout(trainer.load_examples(data), 0.2)
    vocab = frequent_tokens([e.input_ids[e.loss_start :] for e in train], 64, 40)
    d2t = straight["d2t"]
    assert (d2t + torch.arange(40)).tolist() == vocab
    logs = [[json.loads(line) for line in (root / run / "log.jsonl").read_text().splitlines()]
            for run in ("straight", "split")]
    last_losses = [[r["loss"] for r in log if "loss" in r and r["step"] > 5] for log in logs]
    assert len(last_losses[0]) == 3 and last_losses[0] == pytest.approx(last_losses[1], rel=1e-5)
    assert [r["step"] for r in logs[0] if "eval_tau" in r] == [3, 6, 8]
    assert all(len(r["accuracy"]) == 3 for r in logs[0] if "accuracy" in r)  # block size 4: 3 chain steps


def test_eagle3_final_loads_everywhere_and_is_lossless(eagle3_runs, capsys):
    """OUT/final is an EAGLE-3 head folder: build_eagle3_proposer (bench --drafter eagle3=DIR, generate --method eagle3
    --drafter) loads it, and greedy output equals ar token for token."""
    from dflash.cli import main
    from dflash.methods.base import MethodOptions
    from dflash.methods.eagle3.proposer import build as build_eagle3
    from dflash.engine import GenerationConfig, SpeculativeDecoder
    from dflash.loading import load_target_cached

    final = eagle3_runs[0] / "straight" / "final"
    target = load_target_cached("tiny-llama")
    proposer, note = build_eagle3(target, MethodOptions(drafter=str(final)))
    assert note is None and proposer.depth == 3 and proposer.head.config.draft_vocab_size == 40
    generation = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    for prompt in ([3, 9, 10, 11, 12], [3, 40, 7, 41, 42, 43]):
        ar = SpeculativeDecoder(target).generate(prompt, generation)
        assert SpeculativeDecoder(target, proposer).generate(prompt, generation).tokens == ar.tokens
    capsys.readouterr()
    outputs = {}
    for method, extra in (("ar", []), ("eagle3", ["--drafter", str(final)])):
        assert main(["generate", "--target", "tiny-llama", "--method", method, *extra,
                     "--max-new-tokens", "16", "--json", "w5 w6 w7"]) == 0
        outputs[method] = json.loads(capsys.readouterr().out)["tokens"]
    assert main(["generate", "--target", "tiny-llama", "--method", "ar", "--drafter", str(final), "w5"]) == 2
    assert "--drafter" in capsys.readouterr().err  # a flag that means nothing for ar is an error, not ignored
    assert outputs["eagle3"] == outputs["ar"] and outputs["ar"]


def test_eagle3_method_mistakes_are_user_errors(eagle3_runs, resume_runs, tmp_path):
    root, data = eagle3_runs

    def error(argv) -> str:
        with pytest.raises(UserError) as info:
            trainer.run(build_parser().parse_args(argv))
        return str(info.value)

    dflash_ckpt = resume_runs[0] / "split" / "checkpoints" / "step-000008"
    assert "was trained with --method dflash" in error(eagle3_argv(data, tmp_path / "a", "--resume", str(dflash_ckpt)))
    as_dflash = train_argv(data, tmp_path / "b", "--method", "dflash", "--resume", str(root / "split"))
    assert "was trained with --method eagle3" in error(as_dflash)
    for method in ("ar", "ngram"):
        assert "needs no training" in error(eagle3_argv(data, tmp_path / "c", "--method", method))
    assert "train it with --method eagle3" in error(eagle3_argv(data, tmp_path / "d", "--method", "eagle3+ngram"))
    assert "--gamma applies to --method dflash" in error(eagle3_argv(data, tmp_path / "e", "--gamma", "3"))
    assert "has 1 layer" in error(eagle3_argv(data, tmp_path / "f", "--num-layers", "2"))
    assert "not an EAGLE-3 head" in error(eagle3_argv(data, tmp_path / "g", "--init-from", str(dflash_ckpt)))


def test_dflash_run_writes_its_draft_vocabulary(resume_runs, tmp_path):
    """A new DFlash drafter proposes among the N most frequent response tokens of its training data; the file goes
    with every checkpoint and the export, and drafting scores only those rows of the LM head (still lossless)."""
    from dflash.corpus import frequent_tokens
    from dflash.engine import GenerationConfig, SpeculativeDecoder
    from dflash.methods.dflash.proposer import DFlashProposer

    _, data = resume_runs
    out = tmp_path / "vocab"
    assert trainer.run(train_args(data, out, "--draft-vocab", "12", "--max-steps", "2")) == 0
    train, _ = trainer.split_heldout(trainer.load_examples(data), 0.2)
    expected = frequent_tokens([e.input_ids[e.loss_start:] for e in train], 64, 12)
    for folder in (out / "final", trainer.checkpoint_dirs(out)[-1]):
        assert json.loads((folder / "draft_vocab.json").read_text())["token_ids"] == expected
    drafter = DFlashDrafter.load(out / "final")
    assert drafter.draft_vocab == expected
    target = tiny_target("llama", logit_scale=4.0)
    proposer = DFlashProposer(drafter.freeze(), target)
    config = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    for prompt in ([3, 9, 10, 11, 12], [3, 40, 7, 41, 42, 43]):
        result = SpeculativeDecoder(target, proposer, adaptive=False).generate(prompt, config)
        assert result.tokens == SpeculativeDecoder(target).generate(prompt, config).tokens
        features = target.forward(torch.tensor([prompt[:-1]]), None, proposer.feature_layers).features
        proposer.start(prompt[:-1], features)
        assert set(proposer.propose(prompt).tokens) <= set(expected)


def test_distilled_and_target_initialised_runs_and_a_fixed_schedule(resume_runs, tmp_path):
    """--loss kl trains (the loss falls), --init target starts from the target's last layers, and --schedule-steps
    fixes the cosine horizon in steps, whatever the epochs."""
    _, data = resume_runs
    out = tmp_path / "kl"
    assert trainer.run(train_args(data, out, "--loss", "kl", "--init", "target", "--schedule-steps", "6",
                                  "--max-steps", "6", "--save-every", "6")) == 0
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in log if "loss" in r]
    assert len(losses) == 6 and sum(losses[3:]) < sum(losses[:3])
    assert [r["lr"] for r in log if "lr" in r][-1] < 0.15 * 3e-3  # the cosine nearly ended by step 6 of 6
    config = TrainConfig.from_file(out / trainer.CONFIG_FILE)
    assert (config.loss, config.init, config.schedule_steps) == ("kl", "target", 6)
    target = tiny_target("llama")
    fresh = trainer.recipe_of(config).new_model(target, config)
    last = target.model.get_decoder().layers[-1]
    assert torch.equal(fresh.layers[-1].mlp.down_proj.weight, last.mlp.down_proj.weight)
    with pytest.raises(UserError, match="loss must be ce or kl"):
        TrainConfig(loss="mse").validate()


def test_more_kv_heads_keep_the_drafters_outputs(target):
    """Widening a drafter's key/value heads repeats each head: the training pass and cached inference give the
    same hidden states as before, and head counts that cannot hold the old heads are user errors."""
    from dflash.methods.dflash.drafter import repeat_kv_rows

    drafter = tiny_drafter(target, num_layers=2, block_size=4, seed=3).eval()
    wider = drafter.with_kv_heads(4)  # the tiny target has 4 query heads over 2 key/value heads
    assert wider.config.num_key_value_heads == 4 and wider.layers[0].self_attn.k_proj.weight.shape[0] == 64
    k = drafter.layers[1].self_attn.k_proj.weight
    assert torch.equal(repeat_kv_rows(k, 16, 2)[16:32], k[:16]) and torch.equal(repeat_kv_rows(k, 16, 2)[32:48], k[16:])
    objective = DFlashObjective(drafter, target, anchors_per_seq=8)
    input_ids = torch.tensor(counting_records(1)[0]["input_ids"])
    batch = build_block_batch(input_ids, torch.tensor([4, 9, 20]), 4, MASK_ID)
    features = objective.target_pass(input_ids[None])[0]
    with torch.no_grad():
        embeds = target.embed_tokens(batch.block_ids.reshape(1, -1))
        args = (embeds, batch.positions.reshape(1, -1), features, torch.arange(len(input_ids))[None])
        torch.testing.assert_close(wider(*args, mask=batch.layout), drafter(*args, mask=batch.layout),
                                   atol=1e-6, rtol=1e-6)
        cached = [m(embeds[:, :4], batch.positions[:1], features[:, :4], torch.arange(4)[None], cache=m.new_cache())
                  for m in (drafter, wider)]
        torch.testing.assert_close(cached[1], cached[0], atol=1e-6, rtol=1e-6)
    assert drafter.with_kv_heads(2) is drafter
    for bad in (3, 1, 8):
        with pytest.raises(UserError, match="kv_heads must divide"):
            drafter.with_kv_heads(bad)

    deeper = drafter.with_layers(4)  # two layers appended that add nothing until trained
    assert len(deeper.layers) == 4 and not deeper.layers[3].mlp.down_proj.weight.any()
    assert torch.equal(deeper.layers[3].self_attn.q_proj.weight, drafter.layers[1].self_attn.q_proj.weight)
    with torch.no_grad():
        torch.testing.assert_close(deeper(*args, mask=batch.layout), drafter(*args, mask=batch.layout),
                                   atol=1e-6, rtol=1e-6)
    assert drafter.with_layers(2) is drafter
    with pytest.raises(UserError, match="can only add layers"):
        drafter.with_layers(1)


def test_training_with_more_kv_heads_and_layers(resume_runs, tmp_path):
    """--kv-heads and --num-layers widen and deepen an --init-from drafter (which then trains and resumes),
    --kv-heads gives a new drafter that many heads, and with --init target repeats the target's key/value rows."""
    root, data = resume_runs
    out = tmp_path / "wide"

    def two_layer_args(*extra):
        argv = train_argv(data, out, *extra)
        argv[argv.index("--num-layers") + 1] = "2"
        return build_parser().parse_args(argv)

    assert trainer.run(two_layer_args("--init-from", str(root / "straight" / "final"), "--kv-heads", "4",
                                      "--max-steps", "2", "--save-every", "2")) == 0
    start = DFlashDrafter.load(root / "straight" / "final")
    wide = DFlashDrafter.load(out / "checkpoints" / "step-000002")
    assert (start.config.num_key_value_heads, wide.config.num_key_value_heads) == (2, 4)
    assert (start.config.num_hidden_layers, wide.config.num_hidden_layers) == (1, 2)
    assert wide.layers[1].mlp.down_proj.weight.any()  # trained away from zero
    config = TrainConfig.from_file(out / trainer.CONFIG_FILE)
    assert (config.kv_heads, config.num_layers) == (4, 2)
    assert trainer.run(two_layer_args("--resume", "--max-steps", "3", "--save-every", "100")) == 0
    assert DFlashDrafter.load(out / "final").config.num_key_value_heads == 4

    fresh_out = tmp_path / "fresh"
    assert trainer.run(train_args(data, fresh_out, "--kv-heads", "4", "--init", "target", "--max-steps", "1")) == 0
    config = TrainConfig.from_file(fresh_out / trainer.CONFIG_FILE)
    tiny = tiny_target("llama")
    fresh = trainer.recipe_of(config).new_model(tiny, config)
    theirs = tiny.model.get_decoder().layers[-1].self_attn.v_proj.weight
    assert torch.equal(fresh.layers[-1].self_attn.v_proj.weight[16:32], theirs[:16])
    with pytest.raises(UserError, match="kv_heads must divide"):
        trainer.run(train_args(data, tmp_path / "bad", "--kv-heads", "3"))
    # a random drafter may have fewer heads than the target; copying the target's layers may not
    narrow = DFlashConfig.for_target(tiny.config, tiny.vocab_size, MASK_ID, kv_heads=1)
    assert narrow.num_key_value_heads == 1
    with pytest.raises(UserError, match="multiple of 2"):
        trainer.run(train_args(data, tmp_path / "narrow", "--kv-heads", "1", "--init", "target"))
    with pytest.raises(UserError, match="applies to --method dflash"):
        trainer.run(train_args(data, tmp_path / "eagle", "--method", "eagle3", "--kv-heads", "4"))
