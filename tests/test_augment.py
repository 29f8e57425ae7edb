"""Training pairs as people type them (nmt.data.augment): deterministic, in the recipe's shares, strict."""

from __future__ import annotations

import random

import pytest

from nmt.config import AugmentConfig, config_from_dict
from nmt.data.augment import MODIFIERS, augment_pair, is_on, title_case, typos
from nmt.errors import ConfigError

hypothesis = pytest.importorskip(
    "hypothesis", reason="hypothesis generates the inputs: pip install -e '.[dev]'"
)
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

MOZILLA = AugmentConfig(uppercase=0.07, titlecase=0.05, typos=0.05, remove_end_punct=0.2)
PAIR = (
    "A man in a blue shirt is standing on a ladder.",
    "Ein Mann in einem blauen Hemd steht auf einer Leiter.",
)


def test_the_same_seed_epoch_and_index_give_the_same_pair_and_others_differ():
    everything = AugmentConfig(uppercase=0.3, titlecase=0.3, typos=1.0, remove_end_punct=0.5, seed=7)
    draws = {
        key: augment_pair(*PAIR, everything, epoch=key[0], index=key[1]) for key in ((0, 0), (0, 1), (1, 0))
    }
    for (epoch, index), result in draws.items():
        assert augment_pair(*PAIR, everything, epoch=epoch, index=index) == result
    # every pair gets typos (share 1), drawn from its own generator: another index or epoch, other typos
    assert len({r[0].lower() for r in draws.values()}) == 3
    other_seed = AugmentConfig(uppercase=0.3, titlecase=0.3, typos=1.0, remove_end_punct=0.5, seed=8)
    assert augment_pair(*PAIR, other_seed, epoch=0, index=0) != draws[(0, 0)]


def test_each_modifier_is_applied_to_about_its_share():
    n = 20_000
    counts = dict.fromkeys(MODIFIERS, 0)
    for i in range(n):
        _, _, applied = augment_pair(*PAIR, MOZILLA, epoch=0, index=i)
        for m in applied:
            counts[m] += 1
    for m in MODIFIERS:
        share = getattr(MOZILLA, m)
        assert abs(counts[m] / n - share) < 4 * (share * (1 - share) / n) ** 0.5 + 1e-9, (m, counts[m])


def test_modifiers_change_what_they_say_and_only_that():
    def only(**share) -> AugmentConfig:
        return AugmentConfig(**{m: 0.0 for m in MODIFIERS} | share)

    src, tgt, applied = augment_pair(*PAIR, only(uppercase=1.0), 0, 0)
    assert (src, tgt, applied) == (PAIR[0].upper(), PAIR[1].upper(), ("uppercase",))
    src, tgt, _ = augment_pair(*PAIR, only(titlecase=1.0), 0, 0)
    assert src == "A Man In A Blue Shirt Is Standing On A Ladder."
    assert tgt == "Ein Mann In Einem Blauen Hemd Steht Auf Einer Leiter."
    src, tgt, _ = augment_pair(*PAIR, only(remove_end_punct=1.0), 0, 0)
    assert (src, tgt) == (PAIR[0][:-1], PAIR[1][:-1])
    src, tgt, _ = augment_pair(*PAIR, only(typos=1.0), 0, 0)
    assert src != PAIR[0] and tgt == PAIR[1]  # typos are the source's only: the target stays right
    assert augment_pair(*PAIR, AugmentConfig(), 0, 0) == (*PAIR, ())
    assert not is_on(AugmentConfig()) and is_on(MOZILLA)


def test_case_follows_the_script_and_end_punctuation_only_goes_from_both_sides():
    upper = AugmentConfig(uppercase=1.0)
    assert augment_pair("Straße.", "日本語です。", upper, 0, 0)[:2] == ("STRASSE.", "日本語です。")
    assert title_case("mcDonald's  e-mail") == "McDonald's  E-mail"  # not str.title's "Mcdonald'S"
    strip = AugmentConfig(remove_end_punct=1.0)
    assert augment_pair("Hello!", "Hallo", strip, 0, 0)[:2] == ("Hello!", "Hallo")  # one side only: left
    assert augment_pair("...", "…", strip, 0, 0)[:2] == ("...", "…")  # never an empty line


