"""fp32 and bf16 translation on the CPU with every linear map's weights prepacked once for oneDNN.

A decoder step multiplies a few rows (sentences x beam: 4 for one sentence at beam 4) by every weight
matrix of the decoder and by the tied (vocabulary x d_model) output projection (3.4). At that shape
torch's default CPU product (F.linear, MKL's sgemm) reads the weights slowly: measured on an AMD EPYC with
AVX2, 2 threads, 4 rows times the 8000 x 256 output projection took 0.8-1.8 ms in F.linear and 0.21-0.26 ms
in oneDNN's inner product over the same weight reordered once into oneDNN's blocked layout; the base model's
37000 x 512 projection 19 against 5 ms; the other decoder maps 1.2-2.1x faster at 4 rows, 1.1-1.7x at 64,
about even from 256 rows on (benchmarks/RESULTS.md, "Translation speed"). The encoder's products, and
the decoder's projection of the encoder output into keys and values, have hundreds of rows, where the two
are even: they are prepacked for the rows' sake, not the speed's (below).

A row's output must not depend on how many rows share its product, or a sentence would translate one way
alone and another in a batch. Neither library promises it: MKL's sgemm behind F.linear gave rows other
bits at up to 9-12 rows than among thousands, and up to 128-256 rows with 1,024-2,048 inputs at two
threads; oneDNN's prepacked bf16 kernel with AMX gave them other bits from 33-64 rows on with 512 inputs
or more (an Intel Xeon with AMX, torch 2.13, benchmarks/RESULTS.md, 2026-11-28). So every product runs at
a few row counts (ROW_BUCKETS, padded or cut into pieces), and `row_range` probes each shape once for the
counts between which a row keeps its bits: from 1 (or 2, where the one-row kernel sums in another order:
fp32 with 2,048 inputs or more on that Xeon) up to a largest count (32 in bf16 there, beyond 256 inputs).
tests/test_prepacked.py checks rows over 1 to 2,100. Results may differ from F.linear's in the last bits
(a relative 1e-6 to 1e-5: another summation order), as two BLAS libraries do.

The operators are torch's own, but private ones (torch.ops.mkldnn._reorder_linear_weight and
_linear_pointwise), so `prepack_model` first checks them on a small product (`available`) and leaves the
model as it is where they are missing, disagree with F.linear, or no row count keeps a row's bits.

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
from typing import Optional, Union  # noqa: UP035 - for TorchScript (ScriptedPrepacked)

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
# largest counts that fit, whose outputs are then copied into one (one more copy of the whole output).
# Powers of two: the demo model's 1,000 test lines met 18 counts of the 22 that also had the halfway
# counts (3, 6, 12 ... 1536), for each of its decoder's 5 shapes of product; the 8 fewer counts cut the
# peak RSS by 23-47 MiB at the same speed and outputs (benchmarks/RESULTS.md, 2026-11-28).
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
PAD_BELOW = 64
PAD_SHARE = 8  # pad m rows where the padding is at most m / PAD_SHARE rows


@functools.lru_cache(maxsize=4096)
def row_pieces(m: int, least: int = 1, most: int = ROW_BUCKETS[-1]) -> tuple[tuple[int, int], ...]:
    """How m rows are multiplied: (rows, bucket) pieces in order, rows <= bucket, bucket in ROW_BUCKETS
    between `least` and `most` (a product's `row_range`)."""
    lo, hi = bisect.bisect_left(ROW_BUCKETS, least), bisect.bisect_right(ROW_BUCKETS, most)
    pieces = []
    while m > 0:
        up = bisect.bisect_left(ROW_BUCKETS, m, lo, hi)  # the smallest count that holds all m rows
        if up < hi and (m <= PAD_BELOW or (ROW_BUCKETS[up] - m) * PAD_SHARE <= m):
            pieces.append((m, ROW_BUCKETS[up]))
            break
        largest = ROW_BUCKETS[bisect.bisect_right(ROW_BUCKETS, m, lo, hi) - 1]  # the largest count that fits
        pieces.append((largest, largest))
        m -= largest
    return tuple(pieces)


def one_piece_pads(least: int = 1, most: int = ROW_BUCKETS[-1]) -> list[int]:
    """pad_to[m]: the row count that `in_row_buckets` pads m rows to, for each m from 1 up to the most it
    multiplies in one piece (PAD_BELOW at most: a scripted product's rows); pad_to[0] = 0."""
    pad_to = [0]
    for m in range(1, PAD_BELOW + 1):
        pieces = row_pieces(m, least, most)
        if len(pieces) > 1:
            break
        pad_to.append(pieces[0][1])
    return pad_to


def in_row_buckets(
    rows: Tensor, product: Callable[[Tensor], Tensor], least: int = 1, most: int = ROW_BUCKETS[-1]
) -> Tensor:
    """`product` of (M, in) rows, called at ROW_BUCKETS counts only (row_pieces): the rows padded with
    zeros or cut into pieces, the outputs (M, out) as if it had run on all M rows at once. For products
    whose row results do not depend on the other rows, and whose library builds a kernel per row count.
    `least` and `most` (buckets, `row_range`): no piece has fewer rows than `least` (it is padded up to
    them), nor more than `most`."""
    pieces, start, out = row_pieces(rows.shape[0], least, most), 0, None
    if not pieces:  # no rows
        return product(rows)
    for m, bucket in pieces:
        piece = rows[start : start + m]
        if bucket != m:
            piece = F.pad(piece, (0, 0, 0, bucket - m))
        y = product(piece)
        if len(pieces) == 1:
            return y if bucket == m else y[:m]
        # Each piece's output goes into the whole output and is freed before the next is multiplied: the
        # whole and one piece held at a time, where concatenating held every piece and the whole at once.
        # A decoder step's output projection is where a batch's memory peaks: 6 MiB less of the heap in
        # use there for the demo model at its default budget (benchmarks/RESULTS.md, 2026-12-04 02:40)
        if out is None:
            out = y.new_empty(rows.shape[0], y.shape[1])
        out[start : start + m] = y[:m]
        del y
        start += m
    return out


def _pack(weight: Tensor) -> Tensor:
    """(out, in) float32 weight -> oneDNN's blocked copy of it (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


class PrepackedLinear(nn.Module):
    """y = x W^T + b through oneDNN, W reordered once: (.., in) -> (.., out). Inference only.

    `activation` "relu" applies max(0, y) inside the same oneDNN call (a post-op): one operator less.
    """

    def __init__(
        self,
        weight: Tensor,
        bias: Tensor | None,
        activation: str = "none",
        rows: tuple[int, int] | None = None,
    ):
        """`rows`: (least, most) as `row_range` gives them; by default that of this weight's shape."""
        super().__init__()
        self.in_features, self.out_features, self.dtype = weight.shape[1], weight.shape[0], weight.dtype
        self.packed = _pack(weight)
        self.bias = None if bias is None else bias.detach().contiguous()
        self.activation = activation
        self.least, self.most = rows or row_range(weight.dtype, *weight.shape[::-1]) or (1, ROW_BUCKETS[-1])

    def forward(self, x: Tensor) -> Tensor:
        y = in_row_buckets(x.reshape(-1, self.in_features), self.product, self.least, self.most)  # (M, out)
        return y.view(*x.shape[:-1], self.out_features)

    def product(self, rows: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, self.activation, [], "")

    def scripted(self, rows: int = 1) -> tuple[nn.Module, int] | None:
        """This product as a TorchScript module of the same operators (nmt.translate.scripted), for the row
        counts it pads into one piece (up to PAD_BELOW, where a step's operators are small), and how many
        those are; None where even one row takes more than one piece. `rows`: as int8's (`_Kernel.scripted`),
        here with nothing to build."""
        pad_to = one_piece_pads(self.least, self.most)
        rows = len(pad_to) - 1
        return (ScriptedPrepacked(self, pad_to), rows) if rows else None

    def over(self, ids: Tensor, floats: Callable[[], tuple[Tensor, Tensor | None]]) -> PrepackedLinear:
        """The same product over this map's output rows `ids`, whose floats `floats()` gathers (weight and
        bias: a shortlist's union): laid out again, as oneDNN's layout cannot be gathered. Its rows are those
        probed for its width rounded up to a power of two: a union's width changes batch to batch, and a
        probe per width would cost more than the batch."""
        weight, bias = floats()
        width = 1 << (len(weight) - 1).bit_length()
        # probed on the threads of the batch it is built for (nmt.translate.threads), the only it serves
        rows = row_range(weight.dtype, weight.shape[1], width, torch.get_num_threads())
        return PrepackedLinear(weight, bias, self.activation, rows)

    def extra_repr(self) -> str:
        fused = "" if self.activation == "none" else f", {self.activation} fused"
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN prepacked{fused}"


class ScriptedPrepacked(nn.Module):
    """PrepackedLinear in TorchScript for the rows that `in_row_buckets` multiplies in one piece, operator for
    operator: (.., in) -> (.., out), for at most len(pad_to) - 1 rows."""

    def __init__(self, linear: PrepackedLinear, pad_to: list[int]):
        super().__init__()
        self.packed, self.bias, self.activation = linear.packed, linear.bias, linear.activation
        self.in_features, self.pad_to = linear.in_features, pad_to

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features)
        m = rows.shape[0]
        bucket = self.pad_to[m]
        if bucket != m:
            rows = F.pad(rows, [0, 0, 0, bucket - m])
        none: list[Optional[Union[int, float, complex]]] = []  # noqa: UP007, UP045 - TorchScript's Scalar?[]
        y = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, self.activation, none, "")
        if bucket != m:
            y = y[:m]
        return y.view(x.shape[:-1] + [y.shape[1]])


