"""The `nmt` command: a thin Typer shell over the library.

Each command parses its options, loads the config, calls ONE library function and renders the result.
Human-facing output (progress, tables, warnings) goes to stderr through Rich; results (translations,
scores with --json) go to stdout so they can be piped. Library errors (nmt.errors.NmtError) become one
red line and exit status 2 here, at the single boundary in `Commands.invoke`. Options that several
commands take are declared once, below the app. Every command's help ends with examples in one format:
command lines a user can run as written, flush with the text.
"""

from __future__ import annotations

import errno
import re
import signal
import sys
import threading
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption

try:  # a recent typer carries its own copy of click, whose exceptions have no public name
    from typer._click.exceptions import NoArgsIsHelpError, UsageError
except ImportError:  # an older typer over click itself
    from click.exceptions import NoArgsIsHelpError, UsageError

from nmt.config import Engine, Precision, ShortlistSizes
from nmt.data.filters import FilterSettings
from nmt.distill.options import DistillOptions
from nmt.errors import ConfigError, Interrupted, NmtError, Signalled
from nmt.formats import FORMATS
from nmt.output import write_failed
from nmt.serve.settings import ServeSettings

OUTPUT_ERRNOS = (errno.EPIPE, errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EBADF)

# soft_wrap: a message is one line however wide, so a log file or `grep` gets it whole (Rich would
# otherwise wrap at 80 columns whenever stderr is not a terminal).
err = Console(stderr=True, soft_wrap=True)


LIST_TYPE = re.compile(r"<list\[(\w+)\]>")


class ArgumentHelp(TyperArgument):
    """An argument whose help shows the type of one value (`<path>`; the usage line's `...` says when
    there may be several), not typer's Python type (`<list[Path]>`), and no type for text (`<str>`):
    its name (RECIPE) says what it is."""

    def display_type_rich(self, ctx) -> str | None:
        label = super().display_type_rich(ctx)
        found = LIST_TYPE.fullmatch(label or "")
        return f"<{found[1].lower()}>" if found else None if label == "<str>" else label


def display_type(param, ctx) -> str:
    """The type typer's help shows for an option (`<list[Path]>`); "" from a typer before 0.29, which
    has no such method: its help then shows the option as it always did, and the command still runs."""
    method = getattr(param, "display_type", None)
    return method(ctx) if method is not None else ""


class HelpShowsValues:
    """Help that shows what a user types: nothing beside a flag (typer's Rich help would print <bool>),
    and for a repeatable option or argument the type of one value, not <list[Path]> (ArgumentHelp)."""

    def get_params(self, ctx):
        params = super().get_params(ctx)
        for param in params:
            if type(param) is TyperArgument:
                param.__class__ = ArgumentHelp  # a subclass that only changes what help shows
            elif not isinstance(param, TyperOption) or param.metavar is not None:
                continue
            elif getattr(param, "is_flag", False):
                param.metavar = ""
            elif found := LIST_TYPE.fullmatch(display_type(param, ctx)):
                param.metavar = f"<{found[1].lower()}>"
        return params


class Command(HelpShowsValues, TyperCommand):
    """Every command of nmt: its numeric options checked against nmt.limits before it runs, so a number
    out of bounds is one line naming the option before a model loads or a file is written."""

    def invoke(self, ctx):
        from nmt.limits import check

        for param in self.params:
            if number_type(param) is not None:
                check(option_name(param), ctx.params.get(param.name))
        return super().invoke(ctx)


def number_type(param) -> type | None:
    """int or float where the parameter takes a number (not a flag), else None."""
    descriptor = getattr(param, "type_descriptor", None)  # a recent typer's own parameters
    if descriptor is not None:
        found = descriptor.annotation
    else:  # an older typer's click types: INT, FLOAT, IntRange, FloatRange
        found = {"integer": int, "float": float}.get(getattr(param.type, "name", "").split(" ")[0])
    return found if found in (int, float) else None


def option_name(param) -> str:
    """The name an option is known by, in help and in errors: its long form (--max-tokens)."""
    return max(param.opts, key=len)


def usage_error(e: UsageError) -> typer.Exit:
    """A usage error (an unknown option, a missing or invalid value) as one red line naming the command,
    and its exit status (2), as every other error: not click's box of usage, hint and message."""
    if isinstance(e, NoArgsIsHelpError):
        raise e  # `nmt` or `nmt COMMAND` alone asks for help, which is what click shows
    where = f" (see {e.ctx.command_path} --help)" if e.ctx is not None else ""
    message = " ".join(e.format_message().split())  # click's "Did you mean" hint goes on the same line
    err.print(f"[bold red]error:[/] {escape(message)}{escape(where)}", highlight=False)
    return typer.Exit(e.exit_code)


