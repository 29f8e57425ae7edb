"""SentencePiece: the only module that knows the tokenizer.

One joint model for both languages (paper, 5.1: "a shared source-target vocabulary"), trained on the raw
cleaned text, so no Moses tokenizer is needed; ids 0-3 are reserved for pad, unk, bos and eos.
"""

from __future__ import annotations

import io
import random
from pathlib import Path

import sentencepiece as spm

from nmt import atomic
from nmt.config import DataConfig
from nmt.errors import DataError
from nmt.tokens import BOS, EOS, PAD, UNK

SAMPLE_SEED = 1  # the sentence sample is part of the model: the same corpus gives the same subwords


def sample_lines(text_files: list[Path], n: int, seed: int = SAMPLE_SEED) -> list[str]:
    """A uniform sample of n non-blank lines over all the files (reservoir sampling), in one streaming
    pass: memory holds the sample only, and the same files and seed give the same sample."""
    rng = random.Random(seed)
    sample: list[str] = []
    seen = 0
    for path in text_files:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                seen += 1
                if len(sample) < n:
                    sample.append(line)
                elif (j := rng.randrange(seen)) < n:
                    sample[j] = line
    return sample


def train_subword(text_files: list[Path], out_prefix: Path, data: DataConfig) -> Path:
    """Train the joint model on `text_files`; writes out_prefix.model/.vocab and returns the .model path.

    Training reads a sample of `data.spm_sample_sentences` lines, so a WMT-sized corpus costs no more
    memory than that sample. The sample is drawn here with a fixed seed, not by SentencePiece, whose own
    sampling differs from run to run: re-running preprocessing must give the same model, or a resumed
    run would train on remapped ids. Given the same lines, SentencePiece's training is deterministic.
    The lines are handed over in memory and the model comes back as bytes: SentencePiece records its
    input and output paths in the model it writes, and a model that carries the work directory's path
    would differ between two work directories (and tell every reader of a checkpoint where it was made);
    nothing of the machine is recorded either, so the same lines and settings give the same bytes.
    The files are written atomically, the model last, so an interrupted run never leaves a .model that
    looks finished.
    """
    sample = sample_lines(text_files, data.spm_sample_sentences)
    if not sample:
        names = " and ".join(str(p) for p in text_files)
        raise DataError(f"{names}: no training sentences to build the vocabulary from (empty after cleaning)")
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sample),
            model_writer=model,
            model_type=data.subword_type,
            vocab_size=data.vocab_size,
            character_coverage=data.character_coverage,
            pad_id=PAD,
            unk_id=UNK,
            bos_id=BOS,
            eos_id=EOS,
            shuffle_input_sentence=False,
            # num_threads is left at SentencePiece's default (16): a value set here is recorded in the
            # model, so the machine's core count would make the same vocabulary differ in its bytes.
            minloglevel=2,
        )
    except RuntimeError as e:
        # SentencePiece's messages ("Vocabulary size too high (8000). Please set it to a value <= 5342.")
        # are already actionable; name the key that sets it.
        raise DataError(f"SentencePiece training on {text_files[0]} failed (data.vocab_size?): {e}") from None
    sp = Subword(model.getvalue())._sp
    vocab = "".join(f"{sp.id_to_piece(i)}\t{sp.get_score(i):g}\n" for i in range(sp.get_piece_size()))
    out_prefix.parent.mkdir(parents=True, exist_ok=True)
    path = Path(f"{out_prefix}.model")
    atomic.write_text(f"{out_prefix}.vocab", vocab)  # the pieces and scores, for people to read
    atomic.write_bytes(path, model.getvalue())
    return path


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
