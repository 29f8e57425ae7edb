"""Lexical shortlists (`nmt shortlist`, `nmt translate --shortlist`): each sentence decodes over a small
set of target subwords instead of the whole vocabulary, as Marian and Bergamot students do.

Building. IBM Model 1 (Brown et al., 1993) over subword ids, in torch: t(f | e), the probability that
source piece e (or NULL) translates as target piece f, by EM on the training pairs. Every target token of
a pair is aligned to one of its sentence's source tokens or NULL with posterior
    a(i | j) = t(f_j | e_i) / sum_i' t(f_j | e_i'),
the expected counts c(e, f) = sum a(i | j) over every (i, j) with e_i = e, f_j = f are summed over the
corpus, and t(f | e) = c(e, f) / sum_f' c(e, f'). Only pairs (e, f) that co-occur in some sentence pair
can get mass, so t lives on those keys alone (a sorted tensor of e * V + f), not on a V x V table; each
chunk of sentences is one batch of index_add_ calls. The shortlist is then the `frequent` most frequent
target pieces of the training data plus the `per_source` likeliest pieces t(. | e) of every source
piece e (Bergamot's students use 100 and 50).

Storing. Two int32 tensors, the frequent ids (F,) and the table (V, K) of each source piece's best
target ids (PAD where it has fewer), travel in the checkpoint's `shortlist` entry: tensors, so
`torch.load(weights_only=True)` reads them.

Decoding over a sentence's set is nmt.translate.shortlist's (`Shortlist.members` gives the set).
"""

from __future__ import annotations

import gzip
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from nmt.checkpoint import load_checkpoint, save_checkpoint
from nmt.config import ShortlistSizes
from nmt.errors import DataError, NmtError
from nmt.limits import check
from nmt.tokens import BOS, EOS, PAD, UNK

# The defaults of `nmt shortlist`, kept where its options can read them without importing torch
FREQUENT, PER_SOURCE, ITERATIONS = (
    ShortlistSizes.frequent,
    ShortlistSizes.per_source,
    ShortlistSizes.iterations,
)
CHUNK_TOKENS = 1 << 22  # (source + NULL) x target token pairs handled at once: ~100 MB of index tensors


@dataclass(frozen=True)
class Shortlist:
    """The frequent target ids (F,) and each source id's best target ids (V, K), PAD-filled; int64."""

    frequent: Tensor
    table: Tensor

    @property
    def vocab_size(self) -> int:
        return self.table.shape[0]

    def payload(self) -> dict[str, Tensor]:
        """What the checkpoint's `shortlist` entry holds (int32: a WMT table of 37000 x 50 is 7 MB)."""
        return {"frequent": self.frequent.to(torch.int32), "table": self.table.to(torch.int32)}

    @classmethod
    def from_payload(cls, payload: dict[str, Tensor]) -> Shortlist:
        return cls(payload["frequent"].long(), payload["table"].long())

    def members(self, src: Tensor, extra: Tensor | None = None) -> Tensor:
        """The ids each sentence's log-softmax runs over, as a mask: (B, S) source ids (PAD-padded), (B, E)
        ids to add (PAD-filled) or None -> (B, V) bool. Its set, and PAD and BOS: never emitted, the search
        forbids them after the log-softmax as it does without a shortlist, so they count in the
        normalisation alike and a shortlist of the whole vocabulary gives the very scores of none."""
        b, v = src.shape[0], self.vocab_size
        member = torch.zeros(b, v, dtype=torch.bool, device=src.device)  # (B, V)
        member[:, self.frequent.to(src.device)] = True
        member[:, [EOS, UNK]] = True
        member.scatter_(1, self.table.to(src.device)[src].view(b, -1), True)  # table[PAD] is all PAD
        if extra is not None:
            member.scatter_(1, extra, True)
        member[:, [PAD, BOS]] = True
        return member

    def sentence_ids(self, src: Tensor, extra: Tensor | None = None) -> Tensor:
        """Each sentence's set (the ids it may emit) as ascending ids padded with PAD to the largest set:
        -> (B, M)."""
        member = self.members(src, extra)
        member[:, [PAD, BOS]] = False
        rows, cols = member.nonzero(as_tuple=True)  # row-major: each row's ids ascending
        sizes = member.sum(1)  # (B,)
        starts = torch.cumsum(sizes, 0) - sizes  # (B,)
        ids = torch.full((len(member), int(sizes.max())), PAD, dtype=torch.long, device=src.device)  # (B, M)
        ids[rows, torch.arange(len(rows), device=src.device) - starts[rows]] = cols
        return ids


