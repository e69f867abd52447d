"""Training the EAGLE-3 head: the training-time test (TTT) unroll, its loss, the draft vocabulary from data, and the
recipe `dflash train --method eagle3` uses.

TTT. `unroll` reproduces inference for EVERY position at once: step k at position j uses the hidden state step k-1
produced at j-1 and attends to step-0 keys at positions <= j-k (the chain's real root and before) plus step-i keys at
j-k+i for i = 1..k (its own chain), exactly what the speculative step sees at inference.
"""

from __future__ import annotations


import numpy as np
import torch
import torch.nn.functional as F

from ...corpus import frequent_tokens
from .head import DEFAULT_DEPTH, IGNORE, Eagle3Head


def unroll(head: Eagle3Head, embeds: torch.Tensor, hidden: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Training-time test over all positions: the output hidden states [b, s, D] of steps 0..steps-1.
    embeds: target embeddings of the pairs' tokens; hidden: fused target features of the pairs."""
    positions = torch.arange(embeds.shape[1], device=embeds.device)[None]
    rope = head.rotary(positions, hidden.dtype)
    layer = head.midlayer
    attn = layer.self_attn
    embeds = embeds.to(hidden.dtype)
    keys, values, outputs = [], [], []
    for k in range(steps):
        if k > 0:  # position j continues the chain of position j-1: its hidden is the previous step's output there
            hidden = F.pad(outputs[-1][:, :-1], (0, 0, 1, 0))
        q, key, value = attn.project(layer.attention_input(embeds, hidden), rope)
        keys.append(key)
        values.append(value)
        attended = ttt_attention(q, keys, values)
        b, heads, s, d = attended.shape
        outputs.append(layer.finish(hidden, attended.transpose(1, 2).reshape(b, s, heads * d)))
    return outputs


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """Attention of step k = len(keys) - 1 at every position j: step-0 keys at positions <= j-k, and step-i keys at
    position j-k+i for i = 1..k (the diagonal of the speculative chain). Positions j < k have no real root; they only
    see what exists (at least their own key) and carry no loss."""
    k = len(keys) - 1
    heads, seq = q.shape[1], q.shape[2]
    scale = q.shape[-1] ** -0.5

    def expand(t: torch.Tensor) -> torch.Tensor:  # GQA: kv head g serves query heads g*r .. g*r+r-1 (as SDPA does)
        return t.repeat_interleave(heads // t.shape[1], dim=1)

    def shift(t: torch.Tensor, by: int) -> torch.Tensor:  # t'[j] = t[j - by]
        return F.pad(t[:, :, : seq - by], (0, 0, by, 0)) if by else t

    rows = torch.arange(seq, device=q.device)
    scores = [(q @ expand(keys[0]).transpose(-1, -2)) * scale]
    scores[0] = scores[0].masked_fill(rows[None, :] > rows[:, None] - k, float("-inf"))
    shifted_values = []
    for i in range(1, k + 1):
        key = shift(expand(keys[i]), k - i)
        diagonal = (q * key).sum(-1, keepdim=True) * scale
        scores.append(diagonal.masked_fill((rows < k - i)[:, None], float("-inf")))
        shifted_values.append(shift(expand(values[i]), k - i))
    weights = torch.cat(scores, dim=-1).float().softmax(-1).to(q.dtype)
    out = weights[..., :seq] @ expand(values[0])
    for i, value in enumerate(shifted_values):
        out = out + weights[..., seq + i : seq + i + 1] * value
    return out


# ---- draft vocabulary from data ------------------------------------------------------------------------------------
# ---- training loss ---------------------------------------------------------------------------------------------
def _label_mask(input_ids: torch.Tensor, loss_start) -> torch.Tensor:
    """Bool [b, s]: positions whose token is a training label. `loss_start` is an int, a [b] tensor of first
    response indices, or already a bool [b, s] mask (e.g. response and not padding)."""
    if isinstance(loss_start, torch.Tensor) and loss_start.dtype == torch.bool:
        return loss_start.to(input_ids.device)
    start = torch.as_tensor(loss_start, device=input_ids.device).reshape(-1, 1)
    return torch.arange(input_ids.shape[1], device=input_ids.device)[None] >= start


def draft_labels(head: Eagle3Head, input_ids: torch.Tensor, loss_start) -> torch.Tensor:
    """On the host: the draft index of token j+2 for each pair j [b, s-2], IGNORE before `loss_start` and where the
    draft vocabulary lacks the token. Which rows have labels is then known without asking a GPU (each boolean index
    there stalls the step until the GPU has caught up)."""
    input_ids, target_ids = input_ids.cpu(), head.target_ids()
    kept = head.__dict__.get("_host_lookup")  # kept while the vocabulary stands (target_ids gives the same list)
    if kept is None or kept[0] is not target_ids:
        lookup = torch.full((head.config.vocab_size,), IGNORE, dtype=torch.long)
        lookup[torch.tensor(target_ids, dtype=torch.long)] = torch.arange(head.config.draft_vocab_size)
        kept = head.__dict__["_host_lookup"] = (target_ids, lookup)
    labels = kept[1][input_ids[:, 2:]]
    mask = loss_start.cpu() if isinstance(loss_start, torch.Tensor) else loss_start
    return labels.masked_fill(~_label_mask(input_ids, mask)[:, 2:], IGNORE)


def eagle3_loss(head: Eagle3Head, target, input_ids: torch.Tensor, loss_start, features: torch.Tensor | None = None,
                steps: int = DEFAULT_DEPTH, decay: float = 0.8) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Training-time-test loss over sequences `input_ids` [b, s] (prompt + target-regenerated response).

    Pair j = (feature j, token j+1) predicts token j+2, whose value in the data is the target's own choice. Step k
    unrolls the head on its own outputs; its cross-entropy over the draft vocabulary is weighted decay**k and the sum
    is divided by the sum of the weights of the steps that have labels. Labels outside the draft vocabulary and
    positions before `loss_start` are ignored. `features` [b, s, 3D]: the target's outputs of head.feature_layers
    (computed here when None). Metrics (detached, on the device): loss, accuracy [steps] (top-1 per step) and tau
    (1 + mean number of leading correct steps over chains with all steps labelled; a surrogate of acceptance).
    Labels and their rows are worked out on the host (`draft_labels`), so the step never waits on a GPU.
    """
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.shape[1] < 3:
        raise ValueError("eagle3_loss needs sequences of at least 3 tokens")
    device = head.fc.weight.device
    labels = draft_labels(head, input_ids, loss_start)
    input_ids = input_ids.to(device, non_blocking=True)
    if features is None:
        features = target.forward(input_ids, None, head.feature_layers, logits_at="none").features
    if features.is_inference():  # autograd may not save inference tensors (target.forward runs in inference mode)
        features = features.clone()
    with torch.no_grad():
        embeds = target.embed_tokens(input_ids[:, 1:-1])
    outputs = unroll(head, embeds, head.fuse(features[:, :-2]), steps)

    total = weight_sum = torch.zeros((), device=device)
    accuracy, correct_steps = [], []
    for k, hidden in enumerate(outputs):
        step_labels = labels.clone()
        step_labels[:, :k] = IGNORE  # no real root k pairs back
        rows = (step_labels != IGNORE).flatten().nonzero()[:, 0]
        wanted = step_labels.flatten()[rows].to(device, non_blocking=True)
        rows = rows.to(device, non_blocking=True)
        logits = head.logits(hidden.flatten(0, 1).index_select(0, rows))
        if rows.numel():
            total = total + decay**k * F.cross_entropy(logits.float(), wanted)
            weight_sum = weight_sum + decay**k
        correct = torch.zeros(labels.numel(), dtype=torch.bool, device=device)
        correct = correct.index_put_((rows,), logits.argmax(-1) == wanted).view(labels.shape)
        accuracy.append(correct.sum() / max(1, rows.numel()))
        correct_steps.append(correct)
    loss = total / weight_sum.clamp_min(1e-12)
    return loss, {"loss": loss.detach(), "accuracy": torch.stack(accuracy).detach(),
                  "tau": _surrogate_tau(correct_steps, labels, steps)}


def _surrogate_tau(correct_steps: list[torch.Tensor], labels: torch.Tensor, steps: int) -> torch.Tensor:
    """1 + leading correct drafts of the chain rooted at each pair r (its step-k draft sits at pair r+k); `labels`
    on the host, so which chains have every step labelled is known there."""
    device = correct_steps[0].device
    n = labels.shape[1] - steps + 1
    if n <= 0:
        return torch.ones((), device=device)
    has_all = torch.stack([labels[:, k : k + n] != IGNORE for k in range(steps)], dim=-1).all(-1)
    chains = has_all.flatten().nonzero()[:, 0]
    if not chains.numel():
        return torch.ones((), device=device)
    chain_ok = torch.stack([c[:, k : k + n] for k, c in enumerate(correct_steps)], dim=-1)  # [b, n, steps]
    lengths = 1 + chain_ok.long().cumprod(-1).sum(-1).float()
    return lengths.flatten().index_select(0, chains.to(device, non_blocking=True)).mean().detach()


class Eagle3Objective:
    """The EAGLE-3 head behind the trainer's objective interface (`loss(example, rng) -> (loss, metrics)`), the same
    interface as blocks.DFlashObjective: one clean target pass for features, one unrolled head pass."""

    name = "eagle3"

    def __init__(self, head: Eagle3Head, target, steps: int = DEFAULT_DEPTH, decay: float = 0.8,
                 max_length: int = 3072):
        head.check_fits(target)
        self.model, self.target = head, target
        self.steps, self.decay = steps, decay
        self.max_length = min(max_length, target.max_context)

    def sequence(self, input_ids) -> torch.Tensor:
        """On the host: eagle3_loss builds the labels there and sends the ids over without waiting."""
        return torch.as_tensor(input_ids)[: self.max_length].to("cpu", torch.long)

    def usable(self, example) -> bool:
        """False when the (truncated) sequence has no response token that a pair predicts (pairs predict j + 2)."""
        return min(len(example.input_ids), self.max_length) > max(example.loss_start, 2)

    def loss(self, example, rng: np.random.Generator | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        input_ids = self.sequence(example.input_ids)
        return eagle3_loss(self.model, self.target, input_ids, example.loss_start, None, self.steps, self.decay)

    @torch.no_grad()
    def evaluate(self, examples, rngs=None) -> dict:
        losses, taus, accuracies = [], [], []
        for example in examples:
            loss, metrics = self.loss(example)
            losses.append(float(loss))
            taus.append(float(metrics["tau"]))
            accuracies.append(metrics["accuracy"])
        if not losses:
            return {}
        return {"eval_loss": float(np.mean(losses)), "eval_tau": float(np.mean(taus)),
                "eval_accuracy": torch.stack(accuracies).mean(0).tolist()}

    def save(self, folder, dtype: torch.dtype | None = None) -> None:
        self.model.save(folder, dtype=dtype)


# ---- what `dflash train --method eagle3` needs ---------------------------------------------------------------------
DEFAULT_DRAFT_VOCAB = 8192


class Eagle3Training:
    # one decoder layer over a low, middle and high target layer; block 8 = the root + 7 chain steps (section 8)
    shape_defaults = {"num_layers": 1, "block_size": 8, "num_features": 3}
    fixed_shape = ("num_layers", "num_features")
    fixed_shape_note = "an EAGLE-3 head has 1 layer and fuses 3 target layers"
    free_on_init = ("block_size",)  # the chain depth is no weight shape: a head may be trained on for longer chains
    own_options: tuple[str, ...] = ()

    def new_model(self, target, config) -> Eagle3Head:
        # its draft vocabulary is fitted to the training data by prepare_new
        vocab = min(config.draft_vocab or DEFAULT_DRAFT_VOCAB, target.vocab_size)
        return Eagle3Head.for_target(target, range(vocab), depth=config.block_size - 1, seed=config.seed)

    def load_model(self, folder, target) -> Eagle3Head:
        head = Eagle3Head.load(folder, dtype=torch.float32, device=str(target.device))
        head.check_fits(target)
        return head

    def shape_of(self, head: Eagle3Head) -> dict[str, int]:
        return {"num_layers": 1, "block_size": head.config.depth + 1, "num_features": 3,
                "draft_vocab": head.config.draft_vocab_size}

    def objective(self, head: Eagle3Head, target, config) -> "Eagle3Objective":
        head.config.depth = config.block_size - 1  # the depth is no weight shape: a head may train on for longer
        return Eagle3Objective(head, target, steps=config.block_size - 1, max_length=config.max_length)

    def prepare_new(self, objective, train_examples, config) -> None:
        """A new head drafts the most frequent response tokens of the training sequences (the labels it learns)."""
        head = objective.model
        responses = (e.input_ids[e.loss_start: objective.max_length] for e in train_examples)
        head.set_draft_vocab(frequent_tokens(responses, head.config.vocab_size, head.config.draft_vocab_size))

