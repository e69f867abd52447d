"""EAGLE-3 drafting: a chain (top-1) of up to `depth` drafts per round from the one-layer head, or a dynamic tree."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ...checkpoint import folder_not_found
from ...errors import UserError
from ...trees import MAX_TREE_TOKENS
from ..base import (Draft, DraftPrecision, FeatureBacklog, MethodOptions, Proposer, best_drafting_seconds,
                    in_draft_dtype, shipped_drafter, with_kernel)
from .head import Eagle3Head


TREE_TOP_K = 8  # a dynamic tree's branching: candidates per expanded node, and nodes expanded per depth


class Eagle3Proposer(FeatureBacklog, Proposer):
    name = "eagle3"

    def __init__(self, head: Eagle3Head, target, depth: int | None = None, tree: int | None = None):
        head.check_fits(target)
        self.depth = depth or head.config.depth
        if self.depth < 1:
            raise UserError(f"EAGLE-3 draft depth must be >= 1, got {self.depth}")
        if tree is not None and not 1 <= tree < MAX_TREE_TOKENS:
            raise UserError(f"a tree has 1 to {MAX_TREE_TOKENS - 1} drafts (nodes), got {tree}")
        self.tree_nodes = tree
        self.head, self.target = head.eval(), target
        self.feature_layers = head.feature_layers
        self.max_draft = self.depth

    def setup_report(self) -> dict:
        return {"tree_nodes": self.tree_nodes} if self.tree_nodes else {}

    def start(self, prompt_ids: list[int], features: torch.Tensor | None) -> None:
        self.cache = self.head.new_cache(capacity=len(prompt_ids) + 256)
        self.pending = [features]

    def commit(self, token_ids: list[int], features: torch.Tensor | None) -> None:
        self.pending.append(features)

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.target.embed_tokens(token_ids)

    @torch.inference_mode()
    def propose(self, sequence: list[int], limit: int | None = None, keep_going=None) -> Draft:
        last = len(sequence) - 1  # position of the pending bonus token
        done = self.cache.lengths[0]
        pending = self.pending[0] if len(self.pending) == 1 else torch.cat(self.pending, dim=1)
        if done + pending.shape[1] != last:
            raise RuntimeError("EAGLE-3 head out of step with the target")
        device = self.target.device
        # new real pairs: committed features done..last-1 with the tokens that follow them (the last one: the bonus)
        tokens = torch.tensor([sequence[done + 1: last + 1]], device=device)
        hidden = self.head.step(self._embed(tokens), self.head.fuse(pending), done, self.cache)[:, -1:]
        self.cache.advance(last - done)  # the real pairs are committed; speculative ones are not
        self.pending = []
        if self.tree_nodes:
            return self._tree(hidden, last, keep_going)
        depth = self.depth if limit is None else min(limit, self.depth)
        drafts, confidences = [], []
        for k in range(depth):
            logits = self.head.logits(hidden).float()  # float32: a bf16 argmax is several times slower on CPU
            confidence, index = logits.softmax(-1).max(-1)
            drafts.append(self.head.target_ids()[int(index)])
            confidences.append(float(confidence))
            if k + 1 == depth or (keep_going is not None and not keep_going(confidences)):
                break
            # the next speculative pair, at position last+k: written past the committed length
            token = torch.tensor([[drafts[-1]]], device=device)
            hidden = self.head.step(self._embed(token), hidden, last + k, self.cache)
        return Draft(drafts, confidences)


    def _top(self, hidden: torch.Tensor) -> tuple[list[list[float]], list[list[int]]]:
        """Per row of `hidden` [1, m, D]: the head's TREE_TOP_K likeliest target tokens and their log-probabilities."""
        logits = self.head.logits(hidden).float()[0]
        scores, index = logits.log_softmax(-1).topk(min(TREE_TOP_K, logits.shape[-1]), dim=-1)
        return scores.tolist(), self.head.draft_to_target(index).tolist()

    def _tree(self, hidden: torch.Tensor, last: int, keep_growing=None) -> Draft:
        """A dynamic draft tree (EAGLE-2's, DFLASH_SPEC section 8): from the bonus's hidden state, the top K
        tokens; at each further depth the K likeliest nodes of the newest depth (by the sum of log-probabilities
        along their path) run through the head together, each attending to the committed pairs and its own
        ancestors, and their children's top K join the candidates; `depth` levels at most, fewer where
        `keep_growing(the likeliest leaf's path probability, depth)` (the controller's) says another does not pay.
        The `tree_nodes` likeliest nodes are kept (a path never scores above its prefix, so they form a tree), best
        first."""
        device = self.target.device
        scores, tokens = self._top(hidden)
        # nodes: (score, depth, parent node or -1, token); the frontier: the newest depth's node indices
        nodes = [(s, 1, -1, t) for s, t in zip(scores[0], tokens[0])]
        outputs = {-1: hidden[0, 0]}  # a node's output hidden state, the input of its children
        slots: dict[int, int] = {}  # a node's slot in the head's cache (past the committed length)
        frontier, slot = list(range(len(nodes))), last
        for depth in range(1, self.depth):
            expand = sorted(frontier, key=lambda i: -nodes[i][0])[:TREE_TOP_K]
            if keep_growing is not None and not keep_growing(math.exp(nodes[expand[0]][0]), depth):
                break
            for k, i in enumerate(expand):
                slots[i] = slot + k
            seen = torch.zeros(len(expand), slot + len(expand), dtype=torch.bool, device=device)
            seen[:, :last] = True
            for k, i in enumerate(expand):
                j = i
                while j >= 0:
                    seen[k, slots[j]] = True
                    j = nodes[j][2]
            step = self.head.tree_step(
                self._embed(torch.tensor([[nodes[i][3] for i in expand]], device=device)),
                torch.stack([outputs[nodes[i][2]] for i in expand])[None],
                torch.full((len(expand),), last + depth - 1, device=device), slot, seen, self.cache)
            slot += len(expand)
            scores, tokens = self._top(step)
            frontier = []
            for k, i in enumerate(expand):
                outputs[i] = step[0, k]
                for s, t in zip(scores[k], tokens[k]):
                    frontier.append(len(nodes))
                    nodes.append((nodes[i][0] + s, depth + 1, i, t))
        kept = sorted(range(len(nodes)), key=lambda i: (-nodes[i][0], nodes[i][1]))[: self.tree_nodes]
        block = {node: b + 1 for b, node in enumerate(kept)}  # block index 0 is the bonus
        return Draft([nodes[i][3] for i in kept], [math.exp(nodes[i][0]) for i in kept],
                     parents=[block[nodes[i][2]] if nodes[i][2] >= 0 else 0 for i in kept])


