"""The encoder, the decoder step and the searches' loops in TorchScript: nmt.model's and the search's
operators, in their order, without Python between them.

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
where every linear map of theirs runs in a kernel with a scripted form (`scripted()`: fbgemm's and
torch._int_mm's int8 for any row count, oneDNN's int8 and its prepacked fp32 and bf16 for the row counts
they pad into one piece, _ByRows's two each for its rows: nmt.translate.int8, nmt.translate.prepacked;
nn.Linear). A search of up
to LOOP_ROWS rows (sentences x beam), the lines that come alone or a few at a time, runs its whole loop in
TorchScript (ScriptedGreedy, ScriptedBeam): steps, output projection (a shortlist's union's too, a copy of
the scripted projection over the union's weights: `rebound`), and the search's own parts, which are
TorchScript functions of nmt.translate.search, so both loops run the very code of the eager ones. On the
demo model, trained, one sentence greedy took 0.82x the time in int8 (with its shortlist or without) and
0.88x in fp32 with its shortlist, against the step alone scripted (AMD EPYC, avx2 only, one thread,
2026-12-02 15:27). The model keeps its eager path, which runs where the scripted one does not: more
rows than every kernel's scripted form serves, a model in training mode, or nothing scripted at all
(another kernel; a torch where scripting fails: torch.jit.script is deprecated in torch 2.x, and a model
still translates without it).
"""

from __future__ import annotations

import copy
import math
import sys
import warnings
from typing import Optional  # noqa: UP035 - TorchScript reads the annotations as written

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nmt.model import CACHE_BLOCK, DecoderLayer, DecoderState, EncoderLayer, Transformer
from nmt.tokens import BOS, EOS, PAD
from nmt.translate.search import (
    TokenMasks,
    expand_scores,
    finalize,
    length_penalty,
    select_live,
    sentence_done,
    step_log_probs,
    top_candidates,
)

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


def scripted_map(linear: nn.Module, rows: int = 1) -> tuple[nn.Module, int] | None:
    """A linear map's scripted form and the most rows it serves, or None where its kernel has none; what a
    kernel builds at its first call of more rows than it has met is built for `rows` (nmt.translate.int8)."""
    if type(linear) is nn.Linear:
        return ScriptedLinear(linear), ALL_ROWS
    scripted = getattr(linear, "scripted", None)
    return scripted(rows) if scripted is not None else None


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
    relu, swish, or none where fc1 applies it (nmt.translate.prepacked) or fc2 (nmt.translate.int8)."""

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


def scalar(value: float) -> Tensor:
    """A Python number as a 0-dim float32 tensor, for an operator's other operand. Given the number itself,
    torch wraps it in a float64 tensor and converts that at every call: three operators more for each
    `x * 0.125`, in TorchScript as in Python. The product is the same bits: float32 and bfloat16 tensors
    are multiplied by the number's float32 rounding either way."""
    return torch.tensor(value, dtype=torch.float32)


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
        self.scale = scalar(self.d_head**-0.5)
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
        # DecoderLayer.step's indexing as the views it makes, in fewer operators: TorchScript runs each `:`
        # of an index as an operator of its own
        cache_kv.narrow(3, t, 1).copy_(qkv.narrow(0, 1, 2))  # cache_kv[:, :, :, t : t + 1] = qkv[1:]
        kv = cache_kv.narrow(3, 0, t + 1)  # k, v = cache_kv[0, :, :, : t + 1], cache_kv[1, :, :, : t + 1]
        return self.self_out(merge_heads(self.attention(qkv[0], kv[0], kv[1], None)))

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
        self.embed_scale = scalar(math.sqrt(model.cfg.d_model))
        self.pad = PAD  # TorchScript reads no global int
        self.layers = nn.ModuleList(layers)
        self.norm = scripted_norm(model.encoder_norm)

    def forward(self, src: Tensor) -> tuple[Tensor, Tensor]:
        src_keep = (src != self.pad).unsqueeze(1).unsqueeze(2)  # nmt.model.padding_mask
        x = F.embedding(src, self.embed, self.pad) * self.embed_scale
        x = x + self.positions.narrow(0, 0, src.shape[1])
        for layer in self.layers:
            x = layer(x, src_keep)
        return self.norm(x), src_keep


