"""Input typed in ALL CAPS or Title Case (nmt.translate.casing, decode.recase): which lines are recased,
and that `nmt translate --recase` translates them as the same line written as a sentence, an ALL-CAPS
one then upper-cased, while lines as written come out byte-identical with and without it."""

from __future__ import annotations

import pytest

from nmt.config import DecodeConfig
from nmt.translate.casing import Typed, as_typed, sentence_case, typed

from .conftest import cli, sentences
from .test_translate import out_lines

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize(
    "line, how",
    [
        ("A MAN RIDES A BIKE.", Typed.ALL_CAPS),
        ("STRASSE IN KÖLN", Typed.ALL_CAPS),
        ("NASA", Typed.ALL_CAPS),
        ("A Man Rides A Bike.", Typed.TITLE_CASE),
        ("Über Den Fluß", Typed.TITLE_CASE),
        ("A man rides a bike.", Typed.AS_WRITTEN),
        ("A man in New York.", Typed.AS_WRITTEN),
        ("New York City", Typed.TITLE_CASE),
        ("McDonald's Big Mac Menu", Typed.AS_WRITTEN),  # a capital inside a word: as written
        ("A B", Typed.AS_WRITTEN),  # no word of two capitals: single letters are not shouting
        ("I", Typed.AS_WRITTEN),
        ("Two Words", Typed.AS_WRITTEN),  # fewer than three words: not a heading to recase
        ("123 456!", Typed.AS_WRITTEN),
        ("", Typed.AS_WRITTEN),
        ("狗在跑。", Typed.AS_WRITTEN),  # a script without case
        ("ДВА ЧЕЛОВЕКА", Typed.ALL_CAPS),
    ],
)
def test_which_lines_are_typed_how(line, how):
    assert typed(line) is how


def test_sentence_case_and_back():
    assert sentence_case("A MAN RIDES A BIKE.") == "A man rides a bike."
    assert sentence_case("  «ÜBER DEN FLUSS»") == "  «Über den fluss»"
    assert sentence_case("123 GO") == "123 Go"  # the first cased letter, after the digits
    assert as_typed("Ein Mann fährt Fahrrad.", Typed.ALL_CAPS) == "EIN MANN FÄHRT FAHRRAD."
    assert as_typed("Ein Mann fährt Fahrrad.", Typed.TITLE_CASE) == "Ein Mann fährt Fahrrad."
    assert DecodeConfig().recase is False  # a checkpoint from before translates as before


def test_recase_translates_the_sentence_cased_line_and_cases_it_back(checkpoint, tmp_path):
    plain = [s.rstrip(".!?,") for s in sentences(12, 3) if len(s.split()) >= 3][:6]
    shouted, headings = (
        [s.upper() for s in plain],
        [" ".join(w.capitalize() for w in s.split()) for s in plain],
    )
    assert all(typed(s) is Typed.ALL_CAPS for s in shouted)
    assert all(typed(s) is Typed.TITLE_CASE for s in headings)
    lines = plain + shouted + headings
    src = tmp_path / "in.txt"
    src.write_text("\n".join(lines) + "\n")

    def translate(*extra: str, text: str | None = None) -> list[str]:
        if text is not None:
            src.write_text(text)
        result = cli("translate", "-m", checkpoint, "-i", src, "--workers", "1", *extra)
        assert result.returncode == 0, result.stderr
        return out_lines(result.stdout)

    recased = translate("--recase")
    as_is = translate("--no-recase")
    cased = translate(text="".join(sentence_case(s) + "\n" for s in lines))
    n = len(plain)
    assert recased[:n] == as_is[:n]  # lines as written: the same with and without
    assert recased[n : 2 * n] == [t.upper() for t in cased[n : 2 * n]]
    assert recased[2 * n :] == cased[2 * n :]
    assert as_is == translate(text="".join(s + "\n" for s in lines))  # the checkpoint's own: off


@pytest.mark.slow  # an nmt serve process of its own
def test_the_server_recases_as_nmt_translate_does(checkpoint, tmp_path):
    pytest.importorskip("uvicorn", reason="nmt serve needs its extra: pip install 'nmt[serve]'")
    from .servers import Server, libre

    lines = ["ABC DEFG HIJ KL", "Abc Defg Hij Kl", "abc defg hij kl"]
    src = tmp_path / "in.txt"
    src.write_text("\n".join(lines) + "\n")
    result = cli("translate", "-m", checkpoint, "-i", src, "--recase", "--no-split-sentences")
    assert result.returncode == 0, result.stderr
    expected = out_lines(result.stdout)
    assert expected[0] == expected[0].upper()
    server = Server(checkpoint, "--recase")
    try:
        status, body = server.request("/translate", libre(lines))
    finally:
        assert server.stop() == 0
    assert status == 200, body
    assert body["translatedText"] == expected
    assert "ALL CAPS and Title Case recased" in server.log[0]  # the server says so as it starts
