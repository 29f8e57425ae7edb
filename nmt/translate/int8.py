"""int8 inference on the CPU (`--dtype int8`): every linear map of a trained model with 8-bit weights.

Each weight matrix W (out, in) is stored as integers in [-L, L] with one scale per output row,
s_o = max_i |W_oi| / L (symmetric, as CTranslate2's int8). Each product x W^T quantizes its activations
per row, as CTranslate2 does: row r gets its own scale a_r = max_i |x_ri| / 127, the integers
q_ri = round(x_ri / a_r) in [-127, 127] are multiplied by the weight's in torch._int_mm (oneDNN, int32
accumulation), and y_ro = a_r s_o (q_r . W_o) + b_o is formed in float32. That covers the attention and
feed-forward projections and the tied output projection (3.4), the largest product of a decoder step; the
embedding lookup itself stays float32.

A row's integers and scale depend on that row alone, its integer product is exact (no rounding, so no
dependence on the kernel's blocking, which changes with the row count), and every other operation here is
element by element within a row: a sentence's int8 translation does not depend on what else is in its
batch (tests/test_int8_invariance.py). fbgemm's dynamic quantized linear, used before, took one activation
scale over all the rows of a call, so it did. The price is per call: about ten operators where fbgemm's
was one (quantize, multiply, rescale), 1.3-2.3x its time for the few rows of a decoder step on the demo
model, 0.9-1.3x at 256 rows (benchmarks/RESULTS.md, "Translation speed").

Bits. The kernel multiplies unsigned 8-bit by signed 8-bit numbers; signed activations are shifted by 128
into that range. With VNNI (vpdpbusd: AVX-512 VNNI, AVX-VNNI, AMX) the products accumulate in int32
directly, so full 8 bits (L = 127) are exact. Without it (AVX2, AVX-512 without VNNI) pairs of u8 x s8
products are added in saturating int16 (vpmaddubsw): 2 x 254 x 127 overflows and the result is silently
wrong, so the weights get 7 bits (L = 63: 2 x 254 x 63 fits); 7-bit activations would not help, the shift
by 128 puts them back in the overflowing range. Which kernel runs depends on the CPU and on
ONEDNN_MAX_CPU_ISA, so `weight_bits` asks the kernel itself, once: a product built to overflow in int16,
checked against exact integers.

Translations may differ from fp32's in some lines (the BLEU check is in benchmarks/RESULTS.md), and
between a CPU with VNNI and one without (8 against 7 bits).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

from nmt.errors import NmtError

PROBE_ROWS = (1, 3, 8, 64, 512)  # the row counts weight_bits checks the int8 product at
_TINY = 1e-30  # the scale of an all-zero row, whose integers are then all 0


def _exact_with(weight_bits: int) -> bool:
    """Whether torch._int_mm of 8-bit activations by `weight_bits`-bit weights is exact here: the largest
    activations against the largest weights of either sign (where int16 pair sums would saturate), and
    random ones, at several row counts (PROBE_ROWS), since oneDNN may pick another kernel by shape: one
    row (a decoder step of one sentence), a few, and the many rows of a batch's encoder."""
    level = (1 << (weight_bits - 1)) - 1
    gen = torch.Generator().manual_seed(0)
    weight = torch.randint(-level, level + 1, (32, 64), generator=gen, dtype=torch.int8)  # (out, in)
    weight[0], weight[1] = level, -level
    q = torch.randint(-127, 128, (max(PROBE_ROWS), 64), generator=gen, dtype=torch.int8)  # (M, in)
    for top in (0, len(q) - 3):  # the extremes first and last, so that every row count meets them
        q[top], q[top + 1], q[top + 2, ::2], q[top + 2, 1::2] = 127, -127, 127, -127
    exact = q.long() @ weight.long().t()
    return all(
        torch.equal(torch._int_mm(q[rows], weight.t()).long(), exact[rows])
        for m in PROBE_ROWS
        for rows in (slice(0, m), slice(len(q) - m, len(q)))
    )


@functools.cache
def weight_bits() -> int:
    """8 where this CPU's int8 product is exact with full 8-bit weights (VNNI), else 7."""
    try:
        if _exact_with(8):
            return 8
        if _exact_with(7):
            return 7
    except (AttributeError, RuntimeError, NotImplementedError) as err:
        raise NmtError(f"--dtype int8 needs torch's int8 product (torch._int_mm): {err}") from err
    raise NmtError("--dtype int8: torch's int8 product is not exact on this CPU even with 7-bit weights")


class Int8Linear(nn.Module):
    """y = x W^T + b, W in int8 (a scale per output row), x quantized per row: (.., in) -> (.., out)."""

    def __init__(self, weight: Tensor, bias: Tensor | None):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.bits = weight_bits()
        level = (1 << (self.bits - 1)) - 1  # the weights' integers are in [-level, level]
        weight = weight.detach().float()
        self.scales = (weight.abs().amax(dim=1) / level).clamp(min=1e-12)  # (out,)
        self.weight_t = torch.round(weight / self.scales[:, None]).to(torch.int8).t()  # (in, out)
        self.bias = torch.zeros(self.out_features) if bias is None else bias.detach().float().contiguous()

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features)  # (M, in)
        scale = rows.abs().amax(dim=1, keepdim=True).div_(127).clamp_min_(_TINY)  # (M, 1) a_r
        q = torch.div(rows, scale).round_().to(torch.int8)  # (M, in) in [-127, 127]
        acc = torch._int_mm(q, self.weight_t)  # (M, out) int32, exact
        # int32 -> float32 first, then in place: about half the time of a mixed-type multiply and a new tensor
        y = acc.float().mul_(self.scales)  # (M, out) s_o acc
        y = torch.addcmul(self.bias, y, scale, out=y)  # (M, out) a_r s_o acc + b_o
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.bits}-bit weights"


def quantize_int8(model: nn.Module) -> nn.Module:
    """The model (a Transformer, float32 on the CPU) with every nn.Linear and the tied output projection
    in int8, in place; for inference only (nothing here can be trained or saved). An Ensemble is
    quantized member by member (nmt.translate.builder.inference_model)."""
    param = next(model.parameters())
    if param.device.type != "cpu" or param.dtype != torch.float32:
        raise NmtError(f"--dtype int8 is for a float32 model on the CPU, not {param.dtype} on {param.device}")
    weight_bits()  # the kernel's check, before any weight is quantized
    model.eval()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, Int8Linear(child.weight, child.bias))
    model.compile_output(Int8Linear)  # the shared embedding as projection
    return model
