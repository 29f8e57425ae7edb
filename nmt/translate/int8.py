"""int8 inference on the CPU (`--dtype int8`): every linear map of a trained model with 8-bit weights.

Each weight matrix W (out, in) is stored as integers in [-L, L] with one scale per output row,
s_o = max_i |W_oi| / L (symmetric, as CTranslate2's int8). Each product x W^T quantizes its activations
per row, as CTranslate2 does: row r gets its own scale a_r = max_i |x_ri| / 127, the integers
q_ri = round(x_ri / a_r) in [-127, 127] are multiplied by the weight's with int32 accumulation, and
y_ro = a_r s_o (q_r . W_o) + b_o is formed in float32. That covers the attention and
feed-forward projections and the tied output projection (3.4), the largest product of a decoder step; the
embedding lookup itself stays float32.

A row's integers and scale depend on that row alone, its integer product is exact (no rounding, so no
dependence on the kernel's blocking, which changes with the row count), and every other operation here is
element by element within a row: a sentence's int8 translation does not depend on what else is in its
batch (tests/test_int8_invariance.py, for every kernel that runs on the CPU at hand). fbgemm's dynamic
quantized linear as torch's quantization uses it takes one activation scale over all the rows of a call,
so it would; below, each call is made to have the same one.

The product: the first of KERNELS that `kernel` finds exact on this CPU, once.
- torch._int_mm for a few rows and oneDNN's quantized inner product for more (both below; `_ByRows`),
  where both are exact with 8 bits (VNNI, AMX): their integer sums are exact and their scaling the same
  code's, so they give the same bits and can split the work by row count, at a crossover timed here.
  oneDNN's sums are exact only below 2^24 (ONEDNN_EXACT_SUMS): a map whose weights could pass that runs
  on _int_mm alone.
- fbgemm's dynamic quantized linear over prepacked weights (torch.ops.quantized.linear_dynamic), given
  each row divided by its own max |x_ri| and two more columns, +1 and -1, against zero weights: every
  call then spans exactly [-1, 1], so the one activation scale fbgemm takes over a call is the same for
  every call, and each row is quantized as alone. Its activations get 8 bits where the sums are exact
  (VNNI, AMX), 7 (reduce_range) where pairs add in int16.
- oneDNN's quantized inner product over weights prepacked once (torch.ops.onednn.qlinear_prepack and
  qlinear_pointwise, what torch's x86 quantization lowers to), with the integers above shifted by 128
  into u8 (zero point 128): AMX's tile unit and VNNI. Signed activations were ~25x slower for a single
  row on AMX and fell to a reference kernel with AVX-512 VNNI forced.
- torch._int_mm, which reorders the weights at every call (in torch 2.13 on AVX2, a reference kernel).
Measured on an Intel Xeon with AMX and on an AVX2 AMD EPYC, 2 threads (benchmarks/RESULTS.md, "int8
kernels and bf16 on a CPU with AMX"): of fbgemm and oneDNN, fbgemm was the fastest for the few rows of a
decoder step (the base model's output projection for one row: 0.85 ms against 1.28 for oneDNN and 3.1
for fp32 prepacked on AMX), and on AVX2 at every row count; oneDNN with AMX was 1.5-3x faster than
fbgemm from 64 rows up. On an Intel Xeon with AVX-512 VNNI (2026-11-27) _int_mm was faster than both for
one row, and oneDNN than fbgemm from 64 rows up, hence `_ByRows` first.

Bits. The kernels multiply unsigned 8-bit by signed 8-bit numbers. With VNNI (vpdpbusd: AVX-512 VNNI,
AVX-VNNI, AMX) the products accumulate in int32 directly, so 8 bits are exact. Without it (AVX2,
AVX-512 without VNNI) pairs of u8 x s8 products are added in saturating int16 (vpmaddubsw) and the
result is silently wrong: fbgemm then gets 7-bit activations, oneDNN and _int_mm 7-bit weights (L = 63:
2 x 254 x 63 fits). Which kernel runs depends on the CPU and on ONEDNN_MAX_CPU_ISA, so `kernel` asks
each kernel itself: a product built to overflow in int16, checked against exact integers.

Translations may differ from fp32's in some lines (the BLEU check is in benchmarks/RESULTS.md), and
between a CPU with VNNI and one without (8 against 7 bits).
"""

from __future__ import annotations

import functools
import math
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import Optional, Union  # noqa: UP035 - for TorchScript (ScriptedRowQuantized)

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nmt.errors import NmtError
from nmt.model import FeedForward
from nmt.translate.prepacked import applied, in_row_buckets, one_piece_pads

