"""DFlash training batches: anchors, block inputs, the sparse block mask, labels and the position-weighted loss.

One training sequence becomes many blocks trained in ONE drafter pass (DFLASH_SPEC.md section 4). Each anchor `a`
starts a block [token_a, MASK x (B-1)] at positions a..a+B-1; block position k predicts the token AT a+k (same-position
prediction, no shift). A block sees the target features of positions STRICTLY before its anchor (at inference the
bonus token's features do not exist yet) and its own block bidirectionally, never other blocks.

`DFlashObjective` packs this into the `loss(example, rng) -> (loss, metrics)` interface the generic trainer uses;
`DFlashTraining` tells the trainer how to build, load and measure a drafter.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ...errors import UserError
from .attention import KERNELS, BlockLayout, compiled_cannot_run, compiled_unavailable, flex_unavailable
from .drafter import DFlashConfig, DFlashDrafter, check_kv_heads, default_mask_token_id, repeat_kv_rows

IGNORE = -100
DEFAULT_DRAFT_VOCAB = 8192
GAMMA_BY_BLOCK_SIZE = ((8, 4.0), (10, 5.0), (16, 7.0))  # the paper's loss decay per block size
CPU_CHUNK_ROWS = 512  # rows of logits at once in the loss: [512, 16K] float32 is 32 MB
GPU_CHUNK_FLOATS = 1 << 28  # on a GPU, up to 1 GiB of float32 logits at once: one chunk a sequence at 16K rows
# A pass's context length is padded to a multiple of this: the training attention's [.., S + 16] scores are the
# operands of its products, and bfloat16 rows whose length is not a multiple of 8 (16 bytes) are misaligned for the
# tensor-core kernels, which cuBLAS then trades for older, slower ones (stage 16's H100 profile: cutlass_75 kernels).
CONTEXT_MULTIPLE = 8
# The loss's head (the draft vocabulary plus a sequence's prompt tokens: 16,444-16,458 rows in stage 16's steps) is
# padded with zero rows to a multiple of this, for the same reason: its logits' rows are products' operands too
# (with self-distillation, the teacher's gathered rows are padded alike).
COLUMN_MULTIPLE = 8


# ---- block construction ----------------------------------------------------------------------------------------------
def anchor_candidates(seq_len: int, loss_start: int) -> range:
    """Positions that may start a block: inside the response, with at least one label after them, and at least one
    context position before them (inference never drafts from an empty context)."""
    return range(max(loss_start, 1), seq_len - 1)


def sample_anchors(seq_len: int, loss_start: int, num: int, rng: np.random.Generator) -> torch.Tensor:
    """Up to `num` distinct anchor positions, sorted, drawn uniformly from `anchor_candidates`."""
    candidates = anchor_candidates(seq_len, loss_start)
    count = len(candidates)
    if count <= num:
        picked = np.arange(count)
    else:
        picked = np.sort(rng.choice(count, size=num, replace=False))
    return torch.as_tensor(picked + candidates.start, dtype=torch.long)


@dataclass
class BlockBatch:
    block_ids: torch.Tensor  # [nblocks, B]: anchor token then MASK ids
    positions: torch.Tensor  # [nblocks, B]: absolute positions a..a+B-1
    labels: torch.Tensor  # [nblocks, B]: token at a+k, IGNORE at k=0 and past the end
    layout: BlockLayout  # who sees what: the sparse equivalent of block_attention_mask


def block_inputs(input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int):
    """Block token ids [nblocks, B] and their absolute positions."""
    offsets = torch.arange(block_size, device=input_ids.device)
    positions = anchors[:, None].to(input_ids.device) + offsets
    block_ids = torch.full_like(positions, mask_token_id)
    block_ids[:, 0] = input_ids[anchors]
    return block_ids, positions


def block_labels(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Label of block position k = the token AT anchor+k; IGNORE for k=0 (given, not predicted) and past the end."""
    inside = positions < input_ids.shape[0]
    labels = torch.where(inside, input_ids[positions.clamp(max=input_ids.shape[0] - 1)], IGNORE)
    labels[:, 0] = IGNORE
    return labels


