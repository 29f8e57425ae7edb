"""fp32 and bf16 decoding on the CPU with the decoder's weights prepacked once for oneDNN's inner product.

A decoder step multiplies a few rows (sentences x beam: 4 for one sentence at beam 4) by every weight
matrix of the decoder and by the tied (vocabulary x d_model) output projection (3.4). At that shape
torch's default CPU product (F.linear, MKL's sgemm) reads the weights slowly: measured on an AMD EPYC with
AVX2, 2 threads, 4 rows times the 8000 x 256 output projection took 0.8-1.8 ms in F.linear and 0.21-0.26 ms
in oneDNN's inner product over the same weight reordered once into oneDNN's blocked layout; the base model's
37000 x 512 projection 19 against 5 ms; the other decoder maps 1.2-2.1x faster at 4 rows, 1.1-1.7x at 64,
about even from 256 rows on (benchmarks/RESULTS.md, "Translation speed"). The encoder's products, and
the decoder's projection of the encoder output into keys and values, have hundreds of rows, where the two
are even, so they keep F.linear.

The operators are torch's own, but private ones (torch.ops.mkldnn._reorder_linear_weight and
_linear_pointwise), so `prepack_decoder` first checks them on a small product and leaves the model as it
is where they are missing, disagree with F.linear, or give a row other bits among other rows.

A row's output does not depend on how many rows share the product (tests/test_prepacked.py checks it over
1 to 2,100 rows; `available` checks it on the CPU at hand), so translations stay independent of the
batch. One exception was measured: on an Intel Xeon with AMX (torch 2.11, 2026-11-27), oneDNN's kernel
for a single row summed in another order than its kernels for more rows at two threads (not at one), so
where `available` finds that, a single row is multiplied as two (`least_rows`). They may differ from
F.linear's in the last bits (a relative 1e-6 to 1e-5: another summation order), as two BLAS libraries do.

bf16 weights (`--dtype bf16`, and `auto` on a CPU with native bf16: nmt.device) are prepacked the same
way, where the probe passes in bf16. F.linear in bf16 also goes to oneDNN, but reorders the weights at
every call and builds a kernel for every row count it meets: the demo model's 1,000 test lines peaked at
731 MiB that way, 571-578 MiB prepacked (fp32: 584-631), and a sentence took 0.83x the time (AMX Xeon,
benchmarks/RESULTS.md, 2026-11-27 21:30).
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nmt.model import FeedForward
from nmt.translate.threads import on_threads

# oneDNN builds (and caches, 0.5-0.8 MiB each, ~2 ms to build) one primitive per product shape and row
# count, and a long run of `nmt translate` or `nmt serve` sees every row count up to its largest batch.
# So a product runs only at these row counts. Rows are padded up to the next count (zero rows: a row's
# result does not depend on the others) where that adds at most an eighth to the product, or always below
# PAD_BELOW rows, where a product costs about the same at any count; otherwise they are cut into the
# largest counts that fit, whose outputs are then concatenated (one more copy of the whole output).
# Powers of two: the demo model's 1,000 test lines met 18 counts of the 22 that also had the halfway
# counts (3, 6, 12 ... 1536), for each of its decoder's 5 shapes of product; the 8 fewer counts cut the
# peak RSS by 23-47 MiB at the same speed and outputs (benchmarks/RESULTS.md, 2026-11-28).
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
PAD_BELOW = 64
PAD_SHARE = 8  # pad m rows where the padding is at most m / PAD_SHARE rows


@functools.lru_cache(maxsize=4096)
def row_pieces(m: int) -> tuple[tuple[int, int], ...]:
    """How m rows are multiplied: (rows, bucket) pieces in order, rows <= bucket, bucket in ROW_BUCKETS."""
    pieces = []
    while m > 0:
        up = bisect.bisect_left(ROW_BUCKETS, m)  # the smallest count that holds all m rows
        if up < len(ROW_BUCKETS) and (m <= PAD_BELOW or (ROW_BUCKETS[up] - m) * PAD_SHARE <= m):
            pieces.append((m, ROW_BUCKETS[up]))
            break
        largest = ROW_BUCKETS[bisect.bisect_right(ROW_BUCKETS, m) - 1]  # the largest count that fits
        pieces.append((largest, largest))
        m -= largest
    return tuple(pieces)


def in_row_buckets(rows: Tensor, product: Callable[[Tensor], Tensor], least: int = 1) -> Tensor:
    """`product` of (M, in) rows, called at ROW_BUCKETS counts only (row_pieces): the rows padded with
    zeros or cut into pieces, the outputs (M, out) as if it had run on all M rows at once. For products
    whose row results do not depend on the other rows, and whose library builds a kernel per row count.
    `least` (a bucket): fewer rows are padded up to it (`least_rows`)."""
    if rows.shape[0] < least:
        return product(F.pad(rows, (0, 0, 0, least - rows.shape[0])))[: rows.shape[0]]
    pieces, start, out = row_pieces(rows.shape[0]), 0, []
    for m, bucket in pieces:
        piece = rows[start : start + m]
        if bucket != m:
            piece = F.pad(piece, (0, 0, 0, bucket - m))
        y = product(piece)
        out.append(y if bucket == m else y[:m])
        start += m
    return out[0] if len(out) == 1 else torch.cat(out)


def _pack(weight: Tensor) -> Tensor:
    """(out, in) float32 weight -> oneDNN's blocked copy of it (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