# The most rows `row_range` multiplies at once, and so the most any product runs at (more are cut into
# pieces of at most this many). A decoder step at the default batch budget has up to ~650 rows (sentences x
# beam); an encoder's products more, where a piece's cost dwarfs its concatenation. The probe multiplies
# about 1.5 times this many rows in all, per shape and thread setting, and holds about three outputs of a
# count at once: for a wide output it stops at fewer rows, PROBE_OUTPUTS outputs a product (a 37,000-word
# vocabulary: 128 rows, 0.6 s in fp32 for wmt14 base's projection, where 512 took 2.1 s and 230 MB).
PROBE_MOST = 512
PROBE_OUTPUTS = 1 << 23


# How close to F.linear's a prepacked product must be, by dtype: another summation order in float32; in
# bf16 the output's rounding (2^-8 relative) of sums whose order differs
CLOSE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def _cancelling(dtype: torch.dtype, rows: int, in_features: int, out_features: int) -> tuple[Tensor, Tensor]:
    """Probe rows (rows, in) and weights (out, in) whose every product is 0 exactly: a row is u then u
    reversed, a weight a then -a reversed, so each term meets its negation at the far end of the sum. What
    comes out is the rounding of the order the kernel summed in, so two kernels that sum in other orders
    give other bits in nearly every output. Random ones hide most such differences in bf16, whose output
    rounding (2^-8) swallows the last bits of float32 sums: on an Intel Xeon with AMX, oneDNN's bf16
    kernels at 1 and 64 rows, which sum otherwise, differed in one output of 67,000."""
    gen = torch.Generator().manual_seed(0)
    half, odd = in_features // 2, in_features % 2
    u, a = torch.randn(rows, half, generator=gen), torch.randn(out_features, half, generator=gen)
    x = torch.cat([u, torch.ones(rows, odd), u.flip(1)], 1)  # the odd input meets zero weights
    weight = torch.cat([a, torch.zeros(out_features, odd), -a.flip(1)], 1) / half**0.5
    return x.to(dtype), weight.to(dtype)


