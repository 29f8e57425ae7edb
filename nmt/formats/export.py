"""`nmt export`: a checkpoint as a model folder of another inference engine."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from rich.console import Console

from nmt.atomic import refuse_inputs
from nmt.errors import NmtError
from nmt.formats import FORMATS


def export(
    model_path: Path,
    output: Path,
    fmt: str = "ctranslate2",
    force: bool = False,
    license: str | None = None,
    note: Callable[[str], None] | None = None,
) -> Path:
    """`nmt export`: write the checkpoint `model_path` as a `fmt` model folder `output`; returns it.

    The folder is built under a temporary name beside `output` and renamed at the end, so a failed
    export leaves nothing behind. An existing `output` is replaced only with `force`, and only when it
    holds a previous export (never an unrelated folder). `license` goes into the model card that the
    huggingface format writes; `note` receives what the user should know about the folder, a line each.
    """
    if fmt not in FORMATS:
        raise NmtError(f"--format {fmt}: expected one of {', '.join(FORMATS)}")
    refuse_inputs(output, [model_path])  # -o the model itself, or a folder that holds it
    if fmt == "huggingface":
        from nmt.formats.huggingface import export_huggingface

        return export_huggingface(Path(model_path), Path(output), force=force, license=license, note=note)
    if license is not None:
        raise NmtError("--license: only --format huggingface writes a model card, which names the licence")
    from nmt.formats.ctranslate2 import export_ctranslate2

    return export_ctranslate2(Path(model_path), Path(output), force=force)


def exported(model: Path, folder: Path, console: Console) -> Path:
    """`model` as a CTranslate2 folder (`nmt export`), exported again only when the model is newer."""
    from nmt.formats.ctranslate2 import META_FILE

    meta = folder / META_FILE
    if meta.exists() and meta.stat().st_mtime >= Path(model).stat().st_mtime:
        return folder
    console.print(f"export: {model} -> {folder} (CTranslate2)", highlight=False)
    return export(Path(model), folder, "ctranslate2", force=folder.exists())
