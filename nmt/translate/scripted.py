"""The encoder and the decoder step in TorchScript: nmt.model's operators, in its order, without Python
between them.

A decoder step of one sentence is about a hundred small operators (the student's: 1 to 4 rows each), and
most of its time is the machinery around each call rather than the arithmetic: Python, torch's argument
parsing and dispatch. A software-clock profile of the student's sentence put 35% of it in libpython and 9%
in libtorch_python's argument parsing (AMD EPYC, avx2 only; benchmarks/RESULTS.md, 2026-12-02 02:10). So
the encoder and the step's layers are TorchScript modules here, built over the inference model's own
tensors and kernels. TorchScript's interpreter calls the very ATen operators that `Transformer.encode` and
`DecoderLayer.step` call, in the same order, on the same tensors, so they give the same bits (TorchScript
fuses nothing on the CPU unless told to: `scriptable` checks that it is not). tests/test_scripted.py holds
both to the eager path bit for bit, for every kernel they cover, at one row and at many, and whole
translations to be the same.

Measured in one process, eager and scripted alternated line by line over 300 test lines, one thread, the
same translations (AMD EPYC, avx2 only, int8 by fbgemm; benchmarks/RESULTS.md, 2026-12-02 06:40): the
student's sentence, greedy int8 with its shortlist, took 0.67x the time (0.72x with the step alone); the
demo model's at beam 4, 0.71x in int8 and 0.81x in fp32; files in 125-line chunks at 2 threads, 0.87x in
int8 and 0.89-0.99x in fp32. On an Intel Xeon with AMX, where int8 multiplies a few rows by torch._int_mm
(`_ByRows`), a random model of the student's and the demo's shapes, one sentence: a decoder step 0.71-0.81x
the time, the encoder 0.73-0.77x (2026-12-02 12:15).

What it covers: the encoder, and the decoder's layers from the token's embedding to the final LayerNorm,
where every linear map of theirs runs in a kernel with a scripted form (`scripted()`: fbgemm's int8 and
torch._int_mm's, nmt.translate.int8, the latter for the rows `_ByRows` gives it; oneDNN's prepacked fp32
and bf16, nmt.translate.prepacked, for the row counts it pads into one piece; nn.Linear). The output
projection stays eager: a shortlist's union is built per batch. The model keeps its eager path, which runs
where the scripted one does not: more rows than every kernel's scripted form serves, a model in training
mode, or nothing scripted at all (another kernel; a torch where scripting fails: torch.jit.script is
deprecated in torch 2.x, and a model still translates without it).
"""

from __future__ import annotations

import math
import sys
import warnings
from typing import Optional  # noqa: UP035 - TorchScript reads the annotations as written

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nmt.model import DecoderLayer, EncoderLayer, Transformer
from nmt.tokens import PAD

ALL_ROWS = sys.maxsize  # the rows of a kernel whose scripted form serves any number


class ScriptedLinear(nn.Module):
    """y = x W^T + b by F.linear, as nn.Linear computes it: (.., in) -> (.., out)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        # plain tensors, not parameters: the scripted step adds nothing to the model's state_dict
        self.weight = linear.weight.detach()
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)


def scripted_map(linear: nn.Module) -> tuple[nn.Module, int] | None:
    """A linear map's scripted form and the most rows it serves, or None where its kernel has none."""
    if type(linear) is nn.Linear:
        return ScriptedLinear(linear), ALL_ROWS
    scripted = getattr(linear, "scripted", None)
    return scripted() if scripted is not None else None


class ScriptedLayerNorm(nn.Module):
    """nn.LayerNorm's F.layer_norm over its own (detached) weight and bias."""

    def __init__(self, norm: nn.LayerNorm):
        super().__init__()
        self.shape, self.eps = list(norm.normalized_shape), float(norm.eps)
        self.weight = None if norm.weight is None else norm.weight.detach()
        self.bias = None if norm.bias is None else norm.bias.detach()

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.shape, self.weight, self.bias, self.eps)