def build(target, options: MethodOptions) -> tuple[Eagle3Proposer, str | None]:
    """The head at `options.drafter`, else the shipped one for this target, else an UNTRAINED head (with a note);
    `options.block_size` B drafts chains of B - 1."""
    return in_draft_dtype("eagle3", target, options, lambda precision: load(target, options, precision))


def load(target, options: MethodOptions, precision: DraftPrecision) -> tuple[Eagle3Proposer, str | None]:
    if options.tree is not None and target.backend == "transformers":
        raise UserError("a tree of drafts needs our own forward (Llama, Qwen3, Gemma3 targets), not the transformers "
                        "fallback this target runs on")
    path, note = options.drafter, None
    if path is None:
        path = shipped_drafter(target.name, "eagle3")
    elif not Path(path).exists():
        raise folder_not_found(path, "EAGLE-3 head")
    if path is None:
        note = f"no trained EAGLE-3 head ships for {target.name}: using an UNTRAINED head (expect tau ~1, no speedup)"
        head = Eagle3Head.for_target(target)
    else:
        head = Eagle3Head.load(path, device=str(target.device))
    # run in the target's dtype (or the chosen draft dtype), like the DFlash drafter, so both pay alike
    plan = precision.plan_for(target)
    head = head.to(device=target.device, dtype=precision.dtype).freeze(plan)
    depth = options.block_size - 1 if options.block_size else None
    proposer = Eagle3Proposer(head, target, depth, options.tree)
    if target.measure and target.device.type == "cpu":
        settled_head(proposer, target, plan, precision.name)
    return proposer, note


def settled_head(proposer: Eagle3Proposer, target, plan, precision: str, repeats: int = 5,
                 seconds=best_drafting_seconds) -> None:
    """The head's product on the kernel a drafting pass measures fastest: the plan's, ours, or int8 rows summed with
    VNNI (drafts of logits ~1e-2 off: the target verifies each one), timed whole after a target step, in turns, once
    per machine. Its shape (the draft vocabulary's rows) is one no plan measured, and took oneDNN's packed kernel:
    0.67 ms for SmolLM2's 8192 x 576 bfloat16 rows after a target step, of a 1.4 ms draft (the DFlash drafter's head
    is settled the same way, `settled_kernels`). Not for int8 plans, whose products are meant to run on int8."""
    from ...models.target import cached_timing

    head = proposer.head.fast_head
    if head is None or plan.float_plan is not None:
        return
    candidates = {"plan": plan}
    for kernel in ("native", "vnni"):
        candidate = with_kernel(plan, [head], kernel)
        if all(candidate.choices != other.choices for other in candidates.values()):
            candidates[kernel] = candidate
    if len(candidates) == 1:
        return

    def measure() -> dict:
        times: dict[str, list[float]] = {name: [] for name in candidates}
        for _ in range(repeats):  # in turns: a slower moment weighs on every candidate alike
            for name, candidate in candidates.items():
                head.use_plan(candidate)
                times[name].append(seconds(proposer, target))
        return {name: round(1000 * sorted(t)[len(t) // 2], 3) for name, t in times.items()}

    timings = cached_timing(target, f"eagle3-head-kernel:{precision}:{head.out_features}x{head.in_features}:"
                                    f"{sorted(candidates)}", measure)
    head.use_plan(candidates[min((name for name in timings if name in candidates), key=timings.get)])