# ---- building -------------------------------------------------------------------------------------------


def ibm_model1(
    pairs: Sequence[tuple[Tensor, Tensor]], vocab: int, iterations: int = ITERATIONS
) -> tuple[Tensor, Tensor]:
    """t(f | e) of IBM Model 1 by EM (module docstring) over (source ids, target ids) pairs of int64
    tensors, ids < vocab; source id `vocab` is NULL. Returns the co-occurring keys e * (vocab + 1) + f,
    sorted (U,), and t on them (U,), float64."""
    width = vocab + 1
    chunks = [_chunk_pairs(batch, vocab, width) for batch in _batches(pairs)]
    keys = torch.unique(torch.cat([torch.unique(key) for key, _ in chunks])) if chunks else torch.zeros(0)
    chunks = [(torch.searchsorted(keys, key), tgt_of) for key, tgt_of in chunks]  # key -> its index in keys
    source_of = keys // width  # (U,) e of each key
    t = torch.ones(len(keys), dtype=torch.float64)  # uniform: the first E-step counts co-occurrences
    for _ in range(iterations):
        counts = torch.zeros(len(keys), dtype=torch.float64)
        for index, tgt_of in chunks:
            w = t[index]  # (I,) t(f_j | e_i) of every (i, j) of the chunk
            norm = torch.zeros(int(tgt_of[-1]) + 1, dtype=torch.float64).index_add_(0, tgt_of, w)  # (J,)
            counts.index_add_(0, index, w / norm[tgt_of])  # a(i | j)
        totals = torch.zeros(width, dtype=torch.float64).index_add_(0, source_of, counts)  # (V+1,)
        t = counts / totals[source_of]
    return keys, t


def _batches(pairs: Sequence[tuple[Tensor, Tensor]]) -> Iterator[list[tuple[Tensor, Tensor]]]:
    """The pairs in runs of at most CHUNK_TOKENS (source + NULL) x target token pairs (at least one pair)."""
    batch, size = [], 0
    for src, tgt in pairs:
        cost = (len(src) + 1) * len(tgt)
        if batch and size + cost > CHUNK_TOKENS:
            yield batch
            batch, size = [], 0
        batch.append((src, tgt))
        size += cost
    if batch:
        yield batch


def _chunk_pairs(batch: list[tuple[Tensor, Tensor]], null: int, width: int) -> tuple[Tensor, Tensor]:
    """Every (source-or-NULL token, target token) of the batch's sentences: its key e * width + f and
    the target token (numbered across the batch) it belongs to, each (I,)."""
    src = [torch.cat([torch.tensor([null]), s]) for s, _ in batch]  # NULL first
    src_lens = torch.tensor([len(s) for s in src])  # (N,)
    tgt_lens = torch.tensor([len(t) for _, t in batch])  # (N,)
    src_flat, tgt_flat = torch.cat(src), torch.cat([t for _, t in batch])  # (Ns,), (Nt,)
    src_starts = torch.cumsum(src_lens, 0) - src_lens  # (N,)
    sentence_of_tgt = torch.repeat_interleave(torch.arange(len(batch)), tgt_lens)  # (Nt,)
    per_tgt = src_lens[sentence_of_tgt]  # (Nt,) source tokens each target token may align to
    tgt_of = torch.repeat_interleave(torch.arange(len(tgt_flat)), per_tgt)  # (I,)
    first = torch.cumsum(per_tgt, 0) - per_tgt  # (Nt,)
    position = torch.arange(len(tgt_of)) - first[tgt_of]  # (I,) i within the sentence
    e = src_flat[src_starts[sentence_of_tgt[tgt_of]] + position]  # (I,)
    return e * width + tgt_flat[tgt_of], tgt_of