def scripted_norm(norm: nn.Module) -> nn.Module:
    """A LayerNorm's scripted form, or the identity (`norm: post` has no final decoder norm)."""
    return nn.Identity() if isinstance(norm, nn.Identity) else ScriptedLayerNorm(norm)


class ScriptedFeedForward(nn.Module):
    """FeedForward: fc2(activation(fc1(x))), the activation by name (TorchScript calls no Python function):
    relu, swish, or none where fc1 applies it (nmt.translate.prepacked)."""

    def __init__(self, fc1: nn.Module, fc2: nn.Module, activation: str):
        super().__init__()
        self.fc1, self.fc2, self.activation = fc1, fc2, activation

    def forward(self, h: Tensor) -> Tensor:
        h = self.fc1(h)
        if self.activation == "relu":
            h = F.relu(h)
        elif self.activation == "swish":
            h = F.silu(h)
        return self.fc2(h)


def merge_heads(y: Tensor) -> Tensor:
    """(B, H, T, K) -> (B, T, D), as MultiHeadAttention.merge_heads."""
    b, t = y.shape[0], y.shape[2]
    return y.transpose(1, 2).reshape(b, t, -1)


class ScriptedEncoderLayer(nn.Module):
    """EncoderLayer.forward at inference, operator for operator (nmt.model: self_attention, Residual)."""

    def __init__(self, layer: EncoderLayer, maps: dict[str, nn.Module], ffn: ScriptedFeedForward):
        super().__init__()
        self.heads, self.d_head = layer.self_attn.heads, layer.self_attn.d_head
        self.qkv_proj, self.out_proj, self.ffn = maps["self_attn.qkv_proj"], maps["self_attn.out_proj"], ffn
        self.norm_attn, self.norm_ffn = scripted_norm(layer.res_attn.norm), scripted_norm(layer.res_ffn.norm)
        self.pre_norm = layer.res_attn.pre_norm

    def self_attention(self, h: Tensor, src_keep: Tensor) -> Tensor:
        b, t = h.shape[0], h.shape[1]
        qkv = self.qkv_proj(h).view(b, t, -1, self.heads, self.d_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], attn_mask=src_keep, dropout_p=0.0)
        return self.out_proj(merge_heads(y))

    def forward(self, x: Tensor, src_keep: Tensor) -> Tensor:
        if self.pre_norm:
            x = x + self.self_attention(self.norm_attn(x), src_keep)
            return x + self.ffn(self.norm_ffn(x))
        x = self.norm_attn(x + self.self_attention(x, src_keep))
        return self.norm_ffn(x + self.ffn(x))