PROBE_ROWS = (1, 3, 8, 64, 512)  # the row counts at which `kernel` checks each product
_TINY = 1e-30  # the scale of an all-zero row, whose integers are then all 0
# 127 as a float32 tensor: given the number, torch wraps it in a float64 tensor and converts that at every
# call (three operators more); the quotient is the same bits (nmt.translate.scripted.scalar)
_LEVEL = torch.tensor(127.0)
_ENDS = torch.tensor([1.0, -1.0])  # the two columns that make each of fbgemm's calls span [-1, 1]
KEPT_ROWS = 8  # calls of up to this many rows divide into a buffer kept per thread (_Fbgemm.spanned)
_KEPT = threading.local()  # this thread's buffers: (in_features, rows) -> (buffer, its first in_features)
# fbgemm's product as the C++ function torch's operator wraps: the wrapper (an OpOverloadPacket of an
# operator with a TorchScript argument) looks through every call's arguments in Python for the fake
# objects of a trace first, 5 us of a one-row product's 13-18 (one sentence of the student, greedy with
# its shortlist: 0.953x the time, the same translations; AMD EPYC, avx2 only, one thread)
_LINEAR_DYNAMIC = getattr(torch.ops.quantized.linear_dynamic, "_op", torch.ops.quantized.linear_dynamic)


def _weight_integers(weight: Tensor, level: int) -> tuple[Tensor, Tensor]:
    """Per-row symmetric weights: (out, in) float32 -> integers (out, in) int8 in [-level, level], and
    each row's scale s_o = max_i |W_oi| / level (out,)."""
    scales = (weight.abs().amax(dim=1) / level).clamp(min=1e-12)
    return torch.round(weight / scales[:, None]).to(torch.int8), scales


def _row_integers(rows: Tensor, relu: bool = False) -> tuple[Tensor, Tensor]:
    """Per-row symmetric quantization: (M, in) float32 -> q (M, in) int8 in [-127, 127], a (M, 1).

    `relu`: of max(0, rows), without that pass and the one of abs(): the same scales and integers, as
    max_i |max(0, x_i)| is max(0, max_i x_i), and max(0, x) / a_r is max(0, x / a_r) (a_r > 0)."""
    top = rows.amax(dim=1, keepdim=True).clamp_min_(0.0) if relu else rows.abs().amax(dim=1, keepdim=True)
    scale = top.div_(_LEVEL).clamp_min_(_TINY)  # (M, 1) a_r
    q = torch.div(rows, scale)
    return (q.clamp_min_(0.0) if relu else q).round_().to(torch.int8), scale


class _Kernel:
    """An int8 product: built over (out, in) float32 weights and (out,) bias, called on (M, in) float32
    rows, giving (M, out) float32. `bits`: of the integers it has to narrow where sums would saturate."""

    name = ""
    bits = 8
    narrowed = "weights"  # which integers get 7 bits where sums would saturate (the module's docstring)
    relu_input = False  # multiplies max(0, rows): a feed-forward's second map, its ReLU folded in here

    def __call__(self, rows: Tensor) -> Tensor:
        raise NotImplementedError

    def ready(self) -> None:
        """Build now what would be built at first use: before `nmt translate` forks its workers, so that
        they share it rather than each building its own."""

    def gathered(self, ids: Tensor) -> _Kernel | None:
        """The same product over the output rows `ids` of this one's, from the integers it keeps; None
        where it keeps none (prepacked only), and the rows are quantized again from their floats."""
        return None

    def scripted(self, rows: int = 1) -> tuple[nn.Module, int] | None:
        """This product as a TorchScript module of the same operators (nmt.translate.scripted) and the most
        rows it serves, with what calls of up to `rows` rows need built; None where it has none (the eager
        step runs)."""
        return None

    @classmethod
    def exact_with(cls, bits: int) -> bool:
        raise NotImplementedError

    @classmethod
    def probe(cls) -> int | None:
        """The bits (8, else 7) with which this kernel's integer sums are exact here; None if neither."""
        return next((bits for bits in (8, 7) if cls.exact_with(bits)), None)


