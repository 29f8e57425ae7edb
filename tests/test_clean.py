"""The cleaning of training pairs beyond length (nmt.data.clean): duplicates, copies, on any text."""

from __future__ import annotations

import string

import pytest

from nmt.config import config_from_dict
from nmt.data.clean import Seen, clean_pairs

hypothesis = pytest.importorskip(
    "hypothesis", reason="hypothesis generates the inputs: pip install -e '.[dev]'"
)
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

ASCII_TEXT = st.text(alphabet=string.ascii_letters + string.digits + string.punctuation + " ", max_size=40)


def data(**keys):
    spec = {"url": "https://upstream.invalid/x", "sha256": "0" * 64}
    corpus = {"name": "c", "src": spec, "tgt": spec}
    return config_from_dict(
        {"data": {"src_lang": "en", "tgt_lang": "de", "train": [corpus], "valid": [corpus], **keys}}
    ).data


@given(src=ASCII_TEXT, tgt=ASCII_TEXT, punct=st.sampled_from(list(".,;!? \"'-")))
def test_a_pair_differing_in_case_punctuation_or_spaces_is_a_near_duplicate(src, tgt, punct):
    seen = Seen()
    reason, keys = seen.check(src, tgt)
    assert reason is None
    seen.add(keys)
    assert seen.check(src, tgt)[0] == "duplicate"
    assert seen.check(src.swapcase() + punct, punct + tgt.upper())[0] in ("duplicate", "near_duplicate")


def test_words_that_differ_are_not_near_duplicates_and_sides_do_not_run_together():
    seen = Seen()
    seen.add(seen.check("A red car.", "Ein rotes Auto.")[1])
    assert seen.check("A red cart.", "Ein rotes Auto.")[0] is None
    assert seen.check("A red car. Ein", "rotes Auto.")[0] is None  # the same letters split elsewhere
    seen.add(seen.check("«Oui», dit-il.", "„Ja“, sagte er.")[1])
    assert seen.check("oui dit il", "ja sagte er")[0] == "near_duplicate"  # beyond ASCII punctuation too


@given(pairs=st.lists(st.tuples(st.text(max_size=30), st.text(max_size=30)), max_size=30))
def test_any_text_is_cleaned_without_error_and_kept_pairs_are_distinct_non_copies(pairs):
    dropped: dict[str, int] = {}
    kept = list(clean_pairs(iter(pairs), data(max_ratio=100.0), dropped))
    assert len(kept) + sum(dropped.values()) == len(pairs)
    assert len(set(kept)) == len(kept) and all(s != t for s, t in kept)