class ScriptedStep(nn.Module):
    """Transformer.step's decoder, tokens (N,) at position t -> the final hidden states (N, D), with the
    step's state passed as it is (DecoderState: self_kv, mem_kv, src_bias, beam)."""

    def __init__(self, model: Transformer, layers: list[ScriptedDecoderLayer]):
        super().__init__()
        self.embed, self.positions = model.embed.weight.detach(), model.positions
        self.embed_scale = scalar(math.sqrt(model.cfg.d_model))
        self.pad = PAD  # TorchScript reads no global int
        self.zero_start = model.cfg.decoder_start == "zero"
        self.layers = nn.ModuleList(layers)
        self.norm = scripted_norm(model.decoder_norm)

    def forward(
        self, tokens: Tensor, t: int, self_kv: list[Tensor], mem_kv: Tensor, src_bias: Tensor, beam: int
    ) -> Tensor:
        n = tokens.shape[0]
        # Transformer.step's indexing as methods: TorchScript runs each `:` of an index as an operator
        e = F.embedding(tokens.unsqueeze(1), self.embed, self.pad)  # (N, 1, D), nn.Embedding(padding_idx=PAD)
        if t == 0 and self.zero_start:
            e = F.pad(e[:, 1:], [0, 0, 1, 0])
        y = e * self.embed_scale + self.positions.narrow(0, t, 1)
        i = 0
        for layer in self.layers:  # TorchScript unrolls the ModuleList; enumerate is not scriptable here
            kv = mem_kv[i]
            y = layer(y, self_kv[i].narrow(1, 0, n), t, kv[0], kv[1], src_bias, beam)
            i += 1
        return self.norm(y.select(1, 0))


class Projection(nn.Module):
    """An output projection's scripted form, as ScriptedGreedy calls it: final hidden states (N, D) ->
    logits (N, U). A TorchScript interface (`interface`), so that each call may pass its own (a shortlist's
    union, built per batch)."""

    def forward(self, x: Tensor) -> Tensor:
        pass


def interface(cls: type) -> type:
    """torch.jit.interface(cls), or cls where this torch has none (ScriptedGreedy then does not script)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # its DeprecationWarning: TorchScript is deprecated in torch 2.x
            return torch.jit.interface(cls)
    except Exception:  # noqa: BLE001 - any failure leaves the eager loop, which is correct
        return cls


Projection = interface(Projection)  # type: ignore[misc]


# Greedy batches of at most this many sentences run their loop in TorchScript (ScriptedGreedy): lines that
# arrive alone or a few at a time (`--interactive`, `nmt serve`); files keep the eager loop, whose finished
# sentences leave the batch.
LOOP_ROWS = 8


class ScriptedGreedy(nn.Module):
    """greedy_search's loop (nmt.translate.search) over a batch of a few sentences in TorchScript: each step
    the scripted decoder step, the output projection (over a shortlist's union, each sentence masked to its
    own set: SentenceOutput.logits), the log-softmax and the best token, without Python between them. The
    operators are those of greedy_search, Transformer.step and SentenceOutput.logits in their order, and
    the cache grows as Transformer.step grows it, to the same shapes: the same bits. One difference: a
    sentence done stays in the batch, its rows computed and ignored, where the eager loop drops the done
    once they are a quarter of the batch; a row's numbers do not depend on the other rows (every kernel's
    rows are invariant: nmt.translate.int8, nmt.translate.prepacked).

    -> the tokens (B, max_len), PAD after each sentence's last, and the scores (B,) of greedy_search."""

    def __init__(self, step: nn.Module):
        super().__init__()
        self.step = step
        self.block, self.bos, self.eos, self.pad = CACHE_BLOCK, BOS, EOS, PAD  # TorchScript reads no global

    def forward(
        self,
        self_kv: list[Tensor],
        mem_kv: Tensor,
        src_bias: Tensor,
        project: Projection,
        union_mask: Optional[Tensor],  # noqa: UP045 - (B, 1, U): SentenceOutput.mask, or None
        ids: Optional[Tensor],  # noqa: UP045 - (U,) the union's vocabulary ids (ShortlistDecoder), or None
        max_lens: Tensor,
        min_len: int,
        max_len: int,
        lenpen: float,
        masks: TokenMasks,
    ) -> tuple[Tensor, Tensor]:
        b = max_lens.shape[0]
        alive = torch.ones([b], dtype=torch.bool)
        raw = torch.zeros([b], dtype=masks.free.dtype)
        seqs = torch.full([b, max_len], self.pad, dtype=torch.long)
        last = torch.full([b], self.bos, dtype=torch.long)
        out_tokens = torch.full([b, max_len], self.pad, dtype=torch.long)
        out_scores = torch.zeros([b], dtype=masks.free.dtype)
        first_limit = int(max_lens.min())
        for t in range(max_len):
            if t == self_kv[0].shape[3]:  # Transformer.step: the cache is full, grow it by a block
                positions = min(t + self.block, max_len)
                for i in range(len(self_kv)):
                    kv = self_kv[i]
                    grown = kv.new_empty([2, kv.shape[1], kv.shape[2], positions, kv.shape[4]])
                    grown.narrow(3, 0, t).copy_(kv.narrow(3, 0, t))
                    self_kv[i] = grown
            tokens = last if ids is None else ids.index_select(0, last)
            logits = project.forward(self.step(tokens, t, self_kv, mem_kv, src_bias, 1))
            if union_mask is not None:
                u = logits.shape[1]
                logits = logits.view(b, 1, u).add_(union_mask).view(b, u)
            at_limit = max_lens <= t if t >= first_limit else None
            lprobs = step_log_probs(logits, at_limit, masks, t < min_len)
            best, last = lprobs.max(dim=1)
            raw = raw + best
            ended = last == self.eos
            done = ended & alive
            seqs[:, t] = last.masked_fill(ended, self.pad)
            if bool(done.any()):
                alive = alive ^ done
                out_tokens[done] = seqs[done]
                out_scores[done] = raw[done] / length_penalty(t + 1, lenpen)
                if not bool(alive.any()):
                    break
        return out_tokens, out_scores