@given(text=st.text(max_size=80), seed=st.integers(0, 2**32))
def test_typos_change_at_most_one_letter_per_twenty_characters(text, seed):
    out = typos(text, random.Random(seed))
    edits = max(1, len(text) // 20)
    assert abs(len(out) - len(text)) <= edits
    assert [c for c in out if not c.isalpha()] == [c for c in text if not c.isalpha()]  # letters only


@given(src=st.text(max_size=60), tgt=st.text(max_size=60), index=st.integers(0, 10**9))
def test_a_non_empty_pair_stays_non_empty(src, tgt, index):
    everything = AugmentConfig(uppercase=0.5, titlecase=0.5, typos=1.0, remove_end_punct=1.0)
    out_src, out_tgt, _ = augment_pair(src, tgt, everything, epoch=3, index=index)
    assert bool(out_src) == bool(src) and bool(out_tgt) == bool(tgt)


def recipe(**augment) -> dict:
    spec = {"url": "https://upstream.invalid/x.en", "sha256": "0" * 64}
    corpus = {"name": "c", "src": spec, "tgt": spec}
    data = {"src_lang": "en", "tgt_lang": "de", "train": [corpus], "valid": [corpus], "augment": augment}
    return {"data": data}


@pytest.mark.parametrize(
    "augment, message",
    [
        ({"uppercase": 1.5}, "data.augment.uppercase: must be in [0, 1], got 1.5"),
        ({"typos": -0.1}, "data.augment.typos: must be in [0, 1]"),
        ({"uppercase": 0.6, "titlecase": 0.6}, "data.augment.titlecase: upper and title case exclude"),
        ({"upper_case": 0.1}, "unknown key data.augment.upper_case (did you mean data.augment.uppercase?)"),
        ({"typos": "often"}, "data.augment.typos: expected float"),
    ],
)
def test_a_bad_share_is_an_error_naming_the_dotted_key(augment, message):
    with pytest.raises(ConfigError, match=None) as e:
        config_from_dict(recipe(**augment), source="r.yaml")
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_config_without_augment_loads_with_it_off():
    """A checkpoint written before data.augment existed holds a data section without it."""
    cfg = config_from_dict({"data": {k: v for k, v in recipe()["data"].items() if k != "augment"}})
    assert cfg.data.augment == AugmentConfig() and not is_on(cfg.data.augment)


def test_a_checkpoint_written_before_augment_and_cleaning_keys_loads_and_translates_the_same(
    synthetic_run, tmp_path
):
    """A checkpoint's config as nmt wrote it before data.augment, data.dedup, data.drop_copies,
    data.langid_threshold and a corpus's langid existed."""
    import torch
    from typer.testing import CliRunner

    from nmt.checkpoint import load_checkpoint
    from nmt.cli import app

    new = synthetic_run / "checkpoints" / "best.pt"
    payload = torch.load(new, weights_only=True)
    data = payload["config"]["data"]
    for key in ("augment", "dedup", "drop_copies", "langid_threshold"):
        del data[key]
    for corpus in data["train"] + data["valid"] + data["test"]:
        del corpus["langid"]
    old = tmp_path / "old.pt"
    torch.save(payload, old)
    assert load_checkpoint(old).config.data.augment == AugmentConfig()
    lines = "".join(s + "\n" for s in (synthetic_run / "data" / "valid.xx").read_text().splitlines()[:20])
    outputs = [
        CliRunner().invoke(app, ["translate", "-m", str(p), "--beam", "2"], input=lines) for p in (new, old)
    ]
    assert all(o.exit_code == 0 for o in outputs), outputs[1].output
    assert outputs[0].stdout == outputs[1].stdout and outputs[0].stdout.count("\n") == 20