def build_shortlist(
    pairs: Sequence[tuple[Tensor, Tensor]],
    vocab: int,
    frequent: int = FREQUENT,
    per_source: int = PER_SOURCE,
    iterations: int = ITERATIONS,
) -> Shortlist:
    """The `frequent` most frequent target ids and, per source id, the `per_source` likeliest target ids
    under IBM Model 1's t(f | e); ties go to the lower id."""
    check_sizes(frequent, per_source, iterations)
    counts = torch.zeros(vocab, dtype=torch.long)
    for _, tgt in pairs:
        counts.index_add_(0, tgt, torch.ones_like(tgt))
    counts[[PAD, BOS, EOS, UNK]] = -1  # EOS and UNK are always in the set; PAD and BOS never
    frequent_ids = torch.sort(torch.topk(counts, min(frequent, vocab)).indices).values
    frequent_ids = frequent_ids[counts[frequent_ids] > 0]

    keys, t = ibm_model1(pairs, vocab, iterations)
    width = vocab + 1
    e, f = keys // width, keys % width
    keep = (e < vocab) & (f != PAD) & (f != BOS)  # NULL's row is not a source piece
    e, f, t = e[keep], f[keep], t[keep]
    order = torch.argsort(-t, stable=True)  # likeliest first; keys are sorted, so ties by lower f
    order = order[torch.argsort(e[order], stable=True)]  # grouped by e, each group likeliest first
    e, f = e[order], f[order]
    group_start = torch.searchsorted(e, e)  # (U,) first position of each one's e
    rank = torch.arange(len(e)) - group_start
    # no wider than the most candidates any source piece has: a larger --per-source means all of them
    per_source = min(per_source, int(rank.max()) + 1 if len(rank) else 1)
    best = rank < per_source
    table = torch.full((vocab, per_source), PAD, dtype=torch.long)
    table[e[best], rank[best]] = f[best]
    return Shortlist(frequent_ids, table)


def data_prefix(data: Path) -> Path:
    """The prefix of the binarized training split `--data` names: a work directory, its data/ folder,
    or the split's prefix itself."""
    data = Path(data)
    candidates = [data / "data" / "train", data / "train", data]
    prefix = next((p for p in candidates if Path(f"{p}.src.idx").is_file()), None)
    if prefix is None:
        raise DataError(f"{data}: no binarized training data (data/train.src.idx); run nmt preprocess")
    return prefix


def split_files(prefix: Path) -> list[Path]:
    """The files of a binarized split and the SentencePiece model beside it: what --data reads."""
    files = [Path(f"{prefix}.{side}.{ext}") for side in ("src", "tgt") for ext in ("idx", "bin")]
    return [*files, prefix.parent / "spm.model"]


def training_pairs(data: Path | None = None, src: Path | None = None, tgt: Path | None = None, subword=None):
    """The training pairs as id tensors: a binarized split (data_prefix) or two text files encoded with
    `subword`."""
    if data is not None:
        from nmt.data.binarized import ParallelData

        split = ParallelData(data_prefix(data))
        return [(split.src(i), split.tgt(i)) for i in range(len(split))]
    if src is None or tgt is None:
        raise NmtError("give the training data: --data WORKDIR, or --src FILE and --tgt FILE")
    lines = []
    for path in (src, tgt):
        try:
            raw = Path(path).read_bytes()
            raw = gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw  # the corpora's own .gz files
            lines.append(raw.decode("utf-8", errors="replace").splitlines())
        except (OSError, EOFError) as e:
            raise DataError(f"{path}: cannot read: {e.strerror or e}") from None
    if len(lines[0]) != len(lines[1]):
        raise DataError(f"{src} has {len(lines[0])} lines but {tgt} has {len(lines[1])}")
    src_ids, tgt_ids = subword.encode(lines[0]), subword.encode_target(lines[1])
    return [(torch.tensor(s), torch.tensor(t)) for s, t in zip(src_ids, tgt_ids, strict=True)]


