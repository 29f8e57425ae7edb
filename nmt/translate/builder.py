"""One way to build a translator from what a user chose: model files (or a model in memory), engine,
device and precision, and the decode options given over the model's own settings.

`nmt translate`, `nmt serve`, `nmt run`'s translate step and validation during training all call
`build_translator`, so they load, default and check alike, and get back what each needs: the line
translator (its decode settings and subword model with it), the language pair, and what was chosen.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console

from nmt.checkpoint import LoadedModel, read_model
from nmt.config import DecodeConfig, DecodeOverrides, Engine, Precision
from nmt.device import (
    attention_for_varying_shapes,
    inference_choice,
    inference_dtype,
    keep_freed_buffers,
    resolve_device,
)
from nmt.errors import NmtError
from nmt.languages import same, short, target_tag
from nmt.subword import Subword
from nmt.translate.frontend import LineTranslator, Translator
from nmt.translate.terminology import build_terminology
from nmt.translate.threads import threads_words
from nmt.translate.workers import WorkerPlan


@dataclass(frozen=True)
class BuiltTranslator:
    """A translator and what was chosen for it."""

    translator: LineTranslator
    src_lang: str
    tgt_lang: str
    device: torch.device
    precision: str  # what the products run in: float32, bfloat16, int8, or CTranslate2's compute type
    # Every language the model reads and writes, by the codes people use (`fr`): several targets for a
    # model that reads its target from a tag (nmt.languages), several sources for one trained on them.
    sources: tuple[str, ...] = ()
    targets: tuple[str, ...] = ()
    # why the precision is what it is, for the log (device.inference_choice, int8.kernel_words); kept out
    # of `precision`, which chunk manifests compare on resume
    why: str = ""
    scripted: str = ""  # what runs in TorchScript rather than eager PyTorch (scripted_words)

    @property
    def engine(self) -> Engine:
        return self.translator.engine.name

    @property
    def decode(self) -> DecodeConfig:
        return self.translator.decode

    @property
    def subword(self) -> Subword:
        return self.translator.subword

    def describe(self, threads: int | None = None) -> str:
        """For a log line, e.g. `device cpu, float32 (products prepacked for oneDNN), the default on
        a CPU without native bf16 (AVX-512 BF16 or AMX)`; with `threads` (one process searching on the
        CPU in several threads), how its batches share them out (nmt.translate.threads)."""
        engine = "" if self.engine is Engine.TORCH else "CTranslate2 "
        text = f"device {self.device}, {engine}{self.precision}" + (f", {self.why}" if self.why else "")
        text += f", {self.scripted}" if self.scripted else ""
        if threads is not None and threads > 1 and self.engine is Engine.TORCH and self.device.type == "cpu":
            text += f", {threads_words(threads)}"
        return text


def build_translator(
    models: Path | str | Sequence[Path | str] | LoadedModel,
    overrides: DecodeOverrides | None = None,
    device: str | torch.device = "auto",
    dtype: Precision | str | None = Precision.AUTO,
    engine: Engine | str = Engine.TORCH,
    console: Console | None = None,
    command: str = "nmt translate",
    glossary: Path | None = None,
    avoid: Path | None = None,
    workers: WorkerPlan | None = None,
    target: str | None = None,
    source: str | None = None,
) -> BuiltTranslator:
    """The translator of `models`, decoding with their own settings overridden by `overrides`.

    `models`: checkpoints (several: one ensemble; they must share their subword model, and the first
    one's decode settings apply), a folder from `nmt export` (engine ctranslate2, which keeps the
    checkpoint's decode settings), or a model already in memory (validation: the model being trained).
    `dtype` None leaves a model in memory as it is, for the caller to use again: no precision cast, no
    int8 or prepacked kernels. Errors name the option; `command` names the caller in decode errors.
    `glossary` (a TSV of terms) and `avoid` (phrases): files the translator obeys (nmt.translate.terminology;
    the engine's capability checked here, once). `workers`: who searches the batches (nmt.translate.workers:
    planned before the model loads), fitted here to the model's own decode settings; None: this process.
    `target`, `source` (`--target`, `--source`): languages by any ISO 639 code, checked against the
    model's; a model of several targets translates into `target` unless a line's leading tag says other.
    """
    engine = Engine.parse(engine, "--engine")
    choice = target, source
    precision = None if dtype is None else Precision.parse(dtype, "--dtype")
    overrides = overrides if overrides is not None else DecodeOverrides()
    torch_device = resolve_device(str(device))
    if engine is Engine.CTRANSLATE2:
        return ctranslate2_build(
            models, overrides, torch_device, precision, console, command, glossary, avoid, workers, choice
        )
    payload = None  # the first checkpoint's shortlist entry: an ensemble shares the first model's vocabulary
    if isinstance(models, LoadedModel):
        loaded, names = [models], ["the model"]
    else:
        names = model_paths(models)
        read = [read_model(path, torch_device) for path in names]
        loaded, payload = [m for m, _ in read], read[0][1]
    model, subword, cfg = loaded[0]
    for name, (_, other, _) in zip(names[1:], loaded[1:], strict=True):
        if other.proto != subword.proto:
            raise NmtError(f"{name}: its subword vocabulary differs from {names[0]}'s; an ensemble needs one")
    if len(loaded) > 1:
        from nmt.translate.ensemble import Ensemble

        model = Ensemble([m for m, _, _ in loaded])
    decode = overrides.apply(cfg.decode, command)
    shortlist = None
    if decode.shortlist and isinstance(models, LoadedModel):
        # a model in memory (validation) has no checkpoint to carry one: it is judged on the whole vocabulary
        decode = dataclasses.replace(decode, shortlist=False)
    elif decode.shortlist:
        from nmt.shortlist import carried_shortlist

        shortlist = carried_shortlist(names[0], payload)
    workers = workers.fit(decode.sampling) if workers is not None else None
    terminology = build_terminology(Engine.TORCH, decode, subword, model.max_positions, glossary, avoid)
    if precision is not None:
        model = inference_model(model, precision, torch_device)
    sources, targets = model_languages(cfg.data, subword)
    tag = chosen_target(subword, sources, targets, *choice)
    translator = Translator(
        model, subword, decode, torch_device, console, shortlist, terminology, workers, tag
    )
    languages = cfg.data.src_lang, cfg.data.tgt_lang
    why = precision_words(precision, torch_device)
    return BuiltTranslator(
        translator,
        *languages,
        torch_device,
        precision_of(model),
        sources,
        targets,
        why,
        scripted_words(model),
    )


def model_languages(data, subword: Subword) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(sources, targets) of a model, by the codes people use: its target tags' languages where it has
    several (an imported OPUS-MT model too), else its recipe's; its training directions' sources."""
    targets = tuple(short(lang) for lang in subword.targets) or (data.tgt_lang,)
    sources = tuple(dict.fromkeys(s for s, _ in data.directions)) if data.train else (data.src_lang,)
    return sources, targets


def chosen_target(
    subword: Subword,
    sources: tuple[str, ...],
    targets: tuple[str, ...],
    target: str | None,
    source: str | None,
) -> str | None:
    """The target tag `--target` selects (None for a model of one target, or none chosen); an error
    naming the model's languages for one it does not have."""
    if source is not None and not any(same(source, s) for s in sources):
        raise NmtError(f"--source {source}: this model translates from {', '.join(sources)}")
    if target is None:
        return None
    if not any(same(target, t) for t in targets):
        raise NmtError(f"--target {target}: this model translates into {', '.join(targets)}")
    return target_tag(target) if subword.targets else None


def model_paths(models: Path | str | Sequence[Path | str]) -> list[Path]:
    return [Path(p) for p in ([models] if isinstance(models, str | Path) else models)]


def ctranslate2_build(
    models,
    overrides: DecodeOverrides,
    device: torch.device,
    precision: Precision | None,
    console,
    command,
    glossary: Path | None = None,
    avoid: Path | None = None,
    workers: WorkerPlan | None = None,
    choice: tuple[str | None, str | None] = (None, None),
) -> BuiltTranslator:
    """A folder written by `nmt export --format ctranslate2`, decoded by CTranslate2."""
    if isinstance(models, LoadedModel):
        raise NmtError("--engine ctranslate2 decodes a folder written by nmt export, not a model in memory")
    paths = model_paths(models)
    if len(paths) > 1:
        raise NmtError("--engine ctranslate2 decodes one model: ensembles need --engine torch")
    from nmt.formats.ctranslate2 import read_meta
    from nmt.translate.ctranslate2_engine import compute_type

    meta = read_meta(paths[0])
    decode = overrides.apply(DecodeConfig(**meta["decode"]), command)
    compute = compute_type(precision or Precision.AUTO, device)
    workers = workers.fit(decode.sampling) if workers is not None else None
    inter, intra = (workers.ct2_threads if workers is not None else None) or (1, None)
    subword = Subword.load(paths[0] / "spm.model")
    sources = tuple(meta.get("sources") or (meta["src_lang"],))
    targets = tuple(short(lang) for lang in subword.targets) or (meta["tgt_lang"],)
    tag = chosen_target(subword, sources, targets, *choice)
    translator = ctranslate2_translator(
        paths[0], decode, str(device), compute, intra, console, inter, workers, tag
    )
    build_terminology(Engine.CTRANSLATE2, decode, translator.subword, 0, glossary, avoid)  # refuses files
    used = translator.engine.compute_type  # what "default" turned out to be
    languages = meta["src_lang"], meta["tgt_lang"]
    return BuiltTranslator(translator, *languages, device, used, sources, targets)


def ctranslate2_translator(
    model_dir: Path,
    decode: DecodeConfig,
    device: str = "cpu",
    compute_type: str = "default",
    threads: int | None = None,
    console: Console | None = None,
    inter_threads: int = 1,
    workers: WorkerPlan | None = None,
    target: str | None = None,
) -> LineTranslator:
    """Lines through CTranslate2, over a folder written by `nmt export` (its own subword model);
    `target`: the target tag of a model of several targets."""
    from nmt.translate.ctranslate2_engine import CT2Engine

    engine = CT2Engine(Path(model_dir), decode, device, compute_type, threads, inter_threads)
    subword = Subword.load(Path(model_dir) / "spm.model")
    return LineTranslator(engine, subword, console, workers=workers, target=target)


def inference_model(model, precision: Precision, device: torch.device, prepack: bool = True):
    """The model (or each member of an Ensemble) in `precision`: a torch dtype (nmt.device.inference_dtype),
    or int8 weights on the CPU (nmt.translate.int8). In float32 or bfloat16 on the CPU the linear
    weights are prepacked for oneDNN (nmt.translate.prepacked) unless `prepack` is off. `precision` is
    parsed already, where the name was read (build_translator, or the CLI)."""
    int8 = precision is Precision.INT8
    if int8 and device.type != "cpu":
        raise NmtError(f"--dtype int8 runs on the CPU, not {device}: add --device cpu")
    torch_dtype = torch.float32 if int8 else inference_dtype(precision, device)
    attention_for_varying_shapes(device)  # encoding batches of every shape
    if device.type == "cpu":
        keep_freed_buffers()  # a step's large buffers reused, not faulted in anew at every step
    # An Ensemble keeps its members in a plain list, out of reach of its own .to()
    for member in model.members:
        member.to(torch_dtype)
        if int8:
            from nmt.translate.int8 import quantize_int8

            quantize_int8(member)
        elif prepack and device.type == "cpu":
            from nmt.translate.prepacked import prepack_model

            prepack_model(member)
        if device.type == "cpu":
            from nmt.translate.scripted import script_model

            script_model(member)
    return model


def precision_words(precision: Precision | None, device: torch.device) -> str:
    """Why the products run in what they do: int8's kernel and bits, or what `--dtype auto` weighed."""
    if precision is Precision.INT8:
        from nmt.translate.int8 import kernel_words

        return kernel_words()
    return inference_choice(precision, device) if precision is not None else ""


def scripted_words(model) -> str:
    """What TorchScript runs, for the log (nmt.translate.scripted): `encoder, decoder steps and the
    searches (up to 8 rows) in TorchScript`, or with the most each serves, `encoder (up to 64 source
    tokens), decoder steps (up to 64 rows) and ...`; empty where everything runs eagerly."""
    from nmt.translate.scripted import ALL_ROWS

    parts = []
    for name, rows, unit in (
        ("encoder", "encode_rows", "source tokens"),
        ("decoder steps", "step_rows", "rows"),
    ):
        most = min(getattr(m, rows) for m in model.members)
        if most:
            parts.append(name + ("" if most == ALL_ROWS else f" (up to {most} {unit})"))
    loops = getattr(model, "search_loops", None)  # an Ensemble searches eagerly
    if loops is not None and loops.rows:
        parts.append(f"the searches (up to {loops.rows} rows)")
    words = ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else "".join(parts)
    return f"{words} in TorchScript" if parts else ""


def precision_of(model) -> str:
    """What a model's products run in, as a log line says it: `int8`, or its weights' dtype, and whether
    its products are prepacked (nmt.translate.prepacked)."""
    from nmt.translate.int8 import Int8Linear
    from nmt.translate.prepacked import PrepackedLinear

    members = model.members
    kernels = {type(m.output_kernel) for m in members}
    if kernels == {Int8Linear}:  # the embedding stays float32, but every product runs in int8
        return "int8"
    param = next(members[0].parameters(), None)
    dtype = str(param.dtype).removeprefix("torch.") if param is not None else "float32"
    return dtype + (" (products prepacked for oneDNN)" if kernels == {PrepackedLinear} else "")