class Commands(HelpShowsValues, TyperGroup):
    """The one boundary where library errors, and usage errors, become a red line on stderr and exit
    status 2."""

    def make_context(self, info_name, args, parent=None, **extra):
        try:  # `nmt --bogus`: the group's own options; a command's are parsed in `invoke`
            return super().make_context(info_name, args, parent, **extra)
        except UsageError as e:
            raise usage_error(e) from None

    def invoke(self, ctx):
        previous = raise_on_signals()
        try:
            result = super().invoke(ctx)
            if sys.stdout is not None:
                sys.stdout.flush()  # here, so a full disk is reported in one line, not by the interpreter
            return result
        except OSError as e:
            # Results that could not be written: a reader gone (`| head -n 1`) ends quietly, as a Unix
            # tool killed by SIGPIPE (status 141); a full disk or a closed stdout is one line, exit 1.
            # Other OSErrors are bugs or files a command should have named: they keep their traceback.
            if e.errno not in OUTPUT_ERRNOS:
                raise
            problem = write_failed(e)
            if problem is None:
                raise typer.Exit(128 + signal.SIGPIPE) from None
            err.print(f"[bold red]error:[/] {escape(str(problem))}", highlight=False)
            raise typer.Exit(problem.exit_code) from None
        except KeyboardInterrupt:
            # Ctrl-C outside training (which saves and raises Interrupted): one line and 128 + SIGINT, as
            # a shell reports it, rather than click's "Aborted!" and status 1. Outputs are atomic, so
            # nothing half-written was left behind.
            err.print("[yellow]interrupted[/]", highlight=False)
            raise typer.Exit(128 + signal.SIGINT) from None
        except Signalled as e:  # SIGTERM/SIGHUP (nohup, a scheduler, a closed terminal) outside training
            err.print(f"[yellow]{escape(str(e))}[/]", highlight=False)
            raise typer.Exit(e.exit_code) from None
        except Interrupted as e:  # not a mistake: the work was saved and the same command continues it
            err.print(f"[yellow]{escape(str(e))}[/]", highlight=False, soft_wrap=True)
            raise typer.Exit(e.exit_code) from None
        except NmtError as e:
            err.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
            raise typer.Exit(e.exit_code) from None
        except UsageError as e:  # a command's options, parsed when the group invokes it
            raise usage_error(e) from None
        finally:
            for s, handler in previous.items():  # a caller in the same process (a test) gets its own back
                if handler is not None:  # None: set outside Python, which cannot be put back
                    signal.signal(s, handler)


def raise_on_signals() -> dict:
    """SIGTERM and SIGHUP raise Signalled wherever the command is, as Ctrl-C raises KeyboardInterrupt, so
    every `finally` on the way out runs: a temporary output file is removed, not left behind by the
    default action (the process ending at once). Training puts its own handler in place while it runs
    (nmt.train.stopping: save, then stop) and the server its own (graceful shutdown).

    Returns the handlers it replaced. Only the main thread may set handlers: elsewhere, nothing.
    """

    def handle(signum, _frame):
        raise Signalled(signum)

    previous = {}
    if threading.current_thread() is not threading.main_thread():
        return previous
    for s in (signal.SIGTERM, signal.SIGHUP):
        # An ignored signal stays ignored: `nohup` ignores SIGHUP so that the work goes on.
        if signal.getsignal(s) is not signal.SIG_IGN:
            previous[s] = signal.signal(s, handle)
    return previous


app = typer.Typer(
    cls=Commands,
    name="nmt",
    help="Neural machine translation with the Transformer of 'Attention Is All You Need'.",
    no_args_is_help=True,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def print_version(value: bool) -> None:
    if value:
        from nmt import __version__

        typer.echo(f"nmt {__version__}")
        raise typer.Exit()


@app.callback()
def global_options(
    version: Annotated[
        bool,
        typer.Option(
            "--version", help="Print the version of nmt and exit.", is_eager=True, callback=print_version
        ),
    ] = False,
) -> None:
    """Neural machine translation with the Transformer of 'Attention Is All You Need'."""


# ---- options that several commands take ---------------------------------------------------------------

RecipeArg = Annotated[
    str,
    typer.Argument(
        metavar="RECIPE",
        help="Recipe YAML file, or the name of a shipped recipe such as [bold]multi30k-en-de[/].",
    ),
]
WorkdirOpt = Annotated[
    Path | None, typer.Option("--workdir", "-w", help="Work directory. Default: runs/<recipe file stem>/.")
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set", "-s", metavar="<key=value>", help="Override a recipe key, e.g. train.max_steps=200."
    ),
]
MirrorOpt = Annotated[
    str | None,
    typer.Option(
        "--mirror",
        envvar="NMT_DATA_MIRROR",
        metavar="<folder|url>",
        help="Folder or base URL that replaces upstream download locations (file names kept).",
    ),
]
InitFromOpt = Annotated[
    Path | None,
    typer.Option(
        "--init-from",
        help="Fine-tune: start from this checkpoint's weights and subwords (sets data.init_from).",
    ),
]
BeamOpt = Annotated[int | None, typer.Option(help="Beam size; 1 is greedy. Default: the recipe's.")]
LenpenOpt = Annotated[float | None, typer.Option(help="Length penalty alpha, ((5+|Y|)/6)^alpha.")]
DeviceOpt = Annotated[
    str, typer.Option(metavar="<device>", help="auto (CUDA if available), cpu, cuda or cuda:N.")
]
DtypeOpt = Annotated[
    Precision,
    typer.Option(
        case_sensitive=False,
        help="auto (bf16 on a CUDA GPU or CPU that multiplies it natively: AMX, AVX-512 BF16; else fp32), "
        "fp32, bf16, fp16, or int8 (CPU: 8-bit "
        "weights, faster; translations may differ a little from fp32's). With --engine ctranslate2: its "
        "compute type of that name, where CTranslate2 has it on the device.",
    ),
]
EngineOpt = Annotated[
    Engine,
    typer.Option(
        case_sensitive=False,
        help="torch, or ctranslate2 with --model a folder from nmt export --format ctranslate2.",
    ),
]
ShortlistOpt = Annotated[
    bool | None,
    typer.Option(
        "--shortlist",
        help="Decode each sentence over the lexical shortlist the checkpoint carries (nmt shortlist): "
        "faster; scores are then over the shortlist.",
    ),
]

TermsReplaceOpt = Annotated[
    bool | None,
    typer.Option(
        "--terms-replace/--no-terms-replace",
        help="A glossary term takes the place of the model's own word for its source (that word, read "
        "from its translation without terms, is banned). Default: the checkpoint's decode.terms_replace.",
    ),
]