def block_attention_mask(anchors: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """Boolean [nblocks*B, seq_len + nblocks*B]: context keys strictly before the block's anchor, then the block's
    own keys (bidirectional). Keys are ordered as the drafter concatenates them: all context, then all blocks.
    This dense mask defines the training attention; the drafter computes it sparsely from a BlockLayout (tests
    check both against each other), since at 512 anchors almost every entry is False."""
    device = anchors.device
    block_of_query = torch.arange(anchors.shape[0] * block_size, device=device) // block_size
    # `<` not `<=`: the anchor's own target feature is not available at inference time
    sees_context = torch.arange(seq_len, device=device)[None, :] < anchors[block_of_query][:, None]
    sees_block = block_of_query[:, None] == block_of_query[None, :]
    return torch.cat([sees_context, sees_block], dim=1)


def build_block_batch(
    input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int
) -> BlockBatch:
    anchors = anchors.to(input_ids.device)
    block_ids, positions = block_inputs(input_ids, anchors, block_size, mask_token_id)
    return BlockBatch(
        block_ids=block_ids,
        positions=positions,
        labels=block_labels(input_ids, positions),
        layout=BlockLayout(anchors, block_size),
    )


# ---- loss and metrics ------------------------------------------------------------------------------------------------
def default_gamma(block_size: int) -> float:
    """The paper's decay (7 for B=16, 5 for B=10, 4 for B=8), linearly interpolated between and clamped outside."""
    sizes, gammas = zip(*GAMMA_BY_BLOCK_SIZE)
    return float(np.interp(block_size, sizes, gammas))


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for block positions k = 1..B-1 (early positions matter most: a miss there ends the
    accepted prefix); w_0 = 0 because position 0 holds the given anchor token."""
    k = torch.arange(block_size, dtype=torch.float32)
    weights = torch.exp(-(k - 1) / gamma)
    weights[0] = 0.0
    return weights


@dataclass
class BlockResult:
    loss: torch.Tensor  # weighted cross-entropy, scalar
    correct: torch.Tensor  # [nblocks, B-1] bool: argmax == label at positions 1..B-1 (False where no label)
    valid: torch.Tensor  # [nblocks, B-1] bool: a label exists
    weight_sum: torch.Tensor  # the normaliser of `loss` (to pool losses over sequences exactly)


def hard_label_terms(logits, labels, weights, weight_sum, out_dtype: torch.dtype, need_grad: bool):
    """One chunk of LinearCrossEntropy against hard labels: (sum_i w_i * CE(logits_i, label_i), the argmax of each
    row, and the gradient w.r.t. the logits (softmax - onehot) * w / weight_sum in `out_dtype`, or None).

    In as few passes over the [rows, vocab] logits as torch's operations allow (on a GPU the chunk is a whole
    sequence's rows, ~0.5 GB in float32, and each pass is memory traffic): one softmax in float32 straight from the
    products' dtype (no float32 copy of the logits, no logsumexp's temporaries), the probabilities' own row of the
    label and of the argmax for the loss, and one pass that scales them and writes the products' dtype. The
    log-normaliser is logit(argmax) - log p(argmax): p(argmax) >= 1/vocab, so its log loses nothing.
    `compiled_terms` is this function compiled (the `compiled` training kernel), which fuses the passes further."""
    stats = torch.promote_types(logits.dtype, torch.float32)
    predictions = logits.argmax(-1)
    probs = torch.softmax(logits, -1, dtype=stats)
    top = predictions[:, None]
    log_norm = logits.gather(1, top)[:, 0].to(stats) - probs.gather(1, top)[:, 0].log()
    picked = logits.gather(1, labels[:, None])[:, 0].to(stats)
    loss = ((log_norm - picked) * weights).sum().float()
    if not need_grad:
        return loss, predictions, None
    probs.scatter_add_(1, labels[:, None], probs.new_full((probs.shape[0], 1), -1.0))  # minus the one-hot
    scaled = torch.empty(probs.shape, dtype=out_dtype, device=probs.device)
    torch.mul(probs, (weights / weight_sum)[:, None].to(stats), out=scaled)
    return loss, predictions, scaled


def soft_label_terms(logits, teacher_logits, weights, weight_sum, out_dtype: torch.dtype, need_grad: bool):
    """One chunk of LinearCrossEntropy against the target's own distributions (self-distillation): (sum_i w_i *
    KL(softmax(teacher_logits_i) || softmax(logits_i)), the argmax of each row, and the gradient w.r.t. the logits
    (softmax(logits) - softmax(teacher)) * w / weight_sum in `out_dtype`, or None). Both log-softmaxes are taken in
    float32 straight from the products' dtype (no float32 copies); the gradient reuses the drafter's."""
    stats = torch.promote_types(logits.dtype, torch.float32)
    predictions = logits.argmax(-1)
    log_probs = torch.log_softmax(logits, -1, dtype=stats)
    teacher_log = torch.log_softmax(teacher_logits, -1, dtype=stats)
    teacher = teacher_log.exp()
    loss = ((teacher * (teacher_log - log_probs)).sum(-1) * weights).sum().float()
    if not need_grad:
        return loss, predictions, None
    difference = log_probs.exp_().sub_(teacher)
    scaled = torch.empty(difference.shape, dtype=out_dtype, device=difference.device)
    torch.mul(difference, (weights / weight_sum)[:, None].to(stats), out=scaled)
    return loss, predictions, scaled


@functools.cache
def compiled_terms(soft: bool = False):
    """`hard_label_terms` (or `soft_label_terms`) through torch.compile, once per process; rows and vocabulary
    change every sequence, so its shapes are dynamic from the start."""
    return torch.compile(soft_label_terms if soft else hard_label_terms, dynamic=True)


class LinearCrossEntropy(torch.autograd.Function):
    """sum_i w_i * CE(hidden_i @ head.T, label_i) / sum_i w_i, and the argmax of each row, computed in row chunks.
    With `teacher_logits` [S, vocab] and `teacher_rows` [N] the target of row i is the teacher's distribution
    softmax(teacher_logits[teacher_rows[i]]) instead of the one-hot label: the loss is then KL(teacher || drafter)
    (self-distillation); the teacher's rows are gathered chunk by chunk too, and with `teacher_columns` only those
    columns of them (the teacher restricted to the head's vocabulary, renormalised).

    The [N, vocab] logits are the largest tensor of a training step (at 512 anchors x 16 positions x 49K words they
    are 1.6 GB in float32) and their log-softmax passes dominated the CPU step time. The head is frozen, so the
    gradient w.r.t. hidden, (softmax - target) * w / sum(w) @ head, is formed chunk by chunk during the forward pass
    and no logits are kept. Softmax statistics are float32 whatever the matmul dtype.
    """

    @staticmethod
    def forward(ctx, hidden, head_weight, labels, weights, teacher_logits=None, teacher_rows=None,
                teacher_columns=None, chunk_rows: int = CPU_CHUNK_ROWS, compiled: bool = False):
        values = hidden.detach()
        weight_sum = weights.sum().clamp_min(1e-12)
        need_grad = hidden.requires_grad
        grad = torch.empty_like(values) if need_grad else None
        predictions = torch.empty(hidden.shape[0], dtype=torch.long, device=hidden.device)
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        # zero rows, whose logits (and the teacher's there) are set to the dtype's lowest: probability 0, never the
        # argmax; finite, so that the teacher's 0 x (its log-probability - the drafter's) is 0 there, not 0 x inf
        columns, padding = head_weight.shape[0], -head_weight.shape[0] % COLUMN_MULTIPLE
        if padding:
            head_weight = F.pad(head_weight, (0, 0, 0, padding))
            if teacher_columns is not None:  # gathers column 0 into the padding, overwritten below
                teacher_columns = F.pad(teacher_columns, (0, padding))
        lowest = torch.finfo(head_weight.dtype).min
        for start in range(0, hidden.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            logits = values[rows].to(head_weight.dtype) @ head_weight.t()
            if padding:
                logits[:, columns:] = lowest
            if teacher_logits is None:
                terms = compiled_terms() if compiled else hard_label_terms
                targets = labels[rows]
            else:  # the teacher's rows, only the head's columns where it holds a vocabulary's (one gather)
                terms = compiled_terms(soft=True) if compiled else soft_label_terms
                if teacher_columns is None:
                    targets = teacher_logits[teacher_rows[rows]]
                    targets = F.pad(targets, (0, padding)) if padding else targets
                else:
                    targets = teacher_logits[teacher_rows[rows][:, None], teacher_columns[None, :]]
                if padding:
                    targets[:, columns:] = torch.finfo(targets.dtype).min
            chunk_loss, predictions[rows], scaled = terms(logits, targets, weights[rows], weight_sum,
                                                          head_weight.dtype, need_grad)
            loss += chunk_loss
            if need_grad:
                grad[rows] = (scaled @ head_weight).to(grad.dtype)
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(predictions)
        return loss / weight_sum, predictions

    @staticmethod
    def backward(ctx, grad_loss, _grad_predictions):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss.to(grad.dtype), None, None, None, None, None, None, None, None


def chunk_rows_for(device: torch.device, vocab: int) -> int:
    """Rows of logits a LinearCrossEntropy chunk computes at once. On a CPU, CPU_CHUNK_ROWS. On a GPU as many as fit
    GPU_CHUNK_FLOATS, since each chunk costs ~35 operations (kernel launches there) whatever its size: in 512-row
    chunks the loss of one step of the paper's recipe (8 sequences x 512 anchors) dispatched 3,700 operations, more
    than the rest of the step together (2,150); in one chunk a sequence, 600 (scripts/count_train_ops.py)."""
    if device.type == "cpu":
        return CPU_CHUNK_ROWS
    return max(CPU_CHUNK_ROWS, GPU_CHUNK_FLOATS // max(1, vocab))


def linear_cross_entropy(hidden, head_weight, labels, weights, teacher_logits=None, teacher_rows=None,
                         teacher_columns=None, compiled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(weighted mean loss, argmax predictions) of the logits hidden @ head_weight.T; see LinearCrossEntropy.
    hidden [N, D], head_weight [V, D] (frozen), labels [N], weights [N]; teacher_logits [S, V'] and teacher_rows [N]
    for self-distillation, with teacher_columns [V] when the head holds only some of the teacher's columns.
    `compiled`: the chunks (hard labels' or the teacher's) through `compiled_terms`."""
    return LinearCrossEntropy.apply(hidden, head_weight.detach(), labels, weights.to(torch.float32), teacher_logits,
                                    teacher_rows, teacher_columns, chunk_rows_for(hidden.device, head_weight.shape[0]),
                                    compiled)


def on_device(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor's copy on `device`, queued without waiting: a blocking copy to a GPU waits for everything queued
    before it, so each one would stall the host until the GPU caught up (non_blocking from pageable memory still
    copies the values before it returns, so the host tensor may change afterwards)."""
    return values.to(device, non_blocking=True)


def block_loss(hidden: torch.Tensor, labels: torch.Tensor, lm_head, weights: torch.Tensor,
               teacher_logits: torch.Tensor | None = None, teacher_rows: torch.Tensor | None = None,
               vocab: torch.Tensor | None = None, compiled: bool = False) -> BlockResult:
    """Loss and accuracy of drafter hidden states [nblocks, B, D] against `labels` [nblocks, B] (or, with the
    sequence's `teacher_logits` [S, V] and `teacher_rows` [nblocks, B], the row of each block position's
    distribution, against the target's own distributions).

    The LM head runs only on positions with a label: the vocabulary projection is the largest tensor in a step.
    With `vocab` (sorted token ids) it also runs only on those rows, the ones drafting scores: a label outside
    them cannot be drafted, so it adds nothing to the loss and counts as a miss.

    `labels`, `teacher_rows` and `vocab` may live on the host while `hidden` is on a GPU (training builds them
    there): which rows have labels is then worked out on the host, so the step never waits on the GPU for it
    (a boolean index on the GPU would: its size is only known once the GPU has computed the mask).
    `compiled`: the loss's chunks through torch.compile (the `compiled` training kernel).
    """
    device = hidden.device
    valid = labels != IGNORE
    rows = valid.flatten().nonzero()[:, 0]
    valid_labels = labels.flatten()[rows]
    loss_weights = weights.to(labels.device).expand_as(labels).flatten()[rows]
    loss_labels = valid_labels
    if vocab is not None:
        column = torch.full((lm_head.weight.shape[0],), -1, dtype=torch.long, device=labels.device)
        column[vocab] = torch.arange(vocab.shape[0], device=labels.device)
        loss_labels = column[valid_labels]
        loss_weights = loss_weights * (loss_labels >= 0)
        loss_labels = loss_labels.clamp_min(0)
        vocab = on_device(vocab, device)
    head = lm_head.weight if vocab is None else lm_head.weight[vocab]
    teacher = on_device(teacher_rows.flatten()[rows.to(teacher_rows.device)], device) \
        if teacher_rows is not None else None
    rows = on_device(rows, device)
    loss, predictions = linear_cross_entropy(hidden.flatten(0, 1).index_select(0, rows), head,
                                             on_device(loss_labels, device), on_device(loss_weights, device),
                                             teacher_logits, teacher, vocab if teacher_logits is not None else None,
                                             compiled)
    if vocab is not None:
        predictions = vocab[predictions]
    hits = predictions == on_device(valid_labels, device)
    correct = torch.zeros(valid.numel(), dtype=torch.bool, device=device).index_put_((rows,), hits)
    valid = on_device(valid, device)
    return BlockResult(loss, correct.view_as(valid)[:, 1:], valid[:, 1:], loss_weights.sum())


def accept_lengths(correct: torch.Tensor) -> torch.Tensor:
    """Per block: 1 (the anchor, like the bonus token) + the number of LEADING correct predictions."""
    return 1 + correct.long().cumprod(dim=1).sum(dim=1)


def decode_rounds(lengths: list[int]) -> list[int]:
    """The tokens each round of greedy whole-block decoding commits through a response, from the accept length of a
    block anchored at EVERY position but the last (`lengths[i]`: the block at the i-th response position): each
    round's block starts where the previous round's tokens end, and the last round keeps what fits before the end
    (as decoding with a length limit does). Exact for a response the target generated greedily, since a block's
    drafts depend only on the context before its anchor (test_decode_rounds_equal_decoding)."""
    rounds, at = [], 0
    while at < len(lengths):
        rounds.append(min(lengths[at], len(lengths) - at))
        at += rounds[-1]
    return rounds


def block_metrics(result: BlockResult) -> dict[str, torch.Tensor]:
    """Per-step metrics, left on the device (the trainer syncs only when it logs)."""
    valid_count = result.valid.sum(0).clamp_min(1)
    return {
        "loss": result.loss.detach(),
        "accuracy": result.correct.sum(0) / valid_count,
        "tau": accept_lengths(result.correct).float().mean(),
    }


# ---- the objective ---------------------------------------------------------------------------------------------------
class DFlashObjective:
    """Trains a DFlashDrafter against a frozen target: one clean target pass for features, one drafter pass for
    all blocks of the sequence."""

    name = "dflash"

    def __init__(self, drafter, target, anchors_per_seq: int, gamma: float | None = None, max_length: int = 3072,
                 distill: bool = False, loss_vocab: str = "draft", anchor_policy: str = "uniform",
                 attention: str = "blocks"):
        """`attention`: the training attention's kernel (attention.KERNELS), or auto: blocks until `dflash train`
        times `attention_choices` at its first step."""
        if attention == "flex" and flex_unavailable(target.device):
            raise UserError(f"--attention {attention}: {flex_unavailable(target.device)}")
        if attention == "compiled" and compiled_cannot_run(target.device):
            raise UserError(f"--attention {attention}: {compiled_cannot_run(target.device)}")
        self.attention_setting = attention
        self.attention = "blocks" if attention == "auto" else attention
        self.fixed_batch: int | None = None  # the sequences per pass flex or compiled compiled for (`pass_kernel`)
        self.model = drafter
        self.anchor_policy = anchor_policy  # "uniform" or "decoded" (`decoded_anchors`)
        self.target = target
        self.distill = distill  # soft labels: the target's own distribution at each block position (KL)
        self.loss_vocab = loss_vocab  # "draft": score the rows drafting scores; "full": the whole vocabulary
        self._base_vocab: tuple[list[int] | None, torch.Tensor | None] = (None, None)  # (ids, membership mask)
        self.block_size = drafter.config.block_size
        self.anchors_per_seq = anchors_per_seq
        self.max_length = min(max_length, target.max_context)
        self.gamma = gamma if gamma is not None else default_gamma(self.block_size)
        self.weights = position_weights(self.block_size, self.gamma)  # on the host, like the labels they weigh
        self.feature_layers = tuple(drafter.config.target_layer_ids)

    def sequence(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The training sequence, on the host: a step builds its blocks, labels and loss rows there and sends them to
        the GPU without waiting for it (`on_device`)."""
        return torch.as_tensor(input_ids[: self.max_length], dtype=torch.long, device="cpu")

    def target_pass(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(features, logits or None), each [b, S, ...]: one clean target forward of the sequences [b, S]."""
        input_ids = on_device(input_ids, self.target.device)
        out = self.target.forward(input_ids, None, self.feature_layers, logits_at="all" if self.distill else "none")
        # target.forward runs in inference mode; autograd may not save inference tensors, so copy out of it
        return out.features.clone(), (out.logits.clone() if out.logits is not None else None)

    def attention_choices(self) -> list[str]:
        """The attention kernels `dflash train` times at its first step (auto, where flex can train), else the one
        set."""
        if self.attention_setting != "auto":
            return [self.attention_setting]
        device = self.target.device
        unavailable = {"blocks": "", "flex": flex_unavailable(device), "compiled": compiled_unavailable(device)}
        return [kernel for kernel in KERNELS if not unavailable[kernel]]

    def pass_kernel(self, count: int, nblocks: int) -> tuple[str, int]:
        """(kernel, blocks per sequence) of a pass of `count` sequences with up to `nblocks` blocks each. flex and
        compiled compile for one shape of the blocks: their passes pad every sequence to anchors_per_seq blocks
        (nearly all passes have that many already) and keep the sequences per pass of their first; any other pass,
        and any pass without gradients, takes blocks."""
        if self.attention == "blocks" or not torch.is_grad_enabled():
            return "blocks", nblocks
        self.fixed_batch = self.fixed_batch or count
        if count != self.fixed_batch:
            return "blocks", nblocks
        return self.attention, max(nblocks, self.anchors_per_seq)

    @property
    def activations_per_sequence(self) -> int:
        """Numbers in one hidden state of a sequence's blocks (anchors x block x width): what sizes a pass."""
        return self.anchors_per_seq * self.block_size * self.model.config.hidden_size

    def vocab_for(self, input_ids: torch.Tensor, loss_start: int) -> torch.Tensor | None:
        """The token ids a drafting pass would score for this sequence (DFlashProposer: the draft vocabulary plus
        the prompt's tokens), sorted; None for the whole vocabulary. Scoring only these rows cuts the LM head, the
        largest cost of a CPU step, by the vocabulary's ratio (49K -> 16K rows: 3x), and trains exactly the choice
        the drafter makes at inference."""
        draft_vocab = self.model.draft_vocab
        if self.loss_vocab == "full" or draft_vocab is None:
            return None
        if self._base_vocab[0] is not draft_vocab:  # prepare_new may set the vocabulary after construction
            member = torch.zeros(self.model.config.vocab_size, dtype=torch.bool)
            member[torch.tensor(draft_vocab, dtype=torch.long)] = True
            self._base_vocab = (draft_vocab, member)
        # on the host (a GPU's unique would stall the step), by membership: torch.unique over the 16K ids took
        # 0.7-0.9 ms a sequence on the CPU, this 0.14
        member = self._base_vocab[1].clone()
        member[input_ids[:loss_start].cpu()] = True
        return member.nonzero()[:, 0]

    def blocks_result(self, input_ids: torch.Tensor, anchors: torch.Tensor, loss_start: int = 0) -> BlockResult:
        """Run every block anchored at `anchors` through the drafter in one pass."""
        return self.blocks_results([input_ids], [anchors], [loss_start])[0]

    @staticmethod
    def padded(sequences: list[torch.Tensor]) -> torch.Tensor:
        """The sequences right-padded to the longest, rounded up to a multiple of CONTEXT_MULTIPLE, [b, S]: attention
        is causal, so padding after a sequence never reaches its positions, and every anchor lies before it."""
        length = -(-max(seq.shape[0] for seq in sequences) // CONTEXT_MULTIPLE) * CONTEXT_MULTIPLE
        ids = torch.zeros(len(sequences), length, dtype=torch.long, device=sequences[0].device)
        for row, seq in enumerate(sequences):
            ids[row, : seq.shape[0]] = seq
        return ids

    def blocks_results(self, sequences: list[torch.Tensor], anchor_sets: list[torch.Tensor],
                       loss_starts: list[int], context: tuple | None = None) -> list[BlockResult]:
        """Every block of several sequences in ONE target pass and ONE drafter pass, a result per sequence, each
        what `blocks_result` gives for that sequence alone (`context`: the target pass of the `padded` sequences,
        where the caller ran it already). Block lists are padded to the longest with blocks that have no labels;
        blocks never see each other. On a GPU one sequence per pass left the H100 half idle in stage 11 (launches
        and Python, not arithmetic). Blocks, labels and loss rows are built on the host (sequences on a GPU are
        copied back first) and sent over without waiting."""
        device = self.target.device
        sequences = [seq.cpu() for seq in sequences]
        count = len(sequences)
        batches = [build_block_batch(seq, anchors.cpu(), self.block_size, self.model.config.mask_token_id)
                   for seq, anchors in zip(sequences, anchor_sets)]
        kernel, nblocks = self.pass_kernel(count, max(batch.block_ids.shape[0] for batch in batches))
        block_ids = torch.full((count, nblocks, self.block_size), self.model.config.mask_token_id)
        positions = torch.arange(1, 1 + self.block_size).repeat(count, nblocks, 1)
        anchors = torch.ones(count, nblocks, dtype=torch.long)  # a padding block: anchor 1, no labels
        for row, batch in enumerate(batches):
            used = batch.block_ids.shape[0]
            block_ids[row, :used], positions[row, :used] = batch.block_ids, batch.positions
            anchors[row, :used] = batch.layout.anchors
        features, logits = context if context is not None else self.target_pass(self.padded(sequences))
        length = features.shape[1]  # a caller's context may be unpadded: every anchor lies before its end
        with torch.no_grad():
            embeds = self.target.embed_tokens(on_device(block_ids.reshape(count, -1), device))
        hidden = self.model(
            embeds,
            on_device(positions.reshape(count, -1), device),
            features,
            torch.arange(length, device=device).expand(count, -1),
            mask=BlockLayout(on_device(anchors, device), self.block_size, kernel, self.max_length),
        )
        results = []
        for row, (seq, batch, loss_start) in enumerate(zip(sequences, batches, loss_starts)):
            used = batch.block_ids.shape[0]
            # the label at block position k is the token at a+k, which the target predicted at position a+k-1
            rows = (batch.positions - 1).clamp(0, seq.shape[0] - 1) if logits is not None else None
            results.append(block_loss(hidden[row, : used * self.block_size].view(used, self.block_size, -1),
                                      batch.labels, self.target.lm_head, self.weights,
                                      logits[row] if logits is not None else None, rows,
                                      self.vocab_for(seq, loss_start), compiled=kernel == "compiled"))
        return results

    def usable(self, example) -> bool:
        """False for sequences whose (truncated) response leaves no anchor to train on."""
        return len(anchor_candidates(min(len(example.input_ids), self.max_length), example.loss_start)) > 0

    def loss(self, example, rng: np.random.Generator) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.losses([example], [rng])[0]

    def losses(self, examples, rngs) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
        """`loss` of each example (its anchors drawn from its own rng), all in one target and one drafter pass
        (with decoded anchors, a drafter pass without gradients first finds them)."""
        sequences = [self.sequence(example.input_ids) for example in examples]
        loss_starts = [example.loss_start for example in examples]
        if self.anchor_policy == "decoded":
            context = self.target_pass(self.padded(sequences))
            anchor_sets = self.decoded_anchors(sequences, loss_starts, rngs, context)
            results = self.blocks_results(sequences, anchor_sets, loss_starts, context)
        else:
            anchor_sets = [sample_anchors(seq.shape[0], start, self.anchors_per_seq, rng)
                           for seq, start, rng in zip(sequences, loss_starts, rngs)]
            results = self.blocks_results(sequences, anchor_sets, loss_starts)
        return [(result.loss, block_metrics(result)) for result in results]

    @torch.no_grad()
    def decoded_anchors(self, sequences, loss_starts, rngs, context) -> list[torch.Tensor]:
        """Per sequence, where greedy whole-block decoding with the drafter as it is would start its blocks in a
        window of `anchors_per_seq` positions drawn at random (all of a shorter response): a block at every window
        position, then `decode_rounds`. Decoding starts a block right after a rejected draft, where the text is
        harder than at a random position; training there trains what decoding asks of the drafter."""
        windows = []
        for seq, start, rng in zip(sequences, loss_starts, rngs):
            candidates = anchor_candidates(seq.shape[0], start)
            first = int(rng.integers(0, max(1, len(candidates) - self.anchors_per_seq + 1)))
            first += candidates.start
            windows.append(torch.arange(first, min(candidates.stop, first + self.anchors_per_seq)))
        probes = self.blocks_results(sequences, windows, loss_starts, context)
        anchor_sets = []
        for window, probe in zip(windows, probes):
            rounds = decode_rounds(accept_lengths(probe.correct).tolist())
            offsets = np.concatenate([[0], np.cumsum(rounds[:-1])]).astype(np.int64)
            anchor_sets.append(window[torch.from_numpy(offsets)])
        return anchor_sets

    @torch.no_grad()
    def evaluate(self, examples, rngs, per_pass: int = 1) -> dict:
        """Surrogate tau (mean over held-out anchors of 1 + leading correct positions), loss and per-position
        accuracy, pooled over all held-out anchors; and `eval_decode_tau`, the tau greedy whole-block decoding gets
        over the first `anchors_per_seq` tokens of each held-out response (`decode_rounds`). The two differ: decoding
        starts its blocks right after a rejected draft, where the text is harder than at a random position (on the
        shipped drafter's held-out set, 1.59 against 1.82 at random anchors over the same tokens). `per_pass`
        sequences share a target and a drafter pass, as a training step's do (the same figures, in fewer passes:
        on a GPU each pass costs its launches, whatever its width)."""
        loss_sum = weight_sum = 0.0
        correct = valid = None
        lengths, rounds = [], []
        for first in range(0, len(examples), per_pass):
            group = examples[first: first + per_pass]
            sequences = [self.sequence(example.input_ids) for example in group]
            starts = [example.loss_start for example in group]
            anchor_sets = [sample_anchors(seq.shape[0], start, self.anchors_per_seq, rng)
                           for seq, start, rng in zip(sequences, starts, rngs[first: first + per_pass])]
            context = self.target_pass(self.padded(sequences))
            for result in self.blocks_results(sequences, anchor_sets, starts, context):
                loss_sum += float(result.loss * result.weight_sum)
                weight_sum += float(result.weight_sum)
                c, v = result.correct.sum(0), result.valid.sum(0)
                correct, valid = (c, v) if correct is None else (correct + c, valid + v)
                lengths.append(accept_lengths(result.correct))
            rounds += self.decoded_rounds(sequences, starts, context)
        if not lengths:
            return {}
        return {
            "eval_loss": loss_sum / max(weight_sum, 1e-12),
            "eval_tau": float(torch.cat(lengths).float().mean()),
            "eval_decode_tau": float(np.mean(rounds)),
            "eval_accuracy": (correct / valid.clamp_min(1)).tolist(),
        }

    def decoded_rounds(self, sequences: list[torch.Tensor], loss_starts: list[int], context: tuple) -> list[int]:
        """Accept lengths of greedy whole-block decoding over the first `anchors_per_seq` response tokens of each
        sequence: a block at every one of those positions in one pass, then `decode_rounds`. `context`: the target
        pass of the `padded` sequences."""
        windows = []
        for seq, start in zip(sequences, loss_starts):
            candidates = anchor_candidates(seq.shape[0], start)
            window = torch.arange(candidates.start, min(candidates.stop, candidates.start + self.anchors_per_seq))
            # no context before the first response token, or no response: decoding never starts there
            windows.append(window if candidates.start == start and len(window) else None)
        kept = [i for i, window in enumerate(windows) if window is not None]
        if not kept:
            return []
        if len(kept) < len(sequences):  # the pass needs the target pass of exactly its sequences
            sequences, loss_starts = [sequences[i] for i in kept], [loss_starts[i] for i in kept]
            context = self.target_pass(self.padded(sequences))
        probes = self.blocks_results(sequences, [windows[i] for i in kept], loss_starts, context)
        return [length for probe in probes
                for length in decode_rounds(accept_lengths(probe.correct).tolist())]

    def save(self, folder, dtype: torch.dtype | None = torch.bfloat16) -> None:
        self.model.save(folder, dtype=dtype)



# ---- what `dflash train --method dflash` needs ---------------------------------------------------------------------
class DFlashTraining:
    shape_defaults = {"num_layers": 3, "block_size": 16, "num_features": 5}
    fixed_shape: tuple[str, ...] = ()
    fixed_shape_note = ""
    # an --init-from drafter is widened or deepened to these without changing its outputs
    free_on_init = ("kv_heads", "num_layers")
    own_options = ("anchors_per_seq", "anchors", "gamma", "loss", "init", "loss_vocab", "kv_heads", "seqs_per_pass",
                   "attention")

    def new_model(self, target, config) -> DFlashDrafter:
        cfg = DFlashConfig.for_target(
            target.config, target.vocab_size, default_mask_token_id(target.tokenizer, target.vocab_size),
            num_layers=config.num_layers, block_size=config.block_size, num_features=config.num_features,
            kv_heads=config.kv_heads,
        )
        drafter = DFlashDrafter.untrained(cfg, seed=config.seed)  # the seed fixes the initial weights
        if config.init == "target":
            copy_target_layers(drafter, target)
        return drafter.to(target.device)

    def load_model(self, folder, target) -> DFlashDrafter:
        try:
            drafter = DFlashDrafter.load(folder, dtype=torch.float32, device=str(target.device))
        except RuntimeError as exc:  # weight shapes that contradict config.json
            raise UserError(f"{folder}: drafter weights do not match its config ({str(exc).splitlines()[0]})") from exc
        drafter.check_fits(target)
        return drafter

    def shape_of(self, drafter: DFlashDrafter) -> dict[str, int]:
        cfg = drafter.config
        return {"num_layers": cfg.num_hidden_layers, "block_size": cfg.block_size,
                "num_features": len(cfg.target_layer_ids), "kv_heads": cfg.num_key_value_heads}

    def objective(self, drafter: DFlashDrafter, target, config) -> DFlashObjective:
        # an --init-from drafter given more heads or layers (no-op for any other)
        if config.kv_heads is not None:
            drafter = drafter.with_kv_heads(config.kv_heads)
        drafter = drafter.with_layers(config.num_layers)
        return DFlashObjective(drafter, target, config.anchors_per_seq, config.gamma, config.max_length,
                               distill=config.loss == "kl", loss_vocab=config.loss_vocab, anchor_policy=config.anchors,
                               attention=config.attention)

    def prepare_new(self, objective, train_examples, config) -> None:
        """A new drafter drafts among the most frequent response tokens of the training sequences (its draft
        vocabulary, saved beside its weights): the LM head rows a drafting pass scores."""
        from ...corpus import frequent_tokens

        drafter = objective.model
        size = min(config.draft_vocab or DEFAULT_DRAFT_VOCAB, drafter.config.vocab_size)
        responses = (e.input_ids[e.loss_start: objective.max_length] for e in train_examples)
        drafter.draft_vocab = frequent_tokens(responses, drafter.config.vocab_size, size)


def copy_target_layers(drafter: DFlashDrafter, target) -> None:
    """Start each drafter layer from one of the target's last layers (same width): attention and MLP projections and
    the two norms. The drafter's per-head q/k norms stay at 1 where the target has none (Llama); the fusion `fc` stays
    random. Gemma-style norms (an offset from 1) are converted to plain scales."""
    layers = target.model.get_decoder().layers
    chosen = layers[len(layers) - len(drafter.layers):]
    unit_offset = target.config.model_type.startswith("gemma")
    cfg = drafter.config
    target_kv_heads = chosen[0].self_attn.k_proj.weight.shape[0] // cfg.head_dim
    check_kv_heads(cfg.num_key_value_heads, cfg.num_attention_heads, target_kv_heads)  # copies need whole repeats
    with torch.no_grad():
        for ours, theirs in zip(drafter.layers, chosen):
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                weight = getattr(theirs.self_attn, name).weight
                wanted = getattr(ours.self_attn, name).weight
                if name in ("k_proj", "v_proj") and wanted.shape[0] != weight.shape[0]:  # more KV heads than it has
                    weight = repeat_kv_rows(weight, cfg.head_dim, wanted.shape[0] // weight.shape[0])
                wanted.copy_(weight)
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(ours.mlp, name).weight.copy_(getattr(theirs.mlp, name).weight)
            for name in ("input_layernorm", "post_attention_layernorm"):
                weight = getattr(theirs, name).weight
                getattr(ours, name).weight.copy_(weight + 1 if unit_offset else weight)
            for name in ("q_norm", "k_norm"):
                if getattr(theirs.self_attn, name, None) is not None:
                    weight = getattr(theirs.self_attn, name).weight
                    getattr(ours.self_attn, name).weight.copy_(weight + 1 if unit_offset else weight)