class _RowQuantized(_Kernel):
    """Rows quantized here (_row_integers), multiplied by `weight_bits`-bit weights in `multiply`."""

    def __init__(self, weight: Tensor, bias: Tensor, weight_bits: int, gather: bool = False):
        # (out, in), (out,) float32; `gather` (Int8Linear's): these keep their integers anyway
        self.bits, self.bias = weight_bits, bias
        self.prepare(*_weight_integers(weight, (1 << (weight_bits - 1)) - 1))

    def prepare(self, weight: Tensor, scales: Tensor) -> None:
        raise NotImplementedError

    def integers(self) -> Tensor | None:
        """The (out, in) int8 weights, where this product keeps them as they are."""
        return None

    def gathered(self, ids: Tensor) -> _RowQuantized | None:
        # each output row's integers and scale are its own (s_o = max_i |W_oi| / L): gathered, they are
        # the very numbers quantizing those rows alone gives, without quantizing again (building a
        # student's union of 448 rows for one sentence took 0.44 ms quantized, 0.13 ms gathered)
        weight = self.integers()
        if weight is None:
            return None
        product = type(self).__new__(type(self))
        product.bits, product.bias = self.bits, self.bias.index_select(0, ids)
        product.prepare(weight.index_select(0, ids), self.scales.index_select(0, ids))
        return product

    def multiply(self, q: Tensor) -> Tensor:
        """(M, in) int8 -> (M, out) float32: s_o (q_r . W_o), the sums exact in int32."""
        raise NotImplementedError

    def __call__(self, rows: Tensor) -> Tensor:
        q, scale = _row_integers(rows, self.relu_input)
        y = self.multiply(q)
        return torch.addcmul(self.bias, y, scale, out=y)  # a_r s_o acc + b_o

    @classmethod
    def exact_with(cls, bits: int) -> bool:
        """Whether the sums of 8-bit activations by `bits`-bit weights are exact here: the largest
        activations against the largest weights of either sign (where int16 pair sums would saturate),
        and random ones, at several row counts (PROBE_ROWS), since a library may pick another kernel by
        shape: one row (a decoder step of one sentence), a few, and the many rows of a batch's encoder.
        The sums (at most 64 x 127 x 127) are exact in float32, so scales of 1 return them as they are."""
        level = (1 << (bits - 1)) - 1
        gen = torch.Generator().manual_seed(0)
        weight = torch.randint(-level, level + 1, (32, 64), generator=gen, dtype=torch.int8)  # (out, in)
        weight[0], weight[1] = level, -level
        q = torch.randint(-127, 128, (max(PROBE_ROWS), 64), generator=gen, dtype=torch.int8)  # (M, in)
        for top in (0, len(q) - 3):  # the extremes first and last, so that every row count meets them
            q[top], q[top + 1], q[top + 2, ::2], q[top + 2, 1::2] = 127, -127, 127, -127
        exact = (q.long() @ weight.long().t()).float()
        return all(
            torch.equal(product.multiply(q[rows].contiguous()), exact[rows])
            for product in cls.probed(weight, torch.ones(len(weight)))
            for m in PROBE_ROWS
            for rows in (slice(0, m), slice(len(q) - m, len(q)))
        )

    @classmethod
    def probed(cls, weight: Tensor, scales: Tensor) -> list[_RowQuantized]:
        """Products of this kernel over (out, in) int8 weights that together run every code path it has."""
        product = cls.__new__(cls)
        product.prepare(weight, scales)
        return [product]


class _OneDNN(_RowQuantized):
    """oneDNN's quantized inner product, the weights prepacked once, q shifted into u8 (zero point 128)."""

    name = "onednn"

    def prepare(self, weight: Tensor, scales: Tensor) -> None:
        self.weight, self.in_features = torch.ops.onednn.qlinear_prepack(weight, None), weight.shape[1]
        self.scales = scales.float().contiguous()
        self.zero_points = torch.zeros(len(scales), dtype=torch.long)

    def multiply(self, q: Tensor) -> Tensor:
        # oneDNN builds and caches a kernel per row count: 400 counts of rows took 172 MiB more memory for
        # the demo model's output projection, 22 MiB in row buckets (nmt.translate.prepacked), as fast
        # q + 128 as u8 is q's two's-complement byte with its top bit flipped: one pass, against three
        # through int16 (5x faster over 1,000 rows of 256)
        return in_row_buckets(q.view(torch.uint8).bitwise_xor(128), self.product)

    def product(self, u: Tensor) -> Tensor:
        return torch.ops.onednn.qlinear_pointwise(
            u,
            1.0,
            128,
            self.weight,
            self.scales,
            self.zero_points,
            None,
            1.0,
            0,
            torch.float32,
            "none",
            [],
            "",
        )

    def scripted(self, rows: int = 1) -> tuple[nn.Module, int]:
        pad_to = one_piece_pads()
        scripted = ScriptedRowQuantized(
            self.bias, self.scales, self.in_features, onednn=self, pad_to=pad_to, relu_input=self.relu_input
        )
        return scripted, len(pad_to) - 1


class _IntMM(_RowQuantized):
    """torch._int_mm: int32 sums, scaled per output row after."""

    name = "int_mm"

    def prepare(self, weight: Tensor, scales: Tensor) -> None:
        self.weight_t, self.scales = weight.t(), scales.float().contiguous()  # (in, out), (out,)

    def integers(self) -> Tensor:
        return self.weight_t.t()

    def multiply(self, q: Tensor) -> Tensor:
        # int32 -> float32 first, then in place: about half the time of a mixed-type multiply and a new tensor
        return torch._int_mm(q, self.weight_t).float().mul_(self.scales)

    def scripted(self, rows: int = 1) -> tuple[nn.Module, int]:
        in_features = len(self.weight_t)
        scripted = ScriptedRowQuantized(
            self.bias, self.scales, in_features, self.weight_t, ALL_ROWS, relu_input=self.relu_input
        )
        return scripted, ALL_ROWS