RecaseOpt = Annotated[
    bool | None,
    typer.Option(
        "--recase/--no-recase",
        help="Translate lines typed in ALL CAPS or Title Case as a sentence is written, and an ALL-CAPS "
        "line's translation in upper case. Default: the checkpoint's decode.recase.",
    ),
]


def _overrides(overrides: list[str] | None, init_from: Path | None) -> list[str]:
    """--set items, and --init-from as the recipe key it stands for (a JSON string is valid YAML)."""
    import json

    extra = [f"data.init_from={json.dumps(str(init_from))}"] if init_from is not None else []
    return [*(overrides or []), *extra]


def _workdir(recipe: str, workdir: Path | None, *inputs: Path | None) -> Path:
    """The work directory of a command that writes one, after the one check of its outputs against
    its inputs: the recipe and the files given as `inputs` (a checkpoint to start from, a teacher)."""
    from nmt.atomic import refuse_overlaps, workdir_outputs
    from nmt.config import resolve_recipe

    path = resolve_recipe(recipe)
    workdir = workdir if workdir is not None else Path("runs") / path.stem
    refuse_overlaps(workdir_outputs(workdir), [path, *inputs])
    return workdir


def _whole_run_only(cfg, command: str) -> None:
    """A back-translation recipe's data exist only once its reverse model has translated: its steps
    run in order under `nmt run`, which alone knows where each model's data are."""
    if cfg.data.backtranslate is not None:
        raise ConfigError(
            f"data.backtranslate: nmt {command} cannot run a back-translation recipe's steps alone; "
            "`nmt run` runs them in order (reverse model, back-translation, forward model), each resumable"
        )


@app.command(cls=Command)
def preprocess(
    recipe: RecipeArg,
    workdir: WorkdirOpt = None,
    mirror: MirrorOpt = None,
    overrides: SetOpt = None,
    force: Annotated[bool, typer.Option("--force", help="Redo every step, even those already done.")] = False,
    init_from: InitFromOpt = None,
) -> None:
    """Fetch the corpora, clean them, train the joint SentencePiece model and binarize every split.

    [bold]Examples[/]
    nmt preprocess multi30k-en-de
    nmt preprocess multi30k-en-de --mirror ~/multi30k   # the Multi30k files, from a folder
    nmt preprocess my-domain.yaml --init-from opus-mt-en-de.pt   # encode with the model's subwords
    """
    from nmt.checkpoint import checkpoint_config, checkpoint_subword
    from nmt.config import load_config
    from nmt.data.preprocess import preprocess as run_preprocess

    cfg = load_config(recipe, _overrides(overrides, init_from), checkpoint_config)
    _whole_run_only(cfg, "preprocess")
    run_preprocess(
        cfg,
        _workdir(recipe, workdir),
        mirror=mirror,
        force=force,
        console=err,
        checkpoint_subword=checkpoint_subword,
    )


@app.command(cls=Command)
def train(
    recipe: RecipeArg,
    workdir: WorkdirOpt = None,
    overrides: SetOpt = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Build the model, print its summary and stop; needs no data.")
    ] = False,
    init_from: InitFromOpt = None,
) -> None:
    """Train a model; running the same command again resumes from the last checkpoint.

    Launch with torchrun for several GPUs or nodes; the effective batch stays the recipe's.

    [bold]Examples[/]
    nmt train multi30k-en-de
    nmt train wmt14-en-de-base --dry-run
    nmt train multi30k-en-de --set train.max_steps=200
    torchrun --nproc-per-node 8 -m nmt train wmt14-en-de-base
    nmt train my-domain.yaml --init-from opus-mt-en-de.pt   # fine-tune a pretrained model
    """
    from nmt.checkpoint import checkpoint_config
    from nmt.config import load_config
    from nmt.train import dry_run as run_dry_run
    from nmt.train import train as run_train

    cfg = load_config(recipe, _overrides(overrides, init_from), checkpoint_config)
    if dry_run:
        run_dry_run(cfg, console=err)
        return
    _whole_run_only(cfg, "train")
    run_train(cfg, _workdir(recipe, workdir, cfg.data.init_from), console=err)


@app.command(cls=Command)
def average(
    checkpoints: Annotated[
        list[Path] | None,
        typer.Argument(
            metavar="CHECKPOINT", help="Checkpoint files to average (or use --last with a folder)."
        ),
    ] = None,
    output: Annotated[Path, typer.Option("--output", "-o", help="The averaged checkpoint to write.")] = Path(
        "average.pt"
    ),
    last: Annotated[
        int | None, typer.Option("--last", help="Average the last N step checkpoints of --dir.")
    ] = None,
    directory: Annotated[
        Path | None, typer.Option("--dir", help="Checkpoint folder for --last, e.g. runs/NAME/checkpoints.")
    ] = None,
    shortlist: Annotated[
        bool,
        typer.Option(
            help="Keep the lexical shortlist the inputs carry alike (nmt shortlist); where they differ, "
            "none is kept and a line says so."
        ),
    ] = True,
) -> None:
    """Average the weights of several checkpoints into one (paper: last 5 for base, 20 for big).

    [bold]Examples[/]
    nmt average runs/multi30k-en-de/checkpoints/step-*.pt -o avg.pt
    nmt average --last 5 --dir runs/multi30k-en-de/checkpoints -o avg.pt
    """
    from nmt.checkpoint import average_checkpoints, last_checkpoints

    if last is not None:
        if directory is None:
            raise NmtError("--last needs --dir, the checkpoint folder")
        checkpoints = last_checkpoints(directory, last)
    if not checkpoints:
        raise NmtError("no checkpoints given: name files, or use --last N --dir FOLDER")
    note = average_checkpoints(checkpoints, output, shortlist)
    if note:
        err.print(f"[yellow]warning:[/] {note}", highlight=False)
    err.print(f"averaged {len(checkpoints)} checkpoints into {output}")


