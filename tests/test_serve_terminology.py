"""Glossaries in `nmt serve`: a server-wide --glossary, a request's `glossary` field, HTML translate="no"
as copy constraints, and a 422 naming the entry that cannot be obeyed."""

from __future__ import annotations

import re

import pytest

from nmt.serve.documents import document
from nmt.serve.markup import Document
from nmt.translate.terminology import glossary_of

from .conftest import sentences
from .servers import Server, libre

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_kept_elements_are_translate_no_and_notranslate_quoted_or_not_and_never_reach_the_model():
    html = (
        '<p>Press <span translate="no">Ctrl  S</span> in <b class="ui notranslate">My <i>App</i></b>'
        "<br><span translate=yes>free</span> <em translate=NO></em> <i class=notranslate>Kept</i>"
        " <u class='a notranslate'>Too</u></p>"
    )
    doc = Document(html)
    assert doc.kept == [
        '<span translate="no">Ctrl  S</span>',
        '<b class="ui notranslate">My <i>App</i></b>',
        "<em translate=NO></em>",
        "<i class=notranslate>Kept</i>",
        "<u class='a notranslate'>Too</u>",
    ]
    # the markup keeps those elements byte for byte: their texts never reach the model as words
    text = " ".join(doc.lines())
    assert "free" in text and not any(w in text for w in ("Ctrl", "App", "Kept", "Too"))


def test_a_kept_span_holds_only_its_own_text_not_the_same_words_elsewhere():
    """`<p>A dog and <span class="notranslate">A dog</span></p>`: the span is kept; the other "A dog" is
    the model's to translate, with no constraint to copy it."""
    html = '<p>A dog and <span class="notranslate">A dog</span></p>'
    item = document(html, "html", "en", True)
    assert item.lines == ["A dog and"]
    assert not item.kept  # no copy constraint: it would land on the other "A dog", the one to translate
    out = item.join(["Ein Hund und"])
    assert out == '<p>Ein Hund und <span class="notranslate">A dog</span></p>'


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):  # noqa: F811
    terms = tmp_path_factory.mktemp("terms") / "terms.tsv"
    word = sentences(4, 21)[0].split()[0]
    terms.write_text(f"{word}\tzebra\n")
    s = Server(checkpoint, "--batch-wait-ms", "5", "--glossary", str(terms))
    s.word = word
    yield s
    if s.proc.poll() is None:
        s.proc.kill()


@pytest.mark.numerics
def test_the_server_obeys_its_glossary_and_a_requests(server):
    lines = sentences(4, 21)
    other = sentences(3, 22)
    plain = [line for line in other if server.word not in line.split()]
    assert plain and lines[0].split()[0] == server.word
    status, before = server.request("/translate", libre(plain))
    assert status == 200
    extra = lines[1].split()[1].rstrip(".!?,")
    status, body = server.request(
        "/translate", libre(lines[:2] + plain, glossary=[{"source": extra, "target": "quagga"}])
    )
    assert status == 200, body
    out = body["translatedText"]
    ours = glossary_of([{"source": server.word, "target": "zebra"}])
    theirs = glossary_of([{"source": extra, "target": "quagga"}])
    assert out[0].count("zebra") == len(ours.matches(lines[0])) > 0, out[0]
    assert out[1].count("quagga") == len(theirs.matches(lines[1])) > 0, out[1]
    assert out[2:] == before["translatedText"]  # lines without a match: as without any glossary
    # a kept span is copied (and not matched against the glossary, which would make it "zebra")
    html = f'<p>{plain[0]}</p><p><span translate="no">{server.word}</span> kept</p>'
    status, body = server.request("/translate", libre(html, format="html"))
    assert status == 200, body
    kept = re.search(r'<span translate="no">(.*?)</span>', body["translatedText"]).group(1)
    assert server.word in kept.split() and "zebra" not in kept


def test_a_glossary_that_cannot_be_obeyed_is_a_422_naming_the_entry(server):
    for glossary, message in [
        (
            [{"source": "a", "target": "b"}, {"source": "A", "target": "c"}],
            r'"glossary"\[1\]: .* contradicts',
        ),
        ([{"source": "a"}], r'"glossary"\[0\]: expected'),
        ("a=b", "must be a list"),
        ([{"source": "a", "target": " ".join(["zqxj"] * 40)}], r'"glossary"\[0\]: the term .* does not fit'),
    ]:
        status, body = server.request("/translate", libre("a b a", glossary=glossary))
        assert status == 422 and re.search(message, body["error"]), body