class _Fbgemm(_Kernel):
    """fbgemm's dynamic quantized linear, each call made to span [-1, 1] (the module's docstring)."""

    name = "fbgemm"
    narrowed = "activations"

    def __init__(self, weight: Tensor, bias: Tensor, activation_bits: int, gather: bool = False):
        self.bits, self.bias, self.in_features = activation_bits, bias, weight.shape[1]
        integers, scales = _weight_integers(weight, 127)
        self._integers: Tensor | None = None
        if gather:
            # One scale over the whole matrix, 1, and each row's own after: fbgemm prepacks a per-channel
            # matrix one row's scale and zero point at a time, each through a tensor's item() (320 rows:
            # 1.37 ms so, 0.28 with one scale), and a union's integers, gathered from the full map's, are
            # not quantized again (0.73 ms): a sentence's union of 320 rows of the student's output
            # projection took 2.55 ms to build, 0.50 so (AMD EPYC, AVX2, one thread). The scaling is then
            # ours, the same code for the full map and any union of its rows: one more pass over the output.
            self.scales = scales
            self.weight = self._pack_integers(integers)
        else:
            self.scales, self.weight = None, self._pack(weight, scales)

    @staticmethod
    def linear(x: Tensor, packed: Tensor, reduce_range: bool) -> Tensor:
        # torch looks for __torch_function__ on every argument of an operator it calls from Python; on the
        # packed weights, a TorchScript object, that lookup throws and catches a C++ exception at every
        # call (an attribute it lacks). With subclasses' torch functions off (none of these are
        # subclasses) it is not looked up: one row through a 256 x 256 map took 26-45 us, 10-14 so
        # (AMD EPYC with AVX2, one thread; benchmarks/RESULTS.md, 2026-12-01)
        with torch._C.DisableTorchFunctionSubclass():
            return _LINEAR_DYNAMIC(x, packed, reduce_range)

    @staticmethod
    def _pack(weight: Tensor, scales: Tensor) -> Tensor:
        """(out, in) float32 weights -> fbgemm's packed int8 (out, in + 2), the two range columns zero."""
        padded = torch.cat([weight, weight.new_zeros(len(weight), 2)], dim=1)
        zero = torch.zeros(len(weight), dtype=torch.long)
        # torch 2.13 marks quantized tensors deprecated; fbgemm's prepack takes no other input
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            quantized = torch.quantize_per_channel(padded, scales.double(), zero, 0, torch.qint8)
            return torch.ops.quantized.linear_prepack(quantized, None)

    @staticmethod
    def _pack_integers(weight: Tensor) -> Tensor:
        """(out, in) int8 -> fbgemm's packed (out, in + 2), one scale of 1 over all, range columns zero."""
        padded = torch.cat([weight, weight.new_zeros(len(weight), 2)], dim=1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            quantized = torch._make_per_tensor_quantized_tensor(padded, 1.0, 0)
            return torch.ops.quantized.linear_prepack(quantized, None)

    def integers(self) -> Tensor | None:
        """The (out, in) int8 weights of a product built to `gather`, unpacked from fbgemm's copy once (a
        shortlist's first batch; nothing kept twice where none comes); None for others."""
        if self.scales is None:
            return None
        if self._integers is None:  # two threads of `nmt serve` may both unpack it: the same integers
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                packed = torch.ops.quantized.linear_unpack(self.weight)[0]
            self._integers = packed.int_repr()[:, : self.in_features].contiguous()
        return self._integers

    def gathered(self, ids: Tensor) -> _Fbgemm | None:
        weight = self.integers()
        if weight is None:
            return None
        product = _Fbgemm.__new__(_Fbgemm)
        product.bits, product.in_features, product._integers = self.bits, self.in_features, None
        product.bias, product.scales = self.bias.index_select(0, ids), self.scales.index_select(0, ids)
        product.weight = self._pack_integers(weight.index_select(0, ids))
        return product

    def scripted(self, rows: int = 1) -> tuple[nn.Module, int]:
        return ScriptedFbgemm(self), sys.maxsize

    def spanned(self, rows: Tensor, divisor: Tensor | float) -> Tensor:
        """(M, in) -> (M, in + 2): the rows divided by `divisor`, then +1 and -1, in one pass. For a few
        rows, the steps of one sentence, the result is a buffer of this thread's, valid until its next
        call with as many rows and inputs: the product reads it at once."""
        m = rows.shape[0]
        if m > KEPT_ROWS:
            return self.span(rows, divisor)
        kept = _KEPT.__dict__
        key = (self.in_features, m)
        buffers = kept.get(key)
        if buffers is None:
            # A buffer that is not an inference tensor: written in place outside inference mode too.
            # Built once, it leaves one operator of the five a call's own takes: one sentence of the
            # student, greedy with its shortlist, 0.93x the time; of the teacher at beam 4, 0.94x; files
            # the same (AMD EPYC, avx2 only, one thread, paired in one process, the same translations).
            with torch.inference_mode(False):
                x = self.span(rows.new_zeros(m, self.in_features), 1.0)
                buffers = kept[key] = (x, x.narrow(1, 0, self.in_features))
        x, head = buffers
        torch.div(rows, divisor, out=head)
        return x

    def span(self, rows: Tensor, divisor: Tensor | float) -> Tensor:
        """`spanned` in a tensor of its own."""
        x = rows.new_empty(rows.shape[0], self.in_features + 2)
        # narrow and copy_, not x[:, i] = 1.0 twice and x[:, :i]: two operators fewer, and Python's
        # indexing is slower than a method (one sentence of the student, greedy: 0.965x the time; files
        # the same, 1.009x; AMD EPYC, avx2 only, one thread, paired in one process)
        x.narrow(1, self.in_features, 2).copy_(_ENDS)
        torch.div(rows, divisor, out=x.narrow(1, 0, self.in_features))
        return x

    def __call__(self, rows: Tensor) -> Tensor:
        if self.relu_input:
            rows = F.relu(rows)
        a = rows.abs().amax(dim=1, keepdim=True).clamp_min_(_TINY)  # (M, 1)
        x = self.spanned(rows, a)  # each row's largest |x| is now exactly 1
        y = self.linear(x, self.weight, self.bits < 8)  # reduce_range: 7 bits
        if self.scales is not None:
            y.mul_(self.scales)
        return torch.addcmul(self.bias, y, a, out=y)

    @classmethod
    def exact_with(cls, bits: int) -> bool:
        """Whether fbgemm's sums are exact with `bits`-bit activations: inputs k / h that it quantizes to
        the integers k + zero point (h = 63.5 for 7 bits, 127.5 for 8), the extremes against the largest
        weights, at several row counts; the scaled output times h is then the exact integer sum."""
        half, top = (127.5, 127) if bits == 8 else (63.5, 63)
        gen = torch.Generator().manual_seed(0)
        weight = torch.randint(-127, 128, (32, 64), generator=gen).float()
        weight[0], weight[1] = 127, -127
        k = torch.randint(-top, top + 1, (max(PROBE_ROWS), 64), generator=gen).float()
        for first in (0, len(k) - 3):
            k[first], k[first + 1], k[first + 2, ::2], k[first + 2, 1::2] = top, -top, top, -top
        product = cls.__new__(cls)
        product.in_features = 64
        x = product.span(k, half)
        exact = k.double() @ weight.double().t()
        packings = (cls._pack(weight, torch.ones(len(weight))), cls._pack_integers(weight.to(torch.int8)))
        return all(
            (cls.linear(x[rows].contiguous(), packed, bits < 8).double() * half
             - exact[rows]).abs().max() < 0.25  # float32 rounding of sums below 2^20: under 0.1
            for packed in packings  # each row's scale, and one over all (`gather`)
            for m in PROBE_ROWS
            for rows in (slice(0, m), slice(len(k) - m, len(k)))
        )  # fmt: skip


class ScriptedFbgemm(nn.Module):
    """Int8Linear over _Fbgemm in TorchScript, operator for operator (`_Fbgemm.__call__`), but for the spanned
    input: the same numbers, concatenated (a buffer kept per thread is Python's; two fills of a new one
    are four operators more, each of TorchScript's narrow two): (.., in) -> (.., out)."""

    def __init__(self, product: _Fbgemm):
        super().__init__()
        self.packed, self.bias, self.scales = product.weight, product.bias, product.scales
        self.reduce_range, self.in_features = product.bits < 8, product.in_features
        self.ends, self.tiny = _ENDS.clone(), _TINY  # TorchScript reads no global float
        self.relu_input = product.relu_input

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.relu_input:
            rows = F.relu(rows)
        a = rows.abs().amax(dim=1, keepdim=True).clamp_min_(self.tiny)  # (M, 1)
        spanned = torch.cat([torch.div(rows, a), self.ends.expand(rows.shape[0], 2)], 1)  # (M, in + 2)
        y = torch.ops.quantized.linear_dynamic(spanned, self.packed, self.reduce_range)
        scales = self.scales
        if scales is not None:
            y.mul_(scales)
        y = torch.addcmul(self.bias, y, a, out=y)
        return y.view(x.shape[:-1] + [y.shape[1]])


class ScriptedRowQuantized(nn.Module):
    """_RowQuantized in TorchScript (`_row_integers`, the scaling of `__call__`) over torch._int_mm for up to
    `few_rows` rows (`_IntMM.multiply`) and oneDNN's prepacked kernel for more (`_OneDNN.multiply`), up to
    the len(pad_to) - 1 rows that `in_row_buckets` pads into one piece (`pad_to[m]`, one_piece_pads): as
    _ByRows, _IntMM (few_rows ALL_ROWS) or _OneDNN (0) splits them, (.., in) -> (.., out). oneDNN's u8
    integers are q + 128 added to the rounded floats before they become integers, not q's bytes with the
    top bit flipped (TorchScript has no Tensor.view(dtype)): the same integers, so the same bits."""

    def __init__(
        self,
        bias: Tensor,
        scales: Tensor,
        in_features: int,
        weight_t: Tensor | None = None,
        few_rows: int = 0,
        onednn: _OneDNN | None = None,
        pad_to: list[int] | None = None,
        relu_input: bool = False,
    ):
        super().__init__()
        self.bias, self.scales, self.relu_input = bias, scales, relu_input  # (out,), (out,)
        self.in_features, self.few_rows = in_features, few_rows
        # a kernel's tensors, or empty ones where it is absent (its rows never come: `rows` of `scripted`)
        self.weight_t = torch.empty(0, 0, dtype=torch.int8) if weight_t is None else weight_t  # (in, out)
        self.packed = torch.empty(0, dtype=torch.int8) if onednn is None else onednn.weight
        self.zero_points = torch.empty(0, dtype=torch.long) if onednn is None else onednn.zero_points
        self.pad_to = [0] if pad_to is None else pad_to
        self.level, self.shift, self.tiny = _LEVEL.clone(), 128.0, _TINY  # TorchScript reads no global float

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features)
        m = rows.shape[0]
        if self.relu_input:  # _row_integers's, of max(0, rows)
            top = rows.amax(dim=1, keepdim=True).clamp_min_(0.0)
        else:
            top = rows.abs().amax(dim=1, keepdim=True)
        scale = top.div_(self.level).clamp_min_(self.tiny)  # (M, 1) a_r
        integers = torch.div(rows, scale)
        if self.relu_input:
            integers = integers.clamp_min_(0.0)
        integers = integers.round_()
        if m <= self.few_rows:
            y = torch._int_mm(integers.to(torch.int8), self.weight_t).float().mul_(self.scales)
        else:
            u = integers.add_(self.shift).to(torch.uint8)
            bucket = self.pad_to[m]
            if bucket != m:
                u = F.pad(u, [0, 0, 0, bucket - m])
            none: list[Optional[Union[int, float, complex]]] = []  # noqa: UP007, UP045 - TorchScript's Scalar?[]
            y = torch.ops.onednn.qlinear_pointwise(
                u, 1.0, 128, self.packed, self.scales, self.zero_points, None, 1.0, 0, torch.float32, "none",
                none, "",
            )  # fmt: skip
            if bucket != m:
                y = y[:m]
        y = torch.addcmul(self.bias, y, scale, out=y)
        return y.view(x.shape[:-1] + [y.shape[1]])