@app.command(cls=Command)
def export(
    model: Annotated[Path, typer.Option("--model", "-m", help="Checkpoint from nmt train or nmt average.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Model folder to write.")],
    fmt: Annotated[
        str,
        typer.Option(
            "--format",
            metavar=f"<{'|'.join(FORMATS)}>",
            help="ctranslate2, or huggingface (MarianMT, or Pegasus for a pre-norm model, for transformers).",
        ),
    ] = "ctranslate2",
    force: Annotated[bool, typer.Option("--force", help="Replace an earlier export in --output.")] = False,
    license: Annotated[
        str | None,
        typer.Option(
            "--license",
            metavar="<id>",
            help="huggingface: the licence the model card states, as the Hub writes it (apache-2.0, ...).",
        ),
    ] = None,
) -> None:
    """Convert a checkpoint for another inference engine (CTranslate2: pip install 'nmt\\[ctranslate2]').

    [bold]Examples[/]
    nmt export -m runs/multi30k-en-de/checkpoints/average.pt --format ctranslate2 -o ct2-en-de
    nmt translate --engine ctranslate2 -m ct2-en-de -i in.en > out.de
    nmt export -m average.pt --format huggingface --license apache-2.0 -o hf-en-de   # OPUS-MT's layout
    """
    from nmt.formats.export import export as run_export

    def note(line: str) -> None:
        err.print(f"[yellow]note:[/] {escape(line)}", highlight=False)

    path = run_export(model, output, fmt, force=force, license=license, note=note)
    err.print(f"exported {model} to {path}")


@app.command(name="import", cls=Command)
def import_model(
    folder: Annotated[
        Path,
        typer.Argument(
            metavar="FOLDER", help="A MarianMT or Pegasus model folder (config.json, vocab.json, ...)."
        ),
    ],
    output: Annotated[Path, typer.Option("--output", "-o", help="The nmt checkpoint to write.")],
    src_lang: Annotated[
        str | None,
        typer.Option(metavar="<code>", help="Source language, when tokenizer_config.json does not name it."),
    ] = None,
    tgt_lang: Annotated[
        str | None,
        typer.Option(metavar="<code>", help="Target language, when tokenizer_config.json does not name it."),
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace --output if it exists.")] = False,
) -> None:
    """Import a Hugging Face MarianMT (OPUS-MT) or Pegasus folder as an nmt checkpoint; needs no transformers.

    [bold]Examples[/]
    huggingface-cli download Helsinki-NLP/opus-mt-en-de --local-dir opus-mt-en-de
    nmt import opus-mt-en-de -o opus-mt-en-de.pt
    echo "A man rides a bike." | nmt translate -m opus-mt-en-de.pt
    """
    from nmt.formats.huggingface import import_huggingface

    err.print(f"imported {folder} as {import_huggingface(folder, output, src_lang, tgt_lang, force)}")


@app.command(cls=Command)
def translate(
    model: Annotated[
        list[Path],
        typer.Option(
            "--model",
            "-m",
            help="Checkpoint from nmt train or nmt average; repeat it to decode an ensemble. With --engine "
            "ctranslate2 a folder from nmt export.",
        ),
    ],
    input: Annotated[Path | None, typer.Option("--input", "-i", help="Input file; default stdin.")] = None,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Output file; default stdout.")
    ] = None,
    beam: BeamOpt = None,
    lenpen: LenpenOpt = None,
    max_len_a: Annotated[float | None, typer.Option(help="Output limit a*source_length+b: a.")] = None,
    max_len_b: Annotated[int | None, typer.Option(help="Output limit a*source_length+b: b.")] = None,
    min_len: Annotated[
        int | None,
        typer.Option(
            help="Tokens a translation has at least before it may end (0 allows empty). Default: 1."
        ),
    ] = None,
    batch_tokens: Annotated[
        int | None,
        typer.Option(
            "--max-tokens",
            help="Batch budget: sentences x beam x max(source, output limit). Default: the recipe's.",
        ),
    ] = None,
    nbest: Annotated[
        int | None,
        typer.Option(
            help="Print up to N hypotheses (samples with --sampling) per input line, best first, as "
            "index<TAB>score<TAB>text; index is the 0-based input line number, score the "
            "length-normalized log-probability."
        ),
    ] = None,
    no_repeat_ngram_size: Annotated[
        int | None, typer.Option(help="Never repeat an n-gram of this size in a translation (0: off).")
    ] = None,
    prefix: Annotated[
        Path | None,
        typer.Option(
            help="File of target prefixes, one per input line (blank: none); each translation "
            "continues its own."
        ),
    ] = None,
    glossary: Annotated[
        Path | None,
        typer.Option(
            help="TSV file of `source term<TAB>target term` lines: each term found in a line (whole words, "
            "any case) comes out as its target, exactly once; a target equal to its source is kept as it is."
        ),
    ] = None,
    avoid: Annotated[
        Path | None, typer.Option(help="File of target phrases, one a line, never to be produced.")
    ] = None,
    sampling: Annotated[
        bool | None,
        typer.Option("--sampling", help="Draw each token instead of searching (back-translation)."),
    ] = None,
    sampling_topk: Annotated[int | None, typer.Option(help="Draw from the K likeliest tokens only.")] = None,
    sampling_topp: Annotated[
        float | None, typer.Option(help="Draw from the smallest set of tokens holding probability P.")
    ] = None,
    temperature: Annotated[
        float | None, typer.Option(help="Sampling temperature: below 1 sharpens, above 1 flattens.")
    ] = None,
    seed: Annotated[
        int | None, typer.Option(help="Random seed for sampling: the same seed, the same output.")
    ] = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = Precision.AUTO,
    interactive: Annotated[
        bool,
        typer.Option("--interactive", help="Answer each line as soon as it is read (default on a terminal)."),
    ] = False,
    engine: EngineOpt = Engine.TORCH,
    shortlist: ShortlistOpt = None,
    recase: RecaseOpt = None,
    terms_replace: TermsReplaceOpt = None,
    split_sentences: Annotated[
        bool | None,
        typer.Option(
            "--split-sentences/--no-split-sentences",
            help="Translate each line sentence by sentence, joined with its own spacing (the default, "
            "but with --prefix). --no-split-sentences: each line whole, as one sentence (fairseq's way).",
        ),
    ] = None,
    workers: Annotated[
        int | None,
        typer.Option(
            help="Processes that translate a file's batches at once, sharing the CPU threads out "
            "(CTranslate2: its inter_threads). Default: one per thread, of one thread each, when the "
            "whole input is read anyway; 1 from a terminal, with --interactive, on a GPU or with sampling.",
        ),
    ] = None,
    target: Annotated[
        str | None,
        typer.Option(
            metavar="<code>",
            help="Target language (fr or fra) of a model with several; a line that starts with >>fra<< "
            "goes into that language instead. Default: the model's only one.",
        ),
    ] = None,
    source: Annotated[
        str | None,
        typer.Option(metavar="<code>", help="Source language, checked against the model's ones."),
    ] = None,
) -> None:
    """Translate lines: exactly one output line for every input line, in order.

    Decode settings default to the checkpoint's own recipe. Blank lines give blank lines; invalid UTF-8
    is replaced and lines too long for the model are truncated, each with a warning on stderr.

    [bold]Examples[/]
    cat in.en | nmt translate -m runs/multi30k-en-de/checkpoints/average.pt > out.de
    nmt translate -m model.pt -i in.en -o out.de --beam 4 --lenpen 0.6
    nmt translate -m model.pt -i in.en --nbest 4 --beam 8
    nmt translate -m a.pt -m b.pt -i in.en   # ensemble of two models
    nmt translate -m model.pt -i mono.de --sampling --sampling-topk 10 --seed 1   # back-translation
    nmt translate -m model.pt -i in.en --prefix starts.de --no-repeat-ngram-size 3
    nmt translate -m model.pt -i in.en --glossary terms.tsv --avoid banned.de
    nmt translate --engine ctranslate2 -m ct2-en-de -i in.en --dtype int8
    nmt translate -m student.pt -i in.en --beam 1 --dtype int8 --shortlist   # after nmt shortlist
    nmt translate -m model.pt -i in.en -o out.de --workers 1   # one process of all the threads
    """
    from nmt.config import DecodeOverrides
    from nmt.translate import translate_stream

    overrides = DecodeOverrides.given(
        {"batch_tokens": "--max-tokens"},
        beam=beam,
        lenpen=lenpen,
        max_len_a=max_len_a,
        max_len_b=max_len_b,
        min_len=min_len,
        batch_tokens=batch_tokens,
        nbest=nbest,
        no_repeat_ngram_size=no_repeat_ngram_size,
        sampling=sampling,
        sampling_topk=sampling_topk,
        sampling_topp=sampling_topp,
        temperature=temperature,
        seed=seed,
        shortlist=shortlist,
        recase=recase,
        terms_replace=terms_replace,
    )
    translate_stream(
        model,
        input=input,
        output=output,
        overrides=overrides,
        device=device,
        dtype=dtype,
        interactive=interactive,
        console=err,
        engine=engine,
        prefix=prefix,
        scored=nbest is not None,
        glossary=glossary,
        avoid=avoid,
        split_sentences=split_sentences,
        workers=workers,
        target=target,
        source=source,
    )


