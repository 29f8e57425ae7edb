"""Corpus-level metrics through sacreBLEU: used by `nmt score` and by validation during training.

Nothing here computes a metric: sacreBLEU does, with its own defaults (13a tokenizer, exp smoothing,
chrF2, TERCOM-like TER), so every number and signature equals the `sacrebleu` command's on the same files.
Files are read the way that command reads them (UTF-8, lines split on "\\n" only, trailing whitespace
stripped), which is what keeps line counts and scores identical.
"""

from __future__ import annotations

import difflib
import gzip
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table
from sacrebleu.metrics import METRICS
from sacrebleu.metrics.base import Metric
from sacrebleu.significance import PairedTest

from nmt.errors import DataError, NmtError
from nmt.languages import short
from nmt.limits import check
from nmt.output import stdout

METRIC_NAMES = tuple(name.lower() for name in METRICS)  # ("bleu", "chrf", "ter")
STDIN = "<stdin>"


@dataclass(frozen=True)
class MetricScore:
    """One system's corpus score under one metric."""

    name: str  # sacreBLEU's name for the score: BLEU, chrF2, TER
    score: float
    signature: str  # how to reproduce it, e.g. nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0
    text: str  # sacreBLEU's one-line report, e.g. "BLEU = 37.5 68.5/44.4/30.2/20.9 (BP = 1.000 ...)"


@dataclass(frozen=True)
class SystemScore:
    """One system's line in a paired bootstrap comparison."""

    system: str
    score: float
    mean: float  # mean over the bootstrap resamples
    ci: float  # half-width of the 95% confidence interval around `mean`
    p_value: float | None  # against the baseline; None for the baseline itself


@dataclass(frozen=True)
class Comparison:
    """Paired bootstrap resampling of several systems under one metric; systems[0] is the baseline."""

    name: str
    signature: str
    systems: list[SystemScore]


