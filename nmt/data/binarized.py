"""Subword ids on disk: one flat id file and one offset file per side, memory-mapped when read.

    prefix.src.bin   the ids of all sentences back to back: uint16 when the vocabulary fits, else int32
    prefix.src.idx   int64: magic, version, dtype code, N, then N+1 offsets into the .bin (in ids)

No pickles and no numpy: torch.from_file maps both files, so a WMT-sized split costs no load time and is
shared between data-loader workers and ranks through the page cache.
"""

from __future__ import annotations

import contextlib
import os
from array import array
from collections.abc import Iterable
from pathlib import Path

import torch

from nmt.atomic import WRITE_ERRNOS, reported
from nmt.errors import DataError

MAGIC = 0x4E4D5442494E  # "NMTBIN"
VERSION = 1
HEADER = 4  # int64 fields before the offsets
# code -> (array typecode, torch dtype, bytes per id)
DTYPES = {1: ("H", torch.uint16, 2), 2: ("i", torch.int32, 4)}
FLUSH_IDS = 1 << 20


def write_split(
    prefix: Path, src: Iterable[list[int]], tgt: Iterable[list[int]], vocab_size: int | None = None
) -> int:
    """Write aligned id sequences to prefix.{src,tgt}.{bin,idx}; returns the number of pairs.

    With `vocab_size` <= 65536 ids are stored as uint16, else int32. Everything is written to .part files
    and renamed at the end, so a split that exists on disk is complete.
    """
    code = 1 if vocab_size is not None and vocab_size <= 1 << 16 else 2
    prefix.parent.mkdir(parents=True, exist_ok=True)
    with reported(prefix, WRITE_ERRNOS):  # a full disk: one line naming the split
        sides = [_SideWriter(prefix, side, code) for side in ("src", "tgt")]
        n = 0
        try:
            for s, t in zip(src, tgt, strict=True):
                sides[0].add(s)
                sides[1].add(t)
                n += 1
            for w in sides:
                w.close()
        except ValueError:
            for w in sides:
                w.abort()
            raise ValueError(f"{prefix}: source and target sequences differ in number") from None
        except BaseException:  # Ctrl-C, SIGTERM, a full disk: no .part file left behind
            for w in sides:
                w.abort()
            raise
    for w in sides:
        w.commit()
    return n


class _SideWriter:
    def __init__(self, prefix: Path, side: str, code: int):
        self.typecode, _, _ = DTYPES[code]
        self.code = code
        self.bin = Path(f"{prefix}.{side}.bin")
        self.idx = Path(f"{prefix}.{side}.idx")
        self.bin_part = self.bin.with_name(self.bin.name + ".part")
        self.idx_part = self.idx.with_name(self.idx.name + ".part")
        self.out = open(self.bin_part, "wb")
        self.ids = array(self.typecode)
        self.offsets = array("q", [0])

    def add(self, ids: list[int]) -> None:
        try:
            self.ids.extend(ids)
        except OverflowError:
            raise ValueError(f"{self.bin}: an id does not fit the chosen {self.typecode!r} storage") from None
        self.offsets.append(self.offsets[-1] + len(ids))
        if len(self.ids) >= FLUSH_IDS:
            self.ids.tofile(self.out)
            self.ids = array(self.typecode)

    def close(self) -> None:
        self.ids.tofile(self.out)
        self.out.flush()
        os.fsync(self.out.fileno())
        self.out.close()
        with open(self.idx_part, "wb") as f:
            array("q", [MAGIC, VERSION, self.code, len(self.offsets) - 1]).tofile(f)
            self.offsets.tofile(f)
            f.flush()
            os.fsync(f.fileno())

    def commit(self) -> None:
        os.replace(self.bin_part, self.bin)
        os.replace(self.idx_part, self.idx)

    def abort(self) -> None:
        with contextlib.suppress(OSError):  # its buffer cannot be flushed on a full disk
            self.out.close()
        self.bin_part.unlink(missing_ok=True)
        self.idx_part.unlink(missing_ok=True)


class ParallelData:
    """The pairs of a binarized split, memory-mapped; ids come out as int64 tensors without EOS."""

    def __init__(self, prefix: Path):
        self.prefix = Path(prefix)
        # ids memory-mapped in their stored dtype; offsets int64 (N+1,), sentence i is ids[o[i] : o[i+1]]
        self.src_ids, src_offsets = _map_side(self.prefix, "src")
        self.tgt_ids, tgt_offsets = _map_side(self.prefix, "tgt")
        if len(src_offsets) != len(tgt_offsets):
            raise DataError(
                f"{self.prefix}.src.idx has {len(src_offsets) - 1} sentences but "
                f"{self.prefix}.tgt.idx has {len(tgt_offsets) - 1}"
            )
        self.src_offsets, self.tgt_offsets = src_offsets, tgt_offsets
        self.src_lens: torch.Tensor = src_offsets[1:] - src_offsets[:-1]  # (N,) int64
        self.tgt_lens: torch.Tensor = tgt_offsets[1:] - tgt_offsets[:-1]  # (N,) int64

    def __len__(self) -> int:
        return len(self.src_lens)

    def check_ids(self, vocab: int, what: str) -> None:
        """A DataError naming the file when any id (of every pair, not a sample) is not below `vocab`:
        split made with other subwords than `what` (a model, a SentencePiece file) has."""
        for side, ids in (("src", self.src_ids), ("tgt", self.tgt_ids)):
            # in blocks: uint16 has no max kernel, and a whole WMT split as int32 would be half a GiB
            for start in range(0, ids.numel(), 1 << 24):
                if int(ids[start : start + (1 << 24)].to(torch.int32).max()) >= vocab:
                    raise DataError(f"{self.prefix}.{side}.bin: ids beyond the {vocab} subwords of {what}")

    def src(self, i: int) -> torch.Tensor:
        o = self.src_offsets
        return self.src_ids[o[i] : o[i + 1]].to(torch.int64)

    def tgt(self, i: int) -> torch.Tensor:
        o = self.tgt_offsets
        return self.tgt_ids[o[i] : o[i + 1]].to(torch.int64)


def _map_side(prefix: Path, side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, offsets) of one side: the ids memory-mapped in their stored dtype, offsets as int64."""
    idx, bin_ = Path(f"{prefix}.{side}.idx"), Path(f"{prefix}.{side}.bin")
    for path in (idx, bin_):
        if not path.is_file():
            raise DataError(f"{path}: no such file; run nmt preprocess first")
    idx_size = idx.stat().st_size
    if idx_size < (HEADER + 1) * 8 or idx_size % 8:
        raise DataError(f"{idx}: not an nmt index file (truncated?)")
    table = torch.from_file(str(idx), shared=False, size=idx_size // 8, dtype=torch.int64)
    magic, version, code, n = table[:HEADER].tolist()
    if magic != MAGIC or version != VERSION or code not in DTYPES or len(table) != HEADER + n + 1:
        raise DataError(f"{idx}: not an nmt index file, or written by another version")
    offsets = table[HEADER:]
    _, dtype, width = DTYPES[code]
    count = int(offsets[-1])
    if bin_.stat().st_size != count * width:
        raise DataError(f"{bin_}: {bin_.stat().st_size} bytes, expected {count * width} (truncated?)")
    ids = torch.from_file(str(bin_), shared=False, size=count, dtype=dtype)
    return ids, offsets
