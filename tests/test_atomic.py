"""Atomic writes: the old content or the whole new content, never a part, and no temporary file left."""

from __future__ import annotations

import errno

import pytest

from nmt.atomic import atomic_write, link_or_copy, write_text
from nmt.errors import OutputError


def test_a_write_that_fails_midway_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "results.json"
    write_text(target, "old\n")
    with pytest.raises(OutputError, match="No space left"), atomic_write(target, "w", encoding="utf-8") as f:
        f.write("half of the new")
        raise OSError(errno.ENOSPC, "No space left on device")
    assert target.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]


def test_a_write_replaces_the_file_whole_and_creates_folders(tmp_path):
    target = tmp_path / "a" / "b" / "out.txt"
    write_text(target, "first\n")
    with atomic_write(target, "w", encoding="utf-8") as f:
        f.write("second\n")
        assert target.read_text() == "first\n"  # readers see the old file until the block ends
    assert target.read_text() == "second\n"
    assert [p.name for p in target.parent.iterdir()] == ["out.txt"]


def test_link_or_copy_points_a_second_name_at_the_same_bytes(tmp_path):
    src, dst = tmp_path / "step-10.pt", tmp_path / "best.pt"
    src.write_bytes(b"weights")
    dst.write_bytes(b"older")
    link_or_copy(src, dst)
    assert dst.read_bytes() == b"weights" and sorted(p.name for p in tmp_path.iterdir()) == [
        "best.pt",
        "step-10.pt",
    ]


@pytest.mark.parametrize("maker", ["mkstemp", "mkdtemp"])
def test_a_signal_as_the_temporary_name_is_made_leaves_nothing_behind(tmp_path, monkeypatch, maker):
    """SIGTERM delivered the moment the temporary file (or an export's staging folder) exists: without the
    signals held back until its name is recorded, the exception left it behind, as a loaded CI machine
    showed (tests/test_output_guard.py, a signal mid-translation)."""
    import os
    import signal
    import tempfile

    from nmt.atomic import atomic_folder
    from nmt.errors import Signalled

    def handler(signum, frame):
        raise Signalled(signum)

    real = getattr(tempfile, maker)

    def made_then_signalled(*args, **kwargs):
        made = real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)  # handled at once, unless held back
        return made

    monkeypatch.setattr(tempfile, maker, made_then_signalled)
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        with pytest.raises(Signalled):
            if maker == "mkstemp":
                write_text(tmp_path / "out.txt", "new\n")
            else:
                with atomic_folder(tmp_path / "export") as folder:
                    folder.mkdir()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert os.listdir(tmp_path) == []