@app.command(cls=Command)
def serve(
    model: Annotated[
        list[Path],
        typer.Option(
            "--model",
            "-m",
            help="Checkpoint from nmt train or nmt average (--engine ctranslate2: a folder from nmt export). "
            "Repeat it to serve every pair of several models, each by a worker of its own; with "
            "--engine ctranslate2, a checkpoint file among folders runs on torch.",
        ),
    ],
    host: Annotated[
        str, typer.Option(metavar="<address>", help="Address to listen on; 0.0.0.0 for every interface.")
    ] = ServeSettings.host,
    port: Annotated[
        int, typer.Option(help="Port to listen on; 0 picks a free one (printed).")
    ] = ServeSettings.port,
    max_batch_tokens: Annotated[
        int,
        typer.Option(
            "--max-tokens",
            help="Batch budget: sentences x beam x max(source, output limit), as nmt translate's.",
        ),
    ] = 8192,
    old_max_batch_tokens: Annotated[
        int | None, typer.Option("--max-batch-tokens", hidden=True, help="The old name of --max-tokens.")
    ] = None,
    batch_wait_ms: Annotated[
        float,
        typer.Option(
            help="How long the first request of a batch waits for others to join it, after a batch of"
            " several requests (a request alone starts at once)."
        ),
    ] = ServeSettings.batch_wait_ms,
    max_chars: Annotated[
        int, typer.Option(help="Largest request, in characters of text.")
    ] = ServeSettings.max_chars,
    max_queue: Annotated[
        int, typer.Option(help="Source lines waiting for the model at most; more get 503 + Retry-After.")
    ] = ServeSettings.max_queue,
    timeout: Annotated[
        float, typer.Option(help="Seconds a request may wait for its translation (504).")
    ] = ServeSettings.timeout,
    read_timeout: Annotated[
        float, typer.Option(help="Seconds to receive a request's headers, and again its body (408).")
    ] = ServeSettings.read_timeout,
    keep_alive: Annotated[
        float, typer.Option(help="Seconds an idle connection stays open.")
    ] = ServeSettings.keep_alive,
    max_connections: Annotated[
        int, typer.Option(help="Open connections at most; more get 503.")
    ] = ServeSettings.max_connections,
    shutdown_timeout: Annotated[
        float, typer.Option(help="After SIGTERM/SIGINT, seconds to answer what is in flight before exiting.")
    ] = ServeSettings.shutdown_timeout,
    cors_origins: Annotated[
        str,
        typer.Option(
            metavar="<origins>",
            help="Origins whose pages may call the server, comma-separated (https://x.org); * any, '' none.",
        ),
    ] = ServeSettings.cors_origins,
    glossary: Annotated[
        Path | None,
        typer.Option(
            help="TSV file of `source term<TAB>target term` lines obeyed by every request (a request's own "
            "`glossary` field adds to it)."
        ),
    ] = None,
    beam: BeamOpt = None,
    lenpen: LenpenOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = Precision.AUTO,
    engine: EngineOpt = Engine.TORCH,
    shortlist: ShortlistOpt = None,
    recase: RecaseOpt = None,
    terms_replace: TermsReplaceOpt = None,
) -> None:
    """Serve models over HTTP: LibreTranslate's /translate, /detect and /languages, OpenNMT-py's route,
    a page to try them at /, and Prometheus metrics at /metrics.

    Every pair of every model is answered: a model of several targets (>>fra<<) each of them, a
    request's "target" choosing; /languages lists each source with its targets.

    Concurrent requests are batched together, large ones in turns with small ones; SIGTERM answers the
    requests in flight, then exits. Needs the serve extra: pip install 'nmt\\[serve]'.

    [bold]Examples[/]
    nmt serve -m runs/multi30k-en-de/checkpoints/average.pt
    nmt serve --engine ctranslate2 -m ct2-en-de --dtype int8
    nmt serve -m en-de.pt -m de-en.pt
    nmt serve -m runs/multi30k-en-de-fr-cs/checkpoints/average.pt
    curl -s localhost:5000/translate -H 'Content-Type: application/json' \\
      -d '{"q": "A dog runs.", "source": "en", "target": "de"}'
    curl -s localhost:5000/translate -H 'Content-Type: application/json' \\
      -d '{"q": "A dog runs.", "glossary": [{"source": "dog", "target": "Hund"}]}'
    """
    import torch

    from nmt.config import DecodeOverrides
    from nmt.serve import serve as run_serve
    from nmt.translate.threads import serving_threads

    torch.set_num_threads(serving_threads())  # a core left to the server's own threads
    settings = ServeSettings(
        host=host, port=port, batch_wait_ms=batch_wait_ms, max_chars=max_chars, max_queue=max_queue,
        timeout=timeout, read_timeout=read_timeout, keep_alive=keep_alive, max_connections=max_connections,
        shutdown_timeout=shutdown_timeout, cors_origins=cors_origins,
    )  # fmt: skip
    # The batch budget is a decode setting, under nmt translate's name for it
    overrides = DecodeOverrides.given(
        {"batch_tokens": "--max-tokens"},
        beam=beam,
        lenpen=lenpen,
        batch_tokens=max_batch_tokens if old_max_batch_tokens is None else old_max_batch_tokens,
        shortlist=shortlist,
        recase=recase,
        terms_replace=terms_replace,
    )
    run_serve(model, settings, overrides, device, dtype, err, engine, glossary=glossary)


