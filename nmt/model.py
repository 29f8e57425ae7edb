"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017), in the paper's order.

Shapes: B batch, S source length, T target length, D d_model, H heads, K = D / H per head, V vocabulary,
L decoder layers. Token id 0 is padding (see nmt.subword).

Deviations from the paper, each optional and off in the paper recipes: `norm: pre` moves LayerNorm in
front of each sub-layer (and adds one after each stack); attention and activation dropout; and, for
pretrained MarianMT models (nmt.formats.huggingface), `activation: swish` in the FFN and `output_bias`, a
fixed (untrained) bias on the output logits. What the decoder starts from the paper leaves open:
`decoder_start: bos` (the default) embeds the BOS token there, `zero` a zero vector, as Marian does.

Besides `forward` (teacher forcing), the decoder offers the incremental contract that search uses
(nmt.translate.search.Decoder): `encode(src)`, `init_state(memory, src_keep, max_len, beam)`,
`step(tokens, state) -> (logits, state)`, `reorder_beams(state, rows)`, `select_rows(state, rows)`,
`expand_beams(state, beam)`, and its `vocab_size` and `max_positions`. The state is explicit: self-attention
keys/values of every row for every layer, in a cache that grows in blocks of CACHE_BLOCK positions as the
output does (most sentences stop long before their length limit), and encoder keys/values for
cross-attention projected once per sentence and shared by its `beam` rows. The contract is for inference
(under torch.no_grad or torch.inference_mode): its caches are written in place. On the CPU, `encode` and
`step` may run through TorchScript forms of themselves, the same operators in the same order
(nmt.translate.scripted, `compile_scripted`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nmt.config import ModelConfig
from nmt.tokens import PAD

# The self-attention cache grows by this many positions at a time, up to the state's max_len. The caches
# are the decoder's largest memory (3 layers of 452 rows x 24 positions: 64 MiB at the default batch budget
# on the demo model, at the peak of a batch), and a block is what they may hold beyond the filled
# positions: 8 rather than 16 cut the peak RSS of 1000 test lines by 26-90 MiB at the same speed, 4 rather
# than 8 the heap's peak in use by 14 MiB, with the same translations and speed (benchmarks/RESULTS.md,
# "Memory", and the 2026-12-04 entry). A growth copies the filled cache, as every step's gather does: with
# a block of 4 the growths copy a quarter of what the gathers do (an eighth at 8), which did not show.
CACHE_BLOCK = 4


def sinusoidal_positions(length: int, d_model: int) -> Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d))  (section 3.5).

    On the CPU always, also where a model is built on the meta device (Transformer.with_weights): the
    table is no weight, so it is not loaded but computed, and the module moves it with the model."""
    cpu = torch.device("cpu")
    pos = torch.arange(length, dtype=torch.float64, device=cpu).unsqueeze(1)  # (T, 1)
    inv_freq = 10000.0 ** (-torch.arange(0, d_model, 2, dtype=torch.float64, device=cpu) / d_model)  # (D/2,)
    pe = torch.empty(length, d_model, dtype=torch.float64, device=cpu)
    pe[:, 0::2] = torch.sin(pos * inv_freq)
    pe[:, 1::2] = torch.cos(pos * inv_freq)
    return pe.float()


def dropout(x: Tensor, p: float, training: bool) -> Tensor:
    """F.dropout, not even called at inference or p = 0: a decoder step makes a dozen calls to it."""
    return F.dropout(x, p, training=True) if training and p > 0 else x


def padding_mask(tokens: Tensor) -> Tensor:
    """Which keys attention may look at: (B, S) ids -> (B, 1, 1, S), True for real tokens."""
    return (tokens != PAD)[:, None, None, :]


def attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None) -> Tensor:
    """Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k) + bias) V  (3.2.1), written out for decoding steps:
    with a query or a beam's few per row, torch's fused kernel (F.scaled_dot_product_attention) took 2-5x
    longer than these three products on a batch of sentences (benchmarks/RESULTS.md); `bias` is 0 or -inf.

    Except in bfloat16 on the CPU, where torch multiplies through oneDNN, which builds and caches a kernel
    for every new shape, and a step's shapes change with every position and batch: 1,000 lines of the demo
    model took 1,099 MiB against 472 through the fused kernel, which is also faster there (AMX Xeon,
    benchmarks/RESULTS.md, 2026-11-27 19:12)."""
    if q.dtype == torch.bfloat16 and q.device.type == "cpu":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(q.shape[-1] ** -0.5)  # (B, H, Tq, Tk)
    if bias is not None:
        scores.add_(bias)
    return torch.matmul(torch.softmax(scores, dim=-1), v)


class MultiHeadAttention(nn.Module):
    """MultiHead(Q, K, V) = Concat(head_1..head_h) W^O, head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V)  (3.2.2)

    Self-attention projects Q, K, V with one fused matrix; cross-attention projects Q from the decoder and
    K, V (fused) from the encoder output, once per sentence. Attention itself is scaled dot-product
    softmax(Q K^T / sqrt(d_k)) V (3.2.1): over whole sequences (training, encoding) through
    F.scaled_dot_product_attention, which picks fused kernels and applies attention dropout; for a decoding
    step's few queries through `attention`'s three products (`attend_step`).
    """

    def __init__(self, d_model: int, heads: int, dropout: float, cross: bool):
        super().__init__()
        self.heads, self.d_head, self.dropout = heads, d_model // heads, dropout
        if cross:
            self.q_proj = nn.Linear(d_model, d_model)
            self.kv_proj = nn.Linear(d_model, 2 * d_model)
        else:
            self.qkv_proj = nn.Linear(d_model, 3 * d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def split_heads(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        return x.view(b, t, -1, self.heads, self.d_head).permute(2, 0, 3, 1, 4)  # (n, B, H, T, K)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None, causal: bool = False) -> Tensor:
        """Whole sequences: heads (B, H, T, K) -> (B, T, D); `keep` (B, 1, 1, S) is True for the keys a
        query may see (None: all), `causal` hides later positions."""
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=p, is_causal=causal)
        return self.merge_heads(y)

    def attend_step(self, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None) -> Tensor:
        """One decoding step: heads (B, H, T, K) -> (B, T, D); `bias` (B, 1, 1, S) is added to the scores,
        0 for the keys a query may see and -inf for the others (None: all)."""
        return self.merge_heads(attention(q, k, v, bias))

    def merge_heads(self, y: Tensor) -> Tensor:
        b, _, t, _ = y.shape
        return self.out_proj(y.transpose(1, 2).reshape(b, t, -1))  # (B, H, T, K) -> (B, T, D)

    def self_attention(self, x: Tensor, keep: Tensor | None, causal: bool) -> Tensor:
        q, k, v = self.split_heads(self.qkv_proj(x))  # each (B, H, T, K)
        return self.attend(q, k, v, keep, causal)

    def memory_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        k, v = self.split_heads(self.kv_proj(memory))  # each (B, H, S, K)
        return k, v

    def cross_queries(self, x: Tensor, beam: int) -> Tensor:
        """Cross-attention queries of x (B*beam, T, D) -> (B, H, beam*T, K): a sentence's `beam`
        consecutive rows are beam*T query positions of one attention, so its keys/values are stored once."""
        n, t, _ = x.shape
        return self.q_proj(x).view(n // beam, beam * t, self.heads, self.d_head).transpose(1, 2)

    def cross_attention(self, x: Tensor, k: Tensor, v: Tensor, src_keep: Tensor) -> Tensor:
        """x (B, T, D) attends over its sentence's k, v (B, H, S, K), the keys `src_keep` (B, 1, 1, S)."""
        return self.attend(self.cross_queries(x, 1), k, v, src_keep)

    def cross_attention_step(self, x: Tensor, k: Tensor, v: Tensor, src_bias: Tensor, beam: int) -> Tensor:
        """x (B*beam, 1, D) attends over its sentence's k, v (B, H, S, K), with the key bias src_bias
        (B, 1, 1, S)."""
        y = self.attend_step(self.cross_queries(x, beam), k, v, src_bias)  # (B, beam, D)
        return y.view(x.shape)  # (B*beam, 1, D)