# The row counts at which `_ByRows` times its two kernels; above the last, oneDNN's kernel runs.
CALIBRATION_ROWS = (1, 2, 4, 8, 16, 32, 64)


def _seconds(multiply, q: Tensor) -> float:
    """The best of three timings of two calls (after one that builds what a kernel caches per shape)."""
    multiply(q)
    best = math.inf
    for _ in range(3):
        start = time.perf_counter()
        multiply(q)
        multiply(q)
        best = min(best, time.perf_counter() - start)
    return best


@functools.cache
def _few_rows(out_power: int, in_features: int, threads: int) -> int:
    """Up to how many rows torch._int_mm multiplies faster than oneDNN's prepacked kernel: timed once per
    input width, output size rounded up to a power of two (2^out_power: a shortlist's union changes size
    batch to batch) and thread count, at the CALIBRATION_ROWS counts. Their results are the same bits, so
    the timing's noise can move the speed only, never a translation."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randint(-127, 128, (1 << out_power, in_features), generator=gen, dtype=torch.int8)
    onednn, int_mm = _ByRows.probed(weight, torch.ones(len(weight)))
    rows = 0
    for m in CALIBRATION_ROWS:
        q = torch.randint(-127, 128, (m, in_features), generator=gen, dtype=torch.int8)
        if _seconds(int_mm.multiply, q) > _seconds(onednn.multiply, q):
            break
        rows = m
    return rows


# oneDNN's u8 kernel for 8 rows and more sums q + 128 against the weights and takes 128 sum_i W_oi off after,
# exactly only while that shifted sum stays below 2^24 (float32's integers): where the weights let it pass
# that, the kernel's result was 1 off in the last place for such rows (2026-11-27, AMX), where its one-row
# kernel and _int_mm were exact, and a row's output would depend on its batch.
ONEDNN_EXACT_SUMS = 1 << 24
ALL_ROWS = sys.maxsize  # `_ByRows.few_rows` of a map multiplied by _int_mm alone


def _shifted_sums(weight: Tensor) -> int:
    """The largest |sum_i u_i W_oi| over u_i in [1, 255] (q + 128) for (out, in) int8 weights: 255 times one
    sign's integers less the other sign's. The demo model's widest maps (1,024 inputs) reach 6.2M, a third
    of 2^24; a wmt14 big model's (4,096) may pass it."""
    positive = weight.clamp(min=0).sum(dim=1, dtype=torch.int64)
    negative = weight.clamp(max=0).sum(dim=1, dtype=torch.int64).neg_()
    if not len(weight):
        return 0
    return int(torch.maximum(255 * positive - negative, 255 * negative - positive).max())


