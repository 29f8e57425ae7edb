"""SentencePiece: the only module that knows the tokenizer.

One joint model for both languages (paper, 5.1: "a shared source-target vocabulary"), trained on the raw
cleaned text, so no Moses tokenizer is needed; ids 0-3 are reserved for pad, unk, bos and eos.

A pretrained MarianMT model (nmt.formats.huggingface) instead has two SentencePiece models, one per language,
whose pieces map to ids through one shared vocabulary (its vocab.json), as transformers' MarianTokenizer
does. Subword holds either kind behind one interface; the MarianMT kind is serialized as a small JSON
document (the two models in base64 and the pieces in id order), so that a checkpoint, a work directory's
data/spm.model and an exported folder carry it as they carry a SentencePiece model: as opaque bytes.
"""

from __future__ import annotations

import base64
import functools
import io
import json
import random
from collections.abc import Iterable, Sequence
from pathlib import Path

import sentencepiece as spm

from nmt import atomic
from nmt.config import DataConfig
from nmt.errors import DataError
from nmt.languages import RESERVED, leading_tag, tag_language
from nmt.tokens import BOS, EOS, PAD, UNK

WORD_START = "\u2581"  # SentencePiece's word-start marker

SAMPLE_SEED = 1  # the sentence sample is part of the model: the same corpus gives the same subwords
PAIR_FORMAT = "nmt-subword-pair"

# nmt's reserved ids (nmt.tokens), given to every SentencePiece model it trains.
RESERVED_IDS = {"pad_id": PAD, "unk_id": UNK, "bos_id": BOS, "eos_id": EOS}

# SentencePiece's list calls start a pool of threads each time: on 2 cores 0.2-0.3 ms for one line, which
# itself takes 5-9 us, and several ms where a core is busy. A line at a time is faster below about 64 lines
# (encode 0.3 against 0.8 ms for 16 lines, decode 0.09 against 0.45), so a sentence typed or sent alone,
# and the server's small batches, never pay for the pool; a file's batches still use it.
POOL_FROM = 64


def sp_encode(sp: spm.SentencePieceProcessor, lines: Iterable[str]) -> list[list[int]]:
    """SentencePiece ids of each line: its list call (a pool of threads) only where the lines pay for it."""
    lines = list(lines)
    if len(lines) < POOL_FROM:
        return [sp.encode(line, out_type=int) for line in lines]
    return sp.encode(lines, out_type=int)


def sp_decode(sp: spm.SentencePieceProcessor, ids: list[list[int]]) -> list[str]:
    """SentencePiece's text of each id sequence, as sp_encode: the pool of threads only for many."""
    if len(ids) < POOL_FROM:
        return [sp.decode(seq) for seq in ids]
    return sp.decode(ids)


def sample_lines(
    text_files: list[Path], n: int, seed: int = SAMPLE_SEED, distinct: bool = False
) -> list[str]:
    """A uniform sample of n non-blank lines over all the files (reservoir sampling), in one streaming
    pass: memory holds the sample only, and the same files and seed give the same sample. `distinct`:
    each line counts once however often it occurs (the English side of EN-DE, EN-FR and EN-CS corpora
    that translate the same captions), at the cost of a hash per distinct line."""
    rng = random.Random(seed)
    sample: list[str] = []
    seen = 0
    hashes: set[int] = set()
    for path in text_files:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                if distinct:
                    if (key := hash(line)) in hashes:
                        continue
                    hashes.add(key)
                seen += 1
                if len(sample) < n:
                    sample.append(line)
                elif (j := rng.randrange(seen)) < n:
                    sample[j] = line
    return sample


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
        **RESERVED_IDS,
        minloglevel=2,
        **options,
    )
    return Subword.load(Path(f"{prefix}.model"))