ACTIVATIONS = {"relu": F.relu, "swish": F.silu}  # swish(x) = x * sigmoid(x), as OPUS-MT models use


class FeedForward(nn.Module):
    """FFN(x) = max(0, x W1 + b1) W2 + b2  (3.3); `activation: swish` replaces max(0, .) by x sigmoid(x)."""

    def __init__(self, d_model: int, d_ff: int, activation_dropout: float, activation: str = "relu"):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)
        self.activation_dropout, self.activation = activation_dropout, ACTIVATIONS[activation]

    def forward(self, x: Tensor) -> Tensor:
        h = self.activation(self.fc1(x))
        return self.fc2(dropout(h, self.activation_dropout, self.training))


class Residual(nn.Module):
    """LayerNorm(x + Dropout(Sublayer(x)))  (3.1, 5.4); norm='pre': x + Dropout(Sublayer(LayerNorm(x)))."""

    def __init__(self, d_model: int, dropout: float, pre_norm: bool):
        super().__init__()
        self.norm, self.dropout, self.pre_norm = nn.LayerNorm(d_model), dropout, pre_norm

    def forward(self, x: Tensor, sublayer) -> Tensor:
        if self.pre_norm:
            return x + dropout(sublayer(self.norm(x)), self.dropout, self.training)
        return self.norm(x + dropout(sublayer(x), self.dropout, self.training))