class ScriptedBeam(nn.Module):
    """beam_search's loop (nmt.translate.search) over a batch of a sentence or two in TorchScript: the
    scripted step, the output projection (over a shortlist's union too), and the search's own parts
    (step_log_probs, top_candidates, finalize, select_live, sentence_done: TorchScript functions), with
    what Beams and the model do between them written out: finishing, extending, widening after step 0,
    the cache growing and following the beams. The operators are beam_search's and Transformer's in their
    order, on caches of the same shapes: the same bits. One difference, as ScriptedGreedy's: a sentence
    done stays in the batch, its rows computed and ignored, where the eager loop drops the done once they
    are 1/COMPACT_EVERY of the batch.

    -> each sentence's K finished scores (B, K), best first, -inf where empty, and their tokens (B, K, T),
    PAD after each one's last: what Beams.hypotheses reads."""

    def __init__(self, step: nn.Module):
        super().__init__()
        self.step = step
        self.block, self.bos, self.eos, self.pad = CACHE_BLOCK, BOS, EOS, PAD  # TorchScript reads no global

    def forward(
        self,
        self_kv: list[Tensor],
        spare: Tensor,
        mem_kv: Tensor,
        src_bias: Tensor,
        project: Projection,
        union_mask: Optional[Tensor],  # noqa: UP045 - (B, 1, U): SentenceOutput.mask, or None
        ids: Optional[Tensor],  # noqa: UP045 - (U,) the union's vocabulary ids (ShortlistDecoder), or None
        k: int,
        width: int,
        max_lens: Tensor,
        min_len: int,
        max_len: int,
        lenpen: float,
        nbest: int,
        masks: TokenMasks,
    ) -> tuple[Tensor, Tensor]:
        b = max_lens.shape[0]
        dtype = masks.free.dtype
        # Beams.__init__
        scores = torch.full([b, width], -math.inf, dtype=dtype)  # (B, beam) live raw scores
        scores[:, 0] = 0.0
        seqs = torch.full([b * width, max_len], self.pad, dtype=torch.long)  # (N, T) live tokens so far
        last = torch.full([b * width], self.bos, dtype=torch.long)
        fin_scores = torch.full([b, k], -math.inf, dtype=dtype)  # (B, K) best first
        fin_tokens = torch.full([b, k, max_len], self.pad, dtype=torch.long)
        out_scores, out_tokens = fin_scores.clone(), fin_tokens.clone()
        offsets = torch.arange(b).unsqueeze(1) * width  # (B, 1) first row of each sentence
        alive = torch.ones([b], dtype=torch.bool)
        first_limit = int(max_lens.min())
        finished = False
        beam = width
        for t in range(max_len):
            n = b * beam
            if t == self_kv[0].shape[3]:  # Transformer.step: the cache is full, grow it by a block
                capacity = min(t + self.block, max_len)  # Transformer.grow_cache
                spare = spare.new_empty([2, n, spare.shape[2], capacity, spare.shape[4]])
                for i in range(len(self_kv)):
                    kv = self_kv[i]
                    spare.narrow(3, 0, t).copy_(kv.narrow(1, 0, n).narrow(3, 0, t))
                    self_kv[i] = spare
                    spare = kv.new_empty([2, n, kv.shape[2], capacity, kv.shape[4]])
            # 1. one decoder step for every live hypothesis
            tokens = last if ids is None else ids.index_select(0, last)
            logits = project.forward(self.step(tokens, t, self_kv, mem_kv, src_bias, beam))
            vocab = logits.shape[1]
            if union_mask is not None:  # SentenceOutput.logits
                logits = logits.view(b, beam, vocab).add_(union_mask).view(n, vocab)
            at_limit = (max_lens <= t).repeat_interleave(beam) if t >= first_limit else None
            lprobs = step_log_probs(logits, at_limit, masks, t < min_len)
            # 2. the 2K best one-token extensions of each sentence
            cand_scores, cand_beams, cand_tokens = top_candidates(expand_scores(scores, lprobs), 2 * k, vocab)
            # 3. those among the K best that end in EOS finish (Beams.finish)
            if bool((cand_tokens.narrow(1, 0, k) == self.eos).any()):
                parents = (offsets + cand_beams.narrow(1, 0, k)).view(-1)
                filled = seqs.narrow(1, 0, t).index_select(0, parents).view(b, k, t)
                fin_view = fin_tokens.narrow(2, 0, t)
                fin_scores, found = finalize(
                    fin_scores, fin_view, cand_scores.narrow(1, 0, k), cand_tokens.narrow(1, 0, k), filled,
                    t + 1, lenpen, self.eos,
                )  # fmt: skip
                fin_view.copy_(found)
                finished = True
            # 4. the K best others stay live: their rows take over their parents' histories (Beams.extend)
            scores, live_beams, live_tokens = select_live(cand_scores, cand_beams, cand_tokens, k)
            rows = (offsets + live_beams).view(-1)
            last = live_tokens.view(-1)
            seqs = seqs.index_select(0, rows)
            seqs[:, t] = last
            widened = beam != k
            if widened:  # after step 0: each sentence's row becomes its K beams (Transformer.expand_beams)
                copies = torch.arange(n).repeat_interleave(k)
                for i in range(len(self_kv)):
                    kv = self_kv[i]
                    wide = kv.new_empty([2, n * k, kv.shape[2], kv.shape[3], kv.shape[4]])
                    filled = kv.narrow(1, 0, n).narrow(3, 0, t + 1)
                    torch.index_select(filled, 1, copies, out=wide.narrow(3, 0, t + 1))
                    self_kv[i] = wide
                spare = spare.new_empty([2, n * k, spare.shape[2], spare.shape[3], spare.shape[4]])
                beam, offsets = k, offsets * k
            # 5. finished sentences are recorded (Beams.done, Beams.record)
            if finished or t >= first_limit:
                done = sentence_done(fin_scores, scores, t, max_lens, lenpen, nbest) & alive
                if bool(done.any()):
                    alive = alive & ~done
                    out_scores[done] = fin_scores[done]
                    out_tokens[done] = fin_tokens[done]
                    if not bool(alive.any()):
                        break
            # 6. the decoder state follows the beams (Transformer.gather_cache)
            if not widened:
                for i in range(len(self_kv)):
                    kv = self_kv[i]
                    if kv.shape[3] == spare.shape[3]:  # rows move whole (Transformer.gather_cache)
                        whole = spare.view([2, spare.shape[1], -1]).narrow(1, 0, n)
                        torch.index_select(kv.view([2, kv.shape[1], -1]), 1, rows, out=whole)
                    else:
                        target = spare.narrow(1, 0, n).narrow(3, 0, t + 1)
                        torch.index_select(kv.narrow(3, 0, t + 1), 1, rows, out=target)
                    self_kv[i], spare = spare, kv
        return out_scores, out_tokens


