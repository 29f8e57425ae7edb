"""benchmarks/RESULTS.md: every benchmark appends dated entries to its own section of it."""

from __future__ import annotations

import platform
from pathlib import Path

from nmt.atomic import write_text

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def machine_name(device: str) -> str:
    """The GPU's name, or the CPU's model name from /proc/cpuinfo."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def record(entry: str, section: str, path: Path = RESULTS) -> None:
    """Append `entry` at the end of `section` (a `## ` heading), leaving every other section as it is."""
    text = path.read_text(encoding="utf-8") if path.exists() else "# Benchmark results\n"
    if section not in text:
        text = text.rstrip("\n") + f"\n\n{section}\n\n"
    start = text.index(section) + len(section)
    end = text.find("\n## ", start)
    end = len(text) if end < 0 else end + 1
    head, tail = text[:end].rstrip("\n") + "\n\n", text[end:]
    write_text(path, head + entry.rstrip("\n") + "\n" + ("\n" + tail if tail else ""))