def check_sizes(frequent: int, per_source: int, iterations: int) -> None:
    """The counts of `nmt shortlist`, checked before any work against nmt.limits. The two sizes have no
    upper bound to refuse: a set never holds more than the vocabulary, so larger counts mean all of it
    (build_shortlist takes them as that, and allocates no more)."""
    check("--frequent", frequent)
    check("--per-source", per_source)
    check("--iterations", iterations)


def check_data(data: Path, prefix: Path, proto: bytes, vocab: int, model: Path) -> None:
    """Binarized pairs made with the model's own subwords: the SentencePiece model beside them is the
    model's, and every id (over the whole split, not a sample) is below its vocabulary size."""
    from nmt.data.binarized import ParallelData

    spm = prefix.parent / "spm.model"
    if spm.is_file() and spm.read_bytes() != proto:
        raise DataError(
            f"--data {data}: preprocessed with another SentencePiece model ({spm}) than {model}'s; "
            f"give the training data of {model}, or --src/--tgt text"
        )
    ParallelData(prefix).check_ids(vocab, str(model))


def shortlist(
    model: Path,
    output: Path,
    data: Path | None = None,
    src: Path | None = None,
    tgt: Path | None = None,
    frequent: int = FREQUENT,
    per_source: int = PER_SOURCE,
    iterations: int = ITERATIONS,
) -> Shortlist:
    """`nmt shortlist`: build a shortlist from the training data and write `model` with it as `output`
    (atomically). `output` may be `model` itself, which it then replaces with the same weights, subwords
    and training state and the new shortlist; it may be none of the training data's files."""
    from nmt.atomic import refuse_overlaps
    from nmt.subword import Subword

    check_sizes(frequent, per_source, iterations)
    prefix = data_prefix(data) if data is not None else None
    refuse_overlaps([("-o", output)], [src, tgt, *(split_files(prefix) if prefix is not None else [])])
    ckpt = load_checkpoint(Path(model))
    if prefix is not None:
        check_data(Path(data), prefix, ckpt.subword_proto, ckpt.vocab_size, model)
    pairs = training_pairs(data, src, tgt, Subword(ckpt.subword_proto))
    if not pairs:
        raise DataError("no training pairs to build a shortlist from")
    built = build_shortlist(pairs, ckpt.vocab_size, frequent, per_source, iterations)
    save_checkpoint(
        Path(output),
        model_state=ckpt.model_state,
        config=ckpt.config,
        subword_proto=ckpt.subword_proto,
        vocab_size=ckpt.vocab_size,
        train_state=ckpt.train_state,
        shortlist=built.payload(),
    )
    return built


def load_shortlist(path: Path) -> Shortlist:
    """The shortlist a checkpoint carries; one line naming the file where it carries none."""
    return carried_shortlist(path, load_checkpoint(Path(path)).shortlist)


def carried_shortlist(path: Path, payload: dict[str, Tensor] | None) -> Shortlist:
    """The shortlist of checkpoint `path` from its `shortlist` entry, read with the model
    (nmt.checkpoint.read_model); one line naming the file where it carries none."""
    if payload is None:
        raise NmtError(f"{path}: carries no shortlist; build one with `nmt shortlist -m {path} ...`")
    return Shortlist.from_payload(payload)
