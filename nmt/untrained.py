"""Models that were never trained, built in seconds: random weights of a config's model saved as
`nmt train` saves a checkpoint (with a SentencePiece model from nmt.subword.train_sentencepiece).

What the speed benchmarks need (a model of a recipe's exact size, nothing learned) and what the tests
build their tiny models from, so that neither carries a copy.
"""

from __future__ import annotations

from pathlib import Path

import torch

from nmt.checkpoint import save_checkpoint
from nmt.config import Config
from nmt.model import Transformer
from nmt.subword import Subword


def save_random_model(path: Path, cfg: Config, subword: Subword, seed: int = 1) -> Path:
    """A checkpoint of cfg.model with its initial random weights (torch seed `seed`) over `subword`."""
    torch.manual_seed(seed)
    model = Transformer(cfg.model, subword.vocab_size)
    save_checkpoint(
        path,
        model_state=model.state_dict(),
        config=cfg,
        subword_proto=subword.proto,
        vocab_size=subword.vocab_size,
    )
    return path
