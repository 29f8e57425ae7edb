"""The language pairs a server answers, and which model answers each.

`nmt serve -m en-de.pt -m de-en.pt -m multi.pt` holds each model once, with its own worker
(nmt.serve.batcher: one thread per model, so a long request to one pair never waits on another model's
batches), and answers every pair of every model: a bilingual model its one pair, a model of several
targets (a target tag on the source side, nmt.languages) each of its sources into each of its targets.
A pair names one model; two models that claim the same pair are refused at start, since a request
could not say which it means (`fr` and `fra` are one language there). Requests name languages by the
codes /languages lists, the models' own (nmt.translate.BuiltTranslator.sources and .targets), as
LibreTranslate's clients do: a server of one pair answers exactly as it always has.
"""

from __future__ import annotations

from dataclasses import dataclass

from nmt.errors import NmtError
from nmt.languages import same, target_tag
from nmt.serve.batcher import Batcher
from nmt.serve.settings import HTTPError
from nmt.translate.frontend import rows_per_sentence

LANGUAGE_NAMES = {
    "en": "English", "de": "German", "fr": "French", "es": "Spanish", "it": "Italian", "cs": "Czech",
    "nl": "Dutch", "pt": "Portuguese", "pl": "Polish", "ru": "Russian", "uk": "Ukrainian", "sv": "Swedish",
    "da": "Danish", "fi": "Finnish", "ro": "Romanian", "tr": "Turkish", "ar": "Arabic", "zh": "Chinese",
    "ja": "Japanese", "ko": "Korean",
}  # fmt: skip


def language_name(code: str) -> str:
    return LANGUAGE_NAMES.get(code, code)


@dataclass(eq=False)
class Model:
    """One model the server holds: its worker (which owns the translator), and what a request's
    preparation needs of it apart from the worker."""

    name: str  # the file or folder name: no server path shown
    batcher: Batcher
    sources: tuple[str, ...]
    targets: tuple[str, ...]
    aligner: object | None = None  # nmt.translate.align.Aligner, None where the engine has no attention
    terminology: object | None = None  # nmt.translate.terminology.Terminology, None where it takes none

    @property
    def translator(self):
        return self.batcher.translator

    @property
    def tagged(self) -> bool:
        """Whether the model reads its target from a tag (several targets), rather than having one."""
        return bool(self.translator.subword.targets)

    @property
    def max_alternatives(self) -> int:
        """The beam's other hypotheses; none when sampling (a request's nbest is then its draws)."""
        return rows_per_sentence(self.batcher.decode, 1) - 1


@dataclass(frozen=True, eq=False)
class Pair:
    """A source and a target language, and the model that translates the one into the other."""

    source: str
    target: str
    model: Model

    @property
    def tag(self) -> str | None:
        """The target tag the model's encoder is given (None for a model of one target)."""
        return target_tag(self.target) if self.model.tagged else None

    def __str__(self) -> str:
        return f"{self.source} to {self.target}"


class Pairs:
    """Every pair the server answers, in the order the models were given, and their models."""

    def __init__(self, models: list[Model]):
        self.models = models
        self.all: list[Pair] = []
        for model in models:
            for s in model.sources:
                for t in model.targets:
                    if same(s, t):
                        continue
                    other = next((p for p in self.all if same(p.source, s) and same(p.target, t)), None)
                    if other is not None:
                        raise NmtError(
                            f"-m {model.name}: {s} to {t} is served by {other.model.name} already; "
                            "give each pair one model"
                        )
                    self.all.append(Pair(s, t, model))
        if not self.all:
            raise NmtError(f"-m {models[0].name}: the model translates no pair of different languages")

    def __len__(self) -> int:
        return len(self.all)

    @property
    def default(self) -> Pair:
        """The pair a request that names none is for (OpenNMT-py's format names none): the first."""
        return self.all[0]

    def find(self, source: str, target: str) -> Pair | None:
        return next((p for p in self.all if (p.source, p.target) == (source, target)), None)

    @property
    def sources(self) -> list[str]:
        return list(dict.fromkeys(p.source for p in self.all))

    @property
    def targets(self) -> list[str]:
        return list(dict.fromkeys(p.target for p in self.all))

    def sources_into(self, target: str) -> list[str]:
        """The sources the server translates into `target`: what source "auto" chooses among."""
        return [p.source for p in self.all if p.target == target]

    def named(self) -> str:
        return ", ".join(map(str, self.all))

    def unserved(self, source: str, target: str) -> HTTPError:
        """The client's error for a pair no model answers, naming those that are."""
        if len(self.all) == 1:  # the message (and status) of a server of one pair, as it always was
            return HTTPError(
                422, f"this server translates {self.default}, not {source} to {target} (see /languages)"
            )
        asked = f"into {target}" if source == "auto" else f"{source} to {target}"
        return HTTPError(400, f"this server translates {self.named()}; not {asked} (see /languages)")

    def languages(self) -> list[dict]:
        """LibreTranslate's /languages: every language, each with the targets it is translated into."""
        into: dict[str, list[str]] = {}
        for p in self.all:
            into.setdefault(p.source, []).append(p.target)
        for t in self.targets:
            into.setdefault(t, [])
        return [{"code": c, "name": language_name(c), "targets": ts} for c, ts in into.items()]