class _ByRows(_RowQuantized):
    """torch._int_mm for a few rows, oneDNN's prepacked kernel for more: the same integers, and the same
    float32 results to the bit whichever multiplies (`exact_with` checks it here), so a row's output still
    does not depend on its batch.

    Measured on an Intel Xeon with AVX-512 VNNI (no AMX), one thread (benchmarks/RESULTS.md, 2026-11-27):
    for one row _int_mm took 31-38 us against oneDNN's 73-100 and fbgemm's 45-57 for each of the demo
    model's decoder maps, 151 against 232 and 189 us for its 8000 x 256 output projection. Over hundreds
    of rows oneDNN's kernel was the fastest for that projection (256 rows: 4.2 ms against fbgemm's 13.8
    and _int_mm's 14.8), and _int_mm's time grew the fastest with the rows (a 768 x 256 map over 1,024
    rows: 4.8 ms against oneDNN's 2.1). Where the crossover lies depends on the CPU, the shape and the
    threads, so it is timed (`_few_rows`)."""

    name = "int_mm+onednn"

    def prepare(self, weight: Tensor, scales: Tensor, few_rows: int | None = None) -> None:
        self.few = _IntMM.__new__(_IntMM)
        self.few.prepare(weight, scales)
        self.scales = self.few.scales
        # oneDNN's copy: `ready`, or when more rows first come. A shortlist's union, built for every batch,
        # is multiplied by one sentence's few rows alone, and prepacking it cost more than a whole step.
        self.many: _OneDNN | None = None
        if _shifted_sums(weight) >= ONEDNN_EXACT_SUMS:  # oneDNN may be off for some rows: _int_mm for all
            few_rows = ALL_ROWS
        elif few_rows is None:
            few_rows = _few_rows((len(weight) - 1).bit_length(), weight.shape[1], torch.get_num_threads())
        self.few_rows = few_rows

    def integers(self) -> Tensor:
        return self.few.integers()

    def ready(self) -> None:
        # two threads of `nmt serve` may both build it: the same weights, one kept
        if self.many is None and self.few_rows < ALL_ROWS:
            many = _OneDNN.__new__(_OneDNN)
            many.prepare(self.integers(), self.scales)
            self.many = many

    def multiply(self, q: Tensor) -> Tensor:
        if q.shape[0] <= self.few_rows:
            return self.few.multiply(q)
        self.ready()
        return self.many.multiply(q)

    def scripted(self, rows: int = 1) -> tuple[nn.Module, int] | None:
        """Both kernels in TorchScript, each for its rows: _int_mm's, and oneDNN's up to the rows it takes in
        one piece. oneDNN's copy is built where `rows` are more than _int_mm's, as the eager product builds it
        at the first such call (a shortlist's union, built for one batch, may need none)."""
        if rows > self.few_rows:
            self.ready()
        pad_to = one_piece_pads() if self.many is not None else [0]
        rows = self.few_rows if self.few_rows == ALL_ROWS else max(self.few_rows, len(pad_to) - 1)
        if rows < 1:
            return None
        weight_t = self.few.weight_t
        scripted = ScriptedRowQuantized(
            self.bias, self.scales, len(weight_t), weight_t, self.few_rows, self.many, pad_to, self.relu_input
        )
        return scripted, rows

    @classmethod
    def probed(cls, weight: Tensor, scales: Tensor) -> list[_RowQuantized]:
        """One product that multiplies every row count by oneDNN, one that multiplies all by _int_mm."""
        products = [cls.__new__(cls), cls.__new__(cls)]
        for product, few_rows in zip(products, (0, max(PROBE_ROWS)), strict=True):
            product.prepare(weight, scales, few_rows)
        return products

    @classmethod
    def exact_with(cls, bits: int) -> bool:
        """Both kernels exact with `bits`-bit weights (the exact sums), and giving the same float32 output
        from the same integers under scales other than 1 (the int32 -> float32 conversion and the scaling
        are each in its own code). Only with 8 bits: without VNNI _int_mm is a reference kernel in torch
        2.13, and fbgemm was the fastest there at every row count."""
        if bits != 8 or not super().exact_with(bits):
            return False
        gen = torch.Generator().manual_seed(0)
        weight = torch.randint(-127, 128, (48, 1024), generator=gen, dtype=torch.int8)
        q = torch.randint(-127, 128, (max(PROBE_ROWS), 1024), generator=gen, dtype=torch.int8)
        onednn, int_mm = cls.probed(weight, torch.rand(48, generator=gen) / 100)
        return all(torch.equal(int_mm.multiply(q[:m]), onednn.multiply(q[:m])) for m in PROBE_ROWS)


