"""int8 inference on the CPU (`--dtype int8`): every linear map of a trained model with 8-bit weights.

Each weight matrix W (out, in) is stored as int8 with one scale per output row, s_o = max_i |W_oi| / 127
(symmetric, as CTranslate2's int8), and each product x W^T runs in fbgemm's dynamic quantized linear:
the activations are quantized to 8 bits on the fly (one scale for the call), multiplied in integers and
scaled back to float32, the bias added in float. That covers the attention and feed-forward projections
and the tied output projection (3.4), which is the largest product of a decoder step; the embedding
lookup itself stays float32.

Two properties differ from fp32 and are the price of the speed: translations may differ from fp32's in
some lines (the BLEU check is in benchmarks/RESULTS.md), and since the activation scale of a call is
taken over all its rows, a sentence's translation may depend on what else is in its batch.

The activations are quantized to 7 bits (reduce_range): fbgemm's AVX2 kernels add pairs of u8 x s8
products in int16, which full 8-bit activations can overflow.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn

from nmt.errors import NmtError


class Int8Linear(nn.Module):
    """y = x W^T + b, W in int8 (a scale per output row), x quantized per call: (.., in) -> (.., out)."""

    def __init__(self, weight: Tensor, bias: Tensor | None):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        weight = weight.detach().float()
        scales = (weight.abs().amax(dim=1) / 127).clamp(min=1e-12).double()  # (out,)
        ints = torch.round(weight / scales[:, None].float()).to(torch.int8)  # (out, in)
        zeros = torch.zeros(self.out_features, dtype=torch.long)
        # Quantized tensors are deprecated in torch (pytorch/pytorch#184982), but fbgemm's packed weights
        # are still made from one; it exists only here, at load time, and is dropped once packed.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
            qweight = torch._make_per_channel_quantized_tensor(ints, scales, zeros, 0)
        b = None if bias is None else bias.detach().float()
        self.packed = torch.ops.quantized.linear_prepack(qweight, b)

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.quantized.linear_dynamic(x, self.packed, True)  # True: 7-bit activations

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def quantize_int8(model: nn.Module) -> nn.Module:
    """The model (a Transformer, float32 on the CPU) with every nn.Linear and the tied output projection
    in int8, in place; for inference only (nothing here can be trained or saved). An Ensemble is
    quantized member by member (nmt.translate.builder.inference_model)."""
    param = next(model.parameters())
    if param.device.type != "cpu" or param.dtype != torch.float32:
        raise NmtError(f"--dtype int8 is for a float32 model on the CPU, not {param.dtype} on {param.device}")
    if not {"x86", "fbgemm"} & set(torch.backends.quantized.supported_engines):
        raise NmtError("--dtype int8 needs torch's x86 (fbgemm) kernels, which this torch build lacks")
    if torch.backends.quantized.engine not in ("x86", "fbgemm"):
        torch.backends.quantized.engine = "x86"
    model.eval()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, Int8Linear(child.weight, child.bias))
    for module in model.modules():
        if hasattr(module, "output_kernel"):  # nmt.model.Transformer: the shared embedding as projection
            module.output_kernel = Int8Linear(module.output_weight, module.output_bias)
    return model
