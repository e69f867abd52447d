"""What verifying a TREE of the drafter's candidates, instead of its one block, would bring, before building it.

A block drafter gives a distribution at each block position; a tree keeps the top-k tokens of each position and
grows, best first by the product of the drafter's probabilities along a path, up to NODES nodes (one target pass
verifies them all with a tree mask). Under greedy decoding the target's answer is known in advance, so a tree
round accepts the longest prefix of the answer that is a path of the tree. This script decodes with the real
drafter and engine (`dflash:whole`, bfloat16 target) but replaces each round's block by the answer's prefix that
the round's tree would accept plus one wrong token, so the rounds, the drafter's context and tau are those of
tree decoding; "chain" (top-1 per position, 15 nodes) is the plain block and must reproduce `dflash:whole`'s tau.

Usage: .venv/bin/python scripts/tree_estimate.py [DATASETS] [PROMPTS] [SHAPES]
(defaults: gsm8k,mt_bench 6 chain,15x4,31x4,63x8; a shape is NODESxTOP_K)
"""

import heapq
import sys

import torch

from dflash.bench import read_prompts, resolve_dataset
from dflash.engine import GenerationConfig, SpeculativeDecoder
from dflash.loading import build_proposer, load_target_cached
from dflash.methods.base import Draft


def best_first_tree(candidates: list[list[tuple[int, float]]], nodes: int) -> set[tuple[int, ...]]:
    """The `nodes` paths of largest probability product whose every prefix is also kept (a path's product never
    exceeds its prefix's, so best-first order keeps the set closed under prefixes)."""
    tree: set[tuple[int, ...]] = set()
    heap = [(-p, (t,)) for t, p in candidates[0]]
    heapq.heapify(heap)
    while heap and len(tree) < nodes:
        negative, path = heapq.heappop(heap)
        tree.add(path)
        if len(path) < len(candidates):
            for t, p in candidates[len(path)]:
                heapq.heappush(heap, (negative * p, path + (t,)))
    return tree


def tree_accepted(tree: set[tuple[int, ...]], answer: list[int], at: int, depth: int) -> int:
    m = 0
    while m < depth and at + m < len(answer) and tuple(answer[at: at + m + 1]) in tree:
        m += 1
    return m


def main(argv: list[str]) -> int:
    datasets = (argv[0] if argv else "gsm8k,mt_bench").split(",")
    limit = int(argv[1]) if len(argv) > 1 else 6
    shapes = (argv[2] if len(argv) > 2 else "chain,15x4,31x4,63x8").split(",")
    torch.set_num_threads(2)
    target = load_target_cached("smollm2-135m", "bfloat16")
    config = GenerationConfig(max_new_tokens=128)
    plain = SpeculativeDecoder(target, build_proposer("ar", target)[0])
    proposer = build_proposer("dflash", target)[0]
    read = proposer.read_drafts
    marginals: list[torch.Tensor] = []  # the last block's probabilities [positions, vocab] and their token ids

    def reading(hidden, base=None):
        flat = hidden.reshape(-1, hidden.shape[-1])
        logits = proposer.base_logits(hidden) if base is None else base
        if proposer.prompt_rows is not None:
            logits = torch.cat([logits, torch.nn.functional.linear(flat, proposer.prompt_rows).float()], dim=-1)
        marginals[:] = [logits.softmax(-1)]
        return read(hidden, base)

    proposer.read_drafts = reading
    drafter_propose = proposer.propose
    for dataset in datasets:
        path, template = resolve_dataset(dataset)
        prompts = [target.encode_prompt(p.turns[0]) for p in read_prompts(path, template, limit)]
        answers = [ids + plain.generate(ids, config).tokens for ids in prompts]
        for shape in shapes:
            nodes, top = (15, 1) if shape == "chain" else map(int, shape.split("x"))
            answer: list[int] = []

            def propose(sequence, limit=None, keep_going=None):
                draft = drafter_propose(sequence, limit, keep_going)
                probs = marginals[0]
                best, ids = probs.topk(top, dim=-1)
                if proposer.vocab_ids is not None:
                    ids = proposer.vocab_ids[ids]
                candidates = [list(zip(i.tolist(), p.tolist())) for i, p in zip(ids, best)]
                at = len(sequence)
                m = tree_accepted(best_first_tree(candidates, nodes), answer, at, len(candidates))
                tokens = answer[at: at + m]
                if at + m < len(answer):
                    tokens.append((answer[at + m] + 1) % target.vocab_size)  # the round's first miss
                return Draft(tokens, [1.0] * len(tokens))

            proposer.propose = propose
            whole = SpeculativeDecoder(target, proposer, adaptive=False)
            accepted = rounds = mismatches = 0
            for ids, full in zip(prompts, answers):
                answer[:] = full
                result = whole.generate(ids, config)
                mismatches += ids + result.tokens != full
                accepted += sum(result.stats.accept_lengths)
                rounds += result.stats.num_rounds
            proposer.propose = drafter_propose
            print(f"{dataset} ({len(prompts)} prompts, 128 tokens) {shape:>8}: tau {accepted / rounds:.3f} "
                  f"({rounds} rounds, {mismatches} answers differ)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