@app.command(name="shortlist", cls=Command)
def build_shortlist(
    model: Annotated[Path, typer.Option("--model", "-m", help="Checkpoint the shortlist is for.")],
    output: Annotated[
        Path, typer.Option("--output", "-o", help="Checkpoint to write: the model with its shortlist.")
    ],
    data: Annotated[
        Path | None,
        typer.Option(help="Work directory of nmt preprocess, or its data/ folder: binarized training pairs."),
    ] = None,
    src: Annotated[Path | None, typer.Option(help="Training source text, one sentence a line.")] = None,
    tgt: Annotated[Path | None, typer.Option(help="Training target text, line by line with --src.")] = None,
    frequent: Annotated[
        int, typer.Option(help="The most frequent target subwords, always allowed.")
    ] = ShortlistSizes.frequent,
    per_source: Annotated[
        int, typer.Option(help="The likeliest target subwords of each source subword (IBM Model 1).")
    ] = ShortlistSizes.per_source,
    iterations: Annotated[
        int, typer.Option(help="EM iterations of IBM Model 1.")
    ] = ShortlistSizes.iterations,
) -> None:
    """Build a lexical shortlist from the training data (IBM Model 1 over subwords) into a checkpoint.

    [bold]Examples[/]
    nmt shortlist -m runs/multi30k-en-de/checkpoints/average.pt --data runs/multi30k-en-de -o model.pt
    nmt shortlist -m student.pt --src train.en --tgt train.de --frequent 100 --per-source 50 -o student.pt
    nmt translate -m model.pt -i in.en --shortlist
    """
    from nmt.shortlist import shortlist as run_shortlist

    built = run_shortlist(model, output, data, src, tgt, frequent, per_source, iterations)
    err.print(
        f"wrote {output}: a shortlist of {len(built.frequent)} frequent subwords and up to "
        f"{built.table.shape[1]} per source subword"
    )


