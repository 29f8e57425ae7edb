"""Language codes and the target-language tags of multilingual models.

A model with more than one target language reads its target from a tag on the source side, OPUS-MT's
way: `>>fra<<`, with the ISO 639-3 code the Tatoeba OPUS-MT models use. Recipes, `--target` and the
server name languages as people do, by ISO 639-1 codes where there is one (`fr`); this module is the one
place that maps one to the other. The tags themselves are reserved subwords (nmt.subword: SentencePiece
control symbols), inserted by id and never read out of a user's text but at a line's very start.
"""

from __future__ import annotations

import re

# ISO 639-1 -> ISO 639-3 (the individual or macrolanguage code OPUS-MT's tags use: `zho`, `ara`, `msa`).
ISO3 = {
    "af": "afr", "am": "amh", "ar": "ara", "as": "asm", "az": "aze", "be": "bel", "bg": "bul", "bn": "ben",
    "br": "bre", "bs": "bos", "ca": "cat", "cs": "ces", "cy": "cym", "da": "dan", "de": "deu", "el": "ell",
    "en": "eng", "eo": "epo", "es": "spa", "et": "est", "eu": "eus", "fa": "fas", "fi": "fin", "fo": "fao",
    "fr": "fra", "fy": "fry", "ga": "gle", "gd": "gla", "gl": "glg", "gu": "guj", "ha": "hau", "he": "heb",
    "hi": "hin", "hr": "hrv", "ht": "hat", "hu": "hun", "hy": "hye", "id": "ind", "ig": "ibo", "is": "isl",
    "it": "ita", "ja": "jpn", "jv": "jav", "ka": "kat", "kk": "kaz", "km": "khm", "kn": "kan", "ko": "kor",
    "ku": "kur", "ky": "kir", "la": "lat", "lb": "ltz", "lo": "lao", "lt": "lit", "lv": "lav", "mg": "mlg",
    "mi": "mri", "mk": "mkd", "ml": "mal", "mn": "mon", "mr": "mar", "ms": "msa", "mt": "mlt", "my": "mya",
    "nb": "nob", "ne": "nep", "nl": "nld", "nn": "nno", "no": "nor", "oc": "oci", "or": "ori", "pa": "pan",
    "pl": "pol", "ps": "pus", "pt": "por", "qu": "que", "ro": "ron", "ru": "rus", "rw": "kin", "sd": "snd",
    "si": "sin", "sk": "slk", "sl": "slv", "sm": "smo", "sn": "sna", "so": "som", "sq": "sqi", "sr": "srp",
    "st": "sot", "su": "sun", "sv": "swe", "sw": "swa", "ta": "tam", "te": "tel", "tg": "tgk", "th": "tha",
    "tk": "tuk", "tl": "tgl", "tr": "tur", "tt": "tat", "ug": "uig", "uk": "ukr", "ur": "urd", "uz": "uzb",
    "vi": "vie", "wa": "wln", "xh": "xho", "yi": "yid", "yo": "yor", "zh": "zho", "zu": "zul",
}  # fmt: skip
ISO1 = {v: k for k, v in ISO3.items()}
# ISO 639-2/B codes people still type (and old OPUS-MT names), for the same languages.
BIBLIOGRAPHIC = {"ger": "deu", "fre": "fra", "cze": "ces", "dut": "nld", "gre": "ell", "chi": "zho",
                 "per": "fas", "rum": "ron", "slo": "slk", "alb": "sqi", "arm": "hye", "baq": "eus",
                 "bur": "mya", "geo": "kat", "ice": "isl", "mac": "mkd", "mao": "mri", "may": "msa",
                 "tib": "bod", "wel": "cym"}  # fmt: skip

# A target tag: `>>` + a language code (with an optional script or region, `>>zho_Hant<<`) + `<<`.
TAG = re.compile(r">>([a-z]{2,3}(?:_[A-Za-z]{2,8})?)<<")
# The reserved tag of back-translated sources (Caswell et al., 2019): reserved like the target tags.
BT_TAG = "<BT>"
# The reserved pair around a glossary's target term written into the source after its word (inline
# terms, Dinu et al. 2019: nmt.data.terms).
TERM_OPEN, TERM_CLOSE = "<term>", "</term>"
RESERVED = frozenset({BT_TAG, TERM_OPEN, TERM_CLOSE})  # the reserved tags other than target tags


def iso3(code: str) -> str:
    """The ISO 639-3 code of a language named by its ISO 639-1, 639-2/B or 639-3 code, any case
    (`fr`, `fre`, `FRA` -> `fra`); a code this table does not know is kept as written, lower case."""
    code = code.strip().lower()
    base, sep, rest = code.partition("_")
    base = ISO3.get(base) or BIBLIOGRAPHIC.get(base) or base
    return base + (sep + rest if sep else "")


def short(code: str) -> str:
    """The code people use for a language: ISO 639-1 where it has one (`fra` -> `fr`), else as given."""
    return ISO1.get(code, code)


def same(a: str, b: str) -> bool:
    """Whether two codes name the same language (`fr` and `fra`)."""
    return iso3(a) == iso3(b)


def target_tag(lang: str) -> str:
    """The source-side tag that selects `lang` as a multilingual model's target: `fr` -> `>>fra<<`."""
    return f">>{iso3(lang)}<<"


def tag_language(tag: str) -> str | None:
    """The language a target tag selects (`>>fra<<` -> `fra`), None for anything else."""
    m = TAG.fullmatch(tag)
    return m.group(1) if m else None


def leading_tag(line: str) -> tuple[str | None, str]:
    """(the target tag a line starts with, the rest of the line), as OPUS-MT clients send `>>fra<< text`;
    (None, line) where it starts with none. Only the very start counts: a tag typed mid-line is text."""
    stripped = line.lstrip()
    m = TAG.match(stripped)
    if m is None:
        return None, line
    return m.group(0), stripped[m.end() :].lstrip()
