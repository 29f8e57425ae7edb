"""Models that were never trained, built in seconds: a SentencePiece model of given lines, and random
weights of a config's model saved as `nmt train` saves a checkpoint.

What the speed benchmarks need (a model of a recipe's exact size, nothing learned) and what the tests
build their tiny models from, so that neither carries a copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import sentencepiece as spm
import torch

from nmt.checkpoint import save_checkpoint
from nmt.config import Config
from nmt.data.subword import Subword
from nmt.model import Transformer
from nmt.tokens import BOS, EOS, PAD, UNK


def train_sentencepiece(lines: Sequence[str], prefix: Path, vocab_size: int, **options) -> Subword:
    """A SentencePiece model of `lines` with nmt's reserved ids, written as prefix.model and .vocab (with
    the lines in prefix.txt). `options` go to SentencePiece as they are: model types the recipes do not
    offer, such as `word`, or `hard_vocab_limit=False`."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    text = prefix.with_suffix(".txt")
    text.write_text("\n".join(lines) + "\n", encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(text),
        model_prefix=str(prefix),
        vocab_size=vocab_size,
        pad_id=PAD,
        unk_id=UNK,
        bos_id=BOS,
        eos_id=EOS,
        minloglevel=2,
        **options,
    )
    return Subword.load(Path(f"{prefix}.model"))


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