KERNELS = (_ByRows, _Fbgemm, _OneDNN, _IntMM)  # in order of preference


@functools.cache
def kernel() -> tuple[type[_Kernel], int]:
    """The int8 product this CPU runs, the first of KERNELS that is exact, and its bits (probe)."""
    errors = []
    for product in KERNELS:
        try:
            bits = product.probe()
        except (AttributeError, RuntimeError, NotImplementedError) as err:
            errors.append(f"{product.name}: {str(err).splitlines()[0] if str(err) else type(err).__name__}")
            continue
        if bits is not None:
            return product, bits
        errors.append(f"{product.name}: not exact even with 7 bits")
    raise NmtError(f"--dtype int8 needs an exact int8 product in torch; here: {'; '.join(errors)}")


def kernel_words() -> str:
    """The kernel and its bits, a clause for the log: `by fbgemm with 7-bit activations (int16 pair sums
    here)`."""
    product, bits = kernel()
    saturating = " (int16 pair sums here)" if bits < 8 else ""
    return f"by {product.name} with {bits}-bit {product.narrowed}{saturating}"


def weight_bits() -> int:
    """The bits of the kernel's integers where it has to give some up (8 with VNNI or AMX, else 7)."""
    return kernel()[1]


class Int8Linear(nn.Module):
    """y = x W^T + b, W in int8 (a scale per output row), x quantized per row: (.., in) -> (.., out)."""

    def __init__(
        self, weight: Tensor, bias: Tensor | None, one_batch: bool = False, product=None, gather: bool = False
    ):
        """`gather`: a map whose rows a shortlist's unions take (`over`), the output projection: its product
        keeps what they are gathered from."""
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        if product is None:
            product, bits = kernel()
            bias = torch.zeros(self.out_features) if bias is None else bias.detach().float().contiguous()
            product = product(weight.detach().float(), bias, bits, gather=gather)
        self.product = product
        if not one_batch:  # a model's own products: all built before workers fork
            self.product.ready()

    def over(self, ids: Tensor, floats: Callable[[], tuple[Tensor, Tensor | None]]) -> Int8Linear:
        """The same product over this map's output rows `ids`, for one batch (a shortlist's union): its
        integers gathered where the kernel keeps them, else their floats, which `floats()` gathers (weight
        and bias), quantized; what only its larger row counts need is built if they come."""
        product = self.product.gathered(ids)
        if product is None:
            return Int8Linear(*floats(), one_batch=True)
        # no floats to gather (the student's union of 448 rows: 0.29 ms of its 0.41 in index_select): only
        # the shape is read, of a tensor that holds no data
        return Int8Linear(torch.empty(len(ids), self.in_features, device="meta"), None, True, product)

    def scripted(self, rows: int = 1) -> tuple[nn.Module, int] | None:
        """The product's TorchScript form and its most rows, or None (`_Kernel.scripted`)."""
        return self.product.scripted(rows)

    def forward(self, x: Tensor) -> Tensor:
        y = self.product(x.reshape(-1, self.in_features))  # (M, out)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.product.name} "
                f"{self.product.bits}-bit")  # fmt: skip


def quantize_int8(model: nn.Module) -> nn.Module:
    """The model (a Transformer, float32 on the CPU) with every nn.Linear and the tied output projection
    in int8, in place; for inference only (nothing here can be trained or saved). An Ensemble is
    quantized member by member (nmt.translate.builder.inference_model)."""
    param = next(model.parameters())
    if param.device.type != "cpu" or param.dtype != torch.float32:
        raise NmtError(f"--dtype int8 is for a float32 model on the CPU, not {param.dtype} on {param.device}")
    kernel()  # the kernels' check, before any weight is quantized
    model.eval()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, Int8Linear(child.weight, child.bias))
    for ffn in list(model.modules()):
        # max(0, x) folded into the quantization of fc2's input (_row_integers): two passes fewer over a
        # step's widest activations, the same integers
        if isinstance(ffn, FeedForward) and ffn.activation is F.relu:
            ffn.fc2.product.relu_input, ffn.activation = True, applied
    model.compile_output(functools.partial(Int8Linear, gather=True))  # the shared embedding as projection
    return model