class EncoderLayer(nn.Module):
    """Self-attention, then feed-forward, each inside a residual connection (3.1)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        pre = cfg.norm == "pre"
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.heads, cfg.attention_dropout, cross=False)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, cfg.activation_dropout, cfg.activation)
        self.res_attn = Residual(cfg.d_model, cfg.dropout, pre)
        self.res_ffn = Residual(cfg.d_model, cfg.dropout, pre)

    def forward(self, x: Tensor, src_keep: Tensor) -> Tensor:
        x = self.res_attn(x, lambda h: self.self_attn.self_attention(h, src_keep, causal=False))
        return self.res_ffn(x, self.ffn)


class DecoderLayer(nn.Module):
    """Masked self-attention, attention over the encoder output, feed-forward (3.1)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        pre = cfg.norm == "pre"
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.heads, cfg.attention_dropout, cross=False)
        self.cross_attn = MultiHeadAttention(cfg.d_model, cfg.heads, cfg.attention_dropout, cross=True)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, cfg.activation_dropout, cfg.activation)
        self.res_self = Residual(cfg.d_model, cfg.dropout, pre)
        self.res_cross = Residual(cfg.d_model, cfg.dropout, pre)
        self.res_ffn = Residual(cfg.d_model, cfg.dropout, pre)

    def forward(self, y: Tensor, mem_k: Tensor, mem_v: Tensor, src_keep: Tensor) -> Tensor:
        # Targets are right-padded, so the causal mask alone keeps every real position off the padding.
        y = self.res_self(y, lambda h: self.self_attn.self_attention(h, None, causal=True))
        y = self.res_cross(y, lambda h: self.cross_attn.cross_attention(h, mem_k, mem_v, src_keep))
        return self.res_ffn(y, self.ffn)

    def step(
        self, y: Tensor, cache_kv: Tensor, t: int, mem_k: Tensor, mem_v: Tensor, src_bias: Tensor, beam: int
    ) -> Tensor:
        """One position: y (N, 1, D), N = B * beam; cache_kv (2, N, H, C, K) receives this position's
        keys/values; mem_k, mem_v (B, H, S, K) and the additive key mask src_bias (B, 1, 1, S) are per
        sentence."""

        def cached_self_attention(h: Tensor) -> Tensor:
            attn = self.self_attn
            qkv = attn.split_heads(attn.qkv_proj(h))  # (3, N, H, 1, K)
            cache_kv[:, :, :, t : t + 1] = qkv[1:]
            k, v = cache_kv[0, :, :, : t + 1], cache_kv[1, :, :, : t + 1]
            return attn.attend_step(qkv[0], k, v, None)

        y = self.res_self(y, cached_self_attention)
        y = self.res_cross(y, lambda h: self.cross_attn.cross_attention_step(h, mem_k, mem_v, src_bias, beam))
        return self.res_ffn(y, self.ffn)