def train_subword(
    text_files: list[Path], out_prefix: Path, data: DataConfig, languages: dict[str, list[Path]] | None = None
) -> Path:
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

    `languages` (a recipe of several directions: each language's files): the sample is balanced, an equal
    share of distinct lines from each language, so English, the source of every direction, does not
    crowd out the targets' subwords. The recipe's reserved tags (data.reserved_tags) become control
    symbols: ids that text never encodes to and decoding never writes (user_defined_symbols would be
    matched in a user's text, and add a stray "▁" piece: sentencepiece #438).
    """
    if languages:
        share = max(1, data.spm_sample_sentences // len(languages))
        sample = [line for files in languages.values() for line in sample_lines(files, share, distinct=True)]
    else:
        sample = sample_lines(text_files, data.spm_sample_sentences)
    reserved = {"control_symbols": ",".join(data.reserved_tags)} if data.reserved_tags else {}
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
            **RESERVED_IDS,
            shuffle_input_sentence=False,
            **reserved,
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
    """A trained SentencePiece model, built from its serialized bytes so a checkpoint can carry it; or a
    source and a target SentencePiece model over one vocabulary (`Subword.pair`)."""

    def __init__(self, model_proto: bytes):
        self.proto = bytes(model_proto)
        self.vocabulary: list[str] | None = None  # pieces in id order, when they are not SentencePiece's ids
        if self.proto.startswith(b"{"):  # a SentencePiece model is a protobuf, never a JSON object
            self._load_pair()
            return
        self._sp = self._target = self._processor(self.proto)
        self.vocab_size: int = self._sp.get_piece_size()

    @staticmethod
    def _processor(proto: bytes) -> spm.SentencePieceProcessor:
        sp = spm.SentencePieceProcessor()
        try:
            sp.LoadFromSerializedProto(proto)
        except (RuntimeError, OSError) as e:
            raise DataError(f"not a SentencePiece model: {e}") from None
        return sp

    @classmethod
    def pair(cls, source_proto: bytes, target_proto: bytes, vocabulary: list[str]) -> Subword:
        """Source and target SentencePiece models whose pieces map to ids through `vocabulary`."""
        doc = {
            "format": PAIR_FORMAT,
            "source": base64.b64encode(source_proto).decode("ascii"),
            "target": base64.b64encode(target_proto).decode("ascii"),
            "vocabulary": list(vocabulary),
        }
        return cls(json.dumps(doc, ensure_ascii=False).encode("utf-8"))

    def _load_pair(self) -> None:
        try:
            doc = json.loads(self.proto.decode("utf-8"))
            if doc.get("format") != PAIR_FORMAT:
                raise ValueError(doc.get("format"))
            source, target = (base64.b64decode(doc[side], validate=True) for side in ("source", "target"))
            vocabulary = [str(piece) for piece in doc["vocabulary"]]
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise DataError(f"not a SentencePiece model nor a source/target pair ({e})") from None
        if len(set(vocabulary)) != len(vocabulary) or len(vocabulary) <= EOS:
            raise DataError("the subword pair's vocabulary repeats a piece or lacks the reserved ones")
        self._sp, self._target = self._processor(source), self._processor(target)
        self.vocabulary, self.vocab_size = vocabulary, len(vocabulary)
        self._ids = {piece: i for i, piece in enumerate(vocabulary)}

    @property
    def source_proto(self) -> bytes:
        return self._sp.serialized_model_proto()

    @property
    def target_proto(self) -> bytes:
        return self._target.serialized_model_proto()

    @functools.cached_property
    def tags(self) -> dict[str, int]:
        """The reserved tags of the vocabulary (target tags such as `>>fra<<`, `<BT>`, `<term>`) and their
        ids: a SentencePiece model's control symbols, or the tag pieces of an imported pair's vocabulary."""
        if self.vocabulary is not None:
            pieces = enumerate(self.vocabulary)
        else:
            pieces = ((i, self._sp.id_to_piece(i)) for i in range(self.vocab_size) if self._sp.is_control(i))
        return {p: i for i, p in pieces if tag_language(p) is not None or p in RESERVED}

    @property
    def targets(self) -> list[str]:
        """The target languages the tags select (`fra`, ...), in id order; empty for a bilingual model."""
        return [lang for tag in self.tags if (lang := tag_language(tag)) is not None]

    def pieces(self) -> list[str]:
        """The pieces in id order (what vocabulary files list)."""
        if self.vocabulary is not None:
            return list(self.vocabulary)
        return [self._sp.id_to_piece(i) for i in range(self.vocab_size)]

    @classmethod
    def load(cls, path: Path) -> Subword:
        try:
            return cls(Path(path).read_bytes())
        except OSError as e:
            raise DataError(f"{path}: cannot read the SentencePiece model: {e.strerror}") from None
        except DataError as e:
            raise DataError(f"{path}: {e}") from None

    def encode(self, lines: list[str], tag: str | None = None) -> list[list[int]]:
        """Subword ids of each source line, without BOS/EOS (the trainer and the translator add those).

        A vocabulary with target tags: a line that starts with one of them (`>>fra<< text`, as OPUS-MT
        clients send it) has it by id, and the rest encoded; any other line gets `tag`'s id first where
        given. Nowhere else is a tag read out of text: typed mid-line it is text like any other.
        """
        if not self.tags:
            if self.vocabulary is None:
                return sp_encode(self._sp, lines)
            return [self._pair_ids(self._sp, line) for line in lines]
        firsts, texts = [], []
        for line in lines:
            lead, rest = leading_tag(line)
            known = lead is not None and lead in self.tags
            firsts.append(self.tags[lead] if known else self.tags.get(tag) if tag else None)
            texts.append(rest if known else line)
        if self.vocabulary is None:
            encoded = sp_encode(self._sp, texts)
        else:
            encoded = [self._pair_ids(self._sp, text) for text in texts]
        return [ids if first is None else [first, *ids] for first, ids in zip(firsts, encoded, strict=True)]

    def encode_text(self, text: str, glued: bool = False) -> list[int]:
        """Subword ids of a piece of a source line assembled around reserved ids (nmt.data.terms), read
        as text only: no tag is taken from it. `glued`: it continues the word before it ("." after
        "bike"), so its first piece goes without the word-start marker where the vocabulary has that."""
        ids = self._sp.encode(text, out_type=int)
        if glued and ids:
            first = self._sp.id_to_piece(ids[0])
            if first == WORD_START:
                return ids[1:]
            bare = self._sp.piece_to_id(first[1:]) if first.startswith(WORD_START) else None
            if bare is not None and bare != self._sp.unk_id():
                return [bare, *ids[1:]]
        return ids

    def encode_target(self, lines: list[str]) -> list[list[int]]:
        """Subword ids of each target line (training references, forced prefixes)."""
        if self.vocabulary is None:
            return sp_encode(self._sp, lines)
        return [self._pair_ids(self._target, line) for line in lines]

    def _pair_ids(self, sp: spm.SentencePieceProcessor, line: str) -> list[int]:
        """As MarianTokenizer: a leading language code whole, the rest SentencePiece's pieces, each piece
        its vocabulary id, UNK where the vocabulary lacks it."""
        code = []  # a leading target-language token such as >>deu<< stays whole, outside SentencePiece
        if line.startswith(">>") and (end := line.find("<<")) != -1:
            code, line = [line[: end + 2]], line[end + 2 :]
        return [self._ids.get(piece, UNK) for piece in code + sp.encode(line, out_type=str)]

    def decode(self, ids: list[list[int]]) -> list[str]:
        """Detokenized text of each id sequence; pad, bos and eos are skipped wherever they occur."""
        kept = [[i for i in seq if i > EOS or i == UNK] for seq in ids]
        if self.tags:  # a tag is an instruction, never text (SentencePiece writes control symbols as "")
            tags = set(self.tags.values())
            kept = [[i for i in seq if i not in tags] for seq in kept]
        if self.vocabulary is None:
            return sp_decode(self._sp, kept)
        return [self._target.decode_pieces([self.vocabulary[i] for i in seq]) for seq in kept]
