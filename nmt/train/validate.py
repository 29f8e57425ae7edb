"""Validation during training: label-smoothed loss and perplexity, and BLEU of greedy translations."""

from __future__ import annotations

import torch

from nmt.config import Config
from nmt.data.batching import collate, epoch_batches
from nmt.data.loader import TrainData
from nmt.model import Transformer
from nmt.tokens import PAD
from nmt.train.loss import batch_loss, perplexity
from nmt.train.runtime import Runtime


@torch.no_grad()
def validate(model: Transformer, data: TrainData, cfg: Config, rt: Runtime) -> dict:
    """Loss, nll and perplexity per target token on the validation pairs, and (train.valid_bleu) the
    BLEU of their greedy translations: each direction's, and their mean."""
    model.eval()
    loss_sum = nll_sum = tokens = 0.0
    for idx in epoch_batches(data.valid.src_lens, data.valid.tgt_lens, cfg.train.batch_tokens, 0, 0):
        batch = tuple(t.to(rt.device) for t in collate(data.valid, idx))
        with rt.autocast():
            loss, nll = batch_loss(model, batch, cfg.train.label_smoothing)
        loss_sum, nll_sum = loss_sum + loss.item(), nll_sum + nll.item()
        tokens += int((batch[2] != PAD).sum())
    result = {
        "loss": loss_sum / tokens,
        "nll": nll_sum / tokens,
        "ppl": perplexity(nll_sum / tokens),
        "bleu": None,
    }
    if cfg.train.valid_bleu:
        from nmt.checkpoint import LoadedModel
        from nmt.config import DecodeOverrides
        from nmt.score import bleu
        from nmt.translate import build_translator

        greedy = DecodeOverrides.given(beam=1, nbest=1)  # the model as it is: dtype None
        built = build_translator(
            LoadedModel(model, data.subword, cfg), greedy, rt.device, None, command="validation"
        )
        scores = {}
        for text in data.valid_text:
            with rt.autocast():
                hyps = built.translator.translate(text.src, target=text.tag)
            scores["-".join(text.direction)] = bleu(hyps, [text.ref])
        # several directions: their mean picks best.pt, each is logged
        result["bleu"] = sum(scores.values()) / len(scores)
        if len(scores) > 1:
            result["bleu_by_direction"] = scores
    model.train()
    return result
