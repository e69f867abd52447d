"""Inference matmuls on CPU: each frozen weight's product runs through the kernel measured fastest on this machine.

Why measured: PyTorch sends a float32 `nn.Linear` on CPU to MKL's sgemm. On one AMD EPYC that path ran SmolLM2-135M's
1-token step in 43 ms against 24 ms with the weights laid out ("packed") once for oneDNN; on an Intel Xeon with AMX
the packed path was 20% slower for the same step (shared/MEASURED.md). So the choice is made per weight shape and
per number of rows by timing both kernels on the weights themselves (`measure_plan`), and cached per machine
(`kernel_plan_for`), never assumed.

A third kernel is our own (native.py, AVX2 C compiled on first use): for the few rows of a decode step or a verify
pass it reads the weight near the memory bandwidth, where oneDNN and MKL reached little more than half of it.

`FrozenLinear` is for weights that no longer change (a frozen target, a loaded drafter). It keeps its weight as a
buffer, so `.to()` moves it, and re-packs whenever the weight it packed was moved, cast or written in place: a packed
copy can never go stale. Autograd, other devices and dtypes without a packed kernel take `F.linear`.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from . import native

KERNELS = ("plain", "packed", "native")  # exact kernels, any of which a plan may pick by measurement
# Inexact kernels, for drafters only and only where a plan names them: "int8" (fbgemm, float32 weights) and "vnni"
# (ours: int8 rows against inputs rounded to int16 per row, summed with AVX512-VNNI; float32 outputs whatever the
# weight's dtype). Drafts never change the output, only how many are accepted.
# Row buckets by their largest row count: 1 (a decode step), 2-16 (verify passes), more (prefill, batches); each is
# measured at a typical count of its own (MEASURED_ROWS).
ROW_BUCKETS = (1, 16, 1 << 30)
MEASURED_ROWS = (1, 8, 32)
PACK_ROWS_HINT = 16  # oneDNN picks its layout for about this many rows: a verify pass of a block of 16


def row_bucket(rows: int) -> int:
    return 1 if rows <= 1 else 16 if rows <= 16 else ROW_BUCKETS[-1]


def shape_key(out_features: int, in_features: int, dtype: torch.dtype, bucket: int) -> str:
    return f"{out_features}x{in_features}:{str(dtype).removeprefix('torch.')}:{bucket}"


@dataclass
class KernelPlan:
    """Which kernel each (weight shape, dtype, row bucket) uses. Keys that were never measured use `default`."""

    choices: dict[str, str] = field(default_factory=dict)
    default: str = "packed"
    timings_ms: dict[str, dict[str, float]] = field(default_factory=dict)  # what the choice rests on, for reports
    float_plan: "KernelPlan | None" = None  # an int8 plan's kernels for the products it keeps in float

    def in_float(self) -> "KernelPlan":
        """The plan for products that must stay in float: those reading a target's raw hidden states, whose few
        huge channels ("massive activations") would swamp a per-call int8 scale of the whole input."""
        return self.float_plan or self

    def kernel(self, out_features: int, in_features: int, dtype: torch.dtype, rows: int) -> str:
        return self.choices.get(shape_key(out_features, in_features, dtype, row_bucket(rows)), self.default)

    def summary(self) -> dict[str, int]:
        """How many measured (shape, rows) keys chose each kernel."""
        counts = {k: 0 for k in KERNELS}
        for choice in self.choices.values():
            counts[choice] = counts.get(choice, 0) + 1
        return counts


PLAIN = KernelPlan(default="plain")  # what a PyTorch user gets: F.linear everywhere
PACKED = KernelPlan(default="packed")
NATIVE = KernelPlan(default="native")  # our AVX2 kernel (native.py) everywhere


def int8_plan(float_plan: KernelPlan) -> KernelPlan:
    """Drafters only, never the target: int8 weights (one scale per output channel) times activations quantised per
    call (fbgemm). A quarter of float32's bytes and integer dot products: on one AVX2 core a 16K-row drafter head took
    0.6 ms instead of 4.3 ms for one row. Drafts never change the output, only how many are accepted, so they may be
    inexact. Products over raw target features keep `float_plan` (see KernelPlan.in_float)."""
    return KernelPlan(default="int8", float_plan=float_plan)


INT8 = int8_plan(PACKED)


def int8_head_plan(float_plan: KernelPlan) -> KernelPlan:
    """Drafters only: `float_plan`'s kernels for every shape it measured (a drafter's layers share the target's
    shapes, so they keep the target's kernels, and with them our C layers), int8 for the rest: a drafter's LM head,
    whose rows (16K of them for SmolLM2's draft vocabulary) are most of the bytes a drafting pass reads."""
    return KernelPlan(dict(float_plan.choices), "int8", dict(float_plan.timings_ms), float_plan=float_plan)


def packing_supported(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def _pack(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """The oneDNN layout of `weight`, or None where this build or CPU has no such kernel or it disagrees with
    F.linear on a probe (a cheap guard against a misbehaving build)."""
    if not packing_supported(weight):
        return None
    try:
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT)
            probe = torch.randn(2, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
            tolerance = 1e-3 if weight.dtype == torch.float32 else 5e-2
            if not torch.allclose(_packed_product(probe, packed, bias).float(), F.linear(probe, weight, bias).float(),
                                  rtol=tolerance, atol=tolerance):
                return None
        return packed
    except RuntimeError:  # e.g. bf16 packing needs AVX512-BF16 / AVX-NE-CONVERT
        return None


def _packed_product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def int8_supported(weight: torch.Tensor) -> bool:
    engines = torch.backends.quantized.supported_engines
    return (weight.device.type == "cpu" and weight.dtype == torch.float32
            and any(e in engines for e in ("x86", "fbgemm")) and hasattr(torch.ops.quantized, "linear_dynamic"))


INT8_PROBE_TOLERANCE = 0.05  # of the probe output's largest magnitude: int8 errors are ~1%, a broken build's ~100%


def _quantize(weight: torch.Tensor, bias: torch.Tensor | None):
    """fbgemm's packed int8 form of `weight` (symmetric, one scale per output row), or None where this build or CPU
    has no such kernel or its product strays from F.linear on a probe."""
    if not int8_supported(weight):
        return None
    try:
        with torch.no_grad():
            scale = (weight.abs().amax(dim=1).clamp_min(1e-12) / 127).double()
            zero = torch.zeros(weight.shape[0], dtype=torch.long)
            with warnings.catch_warnings():  # quantized tensors are deprecated; this one lives only to be packed
                warnings.simplefilter("ignore", UserWarning)
                quantized = torch.quantize_per_channel(weight, scale, zero, 0, torch.qint8)
            packed = torch.ops.quantized.linear_prepack(quantized, None if bias is None else bias.float())
            probe = torch.randn(4, weight.shape[1], generator=torch.Generator().manual_seed(0))
            expected = F.linear(probe, weight, bias)
            error = (_int8_product(probe, packed) - expected).abs().max()
            if not error <= INT8_PROBE_TOLERANCE * expected.abs().max():
                return None
        return packed
    except (RuntimeError, NotImplementedError, AttributeError):  # AttributeError: a torch without these ops
        return None


def _int8_product(x: torch.Tensor, packed) -> torch.Tensor:
    # reduce_range: 7-bit activations, so AVX2's pairwise int16 sums of u8 x s8 products cannot saturate
    return torch.ops.quantized.linear_dynamic(x.contiguous(), packed, True)


_products_changed = [0]  # bumped whenever a product's plan, weight buffer or place in a block may have changed


def products_generation() -> int:
    """A count that moves whenever any FrozenLinear gets a plan (new ones too), has its weight or bias buffer
    replaced or moved (`.to`, a cast), or is set into a layer's block (layers.py): checks that stay valid while
    nothing of that happens (transformer.ProductsUnchanged) skip their work while it stands still. In-place writes
    to a weight do not move it (its version does)."""
    return _products_changed[0]


def products_changed() -> None:
    _products_changed[0] += 1


class ReleasedWeight(torch.Tensor):
    """What a model's linear holds while its weight is released (FrozenLinear.release_plain): the weight's shape,
    dtype and device, and an error for anything that would read its values (a forward of transformers', a move, a
    cast). A meta tensor would not do: F.linear of a CPU input with a meta weight returns uninitialised memory."""

    METADATA = frozenset({"size", "dim", "numel", "nelement", "element_size", "stride", "is_contiguous",
                          "is_floating_point", "is_complex", "is_inference", "detach", "requires_grad_", "__repr__",
                          "__format__"})

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name != "__get__" and name not in cls.METADATA:  # property getters: shape, dtype, device, ...
            raise RuntimeError(f"this weight was released (TargetModel.release_plain_weights), so {name} cannot read "
                               "it: call target.restore_plain_weights() first")
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        return torch.Tensor._make_subclass(cls, out) if name == "detach" else out  # nn.Parameter detaches

    @classmethod
    def like(cls, weight: torch.Tensor) -> nn.Parameter:
        with torch.inference_mode():
            stand_in = torch.empty((), dtype=weight.dtype, device=weight.device).expand(weight.shape)
        return nn.Parameter(torch.Tensor._make_subclass(cls, stand_in), requires_grad=False)


class FrozenLinear(nn.Module):
    """y = x W^T (+ b) for inference, through the kernel `plan` picks for this shape and row count."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, plan: KernelPlan | None = None):
        super().__init__()
        # non-persistent: a frozen twin never adds keys to a model's state dict (checkpoint formats stay as they are)
        self.register_buffer("weight", weight.detach(), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach(), persistent=False)
        self._packed: torch.Tensor | None = None
        self._packed_for: tuple | None = None
        self._int8 = None
        self._int8_for: tuple | None = None
        self._tiles: torch.Tensor | None = None
        self._tiles_for: tuple | None = None
        self._vnni: tuple[torch.Tensor, torch.Tensor] | None = None
        self._vnni_for: tuple | None = None
        self._int8_weights: tuple[torch.Tensor, torch.Tensor, tuple] | None = None  # (q, scales, weight signature)
        # the model's linears whose weights are this weight (or rows of it): [(linear, rows)], set by `of`/`fused`
        self._sharers: list[tuple[nn.Linear, slice]] = []
        self._released: dict | None = None  # what `restore_plain` needs while the plain weight is released
        self.use_plan(plan or PACKED)

    def __setattr__(self, name, value):
        if name in ("weight", "bias"):
            products_changed()
        super().__setattr__(name, value)

    def _apply(self, fn, recurse=True):
        self.plain_weight()  # a move or a cast must carry the weight itself, not the stand-in of a released one
        products_changed()  # a move or a cast replaces the buffers
        return super()._apply(fn, recurse)

    def use_plan(self, plan: KernelPlan) -> None:
        """Look up this weight's kernel per row bucket once, so a call costs one comparison, not a lookup."""
        products_changed()
        self.plan = plan
        out_f, in_f = self.weight.shape
        self._kernel_by_bucket = tuple(plan.kernel(out_f, in_f, self.weight.dtype, b) for b in ROW_BUCKETS)
        self._planned_dtype = self.weight.dtype
        # a laid-out copy is as large as the weight: keep only those the plan uses (others are re-made on demand)
        if "native" not in self._kernel_by_bucket:
            self._tiles, self._tiles_for = None, None
        if "packed" not in self._kernel_by_bucket:
            self._packed, self._packed_for = None, None
        if "vnni" not in self._kernel_by_bucket:
            self._vnni, self._vnni_for = None, None

    def lay_out(self) -> None:
        """Make now the laid-out copies the plan's kernels read, rather than in the first call that needs each: in
        bfloat16 a prompt went through oneDNN's packed weights, and the first decode step then made our kernel's
        tiles (187 ms instead of 7, counted in the first generation's speed; the first pass of a batch took 400 ms
        and set the cost model of its rounds wrong)."""
        for kernel in set(self._kernel_by_bucket):
            if kernel == "native":
                self.native_tiles()
            elif kernel == "packed":
                self.packed()
            elif kernel == "int8":
                self.int8()
            elif kernel == "vnni":
                self.vnni()

    @classmethod
    def of(cls, linear: nn.Linear, plan: KernelPlan | None = None) -> "FrozenLinear":
        """A frozen twin sharing `linear`'s weight storage (no copy)."""
        twin = cls(linear.weight, linear.bias, plan)
        twin._sharers = [(linear, slice(None))]
        return twin

    @classmethod
    def fused(cls, linears: list[nn.Linear], plan: KernelPlan | None = None) -> "FrozenLinear":
        """One product for several linears reading the same input; their outputs are concatenated in order. The
        linears' weights (and biases) become views of the fused ones, so fusing costs no memory, and parameters
        made of true views share the fused tensor's version counter: an in-place write to `q_proj.weight` bumps the
        fused weight's version, which the product's laid-out copies and the C stack's check read (`.data = view`
        keeps a counter of its own, and such writes went unseen)."""
        sharers = []
        with torch.no_grad():
            weight = torch.cat([lin.weight.detach() for lin in linears])
            biases = [lin.bias for lin in linears]
            bias = None if all(b is None for b in biases) else torch.cat(
                [b.detach() if b is not None else weight.new_zeros(lin.out_features)
                 for b, lin in zip(biases, linears)])
            start = 0
            for lin in linears:
                rows = slice(start, start + lin.out_features)
                lin.weight = nn.Parameter(weight[rows], requires_grad=lin.weight.requires_grad)
                if lin.bias is not None:
                    lin.bias = nn.Parameter(bias[rows], requires_grad=lin.bias.requires_grad)
                sharers.append((lin, rows))
                start += lin.out_features
        fused = cls(weight, bias, plan)
        fused._sharers = sharers
        return fused

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    # ---- the plain weight, released while only our tiles are read ----------------------------------------------
    def release_plain(self) -> int:
        """Drop the plain weight where every row bucket runs our kernel, which reads its own laid-out copy (the
        tiles) and nothing else: a second copy of the weight, the size of the tiles in float32 and bfloat16 (an int8
        target's: the bfloat16 weight its integers stand for, and the integers too where the tiles hold them as
        they are, the AVX2 layout). The model's linears that shared it (`of`, `fused`) hold a ReleasedWeight meanwhile, so that
        a forward of transformers' fails with a message instead of reading a stand-in; `plain_weight` (which every
        path here that reads the weight's values calls) and `restore_plain` make it again, bitwise, from the tiles
        or an int8 target's integers. Returns the bytes released (0 where it was not)."""
        weight = self._buffers["weight"]
        tiles = self.native_tiles() if self._released is None and self._sharers else None
        if (tiles is None or set(self._kernel_by_bucket) != {"native"} or weight.requires_grad
                or any(lin.weight is None or lin.weight.requires_grad for lin, _ in self._sharers)):
            return 0
        int8 = self.int8_weights()
        if int8 is None and native.tiles_dtype(tiles) != weight.dtype:
            return 0
        with torch.inference_mode():  # no version counter: the C stack's check of versions skips it
            stand_in = torch.empty((), dtype=weight.dtype).expand(weight.shape)
        released = weight.numel() * weight.element_size()
        if int8 is not None and not native.in_pairs(tiles):  # the widened layout holds the integers as they are
            released += int8[0].numel()
            int8 = (None, int8[1])
        self._released = {"signature": None, "tiles": tiles, "int8": int8}
        self._buffers["weight"] = stand_in  # not setattr: the products did not change, their weight is the same
        self._released["signature"] = self._signature()
        self._tiles_for = self._released["signature"] + self._tiles_for[len(self._released["signature"]):]
        if int8 is not None:
            self._int8_weights = (*int8, self._released["signature"])
        for lin, _ in self._sharers:
            lin.weight = ReleasedWeight.like(lin.weight)
        return released

    def plain_weight(self) -> torch.Tensor:
        """The weight, made again first if it was released."""
        if self._released is not None:
            self.restore_plain()
        return self._buffers["weight"]

    def restore_plain(self) -> None:
        """Undo `release_plain`: the weight, and the model's linears' views of it, as they were (bitwise); the tiles
        stay as they are."""
        held = self._released
        if held is None:
            return
        n, k = self._buffers["weight"].shape
        with torch.inference_mode(False):  # a weight as loaded, with a version counter, even if made mid-generation
            int8 = self._released_int8()
            weight = native.int8_approximation(*int8) if int8 is not None else native.untiled(held["tiles"], n, k)
        self._released = None
        self.weight = weight  # setattr: a new buffer, so the C stack re-reads its products' signatures
        signature = self._signature()
        if self._tiles_for is not None and self._tiles_for[:len(held["signature"])] == held["signature"]:
            self._tiles_for = signature + self._tiles_for[len(signature):]
        if int8 is not None:
            self._int8_weights = (*int8, signature)
        for lin, rows in self._sharers:
            lin.weight = nn.Parameter(weight[rows], requires_grad=False)

    @property
    def released(self) -> bool:
        return self._released is not None

    def _released_int8(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A released int8 product's (q, scales), q read back from the tiles where it was released with the weight."""
        held = self._released
        if held is None or held["int8"] is None:
            return None
        q, scales = held["int8"]
        return (q if q is not None else native.untiled(held["tiles"], *self._buffers["weight"].shape)), scales

    def _signature(self) -> tuple:
        w = self._buffers["weight"]  # not self.weight: nn.Module's attribute lookup costs a microsecond per call
        # inference tensors (made under torch.inference_mode) keep no version counter; they are not written later
        return w.data_ptr(), w.dtype, w.device, 0 if w.is_inference() else w._version

    def packed(self) -> torch.Tensor | None:
        """The oneDNN layout of the CURRENT weight (re-made after a move, a cast or an in-place write)."""
        signature = self._signature()
        if self._packed_for != signature:
            self._packed, self._packed_for = _pack(self.plain_weight(), self.bias), self._signature()
        return self._packed

    def native_tiles(self) -> torch.Tensor | None:
        """Our kernel's layout of the CURRENT weight (native.py), or None where that kernel is not available: the
        int8 one where the weight is int8 (`quantize_int8`) and our kernels read int8 here."""
        weight = self._signature()
        held = self._int8_weights  # int8_weights() without making q, which a released product would read back
        int8 = held is not None and held[2] == weight and native.int8_kernel() is not None
        signature = weight + (native._pairs, native.int8_kernel() if int8 else None)  # switched in A/B runs
        if self._tiles_for != signature:
            if int8:
                self._tiles = native.int8_tiles(*self.int8_weights(weight))
            else:
                self._tiles = native.tiles(self.plain_weight()) if native.supports(self.weight) else None
            self._tiles_for = self._signature() + signature[len(weight):]
        return self._tiles

    def quantize_int8(self) -> None:
        """Makes this an int8 product (an int8 target's, `--dtype int8`): each output row of the bfloat16 weight
        rounded to 255 levels of its own scale (native.int8_weights), and the weight replaced in place by the
        bfloat16 values w' those stand for, so that every reader of it (torch's kernels, transformers' modules
        sharing its storage) runs the int8 model; our kernels read the int8 bytes, half the memory, multiplying
        by each row's scale after the sum instead (the same model up to rounding, as torch's kernels and ours
        are for any bfloat16 model). An in-place write to the weight later ends it: the new weight runs as it
        is."""
        if self.weight.dtype != torch.bfloat16:
            raise ValueError(f"int8 weights stand for bfloat16 ones, not {self.weight.dtype}")
        q, scales, approx = native.int8_weights(self.plain_weight())
        with torch.inference_mode() if self.weight.is_inference() else torch.no_grad():
            self.weight.copy_(approx)
        self._int8_weights = (q, scales, self._signature())

    def int8_weights(self, signature: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(q, scales) of an int8 product whose weight is still the one they stand for, where our kernels read
        int8 here (native.int8_kernel); else None. `signature`: the weight's, if the caller has it."""
        held = self._int8_weights
        if held is None or held[2] != (signature or self._signature()) or native.int8_kernel() is None:
            return None
        return self._released_int8() if held[0] is None else (held[0], held[1])

    def int8(self):
        """fbgemm's int8 form of the CURRENT weight, or None where there is none (then the float kernels run)."""
        signature = self._signature()
        if self._int8_for != signature:
            self._int8, self._int8_for = _quantize(self.plain_weight(), self.bias), self._signature()
        return self._int8

    def has_vnni(self) -> bool:
        """Whether the "vnni" kernel has a form for this weight here."""
        return native.supports(self.weight) and native.int8_vnni()

    def vnni(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Our int8 form of the CURRENT weight (VNNI tiles, per-row scales; native.py), or None where this build or
        CPU has no AVX512-VNNI (then the float kernels run)."""
        signature = self._signature() + (native.int8_vnni(),)
        if self._vnni_for != signature:
            form = None
            if self.has_vnni():
                quantized, scales = native.int8_rows(self.plain_weight())
                form = (native.vnni_tiles(quantized), scales)
            self._vnni, self._vnni_for = form, self._signature()
        return self._vnni

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if x.dtype != weight.dtype or x.device.type != "cpu" or (x.requires_grad and torch.is_grad_enabled()):
            return F.linear(x, self.plain_weight(), self.bias)
        if weight.dtype != self._planned_dtype:  # cast after freezing: the plan's choice for this dtype
            self.use_plan(self.plan)
        return self.run(x, self.kernel_for_rows(x.numel() // x.shape[-1]))

    def float_out(self, x: torch.Tensor) -> torch.Tensor:
        """self(x).float(), bitwise: a bfloat16 product through our kernel writes its outputs as float32 directly
        (an LM head's logits: for 16 rows of SmolLM2, 786k values were converted to bfloat16 on one thread and back
        by torch)."""
        if (x.dtype == self.weight.dtype == self._planned_dtype == torch.bfloat16 and x.device.type == "cpu"
                and not x.requires_grad and self.kernel_for_rows(x.numel() // x.shape[-1]) == "native"):
            tiles = self.native_tiles()
            y = None if tiles is None else native.linear(x, tiles, self.weight.shape[0], self.bias, float_out=True)
            if y is not None:
                return y
        return self(x).float()

    def kernel_for_rows(self, rows: int) -> str:
        return self._kernel_by_bucket[0 if rows <= 1 else 1 if rows <= 16 else 2]  # the bucket's index in ROW_BUCKETS

    def run(self, x: torch.Tensor, kernel: str) -> torch.Tensor:
        """The product through one named kernel (F.linear where that kernel has no form for this weight)."""
        if kernel == "packed":
            packed = self.packed()
            if packed is not None:
                return _packed_product(x, packed, self.bias)
        elif kernel == "native":
            tiles = self.native_tiles()
            if tiles is not None:
                y = native.linear(x, tiles, self.weight.shape[0], self.bias)
                if y is not None:
                    return y
        elif kernel == "int8":
            quantized = self.int8()
            if quantized is not None:
                return _int8_product(x, quantized)
        elif kernel == "vnni":
            form = self.vnni()
            if form is not None:
                y = native.vnni_product(x.reshape(-1, x.shape[-1]), *form, self.weight.shape[0])[0]
                y = y.view(*x.shape[:-1], y.shape[-1])
                return y if self.bias is None else y + self.bias.float()
        return F.linear(x, self.plain_weight(), self.bias)

    def kernels(self) -> tuple[str, ...]:
        """The kernels that have a form for this weight as it is now (`plain` always)."""
        return tuple(k for k in KERNELS if k == "plain" or (k == "packed" and self.packed() is not None)
                     or (k == "native" and native.supports(self.weight)))

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


# ---- choosing kernels by measurement ----------------------------------------------------------------------------
Timer = Callable[[], float]
MIN_GAIN = 0.05  # the other kernel must be this much faster to displace the default (timings are noisy)
CHOICE_VERSION = 3  # 2: the one-token step is timed whole (target.py), not only product by product; 3: 8-token passes too


def measure_plan(linears: Iterable[FrozenLinear], rows: Iterable[int] = MEASURED_ROWS, timer: Timer = time.perf_counter,
                 repeats: int = 2, prefer: str = "packed") -> KernelPlan:
    """Time each kernel on the model's own weights, per weight shape and row bucket, and keep the faster one.

    A narrow product streams its weight from memory, so weights of one shape (e.g. the 30 fused q/k/v projections)
    are timed in one pass over all of them, as a forward pass streams them, never hot in cache; a wide one reuses
    each weight many times, so two of them tell. Only shapes with more than one kernel are timed; a kernel must
    beat `prefer` by MIN_GAIN to be chosen. `timer` is injectable for deterministic tests. About half a second for
    SmolLM2-135M on 2 cores."""
    groups: dict[tuple, list[FrozenLinear]] = {}
    for lin in linears:
        available = lin.kernels()
        if len(available) > 1:
            groups.setdefault((lin.out_features, lin.in_features, lin.weight.dtype, available), []).append(lin)
    plan = KernelPlan(default=prefer)
    with torch.inference_mode():
        for (out_f, in_f, dtype, available), members in groups.items():
            for n in rows:
                timed = members if n <= 16 else members[:2]
                x = torch.randn(n, in_f, dtype=dtype)
                ms = {k: _time_kernel(timed, x, k, timer, repeats) for k in available}
                key = shape_key(out_f, in_f, dtype, row_bucket(n))
                best = min(ms, key=ms.get)
                baseline = ms.get(prefer, ms["plain"])
                plan.choices[key] = best if ms[best] < (1 - MIN_GAIN) * baseline else prefer
                plan.timings_ms[key] = {k: round(v, 4) for k, v in ms.items()}
    return plan


def _time_kernel(linears: list[FrozenLinear], x: torch.Tensor, kernel: str, timer: Timer, repeats: int) -> float:
    linears[0].run(x, kernel)  # warm-up: first calls allocate
    best = float("inf")
    for _ in range(repeats):
        start = timer()
        for lin in linears:
            lin.run(x, kernel)
        best = min(best, timer() - start)
    return 1000 * best / len(linears)


def machine_fingerprint() -> str:
    """What a kernel choice depends on: CPU model and features, torch version, thread count, the kernels we have."""
    cpu = platform.processor() or platform.machine()
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags", "cpu family", "model\t"))]
        cpu = "\n".join(dict.fromkeys(lines))
    except OSError:
        pass
    # a new or changed kernel, or a new way of choosing, makes old choices stale
    kernels = f"{KERNELS} native={native.build_id()} choice={CHOICE_VERSION}"
    text = f"{cpu}|torch {torch.__version__}|threads {torch.get_num_threads()}|{kernels}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# A cached timing taken while another job held the cores is measured again when the same thing now runs under this
# fraction of the time recorded for it (a machine busier now than then keeps it: re-measuring would repeat the error).
# Each new measurement records a step at least 15% faster than the one it replaces, so a machine re-measures a few
# times at most, each time quieter. 0.6 kept a plan and pass costs taken at a 1.19x busier moment: `make run`'s tau
# fell from 2.59 to ~2.0 until they were measured again (twenty-eighth session, docs/RESULTS.md).
STALE_RATIO = 0.85


def plan_cache_file() -> Path:
    from ..hub import cache_dir

    return cache_dir() / "kernel_plans.json"


_announced = False  # whether this process has said it is timing this machine (cached_measurement)


def cached_measurement(key: str, measure: Callable[[], dict], fingerprint: str | None = None,
                       cache_file: Path | None = None,
                       still_valid: Callable[[dict], bool] | None = None) -> tuple[dict, bool]:
    """(result, measured_now): what `measure()` returned for `key` on this machine, from the per-machine cache, or
    measured now (and cached). A result measured on another CPU, torch build or thread count is never reused, nor
    one that `still_valid` rejects (e.g. one measured while another job held the cores). The first measurement of
    a process says so on stderr: a fresh machine's first run spends ~15 of them, half a minute or more on 2 cores,
    and had nothing to show for it."""
    fingerprint = fingerprint or machine_fingerprint()
    cache_file = cache_file or plan_cache_file()
    full_key = f"{fingerprint}/{key}"
    stored = _read_json(cache_file)
    if full_key in stored and (still_valid is None or still_valid(stored[full_key])):
        return stored[full_key], False
    global _announced
    if not _announced:
        _announced = True
        print(f"[dflash] timing kernels and passes on this machine, once (kept in {cache_file})", file=sys.stderr,
              flush=True)
    result = measure()
    stored = _read_json(cache_file)  # re-read: another process may have written meanwhile
    stored[full_key] = result
    _write_json(cache_file, stored)
    return result, True


def kernel_plan_for(model_key: str, linears: list[FrozenLinear], fingerprint: str | None = None,
                    cache_file: Path | None = None, timer: Timer = time.perf_counter,
                    refine: Callable[[KernelPlan], KernelPlan] | None = None,
                    still_valid: Callable[[KernelPlan], bool] | None = None) -> tuple[KernelPlan, bool]:
    """(plan, measured_now): the cached plan of `model_key` on this machine, else a fresh measurement (cached).
    `refine` may revise a fresh plan by measuring more than single products (e.g. a whole step); `still_valid`
    may reject a cached one (it is then measured again)."""
    def measure() -> dict:
        plan = measure_plan(linears, timer=timer)
        if refine is not None:
            plan = refine(plan)
        return {"choices": plan.choices, "default": plan.default, "timings_ms": plan.timings_ms}

    def as_plan(entry: dict) -> KernelPlan:
        return KernelPlan(entry["choices"], entry["default"], entry.get("timings_ms", {}))

    entry, measured = cached_measurement(model_key, measure, fingerprint, cache_file,
                                         None if still_valid is None else lambda e: still_valid(as_plan(e)))
    return as_plan(entry), measured


def covering(plan: KernelPlan, linears: list[FrozenLinear], model_key: str, fingerprint: str | None = None,
             cache_file: Path | None = None, timer: Timer = time.perf_counter) -> KernelPlan:
    """`plan` (a target's) widened to the float products of `linears` (a drafter's) whose shapes it never measured,
    those measured now, once per machine (cached under `model_key`): a shape without a measurement took the plan's
    default, and for the DFlash drafter's feature product (576 x 2880, two rows) that default, oneDNN's packed
    kernel, took 0.87 ms where ours took 0.49 (AMD EPYC, 2 threads, weights cold). An int8 plan widens its float
    plan, the products it keeps in float."""
    floats = plan.in_float()
    measured = {key.rsplit(":", 1)[0] for key in floats.choices}
    missing = [lin for lin in linears if shape_key(lin.out_features, lin.in_features, lin.weight.dtype, 1
                                                   ).rsplit(":", 1)[0] not in measured]
    if not missing:
        return plan
    shapes = sorted({(lin.out_features, lin.in_features, str(lin.weight.dtype)) for lin in missing})
    extra, _ = kernel_plan_for(f"{model_key}:{shapes}", missing, fingerprint, cache_file, timer)
    wider = KernelPlan({**extra.choices, **floats.choices}, floats.default, {**extra.timings_ms, **floats.timings_ms},
                       floats.float_plan)
    if plan.float_plan is None:
        return wider
    return KernelPlan(plan.choices, plan.default, plan.timings_ms, float_plan=wider)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, json.JSONDecodeError):
        return {}


def _write_json(path: Path, data: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache costs a re-measurement next time, nothing more