def _agreeing_rows(product: Callable[[Tensor], Tensor], x: Tensor, least: int, settings: list[int]) -> int:
    """The largest count of ROW_BUCKETS, up to len(x), at which (as at every count below it) each row of
    `product` has the bits it has alone (padded to `least` rows), on each of the thread `settings` alike.
    On the first setting a count's first half must be as the count below gave it, its second half as that
    count gives it on its own, so that neither a row's companions nor its position change it; every other
    setting must give that count's very bits. 0 where a row alone differs between the settings, 1 where
    two rows do not agree.

    The other settings' own second halves are not multiplied: bits equal to the first setting's at every
    count have its positions' bits. Each of the other settings' products is a parallel region of several
    threads, which stalls where another process holds one of their cores: on an AMD EPYC of 2 cores with
    one kept busy, the demo model's prepacking took 1.31-1.52 s on two threads with those products,
    1.11-1.24 s without, 0.4 on one thread (benchmarks/RESULTS.md, 2026-12-01)."""

    def alone(i: int) -> Tensor:
        return product(F.pad(x[i : i + 1], (0, 0, 0, least - 1)))[:1]

    first, others = settings[0], settings[1:]
    with on_threads(first):
        below = torch.cat([alone(0), alone(1)])
    for threads in others:
        with on_threads(threads):
            if not torch.equal(torch.cat([alone(0), alone(1)]), below):
                return 0
    most = 1
    for count in ROW_BUCKETS[1:]:
        if count > len(x):
            break
        half = count // 2
        with on_threads(first):
            y = product(x[:count])
            second = below[1:] if count == 2 else product(x[half:count])
        if not (torch.equal(y[:half], below[:half]) and torch.equal(y[half:], second)):
            return most
        for threads in others:
            with on_threads(threads):
                if not torch.equal(product(x[:count]), y):
                    return most
        below, most = y, count
    return most


