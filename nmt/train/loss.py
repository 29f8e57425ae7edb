"""Label-smoothed cross-entropy (Szegedy et al., 2016; paper section 5.4) as a pure function, and
`batch_loss`, the model's loss on one batch: what an update differentiates and validation sums."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from nmt.tokens import PAD


def label_smoothed_nll(
    logits: Tensor, target: Tensor, epsilon: float, ignore_index: int
) -> tuple[Tensor, Tensor]:
    """Summed smoothed loss and summed NLL over non-padding positions.

    The target distribution puts 1 - epsilon on the reference token and spreads epsilon uniformly over
    the whole vocabulary (fairseq's convention: the reference also receives epsilon / V):
        loss = (1 - eps) * -log p(y) + eps * mean_v(-log p(v))
    logits: (..., V), target: (...) -> (loss, nll), both scalar sums in float32.
    """
    lprobs = F.log_softmax(logits.float(), dim=-1)  # (N, V)
    keep = target != ignore_index
    nll = -lprobs.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    smooth = -lprobs.mean(dim=-1)
    nll = nll.masked_fill(~keep, 0.0).sum()
    smooth = smooth.masked_fill(~keep, 0.0).sum()
    return (1.0 - epsilon) * nll + epsilon * smooth, nll


def perplexity(nll_per_token: float) -> float:
    """exp of the mean NLL in nats, capped so a diverged run prints a number rather than inf."""
    return float(torch.tensor(min(nll_per_token, 100.0)).exp())


# Logits per chunk. CPU: 1,048 rows at V = 8,000; from 2^21 to 2^23 the step time was the same within
# noise, 2^19 was 25% slower. GPU: large enough that a 37k-vocabulary chunk is ~1,800 rows and a
# micro-batch a few chunks (kernel launches), small enough to be a few hundred MB.
CHUNK_LOGITS = {"cpu": 2**23, "cuda": 2**26}


def projected_label_smoothed_nll(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    epsilon: float,
    ignore_index: int,
    chunk: int = 0,
    bias: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """`label_smoothed_nll(hidden @ weight.T + bias, target, ...)` without the (tokens, vocabulary) logits.

    hidden: (..., D) the decoder's last (normalised) states, weight: (V, D) the output projection,
    target: (...). Padding rows are dropped before the projection, and the rest is projected, scored and
    differentiated `chunk` rows at a time (default: CHUNK_LOGITS[device] / V rows), so memory holds one
    chunk's logits. `bias` (V,), the model's fixed output bias if it has one, gets no gradient.
    Returns (loss, nll) as label_smoothed_nll does; only the loss is differentiable.
    """
    return _ProjectedSmoothedNLL.apply(hidden, weight, target, epsilon, ignore_index, chunk, bias)


def batch_loss(
    model, batch: tuple[Tensor, Tensor, Tensor], epsilon: float, net=None
) -> tuple[Tensor, Tensor]:
    """The summed (loss, nll) of one collated batch (src, tgt_in, tgt_out), padding left out.

    `net` runs forward: the model itself (the default), or its DDP or compiled wrapper. It stops before
    the output projection, which the loss does chunk by chunk with the model's shared embedding matrix;
    under DDP the projection's gradient reaches that matrix within the same backward pass, before DDP's
    hook on it runs.
    """
    src, tgt_in, tgt_out = batch
    states = (model if net is None else net)(src, tgt_in, project=False)  # (B, T, D)
    return projected_label_smoothed_nll(
        states, model.output_weight, tgt_out, epsilon, PAD, bias=model.output_bias
    )


class _ProjectedSmoothedNLL(torch.autograd.Function):
    """Output projection and label-smoothed loss in one pass over row chunks, gradients included.

    With -log p(v) = log Z - x_v, a chunk needs log Z = logsumexp(x), the reference logit and the row
    mean; the gradient of the loss w.r.t. its logits is softmax(x) - (1 - eps) onehot(y) - eps / V,
    written over the chunk's logits in place and multiplied straight back through the projection
    (dh = dx W, dW += dx^T h). The loss is a sum and the last node of the graph, so its gradient for
    an upstream scale g is g times what the forward pass computed: backward only scales.

    Why: through autograd, the (tokens, V) logits, their log-softmax and four more (tokens, V) buffers
    of the backward pass are written and read whole. At the CPU demo's size (1,800 tokens x 8,000) each
    is 57 MB of fresh pages for the kernel to fault in every step (glibc maps every block over 32 MiB
    anew); output projection and loss were a third of the training step. Here the loss makes a few
    passes over one chunk's buffer, and a GPU never holds the full logits (2.8 GB in float32 for a
    20k-token WMT micro-batch).
    """

    @staticmethod
    def forward(ctx, hidden, weight, target, epsilon, ignore_index, chunk, bias):
        shape, vocab = hidden.shape, weight.shape[0]
        keep = (target != ignore_index).reshape(-1)
        rows = keep.nonzero().squeeze(-1)
        h = hidden.reshape(-1, shape[-1]).index_select(0, rows)
        ref = target.reshape(-1).index_select(0, rows).unsqueeze(-1)
        # Under autocast the projection runs in its dtype: cast the weight once, not once per chunk.
        device = h.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else h.dtype
        w, h = weight.to(dtype), h.to(dtype)
        exact = torch.promote_types(dtype, torch.float32)  # softmax and sums in float32 at least
        bias = bias.to(exact) if bias is not None else None
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h) if need_grad else None
        grad_w = torch.zeros_like(weight, dtype=exact) if ctx.needs_input_grad[1] else None
        nll = h.new_zeros((), dtype=exact)
        smooth = h.new_zeros((), dtype=exact)
        step = chunk or max(1, CHUNK_LOGITS.get(device, CHUNK_LOGITS["cpu"]) // vocab)
        with torch.autocast(device, enabled=False):
            for start in range(0, h.shape[0], step):
                h_c, ref_c = h[start : start + step], ref[start : start + step]
                x = (h_c @ w.t()).to(exact)  # (n, V) logits of this chunk
                if bias is not None:
                    x += bias
                log_z = torch.logsumexp(x, dim=-1)
                nll += (log_z - x.gather(-1, ref_c).squeeze(-1)).sum()
                smooth += (log_z - x.mean(dim=-1)).sum()
                if not need_grad:
                    continue
                x.sub_(log_z.unsqueeze(-1)).exp_().sub_(epsilon / vocab)  # softmax - eps / V
                x.scatter_add_(-1, ref_c, x.new_full(ref_c.shape, epsilon - 1.0))
                dx = x.to(dtype)
                torch.mm(dx, w, out=grad_h[start : start + step])
                if grad_w is not None and dtype == exact:
                    grad_w.addmm_(dx.t(), h_c)
                elif grad_w is not None:
                    grad_w += dx.t() @ h_c
        ctx.mark_non_differentiable(nll)
        if need_grad:
            ctx.save_for_backward(grad_h, rows, grad_w)
        ctx.shape, ctx.hidden_dtype, ctx.weight_dtype = shape, hidden.dtype, weight.dtype
        loss = (1.0 - epsilon) * nll + epsilon * smooth
        return loss, nll

    @staticmethod
    def backward(ctx, g_loss, _g_nll):
        grad_h, rows, grad_w = ctx.saved_tensors
        d_hidden = d_weight = None
        if ctx.needs_input_grad[0]:
            d_hidden = grad_h.new_zeros(math.prod(ctx.shape[:-1]), ctx.shape[-1], dtype=ctx.hidden_dtype)
            d_hidden.index_copy_(0, rows, (grad_h * g_loss).to(ctx.hidden_dtype))
            d_hidden = d_hidden.view(ctx.shape)
        if ctx.needs_input_grad[1]:
            d_weight = (grad_w * g_loss).to(ctx.weight_dtype)
        return d_hidden, d_weight, None, None, None, None, None
