"""SentencePiece: the only module that knows the tokenizer.

One joint model for both languages (paper, 5.1: "a shared source-target vocabulary"), trained on the raw
cleaned text, so no Moses tokenizer is needed; ids 0-3 are reserved for pad, unk, bos and eos.
"""

from __future__ import annotations

import os
from pathlib import Path

import sentencepiece as spm

from nmt.config import DataConfig
from nmt.errors import DataError

PAD, UNK, BOS, EOS = 0, 1, 2, 3


def train_subword(text_files: list[Path], out_prefix: Path, data: DataConfig) -> Path:
    """Train the joint model on `text_files`; writes out_prefix.model/.vocab and returns the .model path.

    SentencePiece samples `data.spm_sample_sentences` lines itself (shuffled), so a WMT-sized corpus costs
    no more memory than that sample. The files are written under a temporary prefix and renamed, the model
    last, so an interrupted run never leaves a .model that looks finished.
    """
    out_prefix.parent.mkdir(parents=True, exist_ok=True)
    tmp_prefix = out_prefix.with_name(out_prefix.name + ".part")
    try:
        spm.SentencePieceTrainer.train(
            input=[str(f) for f in text_files],
            model_prefix=str(tmp_prefix),
            model_type=data.subword_type,
            vocab_size=data.vocab_size,
            character_coverage=data.character_coverage,
            pad_id=PAD,
            unk_id=UNK,
            bos_id=BOS,
            eos_id=EOS,
            input_sentence_size=data.spm_sample_sentences,
            shuffle_input_sentence=True,
            num_threads=os.cpu_count() or 1,
            minloglevel=2,
        )
    except RuntimeError as e:
        # SentencePiece's messages ("Vocabulary size too high (8000). Please set it to a value <= 5342.")
        # are already actionable; name the key that sets it.
        raise DataError(f"SentencePiece training on {text_files[0]} failed (data.vocab_size?): {e}") from None
    model = Path(f"{out_prefix}.model")
    os.replace(f"{tmp_prefix}.vocab", f"{out_prefix}.vocab")
    os.replace(f"{tmp_prefix}.model", model)
    return model


class Subword:
    """A trained SentencePiece model, built from its serialized bytes so a checkpoint can carry it."""

    def __init__(self, model_proto: bytes):
        self.proto = bytes(model_proto)
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.LoadFromSerializedProto(self.proto)
        except (RuntimeError, OSError) as e:
            raise DataError(f"not a SentencePiece model: {e}") from None
        self.vocab_size: int = self._sp.get_piece_size()

    @classmethod
    def load(cls, path: Path) -> Subword:
        try:
            return cls(Path(path).read_bytes())
        except OSError as e:
            raise DataError(f"{path}: cannot read the SentencePiece model: {e.strerror}") from None
        except DataError as e:
            raise DataError(f"{path}: {e}") from None

    def encode(self, lines: list[str]) -> list[list[int]]:
        """Subword ids of each line, without BOS/EOS (the trainer and the translator add those)."""
        return self._sp.encode(list(lines), out_type=int)

    def decode(self, ids: list[list[int]]) -> list[str]:
        """Detokenized text of each id sequence; pad, bos and eos are skipped wherever they occur."""
        return self._sp.decode([[i for i in seq if i > EOS or i == UNK] for seq in ids])