def parse_metrics(metrics: str | Sequence[str]) -> tuple[str, ...]:
    """Turn "bleu,chrf" (or a list of names) into known lower-case metric names, in order, without repeats."""
    names = metrics.split(",") if isinstance(metrics, str) else list(metrics)
    out: list[str] = []
    for raw in names:
        name = raw.strip().lower()
        if not name:
            continue
        if name not in METRIC_NAMES:
            close = difflib.get_close_matches(name, METRIC_NAMES, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise NmtError(f"unknown metric {raw.strip()!r} (known: {', '.join(METRIC_NAMES)}){hint}")
        if name not in out:
            out.append(name)
    if not out:
        raise NmtError(f"no metric given (known: {', '.join(METRIC_NAMES)})")
    return tuple(out)


def _metric(name: str, refs: Sequence[Sequence[str]]) -> Metric:
    # Built with the references, as the sacrebleu command does, so their statistics are cached once.
    return METRICS[name.upper()](references=refs)


def _ref_streams(refs: Sequence[str] | Sequence[Sequence[str]]) -> list[list[str]]:
    """Accept one reference stream (a list of lines) or several (a list of such lists)."""
    if refs and isinstance(refs[0], str):
        return [list(refs)]  # type: ignore[arg-type]
    return [list(stream) for stream in refs]


def _check_lengths(hyps: Sequence[str], refs: Sequence[Sequence[str]]) -> None:
    if not refs:
        raise NmtError("no reference given")
    if not hyps:
        raise DataError("nothing to score: no hypotheses")  # sacreBLEU would fail with an IndexError
    for i, stream in enumerate(refs, 1):
        if len(stream) != len(hyps):
            raise DataError(f"{len(hyps)} hypotheses but reference stream {i} has {len(stream)} lines")


def corpus_scores(
    hyps: Sequence[str],
    refs: Sequence[str] | Sequence[Sequence[str]],
    metrics: str | Sequence[str] = ("bleu",),
    *,
    width: int = 1,
) -> dict[str, MetricScore]:
    """Score one system; refs is one reference stream or a list of streams, each as long as hyps.

    Returns one MetricScore per requested metric, keyed by its lower-case name ("bleu", "chrf", "ter");
    `width` is only the number of decimals in the `text` report.
    """
    streams = _ref_streams(refs)
    _check_lengths(hyps, streams)
    out = {}
    for name in parse_metrics(metrics):
        metric = _metric(name, streams)
        result = metric.corpus_score(list(hyps), None)
        out[name] = MetricScore(
            name=result.name,
            score=float(result.score),
            signature=metric.get_signature().format(),
            text=result.format(width),
        )
    return out


def bleu(hyps: Sequence[str], refs: Sequence[str] | Sequence[Sequence[str]]) -> float:
    """Corpus BLEU of detokenized hypotheses (what validation reports); refs as in corpus_scores."""
    if not hyps:
        return 0.0  # sacreBLEU fails on an empty corpus; an empty validation set scores nothing
    return corpus_scores(hyps, refs, ("bleu",))["bleu"].score


def paired_bootstrap(
    systems: Sequence[tuple[str, Sequence[str]]],
    refs: Sequence[str] | Sequence[Sequence[str]],
    metrics: str | Sequence[str] = ("bleu",),
    n_samples: int = 1000,
) -> dict[str, Comparison]:
    """Compare (name, hypotheses) systems by sacreBLEU's paired bootstrap; the first is the baseline.

    The resampling seed is sacreBLEU's (SACREBLEU_SEED, default 12345), so results equal
    `sacrebleu REF -i BASE NEW --paired-bs` and are the same on every run, but for one case: a system
    whose translations are the baseline's, line for line, has p = 1. sacreBLEU counts the resamples
    whose centred difference is strictly greater than the observed one, and when every difference is
    0 none is, so it reports the smallest p it can, 1 / (n_samples + 1) = 0.0010, "significant" (its
    command hides this by dropping a file given twice, but not a copy of it). Identical output cannot
    differ: every resample ties, and the p-value of a tie in every resample is 1.
    """
    if len(systems) < 2:
        raise NmtError("paired bootstrap needs at least two systems")
    streams = _ref_streams(refs)
    for _, hyps in systems:
        _check_lengths(hyps, streams)
    names = parse_metrics(metrics)
    test = PairedTest(
        [(name, list(hyps)) for name, hyps in systems],
        {name: _metric(name, streams) for name in names},
        references=None,
        test_type="bs",
        n_samples=n_samples,
    )
    signatures, table = test()
    # The table's metric columns come in the order the metrics were given, after the "System" column.
    columns = [key for key in table if key != "System"]
    baseline = list(systems[0][1])
    identical = [i > 0 and list(hyps) == baseline for i, (_, hyps) in enumerate(systems)]
    out = {}
    for name, column in zip(names, columns, strict=True):
        # float(): sacreBLEU hands back numpy scalars (float32 for chrF), which json cannot write.
        rows = [
            SystemScore(
                system=sys_name,
                score=float(r.score),
                mean=float(r.mean),
                ci=float(r.ci),
                p_value=None if r.p_value is None else 1.0 if same else float(r.p_value),
            )
            for sys_name, r, same in zip(table["System"], table[column], identical, strict=True)
        ]
        out[name] = Comparison(name=column, signature=signatures[column].format(), systems=rows)
    return out


def _split_lines(text: str) -> list[str]:
    # Split on "\n" only, as sacrebleu does (open(newline="\n")): a stray "\r" must not add a line.
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return [line.rstrip() for line in lines]


def read_lines(path: Path | str) -> list[str]:
    """Read a text file (gzipped if it ends in .gz, "-" for stdin) as sacrebleu reads it."""
    if str(path) in ("-", STDIN):
        return _split_lines(sys.stdin.buffer.read().decode("utf-8", errors="replace"))
    path = Path(path)
    try:
        data = path.read_bytes()
        if path.suffix == ".gz":
            data = gzip.decompress(data)
    except FileNotFoundError:
        raise DataError(f"no such file: {path}") from None
    except (OSError, EOFError) as e:
        raise DataError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    return _split_lines(data.decode("utf-8", errors="replace"))


def score_files(
    refs: Sequence[Path],
    hyps: Sequence[Path],
    metrics: str | Sequence[str] = "bleu",
    json_out: bool = False,
    console: Console | None = None,
    width: int = 1,
) -> dict:
    """`nmt score`: score hypothesis files (stdin when none) against reference files and print the result.

    One hypothesis: one line per metric on stdout (sacreBLEU's report) and its signature.
    Several: a paired bootstrap table on stdout, the first file being the baseline.
    With json_out, stdout gets exactly one JSON object instead, which is also returned.
    """
    console = console or Console(stderr=True)
    stdout()  # a closed standard output is one line before the work, not a score printed to nowhere
    check("--width", width)
    names = parse_metrics(metrics)
    if not refs:
        raise NmtError("no reference file given (-r REF)")
    ref_streams = [read_lines(r) for r in refs]
    hyp_names = [str(h) for h in hyps] or [STDIN]
    systems = [(name, read_lines(name)) for name in hyp_names]
    for hyp_name, lines in systems:
        if not lines:
            raise DataError(f"hypothesis file {hyp_name} is empty")
        for ref, stream in zip(refs, ref_streams, strict=True):
            if len(stream) != len(lines):
                raise DataError(
                    f"line counts differ: hypothesis file {hyp_name} has {len(lines)} lines, "
                    f"reference file {ref} has {len(stream)}"
                )

    if len(systems) == 1:
        scores = corpus_scores(systems[0][1], ref_streams, names, width=width)
        result = {name: asdict(s) for name, s in scores.items()}
        if json_out:
            print(json.dumps(result, ensure_ascii=False))
        else:
            for s in scores.values():
                print(s.text)
                console.print(f"  [dim]{s.name} signature: {s.signature}[/]", highlight=False, soft_wrap=True)
        return result

    console.print(f"paired bootstrap resampling of {len(systems)} systems; baseline: {systems[0][0]}")
    comparisons = paired_bootstrap(systems, ref_streams, names)
    result = {name: asdict(c) for name, c in comparisons.items()}
    if json_out:
        print(json.dumps(result, ensure_ascii=False))
    else:
        # Piped, Rich would wrap the table at 80 columns; a file gets it whole instead.
        out = Console(highlight=False, width=None if sys.stdout.isatty() else 1000)
        out.print(_comparison_table(comparisons, width))
        for c in comparisons.values():
            console.print(f"  [dim]{c.name} signature: {c.signature}[/]", highlight=False, soft_wrap=True)
        console.print("  [dim]* p < 0.05: differs significantly from the baseline[/]")
    return result


def _comparison_table(comparisons: dict[str, Comparison], width: int) -> Table:
    table = Table(box=box.SIMPLE_HEAD, show_edge=False)
    table.add_column("system", no_wrap=True)
    for c in comparisons.values():
        table.add_column(c.name, justify="right", no_wrap=True)
        table.add_column("(μ ± 95% CI)", justify="right", no_wrap=True)
        table.add_column("p", justify="right", no_wrap=True)
    first = next(iter(comparisons.values()))
    for i, row in enumerate(first.systems):
        cells = [("baseline: " if i == 0 else "") + row.system]
        for c in comparisons.values():
            s = c.systems[i]
            cells.append(f"{s.score:.{width}f}")
            cells.append(f"({s.mean:.{width}f} ± {s.ci:.{width}f})")
            p = s.p_value
            cells.append("" if p is None else f"{p:.4f}" + ("*" if p < 0.05 else ""))
        table.add_row(*cells)
    return table


def language_share(lines: list[str], lang: str, among: Sequence[str] = ()) -> float | None:
    """The share of non-blank `lines` that py3langid puts in `lang` (any ISO 639 code): 1 minus the
    off-target rate of a multilingual model's outputs. `among`: the languages it may choose from (a
    model's sources and targets, where it can go off target), else all 97 of its model, where short
    Czech captions are often called Slovak or Croatian. Short lines are misjudged too, so compare it with
    the references' own share. None where py3langid (the serve extra) is not installed."""
    try:
        import py3langid.langid as langid
    except ImportError:
        return None
    identifier = langid.LanguageIdentifier.from_model_file(langid.MODEL_FILE)
    if among:
        identifier.set_languages(sorted({short(code) for code in [*among, lang]}))
    want = short(lang)
    texts = [line for line in lines if line.strip()]
    if not texts:
        return None
    return sum(identifier.classify(line)[0] == want for line in texts) / len(texts)
