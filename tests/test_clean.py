"""The cleaning of training pairs beyond length (nmt.data.clean): duplicates, copies, on any text."""

from __future__ import annotations

import string

import pytest
import torch

from nmt.config import config_from_dict
from nmt.data import clean
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


# Pairs drawn from few words and a few variants of case and punctuation: many exact and near duplicates.
REPEATING = st.lists(
    st.tuples(
        st.sampled_from(["a dog", "A dog.", "a cat", "a dog!", "two", "A  Dog"]),
        st.sampled_from(["ein Hund", "Ein Hund.", "eine Katze", "zwei", "EIN HUND"]),
    ),
    max_size=60,
)


@given(pairs=REPEATING, flush=st.integers(1, 5), block=st.integers(1, 7))
def test_where_the_older_keys_are_kept_changes_no_verdict(pairs, flush, block):
    """Keys move from the recent set into sorted runs every `flush` keys, looked up `block` pairs at a
    time: the same pairs are kept and dropped, for the same reasons, as with every key in one set."""
    everything: dict[str, int] = {}
    want = list(clean_pairs(iter(pairs), data(max_ratio=100.0), everything))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(clean._Keys, "FLUSH", flush)
        patch.setattr(clean, "BLOCK", block)
        seen, runs = Seen(), {}
        assert list(clean_pairs(iter(pairs), data(max_ratio=100.0), runs, seen)) == want
    assert runs == everything
    stored = sum(len(r) for r in seen.exact.runs) + len(seen.exact.recent)
    assert stored == len(want)  # a key a kept pair, each stored once


def test_the_runs_stay_few_as_the_keys_grow(monkeypatch):
    monkeypatch.setattr(clean._Keys, "FLUSH", 4)
    keys = clean._Keys()
    for k in range(1000):
        keys.recent.add(k * 7919 % 1009 - 500)
        keys.settle()
    assert len(keys.runs) <= 9  # about log2(1000 / 4), not 1000 / 4
    assert torch.equal(keys.stored(torch.tensor([-500, 0, 2000])), torch.tensor([True, True, False]))