@app.command(cls=Command)
def score(
    refs: Annotated[list[Path], typer.Option("--ref", "-r", help="Reference file; repeat for several.")],
    hyps: Annotated[
        list[Path] | None,
        typer.Option("--input", "-i", help="Hypothesis file (default stdin); several: paired bootstrap."),
    ] = None,
    metrics: Annotated[
        str, typer.Option(metavar="<names>", help="Comma-separated: bleu, chrf, ter.")
    ] = "bleu",
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")] = False,
    width: Annotated[
        int, typer.Option("--width", help="Decimals shown, as sacrebleu -w (-w is --workdir in nmt).")
    ] = 1,
) -> None:
    """Score translations with sacreBLEU (BLEU by default; chrF and TER on request).

    [bold]Examples[/]
    nmt score -r ref.de -i out.de
    cat out.de | nmt score -r ref.de
    nmt score -r ref.de -i out.de --metrics bleu,chrf,ter --json
    nmt score -r ref.de -i baseline.de -i new.de   # paired bootstrap, first is the baseline
    """
    from nmt.score import score_files

    score_files(refs, hyps or [], metrics=metrics, json_out=json_out, console=err, width=width)


@app.command(cls=Command)
def plot(
    workdir: Annotated[
        Path,
        typer.Argument(metavar="WORKDIR", help="Work directory of a training run (holds metrics.jsonl)."),
    ],
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="PNG to write. Default: WORKDIR/curves.png.")
    ] = None,
) -> None:
    """Draw the learning curves of a run (loss, perplexity, BLEU, learning rate, speed) into a PNG.

    Needs matplotlib: pip install 'nmt\\[plot]'.

    [bold]Examples[/]
    nmt plot runs/multi30k-en-de
    nmt plot runs/multi30k-en-de -o curves.png
    """
    from nmt.plot import plot as run_plot

    path = run_plot(workdir, output)
    err.print(f"wrote {path}")


@app.command(cls=Command)
def run(
    recipe: RecipeArg,
    workdir: WorkdirOpt = None,
    mirror: MirrorOpt = None,
    overrides: SetOpt = None,
    init_from: InitFromOpt = None,
) -> None:
    """Everything: preprocess, train, average, translate the test sets, score, write results.md.

    A step already done is skipped, so running it again after a crash continues where it stopped. A
    back-translation recipe (data.backtranslate) first trains its reverse model and back-translates.

    [bold]Examples[/]
    nmt run multi30k-en-de --mirror ~/multi30k   # the Multi30k files, from a folder
    nmt run wmt14-en-de-base
    nmt run my-domain.yaml --init-from opus-mt-en-de.pt   # fine-tune, then evaluate
    nmt run multi30k-en-de-bt --set data.backtranslate.baseline=true   # and the bitext-only ablation
    """
    from nmt.checkpoint import checkpoint_config
    from nmt.config import load_config
    from nmt.pipeline import run_pipeline

    cfg = load_config(recipe, _overrides(overrides, init_from), checkpoint_config)
    run_pipeline(cfg, _workdir(recipe, workdir, *_run_inputs(cfg)), mirror=mirror, console=err)


def _run_inputs(cfg) -> list[Path]:
    """The files `nmt run` reads that a user may have put in a work directory: a checkpoint to start from,
    a back-translation recipe's reverse model and its monolingual text where given as local files."""
    from nmt.data.fetch import is_url

    inputs = [cfg.data.init_from]
    bt = cfg.data.backtranslate
    if bt is not None:
        inputs += [bt.reverse, *(Path(f.url) for f in bt.mono if not is_url(f.url))]
    return [Path(p) for p in inputs if p is not None]


@app.command(cls=Command)
def distill(
    recipe: RecipeArg,
    teacher: Annotated[
        Path, typer.Option("--teacher", "-t", help="The teacher's checkpoint (its subwords are kept).")
    ],
    workdir: WorkdirOpt = None,
    mirror: MirrorOpt = None,
    overrides: SetOpt = None,
    select: Annotated[
        str | None,
        typer.Option(
            metavar="<chrf|top1>",
            help="Which of the teacher's n-best to keep: chrf, the closest to the reference (default); "
            "top1, the teacher's best (the default with --mono).",
        ),
    ] = DistillOptions.select,
    mono: Annotated[
        Path | None,
        typer.Option(help="Monolingual source text for the teacher to translate instead of the recipe's."),
    ] = None,
    teacher_engine: Annotated[
        Engine, typer.Option(case_sensitive=False, help="What runs the teacher: torch, or ctranslate2.")
    ] = DistillOptions.teacher_engine,
    teacher_precision: Annotated[
        Precision,
        typer.Option(case_sensitive=False, help="The teacher's precision: fp32, or int8 (faster)."),
    ] = DistillOptions.teacher_precision,
    nbest: Annotated[
        int, typer.Option(help="Hypotheses per line from the teacher's beam.")
    ] = DistillOptions.nbest,
    chunk_lines: Annotated[
        int, typer.Option(help="Lines the teacher translates per saved chunk.")
    ] = DistillOptions.chunk_lines,
    max_ratio: Annotated[
        float, typer.Option(help="Drop pairs whose word counts differ by more than this factor.")
    ] = FilterSettings.max_ratio,
    drop_worst: Annotated[
        float, typer.Option(metavar="<percent>", help="Drop this share of the pairs with the lowest scores.")
    ] = FilterSettings.worst_percent,
    init: Annotated[
        str,
        typer.Option(
            metavar="<scratch|teacher>",
            help="scratch, or teacher: the student starts from the teacher's embeddings and layers "
            "(the same width; its stacks take the teacher's layers spread evenly).",
        ),
    ] = DistillOptions.init,
) -> None:
    """Distil a teacher into the recipe's (small) student: the teacher translates the training source,
    the best of its n-best is kept and filtered, the student trains on it with the teacher's subwords,
    and results.md compares the two.

    A step already done is skipped, so running it again after a crash continues where it stopped.
    The student's checkpoints are in WORKDIR/checkpoints/, as `nmt train` writes them.

    [bold]Examples[/]
    nmt distill multi30k-en-de-student --teacher runs/multi30k-en-de/checkpoints/average.pt
    nmt distill wmt14-en-de-student-big --teacher big.pt --teacher-precision int8
    nmt distill my-student.yaml --teacher t.pt --mono news.en --select top1
    nmt distill multi30k-en-de-student --teacher average.pt --init teacher   # shrink and fine-tune
    """
    from nmt.config import load_config
    from nmt.distill import distill as run_distill

    cfg = load_config(recipe, _overrides(overrides, None))
    opts = DistillOptions(
        teacher=teacher,
        select=select,
        mono=mono,
        teacher_engine=teacher_engine,
        teacher_precision=teacher_precision,
        nbest=nbest,
        chunk_lines=chunk_lines,
        filters=FilterSettings(max_ratio=max_ratio, worst_percent=drop_worst),
        init=init,
    )
    run_distill(cfg, opts, _workdir(recipe, workdir, teacher, mono), mirror=mirror, console=err)