@functools.cache
def row_range(
    dtype: torch.dtype, in_features: int, out_features: int, threads: int = 1
) -> tuple[int, int] | None:
    """(least, most): the fewest rows a prepacked product of this shape runs at, 1, or 2 where oneDNN's
    kernel for one row sums in another order than for more; and the most, a count of ROW_BUCKETS up to
    PROBE_MOST (fewer for a wide output: PROBE_OUTPUTS). Between them every row gets the same bits at every
    count, in any position, among any rows, on one thread and on `threads`, so a sentence's translation
    does not depend on its batch. None where not even two rows agree, or there is no such kernel.

    A model's products are probed on one thread when it is prepacked; on more only once a batch is to
    run on more (`keeps_bits_on`), since a product on several threads stalls where another process holds
    one of their cores: with one of two kept busy, a process of two threads prepared the demo model in
    fp32 in 1.12-1.17 s probing on both, 0.71-0.90 s probing on one (one thread's process: 0.58-0.65 s;
    AMD EPYC Zen 4, benchmarks/RESULTS.md, 2026-12-07 23:30).

    Probed once per shape (`_cancelling`), because oneDNN picks its kernel by shape, rows and threads. On
    an Intel Xeon with AMX (torch 2.13, benchmarks/RESULTS.md, 2026-11-28): in bf16 a product of 512 or
    more inputs gave rows other bits from 33-64 rows on (the demo model's second feed-forward map, 1,024
    inputs, among them), where a probe of 256 inputs, the only one before, found nothing; in fp32 one row
    of 2,048 or more inputs (a wmt14 model's second feed-forward map) summed otherwise than two."""
    rows = max(2, min(PROBE_MOST, PROBE_OUTPUTS // out_features))
    x, weight = _cancelling(dtype, rows, in_features, out_features)
    bias = torch.zeros(out_features, dtype=dtype)
    try:
        product = PrepackedLinear(weight, bias, rows=(1, ROW_BUCKETS[-1])).product  # the bare kernel
    except (AttributeError, RuntimeError, NotImplementedError):  # no such kernel here (bf16 on AVX2)
        return None
    settings = sorted({1, threads})
    with torch.inference_mode():
        for least in (1, 2):
            most = _agreeing_rows(product, x, least, settings)
            if most >= 2:
                return least, most
    return None


@functools.cache
def available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch has oneDNN's operators in `dtype`, a product agrees with F.linear, its fused ReLU
    gives the plain one's bits, and rows keep their bits among others (`row_range`) at a small shape; each
    shape is probed again where a model meets it. Where not, the model keeps F.linear."""
    if not torch.backends.mkldnn.is_available() or dtype not in CLOSE:
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        weight, bias = torch.randn(512, 256, generator=gen) / 16, torch.randn(512, generator=gen)
        x = torch.randn(300, 256, generator=gen)
        weight, bias, x = weight.to(dtype), bias.to(dtype), x.to(dtype)
        if row_range(dtype, 256, 512) is None:
            return False
        linear, fused = PrepackedLinear(weight, bias), PrepackedLinear(weight, bias, "relu")
        with torch.inference_mode():
            full = linear(x)
            # the fused ReLU must be the plain one's bits, so that fusing changes no translation
            same_relu = torch.equal(fused(x), F.relu(full)) and torch.equal(fused(x[:4]), F.relu(full[:4]))
        tolerance = CLOSE[dtype]
        close = torch.allclose(
            full.float(), F.linear(x, weight, bias).float(), rtol=tolerance, atol=tolerance
        )
        return same_relu and close
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def keeps_bits_on(model: nn.Module, threads: int) -> bool:
    """Whether every prepacked product of `model` gives each row, on `threads` threads, the bits it gives
    on one at every row count it runs at (`row_range`, probed here on `threads` once per shape). Where
    not, the search keeps such a model's batches on one thread (nmt.translate.threads.SearchThreads)."""
    products = [m for m in model.modules() if isinstance(m, PrepackedLinear)]
    return all(
        row_range(p.dtype, p.in_features, p.out_features, threads) == (p.least, p.most) for p in products
    )


def applied(x: Tensor) -> Tensor:
    """The activation of a FeedForward whose fc1 applies it already, or fc2 to its input (int8)."""
    return x


def prepack_model(model: nn.Module) -> bool:
    """Every linear map of a float32 or bfloat16 Transformer on the CPU, and its output projection,
    prepacked in place for inference (nothing here can be trained or saved). False, and the model
    unchanged, where it is another dtype or not on the CPU, or this torch lacks working operators in its
    dtype, or a shape of the model has no row count that keeps a row's bits (`row_range`)."""
    param = model.embed.weight
    if param.device.type != "cpu" or not available(param.dtype):
        return False
    linears = [
        (parent, name, child)
        for parent in list(model.modules())
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
    shapes = {(c.in_features, c.out_features) for _, _, c in linears} | {model.output_weight.shape[::-1]}
    if any(row_range(param.dtype, *shape) is None for shape in shapes):
        return False
    model.eval()
    for ffn in list(model.decoder.modules()):
        # max(0, x W1 + b1) in one oneDNN call: fc1 applies the ReLU, the activation itself becomes a no-op.
        # The decoder's only: a step's operators are what one sentence waits for.
        if isinstance(ffn, FeedForward) and ffn.activation is F.relu:
            ffn.fc1, ffn.activation = PrepackedLinear(ffn.fc1.weight, ffn.fc1.bias, "relu"), applied
    for parent, name, child in linears:
        if getattr(parent, name) is child:  # not fc1 with its ReLU, done above
            setattr(parent, name, PrepackedLinear(child.weight, child.bias))
    model.compile_output(PrepackedLinear)
    return True
