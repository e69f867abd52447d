"""Greedy tokens without reading the whole LM head: a screen, then the few survivors summed exactly.

A greedy round needs only the argmax of each verified position's logits, yet the float32 head of a small model is a
large share of a step's bytes (SmolLM2-135M: 113 of 540 MB, ~3 ms of a ~23 ms step on 2 EPYC cores). A screen reads
a smaller copy of the head, bfloat16 (half the bytes) or int8 with a scale per token (a quarter), and bounds how
far each approximate logit can be from the float32 one (native.c, `dflash_greedy_screened`, derives the bounds);
tokens that cannot be the largest are dropped, and the rest, a handful, are summed in float32 in exactly the order
the float32 head's kernel sums them. So the chosen token is bitwise the float32 head's argmax: screening changes how
fast a token is found, never which. Which screen runs (or none) is measured per machine (timings.measured_screening).
Where the CPU has AVX512-VNNI, the int8 screen sums in integers (inputs rounded to integers, a term for that rounding
in its bound; native.c): 2-2.5x faster at 5-16 rows, which a float32 FMA per widened weight had made compute-bound.
Where many rows are screened its inputs are wide (all but a row's 8 largest channels in a byte; those add their high
bytes apart), half the integer work for a few more survivors.
"""

from __future__ import annotations

import torch

from . import native

UNIT_ROUNDOFF = 2.0**-24  # float32
BF16_ROUNDING = 2.0**-8  # |w - bf16(w)| <= 2^-8 |w|, rounding to nearest
ROOM = 1 + 1e-6  # for computing a bound in double precision
KINDS = ("bfloat16", "int8")
# Rows from which the integer screen's inputs are wide (native.c): below, reading the head bounds its time and wide
# inputs only add survivors. The engine measures it per machine (timings.measured_screening); this is the start.
WIDE_FROM = 8


def chain_rounding(k: int) -> float:
    """gamma_k: the relative rounding a chain of k float32 FMAs can accumulate."""
    return k * UNIT_ROUNDOFF / (1 - k * UNIT_ROUNDOFF)


def bound_factors(kind: str, k: int) -> tuple[float, float]:
    """(norm_factor, l1_factor) of the bound |float32 logit - screened logit| <= norm_factor |x|_2 |w_i|_2 +
    l1_factor s_i |x|_1 for rows of k inputs (s_i: token i's int8 scale; native.c derives both)."""
    gamma = chain_rounding(k)
    if kind == "bfloat16":
        return (BF16_ROUNDING + 2 * gamma * (1 + BF16_ROUNDING)) * ROOM, 0.0
    # half a step of rounding w / s_i (plus that quotient's own float rounding), the int8 chain's rounding, the scale
    return gamma * ROOM, (0.5 + 1e-4 + 127 * (gamma + UNIT_ROUNDOFF)) * ROOM


ROWS_AT_ONCE = 4096


def by_rows(matrix: torch.Tensor, per_row) -> torch.Tensor:
    """`per_row` (a reduction of each row to one value) over `matrix` ROWS_AT_ONCE rows at a time: each row's value
    is what one call over the whole matrix gives, but a float64 copy of SmolLM2's float32 head (226 MB, made once at
    the first greedy round) had raised the peak memory of a generation by that much."""
    return torch.cat([per_row(matrix[start:start + ROWS_AT_ONCE]) for start in range(0, matrix.shape[0], ROWS_AT_ONCE)])


class ScreenedHead:
    """A head `weight` [vocab, hidden] (kept as it is, no copy) and its screen of `kind`. A float32 head's logits are
    its kernel's float32 sums; a bfloat16 head's are those sums rounded to bfloat16, whose ties the screen keeps (an
    int8 screen reads a quarter of a bfloat16 head's bytes too; a bfloat16 screen of it reads them all)."""

    def __init__(self, weight: torch.Tensor, kind: str = "bfloat16"):
        if kind not in KINDS:
            raise ValueError(f"screen kind must be one of {KINDS}, got {kind!r}")
        self.kind = kind
        self.weight = weight.detach().contiguous()
        self.row_norms = by_rows(self.weight, lambda rows: rows.double().norm(dim=1)).mul_(1 + 1e-12)
        self.bound_norms = self.row_norms  # the per-token factor of the bound's first term (native.c)
        # int8 summed in integers where the CPU has VNNI, the inputs rounded to bytes, dense or wide (native.c)
        self.vnni = kind == "int8" and native.int8_vnni()
        # from how many rows its inputs are wide (the 8 largest channels apart; fewer rows: dense, int16's precision)
        self.wide_allowed, self.wide_from = self.vnni and native.screen_wide(), WIDE_FROM
        if kind == "int8":
            quantized, self.scales = native.int8_rows(self.weight)
            self.tiles = native.vnni_tiles(quantized) if self.vnni else native.tiles(quantized)
            if self.vnni:  # c_i = s_i |q_i|_1, rounded up
                self.bound_norms = (by_rows(quantized, lambda rows: rows.double().abs().sum(dim=1))
                                    * self.scales.double()).mul_(1 + 1e-12)
        else:
            self.scales = None
            # widened, never in pairs: the bound holds for an FMA chain over float32 inputs
            self.tiles = native.tiles(self.weight.to(torch.bfloat16), pairs=False)
        # how the head's own kernel sums a bfloat16 head (native.c): 1 widened FMAs, 2 in pairs; 0 a float32 head
        self.bf16_head = 0 if self.weight.dtype != torch.bfloat16 else 2 if native.bf16_pairs() else 1
        self.norm_factor, self.l1_factor = bound_factors(kind, self.weight.shape[1])
        self.last_screened: torch.Tensor | None = None  # tokens summed in float32 per row, by the last call

    def wide_inputs(self, rows: int) -> bool:
        """Whether a call on `rows` rows rounds its inputs wide (native.c, "the int8 screen in integers")."""
        return self.wide_allowed and rows >= self.wide_from

    @staticmethod
    def applies(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Float32 or bfloat16 weights on a CPU with our kernels, no bias."""
        return (bias is None and weight.dtype in (torch.float32, torch.bfloat16) and weight.dim() == 2
                and weight.device.type == "cpu" and native.supports(weight))

    def argmax(self, x: torch.Tensor, norm=None) -> torch.Tensor | None:
        """argmax over the vocabulary of x [..., hidden] (the head's dtype) . weight^T, per row, or with `norm` (an
        RMSNorm, the model's final norm) of norm.rows(x) . weight^T, the norm taken in the same C call; None where
        the screen cannot decide (non-finite inputs): the caller computes the logits."""
        if x.dtype != self.weight.dtype or x.shape[-1] != self.weight.shape[1]:
            return None
        x = x.contiguous()
        if norm is not None and native.rms_norm_applies(x, norm.weight):
            found = native.greedy_screened(x.reshape(-1, x.shape[-1]), self, norm)
        else:
            x = norm.rows(x) if norm is not None else x
            found = native.greedy_screened(x.reshape(-1, x.shape[-1]).float(), self)  # bfloat16 widens exactly
        if found is None:
            return None
        ids, self.last_screened = found
        return ids.view(x.shape[:-1])