@app.command(cls=Command)
def backtranslate(
    reverse: Annotated[
        Path,
        typer.Option(
            "--reverse", "-r", help="The target->source checkpoint that writes the synthetic sources."
        ),
    ],
    output: Annotated[
        Path,
        typer.Option(
            "--output",
            "-o",
            metavar="PREFIX",
            help="Writes PREFIX.<src> and PREFIX.<tgt>; works in PREFIX.work/.",
        ),
    ],
    mono: Annotated[
        list[Path] | None,
        typer.Option(
            "--mono",
            help="Monolingual target-language text (.gz read as gzip); repeat for several. Default: the "
            "recipe's data.backtranslate.mono, fetched as its corpora are.",
        ),
    ] = None,
    recipe: Annotated[
        str | None,
        typer.Argument(
            metavar="[RECIPE]",
            help="The forward recipe: the reverse model must translate its target into its source, with the "
            "SentencePiece model of its work directory (data/spm.model) where that is there.",
        ),
    ] = None,
    workdir: WorkdirOpt = None,
    mirror: MirrorOpt = None,
    method: Annotated[
        str,
        typer.Option(
            metavar="<sampling|topk|beam|greedy>",
            help="sampling: unrestricted (Edunov et al. 2018); topk: from the 10 likeliest tokens; beam: the "
            "model's beam; greedy: a beam of one (with little parallel data, as good as beam and faster).",
        ),
    ] = "sampling",
    seed: Annotated[int, typer.Option(help="Seed of the samples: the same seed gives the same corpus.")] = 1,
    engine: Annotated[
        Engine, typer.Option(case_sensitive=False, help="What runs the reverse model: torch, or ctranslate2.")
    ] = Engine.TORCH,
    dtype: Annotated[
        Precision,
        typer.Option(case_sensitive=False, help="The reverse model's precision: fp32, or int8 (faster)."),
    ] = Precision.FP32,
    device: DeviceOpt = "auto",
    max_lines: Annotated[
        int | None, typer.Option(help="Back-translate at most this many monolingual lines (after repeats).")
    ] = None,
    chunk_lines: Annotated[int, typer.Option(help="Lines translated per saved chunk.")] = 2000,
    max_ratio: Annotated[
        float, typer.Option(help="Drop pairs whose word counts differ by more than this factor.")
    ] = FilterSettings.max_ratio,
) -> None:
    """Back-translate monolingual target-language text into a parallel corpus for the forward model:
    synthetic sources from a reverse model, real targets; repeats, empty, badly sized and looping pairs
    dropped.

    Translated in chunks: running it again after a crash continues where it stopped.

    [bold]Examples[/]
    nmt backtranslate --reverse de-en.pt --mono news.de -o bt/news   # writes bt/news.en, bt/news.de
    nmt backtranslate multi30k-en-de --reverse de-en.pt --mono train.1.de.gz --mono train.2.de.gz -o bt/m
    nmt backtranslate --reverse de-en.pt --mono news.de -o bt/news --method beam --engine ctranslate2
    nmt backtranslate multi30k-en-de-bt --reverse de-en.pt -o bt/m   # the recipe's monolingual text
    """
    from nmt.backtranslate import BacktranslateOptions
    from nmt.backtranslate import backtranslate as run_backtranslate

    direction, vocab, inputs = None, None, []
    if recipe is not None:
        from nmt.config import load_config, resolve_recipe

        cfg = load_config(recipe)
        direction = cfg.data.src_lang, cfg.data.tgt_lang
        inputs.append(resolve_recipe(recipe))
        data = (workdir if workdir is not None else Path("runs") / resolve_recipe(recipe).stem) / "data"
        if cfg.data.backtranslate is not None:  # `nmt run` keeps the vocabulary every model shares here
            data = data.parent / "bitext" / "data"
            if not mono:
                from nmt.data.corpora import files_text

                mono = files_text(list(cfg.data.backtranslate.mono), mirror=mirror, console=err)
        vocab = data / "spm.model" if (data / "spm.model").is_file() else None
    opts = BacktranslateOptions(
        reverse=reverse,
        mono=tuple(mono or ()),
        output=output,
        method=method,
        engine=engine,
        precision=dtype,
        device=device,
        seed=seed,
        chunk_lines=chunk_lines,
        max_lines=max_lines,
        filters=FilterSettings(max_ratio=max_ratio, worst_percent=0.0),
        vocab=vocab,
        direction=direction,
        inputs=tuple(inputs),
    )
    run_backtranslate(opts, console=err)


def main() -> None:
    app()