@dataclass
class DecoderState:
    """Everything the decoder remembers between steps, for N = B sentences x beam rows, sentence-major.

    Rows move (beam selection, finished sentences leaving) layer by layer: a layer's filled positions are
    gathered into a new buffer, which becomes that layer's cache, and its old cache takes the next layer's
    rows; the last layer's old cache is freed. One copy, one allocation a step, and one layer's buffer
    beyond the cache while the gather runs (a spare for the whole cache would double the decoder's largest
    memory). Between the eager search's steps `spare` holds no rows: a layer's buffer kept there was 17 MiB
    more at the peak of the demo model's batches, in the step's output projection
    (benchmarks/RESULTS.md, 2026-12-04). init_state's spare has its rows, for the scripted loops, which
    keep theirs (nmt.translate.scripted).
    """

    self_kv: list[Tensor]  # L x (2, R, H, C, K), R >= N rows, C positions: rows :N, positions :length filled
    spare: Tensor  # (2, R, H, C, K): where the next gather of a layer's rows writes, if it has the rows
    mem_kv: Tensor  # (L, 2, B, H, S, K): encoder keys/values, projected once, shared by a sentence's rows
    src_bias: Tensor  # (B, 1, 1, S): 0 for source tokens, -inf for padding (a bool mask costs ops a call)
    beam: int  # rows per sentence
    max_len: int  # positions the search may step through: the cache never grows beyond them
    length: int = 0  # target positions decoded so far
    output: Any = None  # nmt.translate.shortlist.SentenceOutput: logits over a batch's shortlists, or None

    @property
    def rows(self) -> int:
        return self.src_bias.shape[0] * self.beam