class ScriptedDecoderLayer(nn.Module):
    """DecoderLayer.step, operator for operator (nmt.model: MultiHeadAttention, attention, Residual)."""

    def __init__(
        self, layer: DecoderLayer, maps: dict[str, nn.Module], ffn: ScriptedFeedForward, fused_attention: bool
    ):
        super().__init__()
        self.heads, self.d_head = layer.self_attn.heads, layer.self_attn.d_head
        self.qkv_proj, self.self_out = maps["self_attn.qkv_proj"], maps["self_attn.out_proj"]
        self.q_proj, self.cross_out = maps["cross_attn.q_proj"], maps["cross_attn.out_proj"]
        self.ffn = ffn
        self.norm_self = scripted_norm(layer.res_self.norm)
        self.norm_cross = scripted_norm(layer.res_cross.norm)
        self.norm_ffn = scripted_norm(layer.res_ffn.norm)
        self.pre_norm = layer.res_self.pre_norm
        self.scale = self.d_head**-0.5
        self.fused_attention = fused_attention  # nmt.model.attention: bfloat16 on the CPU

    def attention(self, q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor]) -> Tensor:  # noqa: UP045
        if self.fused_attention:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        scores = torch.matmul(q, k.transpose(-1, -2)).mul_(self.scale)
        if bias is not None:
            scores.add_(bias)
        return torch.matmul(torch.softmax(scores, dim=-1), v)

    def self_attention(self, h: Tensor, cache_kv: Tensor, t: int) -> Tensor:
        b, length = h.shape[0], h.shape[1]
        qkv = self.qkv_proj(h).view(b, length, -1, self.heads, self.d_head).permute(2, 0, 3, 1, 4)
        cache_kv[:, :, :, t : t + 1] = qkv[1:]
        k, v = cache_kv[0, :, :, : t + 1], cache_kv[1, :, :, : t + 1]
        return self.self_out(merge_heads(self.attention(qkv[0], k, v, None)))

    def cross_attention(self, h: Tensor, k: Tensor, v: Tensor, src_bias: Tensor, beam: int) -> Tensor:
        n, length = h.shape[0], h.shape[1]
        q = self.q_proj(h).view(n // beam, beam * length, self.heads, self.d_head).transpose(1, 2)
        return self.cross_out(merge_heads(self.attention(q, k, v, src_bias))).view(h.shape)

    def forward(
        self, y: Tensor, cache_kv: Tensor, t: int, mem_k: Tensor, mem_v: Tensor, src_bias: Tensor, beam: int
    ) -> Tensor:
        if self.pre_norm:
            y = y + self.self_attention(self.norm_self(y), cache_kv, t)
            y = y + self.cross_attention(self.norm_cross(y), mem_k, mem_v, src_bias, beam)
            return y + self.ffn(self.norm_ffn(y))
        y = self.norm_self(y + self.self_attention(y, cache_kv, t))
        y = self.norm_cross(y + self.cross_attention(y, mem_k, mem_v, src_bias, beam))
        return self.norm_ffn(y + self.ffn(y))


class ScriptedEncoder(nn.Module):
    """Transformer.encode at inference: (B, S) ids -> memory (B, S, D) and the key mask (B, 1, 1, S)."""

    def __init__(self, model: Transformer, layers: list[ScriptedEncoderLayer]):
        super().__init__()
        self.embed, self.positions = model.embed.weight.detach(), model.positions
        self.embed_scale, self.pad = math.sqrt(model.cfg.d_model), PAD  # TorchScript reads no global int
        self.layers = nn.ModuleList(layers)
        self.norm = scripted_norm(model.encoder_norm)

    def forward(self, src: Tensor) -> tuple[Tensor, Tensor]:
        src_keep = (src != self.pad)[:, None, None, :]  # nmt.model.padding_mask
        x = F.embedding(src, self.embed, self.pad) * self.embed_scale + self.positions[: src.shape[1]]
        for layer in self.layers:
            x = layer(x, src_keep)
        return self.norm(x), src_keep


class ScriptedStep(nn.Module):
    """Transformer.step's decoder, tokens (N,) at position t -> the final hidden states (N, D), with the
    step's state passed as it is (DecoderState: self_kv, mem_kv, src_bias, beam)."""

    def __init__(self, model: Transformer, layers: list[ScriptedDecoderLayer]):
        super().__init__()
        self.embed, self.positions = model.embed.weight.detach(), model.positions
        self.embed_scale, self.pad = math.sqrt(model.cfg.d_model), PAD  # TorchScript reads no global int
        self.zero_start = model.cfg.decoder_start == "zero"
        self.layers = nn.ModuleList(layers)
        self.norm = scripted_norm(model.decoder_norm)

    def forward(
        self, tokens: Tensor, t: int, self_kv: list[Tensor], mem_kv: Tensor, src_bias: Tensor, beam: int
    ) -> Tensor:
        n = tokens.shape[0]
        e = F.embedding(tokens[:, None], self.embed, self.pad)  # (N, 1, D), as nn.Embedding(padding_idx=PAD)
        if t == 0 and self.zero_start:
            e = F.pad(e[:, 1:], [0, 0, 1, 0])
        y = e * self.embed_scale + self.positions[t : t + 1]
        i = 0
        for layer in self.layers:  # TorchScript unrolls the ModuleList; enumerate is not scriptable here
            kv = mem_kv[i]
            y = layer(y, self_kv[i][:, :n], t, kv[0], kv[1], src_bias, beam)
            i += 1
        return self.norm(y[:, 0])


def activation_name(activation) -> str | None:
    """A FeedForward's activation by the name the scripted layer knows it by, or None for another."""
    if activation is F.relu:
        return "relu"
    if activation is F.silu:
        return "swish"
    from nmt.translate.prepacked import applied  # fc1 applies it: prepacked with its ReLU fused

    return "none" if activation is applied else None


def scriptable() -> bool:
    """Whether TorchScript here runs each operator as eager does: it fuses none on the CPU (the default)."""
    return not torch._C._jit_can_fuse_on_cpu()


SELF_ATTENTION = ("self_attn.qkv_proj", "self_attn.out_proj")
CROSS_ATTENTION = ("cross_attn.q_proj", "cross_attn.out_proj")


def scripted_maps(
    layer: nn.Module, names: tuple[str, ...]
) -> tuple[dict[str, nn.Module], ScriptedFeedForward, int] | None:
    """A layer's maps `names` and its feed-forward in their scripted forms, and the most rows all of them
    serve; None where one has none."""
    maps, rows = {}, ALL_ROWS
    for name in (*names, "ffn.fc1", "ffn.fc2"):
        found = scripted_map(layer.get_submodule(name))
        if found is None:
            return None
        maps[name], most = found
        rows = min(rows, most)
    activation = activation_name(layer.ffn.activation)
    if activation is None:
        return None
    return maps, ScriptedFeedForward(maps["ffn.fc1"], maps["ffn.fc2"], activation), rows


def script(module: nn.Module) -> nn.Module | None:
    """torch.jit.script of `module`, or None where it fails here."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.jit.script's DeprecationWarning
            return torch.jit.script(module)
    except Exception:  # noqa: BLE001 - any failure to script leaves the eager path, which is correct
        return None


def script_model(model: Transformer) -> bool:
    """The model's encoder and decoder step from now on in TorchScript (`Transformer.compile_scripted`),
    each for the row counts its kernels' scripted forms serve (an encoder's rows are its batch's source
    positions); False where neither could be: a map without a scripted form, a model not on the CPU, or
    TorchScript failing here. The encoder and the step are scripted each on its own."""
    if model.embed.weight.device.type != "cpu" or not scriptable():
        return False
    fused_attention = model.embed.weight.dtype == torch.bfloat16  # nmt.model.attention's choice
    encoder, encode_rows = None, 0
    found = [scripted_maps(layer, SELF_ATTENTION) for layer in model.encoder]
    if all(found):
        layers = [
            ScriptedEncoderLayer(layer, maps, ffn)
            for layer, (maps, ffn, _) in zip(model.encoder, found, strict=True)
        ]
        encoder = script(ScriptedEncoder(model, layers))
        encode_rows = min((rows for _, _, rows in found), default=ALL_ROWS) if encoder is not None else 0
    step, step_rows = None, 0
    found = [scripted_maps(layer, SELF_ATTENTION + CROSS_ATTENTION) for layer in model.decoder]
    if all(found):
        layers = [
            ScriptedDecoderLayer(layer, maps, ffn, fused_attention)
            for layer, (maps, ffn, _) in zip(model.decoder, found, strict=True)
        ]
        step = script(ScriptedStep(model, layers))
        step_rows = min((rows for _, _, rows in found), default=ALL_ROWS) if step is not None else 0
    model.compile_scripted(encoder, encode_rows, step, step_rows)
    return bool(encode_rows or step_rows)