class PrepackedLinear(nn.Module):
    """y = x W^T + b through oneDNN, W reordered once: (.., in) -> (.., out). Inference only.

    `activation` "relu" applies max(0, y) inside the same oneDNN call (a post-op): one operator less.
    """

    def __init__(
        self, weight: Tensor, bias: Tensor | None, activation: str = "none", least: int | None = None
    ):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.packed = _pack(weight)
        self.bias = None if bias is None else bias.detach().contiguous()
        self.activation = activation
        self.least = least if least is not None else least_rows(weight.dtype) or 1  # rows multiplied at least

    def forward(self, x: Tensor) -> Tensor:
        y = in_row_buckets(x.reshape(-1, self.in_features), self.product, self.least)  # (M, out)
        return y.view(*x.shape[:-1], self.out_features)

    def product(self, rows: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, self.activation, [], "")

    def over(self, ids: Tensor, weight: Tensor, bias: Tensor | None) -> PrepackedLinear:
        """The same product over this map's output rows `ids`, whose floats are `weight` and `bias` (a
        shortlist's union): laid out again, as oneDNN's layout cannot be gathered."""
        return PrepackedLinear(weight, bias, self.activation)

    def extra_repr(self) -> str:
        fused = "" if self.activation == "none" else f", {self.activation} fused"
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN prepacked{fused}"


# The row counts `least_rows` multiplies alone and compares with the same rows among 300: one row, a few
# (a decoder step of a sentence or a few) and many (a batch's), where oneDNN's kernels change with the count.
# Each count builds a kernel that stays cached: every bucket up to 256 took 14 MiB more memory, these 4.
PROBE_ROWS = (1, 2, 3, 4, 8, 64, 256)


# How close to F.linear's a prepacked product must be, by dtype: another summation order in float32; in
# bf16 the output's rounding (2^-8 relative) of sums whose order differs
CLOSE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


@functools.cache
def least_rows(dtype: torch.dtype = torch.float32) -> int | None:
    """The fewest rows a product in `dtype` runs at: 1, or 2 where oneDNN's kernel for one row gives it
    other bits than among other rows (and two rows do not); None where the operators are missing, disagree
    with F.linear, or give a row other bits at another of PROBE_ROWS. Checked on one thread and on torch's
    setting (a batch's search runs on either: nmt.translate.threads)."""
    if not torch.backends.mkldnn.is_available() or dtype not in CLOSE:
        return None
    try:
        gen = torch.Generator().manual_seed(0)
        weight, bias = torch.randn(512, 256, generator=gen) / 16, torch.randn(512, generator=gen)
        x = torch.randn(300, 256, generator=gen)
        weight, bias, x = weight.to(dtype), bias.to(dtype), x.to(dtype)
        linear, fused = PrepackedLinear(weight, bias, least=1), PrepackedLinear(weight, bias, "relu", least=1)
        one_row = True
        with torch.inference_mode():
            for threads in sorted({1, torch.get_num_threads()}):
                with on_threads(threads):
                    full = linear.product(x)
                    if not all(torch.equal(linear.product(x[:m]), full[:m]) for m in PROBE_ROWS[1:]):
                        return None
                    one_row = one_row and torch.equal(linear.product(x[:1]), full[:1])
            # the fused ReLU must be the plain one's bits, so that fusing changes no translation
            same_relu = torch.equal(fused.product(x), F.relu(full)) and torch.equal(
                fused.product(x[:4]), F.relu(full[:4])
            )
        tolerance = CLOSE[dtype]
        close = torch.allclose(
            full.float(), F.linear(x, weight, bias).float(), rtol=tolerance, atol=tolerance
        )
        return (1 if one_row else 2) if same_relu and close else None
    except (AttributeError, RuntimeError, NotImplementedError):
        return None


def available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch has the operators in `dtype`, they agree with F.linear, and a row's result is the
    same alone and among other rows (`least_rows`): on a CPU whose kernels differ there, prepacking would
    make translations depend on the batch, so the model keeps F.linear."""
    return least_rows(dtype) is not None


def _applied(x: Tensor) -> Tensor:
    """The activation of a FeedForward whose fc1 applies it already."""
    return x


def prepack_decoder(model: nn.Module) -> bool:
    """The decoder's linear maps and the output projection of a float32 or bfloat16 Transformer on the CPU,
    prepacked in place for inference (nothing here can be trained or saved). False, and the model
    unchanged, where it is another dtype or not on the CPU, or this torch lacks working operators in its
    dtype."""
    param = model.embed.weight
    if param.device.type != "cpu" or not available(param.dtype):
        return False
    model.eval()
    for ffn in list(model.decoder.modules()):
        # max(0, x W1 + b1) in one oneDNN call: fc1 applies the ReLU, the activation itself becomes a no-op
        if isinstance(ffn, FeedForward) and ffn.activation is F.relu:
            ffn.fc1, ffn.activation = PrepackedLinear(ffn.fc1.weight, ffn.fc1.bias, "relu"), _applied
    for parent in list(model.decoder.modules()):
        for name, child in list(parent.named_children()):
            # kv_proj projects the encoder output, once per sentence, over all its positions: hundreds of
            # rows of every possible count, where F.linear is as fast
            if isinstance(child, nn.Linear) and name != "kv_proj":
                setattr(parent, name, PrepackedLinear(child.weight, child.bias))
    model.compile_output(PrepackedLinear)
    return True