def rebound(template: torch.jit.ScriptModule, like: nn.Module) -> torch.jit.ScriptModule | None:
    """A scripted projection over other weights without scripting again (about 12 ms for one): a shallow
    copy of `template` given the attributes of `like`, an unscripted module of the template's class (a
    shortlist union's product, built per batch); None where a type differs."""
    if type(like).__name__ != template.original_name:
        return None
    module = copy.copy(template)
    try:
        for name, value in vars(like).items():
            if not name.startswith("_") and name != "training" and hasattr(template, name):
                setattr(module, name, value)
    except (RuntimeError, TypeError):  # an attribute of another type than the template's
        return None
    return module


class ScriptedSearch:
    """A model's search loops in TorchScript (ScriptedGreedy, ScriptedBeam) with its full output
    projection's scripted form, and what a loop is given for a batch (Transformer.greedy_loop, beam_loop).
    `rows`: the most rows (sentences x beam) a loop searches: LOOP_ROWS, or fewer where the step's or the
    projection's scripted form serves fewer."""

    def __init__(
        self,
        greedy: torch.jit.ScriptModule,
        beam: torch.jit.ScriptModule,
        project: torch.jit.ScriptModule,
        rows: int,
    ):
        self.greedy_module, self.beam_module, self.project = greedy, beam, project
        self.rows = min(LOOP_ROWS, rows)

    def projection(self, state: DecoderState, rows: int) -> tuple[nn.Module, Tensor | None] | None:
        """The scripted projection a batch's steps take, and its union's mask (None: the vocabulary's);
        None where a union's product has no scripted form for `rows` rows."""
        if state.output is None:
            return self.project, None
        found = scripted_map(state.output.project, rows)
        project = rebound(self.project, found[0]) if found is not None and found[1] >= rows else None
        return (project, state.output.mask) if project is not None else None

    def greedy(
        self, state: DecoderState, max_lens: Tensor, min_len: int, lenpen: float, masks, ids: Tensor | None
    ) -> tuple[Tensor, Tensor] | None:
        """The tokens and scores of greedy_search from `state` (the step before the first), or None where
        the loop does not run: more rows than it serves, or a union's product it has no scripted form of."""
        rows = state.rows
        if state.beam != 1 or state.length != 0 or rows > self.rows:
            return None
        found = self.projection(state, rows)
        if found is None:
            return None
        return self.greedy_module(
            list(state.self_kv), state.mem_kv, state.src_bias, found[0], found[1], ids, max_lens, min_len,
            state.max_len, lenpen, masks,
        )  # fmt: skip

    def beam(
        self,
        state: DecoderState,
        k: int,
        max_lens: Tensor,
        min_len: int,
        lenpen: float,
        nbest: int,
        masks,
        ids: Tensor | None,
    ) -> tuple[Tensor, Tensor] | None:
        """The finished scores (B, K) and tokens (B, K, T) of beam_search from `state` (init_state's, at
        search.first_width rows per sentence), or None where the loop does not run (as `greedy`)."""
        rows = state.src_bias.shape[0] * k  # after step 0
        if state.beam not in (1, k) or state.length != 0 or rows > self.rows:
            return None
        found = self.projection(state, rows)
        if found is None:
            return None
        return self.beam_module(
            list(state.self_kv), state.spare, state.mem_kv, state.src_bias, found[0], found[1], ids, k,
            state.beam, max_lens, min_len, state.max_len, lenpen, nbest, masks,
        )  # fmt: skip


def activation_name(activation) -> str | None:
    """A FeedForward's activation by the name the scripted layer knows it by, or None for another."""
    if activation is F.relu:
        return "relu"
    if activation is F.silu:
        return "swish"
    from nmt.translate.prepacked import applied  # fc1 applies it (prepacked), or fc2 to its input (int8)

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
    model.compile_scripted(encoder, encode_rows, step, step_rows, search_loops(step, step_rows, model))
    return bool(encode_rows or step_rows)


def search_loops(step: nn.Module | None, step_rows: int, model: Transformer) -> ScriptedSearch | None:
    """The model's search loops in TorchScript over its scripted `step`, where its output projection has a
    scripted form too (the int8 and prepacked kernels'); None otherwise."""
    found = scripted_map(model.output_kernel) if model.output_kernel is not None else None
    if step is None or found is None:
        return None
    project, greedy, beam = script(found[0]), script(ScriptedGreedy(step)), script(ScriptedBeam(step))
    if project is None or greedy is None or beam is None:
        return None
    return ScriptedSearch(greedy, beam, project, min(step_rows, found[1]))
