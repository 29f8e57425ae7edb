"""The label-smoothed loss (section 5.4): the definition, its chunked projection, and the trainer's
`batch_loss`."""

import pytest
import torch
import torch.nn.functional as F

from nmt.config import ModelConfig
from nmt.model import Transformer
from nmt.tokens import PAD
from nmt.train.loss import batch_loss, label_smoothed_nll, projected_label_smoothed_nll

# numerics: trains or compares numbers, so `make test` runs it again with the AVX2 kernels forced
pytestmark = pytest.mark.numerics


def test_label_smoothing_matches_the_smoothed_target_distribution():
    torch.manual_seed(0)
    logits = torch.randn(5, 11)
    target = torch.tensor([3, 4, PAD, 7, 10])
    eps = 0.1
    loss, nll = label_smoothed_nll(logits, target, eps, PAD)
    keep = target != PAD
    q = torch.full((5, 11), eps / 11)
    q[torch.arange(5), target] += 1 - eps
    expected = -(q * F.log_softmax(logits, -1)).sum(-1)[keep].sum()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert nll.item() == pytest.approx(
        F.cross_entropy(logits[keep], target[keep], reduction="sum").item(), rel=1e-5
    )


def _padded_targets(vocab: int) -> torch.Tensor:
    target = torch.randint(PAD + 1, vocab, (3, 7))
    target[1, 4:] = PAD
    target[2, 1:] = PAD
    return target


def test_projected_loss_is_the_loss_of_the_projected_logits():
    """Chunked projection + loss (values and hand-written gradients) against autograd through the
    plain definition, in float64 with chunks that do not divide the rows."""
    torch.manual_seed(0)
    hidden = torch.randn(3, 7, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    target = _padded_targets(50)
    for chunk in (1, 4, 0):  # 0: the default, one chunk here
        loss, nll = projected_label_smoothed_nll(hidden, weight, target, 0.1, PAD, chunk=chunk)
        ref_loss, ref_nll = label_smoothed_nll(hidden @ weight.t(), target, 0.1, PAD)
        assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
        assert nll.item() == pytest.approx(ref_nll.item(), rel=1e-6)
        got = torch.autograd.grad(0.37 * loss, (hidden, weight))
        want = torch.autograd.grad(0.37 * ref_loss, (hidden, weight))
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)
        assert got[0][2, 1:].abs().max() == 0  # padding positions get no gradient

    # gradcheck perturbs every input one by one: a small model and vocabulary keep it to seconds
    small = (
        torch.randn(3, 7, 4, dtype=torch.float64, requires_grad=True),
        torch.randn(9, 4, dtype=torch.float64, requires_grad=True),
    )
    small_target = _padded_targets(9)

    def loss_of(h, w):
        return projected_label_smoothed_nll(h, w, small_target, 0.1, PAD, chunk=5)[0]

    assert torch.autograd.gradcheck(loss_of, small)


def test_projected_loss_under_bf16_autocast_matches_autocast_linear():
    torch.manual_seed(0)
    hidden = torch.randn(3, 7, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    target = _padded_targets(50)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = projected_label_smoothed_nll(hidden, weight, target, 0.1, PAD, chunk=4)
        ref, _ = label_smoothed_nll(F.linear(hidden, weight), target, 0.1, PAD)
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(ref.item(), rel=1e-3)
    got = torch.autograd.grad(loss, (hidden, weight))
    want = torch.autograd.grad(ref, (hidden, weight))
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, rtol=0.02, atol=0.02)


def test_training_through_the_projected_loss_gives_the_logits_gradients():
    """What the trainer runs (`batch_loss`: states, then the chunked loss with the shared embedding), and
    the chunked loss in chunks of 3 rows, against the model's logits and the plain loss: the same loss
    and the same gradient for every parameter."""
    src = torch.tensor([[5, 6, 7, 8, 2], [9, 10, 2, 0, 0]])
    tgt_in = torch.tensor([[1, 11, 12, 13], [1, 14, 0, 0]])
    tgt_out = torch.tensor([[11, 12, 13, 2], [14, 2, 0, 0]])

    def grads(how: str):
        torch.manual_seed(3)
        cfg = ModelConfig(encoder_layers=2, decoder_layers=2, d_model=32, d_ff=64, heads=4, dropout=0.0)
        model = Transformer(cfg, vocab_size=40).train()
        if how == "batch_loss":
            loss, _ = batch_loss(model, (src, tgt_in, tgt_out), 0.1)
        elif how == "chunks of 3":
            states = model(src, tgt_in, project=False)
            loss, _ = projected_label_smoothed_nll(states, model.output_weight, tgt_out, 0.1, PAD, 3)
        else:
            loss, _ = label_smoothed_nll(model(src, tgt_in), tgt_out, 0.1, PAD)
        loss.backward()
        return loss.item(), {n: p.grad for n, p in model.named_parameters()}

    ref, want = grads("logits")
    for how in ("batch_loss", "chunks of 3"):
        loss, got = grads(how)
        assert loss == pytest.approx(ref, rel=1e-6), how
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=f"{how}: {name}")


def test_projected_loss_without_gradients_only_scores():
    torch.manual_seed(0)
    hidden, weight = torch.randn(3, 7, 16), torch.randn(50, 16)
    target = _padded_targets(50)
    with torch.no_grad():
        loss, nll = projected_label_smoothed_nll(hidden, weight, target, 0.1, PAD, chunk=2)
    ref_loss, ref_nll = label_smoothed_nll(hidden @ weight.t(), target, 0.1, PAD)
    assert not loss.requires_grad
    assert (loss.item(), nll.item()) == pytest.approx((ref_loss.item(), ref_nll.item()), rel=1e-5)