class Transformer(nn.Module):
    """Encoder-decoder with one embedding matrix for source, target and the output projection (3.4)."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, initialise: bool = True):
        """`initialise` False: the weights are left as allocated, for `with_weights` to assign."""
        super().__init__()
        self.cfg, self.vocab_size = cfg, vocab_size
        # an embedding given its weight skips its own N(0, 1) draw (on the meta device, torch's draw
        # imports its compiler: a second and 70 MiB)
        weight = None if initialise else torch.empty(vocab_size, cfg.d_model)
        self.embed = nn.Embedding(vocab_size, cfg.d_model, padding_idx=PAD, _weight=weight)
        self.register_buffer(
            "positions", sinusoidal_positions(cfg.max_positions, cfg.d_model), persistent=False
        )
        self.encoder = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.encoder_layers))
        self.decoder = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.decoder_layers))
        pre = cfg.norm == "pre"
        self.encoder_norm = nn.LayerNorm(cfg.d_model) if pre else nn.Identity()
        self.decoder_norm = nn.LayerNorm(cfg.d_model) if pre else nn.Identity()
        # MarianMT's final_logits_bias: a buffer, not a parameter; fine-tuning keeps it, as transformers does.
        self.output_bias: Tensor | None
        self.register_buffer("output_bias", torch.zeros(vocab_size) if cfg.output_bias else None)
        # Inference only: the output projection (weights and bias) in a CPU kernel's own layout, int8
        # (nmt.translate.int8) or prepacked fp32 (nmt.translate.prepacked): `compile_output`
        self.output_kernel: nn.Module | None = None
        # Inference only: the encoder and the decoder step in TorchScript (nmt.translate.scripted), the
        # same operators as `encode`'s and `step`'s own, for batches of up to `encode_rows` source positions
        # and steps of up to `step_rows` rows (sentences x beam): `compile_scripted`
        self.encode_kernel: nn.Module | None = None
        self.step_kernel: nn.Module | None = None
        self.encode_rows = self.step_rows = 0
        # Inference only: the searches' whole loops for a few sentences in TorchScript, steps and output
        # projection (nmt.translate.scripted.ScriptedSearch): `compile_scripted`, `greedy_loop`, `beam_loop`
        self.search_loops: Any = None
        if initialise:
            self.reset_parameters()

    @classmethod
    def with_weights(cls, cfg: ModelConfig, vocab_size: int, state: dict[str, Tensor]) -> Transformer:
        """A model whose parameters are `state`'s tensors themselves (a checkpoint's, just read): built
        on the meta device, so that no random initialisation runs and no second copy of the weights is
        made. Built the other way (initialised, then copied into), a wmt14 big model took 3.4-3.8 s to
        load and twice its 817 MiB of weights at the peak (benchmarks/RESULTS.md). A tensor of another
        dtype than its parameter's is converted, as load_state_dict's copy would; names and shapes are
        load_state_dict's to check (RuntimeError)."""
        with torch.device("meta"):
            model = cls(cfg, vocab_size, initialise=False)
        expected = model.state_dict()
        state = {k: v.to(expected[k].dtype) if k in expected else v for k, v in state.items()}
        model.load_state_dict(state, assign=True)
        return model

    @property
    def members(self) -> list[Transformer]:
        """The models decoded as one: this one (an ensemble's are several; nmt.translate.ensemble)."""
        return [self]

    def compile_output(self, kernel: Callable[[Tensor, Tensor | None], nn.Module]) -> None:
        """For inference: the output projection from now on in `kernel(weight, bias)`, a CPU kernel built
        over the current weights (nmt.translate.int8.Int8Linear, nmt.translate.prepacked.PrepackedLinear)."""
        self.output_kernel = kernel(self.output_weight, self.output_bias)

    def compile_scripted(
        self,
        encoder: nn.Module | None,
        encode_rows: int,
        step: nn.Module | None,
        step_rows: int,
        loops: Any = None,
    ) -> None:
        """For inference: batches of up to `encode_rows` source positions (B x S) from now on encoded by
        `encoder`, (B, S) ids -> (memory, key mask) as `encode`; steps of up to `step_rows` rows by `step`,
        (tokens, t, self_kv, mem_kv, src_bias, beam) -> the final hidden states (N, D), writing the
        self-attention cache at t as `step` does (nmt.translate.scripted); `loops`, the searches' loops
        (`greedy_loop`, `beam_loop`: nmt.translate.scripted.ScriptedSearch). None and 0: the eager path."""
        self.encode_kernel, self.encode_rows = encoder, encode_rows
        self.step_kernel, self.step_rows = step, step_rows
        self.search_loops = loops

    def reset_parameters(self) -> None:
        """Xavier-uniform linear maps, N(0, D^-1/2) embeddings, as tensor2tensor and fairseq initialise."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        nn.init.normal_(self.embed.weight, mean=0.0, std=self.cfg.d_model**-0.5)
        with torch.no_grad():
            self.embed.weight[PAD].zero_()

    def embed_tokens(self, tokens: Tensor, offset: int = 0, target: bool = False) -> Tensor:
        """Embeddings times sqrt(D) plus positions, then dropout (3.4, 3.5, 5.4): (B, T) -> (B, T, D).

        `target`: the decoder's input, whose position 0 is the start token (BOS); with
        model.decoder_start zero its embedding is a zero vector instead of BOS's row (Marian's convention).
        """
        t = tokens.shape[1]
        self.check_positions(offset + t)
        e = self.embed(tokens)  # (B, T, D)
        if target and offset == 0 and self.cfg.decoder_start == "zero":
            e = F.pad(e[:, 1:], (0, 0, 1, 0))  # (B, T, D): position 0's embedding is zero
        x = e * math.sqrt(self.cfg.d_model) + self.positions[offset : offset + t]
        return dropout(x, self.cfg.dropout, self.training)

    def check_positions(self, length: int) -> None:
        if length > self.cfg.max_positions:
            raise ValueError(f"sequence of {length} positions exceeds model.max_positions")

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor]:
        """(B, S) ids -> memory (B, S, D) and the key mask (B, 1, 1, S)."""
        if src.numel() <= self.encode_rows and not self.training:
            self.check_positions(src.shape[1])
            return self.encode_kernel(src)
        src_keep = padding_mask(src)
        x = self.embed_tokens(src)
        for layer in self.encoder:
            x = layer(x, src_keep)
        return self.encoder_norm(x), src_keep

    def decode(self, tgt_in: Tensor, memory: Tensor, src_keep: Tensor, project: bool = True) -> Tensor:
        """All target positions at once (teacher forcing): (B, T) ids -> logits (B, T, V), or with
        project=False the states (B, T, D) that the output projection would take."""
        y = self.embed_tokens(tgt_in, target=True)
        for layer in self.decoder:
            k, v = layer.cross_attn.memory_kv(memory)
            y = layer(y, k, v, src_keep)
        return self.output(y) if project else self.decoder_norm(y)

    def output(self, y: Tensor) -> Tensor:
        """Pre-softmax projection with the shared embedding matrix (plus output_bias): (.., D) -> (.., V)."""
        return self.project(self.decoder_norm(y))

    def project(self, h: Tensor) -> Tensor:
        """The projection alone, of final hidden states h (.., D) -> (.., V)."""
        if self.output_kernel is not None:
            return self.output_kernel(h)
        return F.linear(h, self.output_weight, self.output_bias)

    @property
    def max_positions(self) -> int:
        """Positions of the sinusoid table (3.5): no sequence, source or target, is longer."""
        return self.cfg.max_positions

    @property
    def output_weight(self) -> Tensor:
        """The (V, D) pre-softmax projection: the embedding matrix, shared (3.4)."""
        return self.embed.weight

    def forward(self, src: Tensor, tgt_in: Tensor, project: bool = True) -> Tensor:
        """Teacher-forced logits (B, T, V); project=False stops before the output projection, for a loss
        that projects by itself (nmt.train.loss.projected_label_smoothed_nll)."""
        memory, src_keep = self.encode(src)
        return self.decode(tgt_in, memory, src_keep, project)

    # ---- incremental decoding ------------------------------------------------------------------------

    def init_state(
        self,
        memory: Tensor,
        src_keep: Tensor,
        max_len: int,
        beam: int = 1,
        output: Callable[[Transformer], Any] | None = None,
    ) -> DecoderState:
        """State for `beam` rows per sentence of memory (B, S, D): encoder keys/values for cross-attention
        projected once per sentence, and a self-attention cache one block long. `output` builds, for this
        model, the restricted output its steps project onto (nmt.translate.shortlist.SentenceOutput:
        each sentence's own target ids); None: the whole vocabulary."""
        mem_kv = torch.stack([torch.stack(layer.cross_attn.memory_kv(memory)) for layer in self.decoder])
        rows, positions = memory.shape[0] * beam, min(CACHE_BLOCK, max_len)
        self_kv = [self.empty_cache(memory, rows, positions) for _ in self.decoder]
        src_bias = torch.zeros(src_keep.shape, dtype=memory.dtype, device=memory.device)
        src_bias.masked_fill_(~src_keep, -math.inf)
        spare = self.empty_cache(memory, rows, positions)
        restricted = output(self) if output is not None else None
        return DecoderState(self_kv, spare, mem_kv, src_bias, beam, max_len, output=restricted)

    def empty_cache(self, like: Tensor, rows: int, positions: int) -> Tensor:
        """One layer's self-attention keys/values (2, rows, H, positions, K), uninitialized: only filled
        positions are read."""
        cfg = self.cfg
        return like.new_empty(2, rows, cfg.heads, positions, cfg.d_model // cfg.heads)

    def step(self, tokens: Tensor, state: DecoderState) -> tuple[Tensor, DecoderState]:
        """Feed the last token of every row: (N,) ids -> logits (N, V) for the next position."""
        t, n = state.length, state.rows
        if t == state.self_kv[0].shape[3]:  # the cache is full: grow it by a block
            if t >= state.max_len:
                raise ValueError(f"step {t + 1} is past the {state.max_len} positions of init_state")
            self.grow_cache(state, self.next_capacity(state))
        if n <= self.step_rows and not self.training:
            self.check_positions(t + 1)
            h = self.step_kernel(tokens, t, state.self_kv, state.mem_kv, state.src_bias, state.beam)
        else:
            y = self.embed_tokens(tokens[:, None], offset=t, target=True)  # (N, 1, D)
            for i, layer in enumerate(self.decoder):
                mem_k, mem_v = state.mem_kv[i]  # each (B, H, S, K)
                y = layer.step(y, state.self_kv[i][:, :n], t, mem_k, mem_v, state.src_bias, state.beam)
            h = self.decoder_norm(y[:, 0])  # (N, D)
        state.length = t + 1
        if state.output is not None:  # (N, U): over the shortlists' union only (nmt.translate.shortlist)
            return state.output.logits(h, state.beam), state
        return self.project(h), state

    def greedy_loop(
        self,
        state: DecoderState,
        max_lens: Tensor,
        min_len: int,
        lenpen: float,
        masks: Any,
        ids: Tensor | None = None,
    ) -> tuple[Tensor, Tensor] | None:
        """Greedy search's plain loop from `state` (init_state's, one row per sentence) to the end in one
        call, where the model has one for it (nmt.translate.scripted.ScriptedSearch; search.greedy_search
        decides what it covers): the tokens (B, T), PAD after each one's last, and the scores (B,); None
        where it has none, or not for this batch. `ids`: the vocabulary ids the tokens stand for (a
        shortlist's union), None where they are the vocabulary's."""
        if self.search_loops is None or self.training or state.rows > self.step_rows:
            return None
        return self.search_loops.greedy(state, max_lens, min_len, lenpen, masks, ids)

    def beam_loop(
        self,
        state: DecoderState,
        beam: int,
        max_lens: Tensor,
        min_len: int,
        lenpen: float,
        nbest: int,
        masks: Any,
        ids: Tensor | None = None,
    ) -> tuple[Tensor, Tensor] | None:
        """Beam search's plain loop from `state` (init_state's) to the end in one call, as `greedy_loop`:
        each sentence's `beam` finished scores (B, K), best first, and their tokens (B, K, T)."""
        if self.search_loops is None or self.training or state.src_bias.shape[0] * beam > self.step_rows:
            return None
        return self.search_loops.beam(state, beam, max_lens, min_len, lenpen, nbest, masks, ids)

    def reorder_beams(self, state: DecoderState, rows: Tensor) -> DecoderState:
        """Row i takes the history of row rows[i], a row of the same sentence (beam selection).

        Rows of one sentence share their encoder keys/values, so only the filled self-attention cache moves.
        """
        return self.gather_cache(state, rows)

    def select_rows(self, state: DecoderState, rows: Tensor) -> DecoderState:
        """Keep only `rows`, in that order: whole sentences, each one's `beam` rows together (finished
        sentences leave the batch). Within a sentence any rows may be taken, so one call both reorders
        beams and drops finished sentences."""
        state = self.gather_cache(state, rows)
        sentences = rows[:: state.beam] // state.beam  # (B',)
        state.mem_kv = state.mem_kv.index_select(2, sentences)
        state.src_bias = state.src_bias.index_select(0, sentences)
        if state.output is not None:
            state.output = state.output.select(sentences)
        return state

    def expand_beams(self, state: DecoderState, beam: int) -> DecoderState:
        """One row per sentence -> `beam` copies of it (beam search's step 0 runs one row per sentence).
        The encoder keys/values stay once per sentence; the caches (and the spare) get the new rows."""
        t, n = state.length, state.rows
        rows = torch.arange(n, device=state.src_bias.device).repeat_interleave(beam)  # (N*beam,)
        for i, kv in enumerate(state.self_kv):
            wide = self.empty_cache(kv, n * beam, kv.shape[3])
            torch.index_select(kv[:, :n, :, :t], 1, rows, out=wide[:, :, :, :t])
            state.self_kv[i] = wide
        self.release_spare(state)
        state.beam *= beam
        return state

    def next_capacity(self, state: DecoderState) -> int:
        """The cache positions the next step needs: a block more where the caches are full (at most the
        state's max_len), else those they have."""
        capacity = state.self_kv[0].shape[3]
        return min(state.length + CACHE_BLOCK, state.max_len) if state.length == capacity else capacity

    def grow_cache(self, state: DecoderState, capacity: int) -> None:
        """Every layer's cache to `capacity` positions, a layer at a time, so that the old and the grown
        cache are never held whole at once; no spare kept (release_spare). A step calls it where no
        gather since the last step has grown the caches (gather_cache): greedy search, the step after
        expand_beams."""
        t, n = state.length, state.rows
        for i, kv in enumerate(state.self_kv):
            grown = self.empty_cache(kv, n, capacity)
            grown[:, :, :, :t] = kv[:, :n, :, :t]
            state.self_kv[i] = grown
        self.release_spare(state)

    def gather_cache(self, state: DecoderState, rows: Tensor) -> DecoderState:
        """Row i of each layer's self-attention cache takes row rows[i]'s filled positions: one copy into
        the spare (a new buffer where it lacks the rows), which becomes the layer's cache; the old cache is
        the next layer's spare, and the last layer's is freed (DecoderState).

        Where the caches are full, the new buffers have the next step's grown capacity (next_capacity), so
        that this copy is the growth's too: beam search then never copies a cache only to grow it (1,000
        test lines of the demo model, one thread: 0.994x the time in fp32, 0.991x in int8, the same bytes;
        benchmarks/RESULTS.md, 2026-12-04 21:40). Every step still reads the caches at the capacities
        grow_cache would have given them.

        Where the capacity stays, a row moves whole, its unfilled positions too (no step reads a position
        before writing it): its keys and its values are then two contiguous runs of H x C x K values, where
        its filled positions alone are 2H runs of t x K, which index_select copies through a strided loop
        per row. The same bytes; over 1,000 test lines of the demo model, one thread, the gathers took
        0.61-0.66x their time in fp32 and 0.76-0.92x in int8 (AMD EPYC Zen 4, benchmarks/RESULTS.md,
        2026-12-07 23:30)."""
        t, n, capacity = state.length, rows.shape[0], self.next_capacity(state)
        for i, kv in enumerate(state.self_kv):
            # More rows than the spare holds (none between steps, or select_rows repeating sentences), or
            # the cache growing: a new buffer of n rows
            fits = n <= state.spare.shape[1] and state.spare.shape[3] == capacity
            target = state.spare if fits else self.empty_cache(kv, n, capacity)
            if kv.shape[3] == capacity:
                whole = target.view(2, target.shape[1], -1)[:, :n]  # (2, n, H * C * K)
                torch.index_select(kv.view(2, kv.shape[1], -1), 1, rows, out=whole)
            else:
                torch.index_select(kv[:, :, :, :t], 1, rows, out=target[:, :n, :, :t])
            state.self_kv[i], state.spare = target, kv
        self.release_spare(state)  # the last layer's old cache
        return state

    def release_spare(self, state: DecoderState) -> None:
        """No layer's buffer kept beyond the caches between steps (DecoderState): the spare with no rows,
        at the caches' capacity."""
        state.spare = self.empty_cache(state.self_kv[0], 0, state.self_kv[0].shape[3])


@contextlib.contextmanager
def evaluating(model: nn.Module) -> Iterator[nn.Module]:
    """The model in eval mode (no dropout) inside the block, and in the mode it had after it. eval() and
    train() walk every submodule (~1 ms a call for one sentence's search), so a model already in eval
    mode, as at inference, is left alone."""
    was_training = model.training
    if was_training:
        model.eval()
    try:
        yield model
    finally:
        if was_training:
            model.train()


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
