"""Fine-tuning: a run that starts from a checkpoint (`data.init_from`, or `--init-from` on preprocess,
train and run) instead of from random weights and new subwords.

The checkpoint decides what its weights mean: the model keys and the vocabulary. A recipe may leave them
out (they are taken from the checkpoint) or repeat them, but not contradict them; only the dropout rates,
which change training and not the weights, are the recipe's to set (nmt.config.merge_init_from).
Preprocessing encodes with the checkpoint's own subword models rather than training new ones, and
training starts from its weights with the recipe's optimizer and schedule, fresh. Everything else
(stops, resume, averaging) is an ordinary run.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from nmt.errors import DataError


def init_subword(path: str | Path) -> bytes:
    """The checkpoint's subword model, as data/spm.model holds it."""
    from nmt.checkpoint import load_checkpoint

    return load_checkpoint(Path(path)).subword_proto


def subword_sha256(proto: bytes) -> str:
    return hashlib.sha256(proto).hexdigest()


def init_weights(model, path: str | Path, subword) -> None:
    """Load the checkpoint's weights into `model`, after checking that the run's subwords are its own."""
    from nmt.checkpoint import load_checkpoint

    ckpt = load_checkpoint(Path(path))
    if ckpt.subword_proto != subword.proto:
        raise DataError(
            f"data/spm.model is not the subword model of {path}: run `nmt preprocess --init-from {path}` "
            "with this recipe first"
        )
    model.load_state_dict(ckpt.model_state)
