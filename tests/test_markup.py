"""HTML fragments: the tokenizer loses and invents nothing, inline tags follow their words through the
translation (by a known alignment, and by the trained reversal model's own attention), everything that is
not prose comes back byte for byte, and malformed markup never becomes text. Sentences split and joined
with their spacing."""

from __future__ import annotations

import html
import time
from types import SimpleNamespace

import pytest

from nmt.sentences import join_sentences, split_sentences

hypothesis = pytest.importorskip(
    "hypothesis", reason="property tests: pip install hypothesis (the dev extra)"
)
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from nmt.serve.markup import Document, tokens  # noqa: E402


def reverse(line: str) -> str:
    return " ".join(reversed(line.split()))


def reversal(source: str, translation: str) -> list[int]:
    """The alignment of a word-reversal: target word j is source word n-1-j."""
    n = len(source.split())
    return [n - 1 - j for j in range(len(translation.split()))]


def identity(source: str, translation: str) -> list[int]:
    return list(range(len(translation.split())))


def translate(fragment: str, translator=reverse, align=reversal, split: bool = True) -> str:
    doc = Document(fragment, "en", split)
    return doc.join([translator(line) for line in doc.lines()], align)


def visible(fragment: str) -> str:
    """The text a browser would show (markup tokens dropped, entities decoded), whitespace collapsed."""
    return " ".join(html.unescape("".join(t.raw for t in tokens(fragment) if t.kind == "text")).split())


def test_the_readme_examples_keep_their_words_and_tags():
    # The cases: one sentence each, translated whole, the tag on the word it wrapped.
    assert translate("<p>A <b>red</b> bike.</p>") == "<p>bike. <b>red</b> A</p>"
    assert translate("<p>A dog <b>runs</b>.</p>") == "<p><b>runs</b>. dog A</p>"  # "." stays outside
    doc = Document("<p>A <b>red</b> bike.</p>")
    assert doc.lines() == ["A red bike."]  # the text without its tags: what plain text would send
    # Nested and sibling spans stay a tree.
    assert translate("a <b>b <i>c</i> d</b> e") == "e <b>d <i>c</i> b</b> a"
    assert translate("<i>a</i> b <u>c</u>") == "<u>c</u> b <i>a</i>"


def test_block_elements_separate_sentences_and_spacing_is_kept():
    fragment = '<p class="x">a b <b>c d</b> e</p>\n<ul><li>f g</li></ul>'
    assert Document(fragment).lines() == ["a b c d e", "f g"]
    assert translate(fragment) == '<p class="x">e <b>d c</b> b a</p>\n<ul><li>g f</li></ul>'
    doc = Document("<p>One two.  Three four!\nFive six?</p>")
    assert doc.lines() == ["One two.", "Three four!", "Five six?"]
    out = doc.join([reverse(line) for line in doc.lines()], reversal)
    assert out == "<p>two. One  four! Three\nsix? Five</p>"


@pytest.mark.parametrize(
    "kept",
    [
        "<script>if (a < b && c) { x = '</p>'; }</script>",
        "<style>p > b { color: red }</style>",
        "<pre>a  b\n  c &amp; d</pre>",
        "<textarea>a <b>b</b></textarea>",
        '<p translate="no">a <b>b</b> c</p>',
        '<div class="x notranslate">a b</div>',
        "<!-- a b c -->",
        "<![CDATA[ a ]] b ]]]]>",
        "<!DOCTYPE html>",
        "<?xml version='1.0'?>",
        '<img alt="a b" src="x.png?a=1&amp;b=2">',
    ],
)
def test_what_is_not_prose_comes_back_byte_for_byte(kept):
    fragment = f"<p>a b</p>{kept}<p>c d</p>"
    assert translate(fragment) == f"<p>b a</p>{kept}<p>d c</p>"
    assert translate(kept) == kept


def test_entities_attributes_and_punctuation_only_nodes():
    assert translate('<a href="/x?a=1&amp;b=2" title="a b">a &amp; b</a>') == (
        '<a href="/x?a=1&amp;b=2" title="a b">b &amp; a</a>'
    )
    # Text with nothing to translate (punctuation, spacing, entities) comes back as it was sent.
    for same in ("<p>-</p>", "<td>&nbsp;</td>", "<p>!?</p><p> . </p>", "&copy; ..."):
        assert translate(same, translator=lambda line: "invented text") == same
    assert translate("a < b") == "b &lt; a"


@pytest.mark.parametrize(
    "malformed",
    [
        "a b <!-- never closed c d",
        "a b <b",
        'a b <a href="x>c d</a> e',
        "a b <![CDATA[ c",
        "a b </i",
        "a b <!doctype",
    ],
)
def test_malformed_markup_never_becomes_text(malformed):
    out = translate(malformed)
    assert out.startswith("b a")
    tail = malformed[malformed.index("<") :]
    assert out.endswith(tail) and visible(out) == "b a"


def test_the_same_fragment_gives_the_same_answer_alone_or_among_others():
    fragments = ["<p>A <b>red</b> bike.</p>", "x <i>y</i> z", "<p>a b. c d.</p>"]
    alone = [translate(f) for f in fragments]
    docs = [Document(f) for f in fragments]
    lines = [line for d in docs for line in d.lines()]
    translated = iter(reverse(line) for line in lines)
    together = [d.join([next(translated) for _ in d.lines()], reversal) for d in docs]
    assert together == alone


MARKUP_ALPHABET = "ab <>/!-[]?=\"'&;.\n"
PIECES = st.sampled_from(
    ["<b>", "</b>", "<i>", "</i>", "<p>", "</p>", "<br/>", "<!--", "-->", "<![CDATA[", "]]>", "<a href='",
     "&amp;", "&lt;", "<script>", "</script>", "<pre>", "</pre>", " translate=no>", "a b", ". ", "c"]
)  # fmt: skip
FRAGMENTS = st.one_of(
    st.text(alphabet=MARKUP_ALPHABET, max_size=40),
    st.lists(st.one_of(PIECES, st.text(alphabet=MARKUP_ALPHABET, max_size=4)), max_size=12).map("".join),
)


@settings(max_examples=300, deadline=None)
@given(FRAGMENTS)
def test_tokens_lose_and_invent_nothing(fragment):
    assert "".join(t.raw for t in tokens(fragment)) == fragment


@settings(max_examples=300, deadline=None)
@given(FRAGMENTS)
def test_an_identity_translation_keeps_every_tag_and_every_visible_word(fragment):
    doc = Document(fragment, "en")
    out = doc.join(doc.lines(), identity)  # never raises
    assert visible(out) == visible(fragment)
    markup = sorted(t.raw for t in tokens(fragment) if t.kind not in ("text", "rawtext"))
    assert all(out.count(raw) >= fragment.count(raw) for raw in markup)


def test_sentences_split_and_join_with_their_spacing():
    text = '  Dr. Smith arrived at 5 p.m. on Jan. 3.  He paid $3.50.\t"Is it ready?" she asked. '
    sentences, gaps = split_sentences(text, "en")
    assert sentences == [
        "Dr. Smith arrived at 5 p.m. on Jan. 3.",
        "He paid $3.50.",
        '"Is it ready?" she asked.',
    ]
    assert gaps == ["  ", "  ", "\t", " "]
    assert join_sentences(gaps, sentences) == text
    sentences, _ = split_sentences("Am 3. Oktober kam Dr. Müller an. Das ist z. B. gut.", "de")
    assert sentences == ["Am 3. Oktober kam Dr. Müller an.", "Das ist z. B. gut."]
    assert split_sentences("   ", "en") == ([], ["   "])


def test_the_trained_reversal_model_aligns_by_its_own_attention(synthetic_run):
    from nmt.translate import build_translator
    from nmt.translate.align import Aligner

    built = build_translator(synthetic_run / "checkpoints" / "best.pt", dtype="fp32", device="cpu")
    translator = built.translator
    aligner = Aligner(translator.model, translator.subword)
    for line in ("a b c d", "p o n m l k", "c d e"):
        out = translator.translate([line])[0]
        assert out == reverse(line)
        assert aligner.align(line, out) == reversal(line, out)
    fragment = "<p>p <b>o</b> n <i>m l</i> k</p>"
    doc = Document(fragment, "xx")
    out = doc.join(translator.translate(doc.lines()), aligner.align)
    assert out == "<p>k <i>l m</i> n <b>o</b> p</p>"


class Reverser:
    """A line translator that reverses words, scoring each line -1 per word."""

    max_chars = 1000
    subword = SimpleNamespace(tags={})  # a model of one target: no target tags

    def translate_nbest(self, lines, first_line=1, prefixes=None, on_batch=None):
        blank = [("", 0.0)]
        return [[(reverse(line), -float(len(line.split())))] if line.strip() else blank for line in lines]


def test_split_sentences_keeps_one_line_per_line_and_the_spacing():
    from nmt.translate.split import SentenceTranslator

    translator = SentenceTranslator(Reverser(), "en")
    lines = ["a b.  c d e!", "", "  f g?  ", "h"]
    assert translator.translate_nbest(lines) == [
        [("b. a  e! d c", -5.0)],
        [("", 0.0)],
        [("g? f", -2.0)],
        [("h", -1.0)],
    ]
    assert translator.max_chars == 1000


def test_split_sentences_is_linear_where_pysbd_backtracked():
    """pysbd's numbered-reference rule took hours on 47 bytes (`nmt translate --split-sentences` and the
    server alike); each of these lines is split in well under a second."""
    from nmt.translate.split import SentenceTranslator

    translator = SentenceTranslator(Reverser(), "en")
    for line in (
        "..[111 111 111 111 111 111 111 111 111 111 111]",
        "A.[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12] B",
    ):
        start = time.perf_counter()
        (out,) = translator.translate_nbest([line])
        assert time.perf_counter() - start < 2
        assert sorted(out[0][0].replace(" ", "")) == sorted(line.replace(" ", ""))  # nothing lost


@pytest.mark.slow  # seconds of timed runs
def test_html_is_linear_in_its_tags():
    """26,000 nested tags took minutes (each end tag looked through the open ones, each span was placed
    against every other): they come back around the translation, in about a second."""
    for fragment, line in [
        ("<b>" * 26000 + "a" + "</b>" * 26000, "a"),
        ("<b>" * 26000 + "</i>" * 26000, None),
        ("<i>a</i> " * 5000, None),
        ("x <img> " * 5000, None),
    ]:
        start = time.perf_counter()
        doc = Document(fragment)
        lines = doc.lines()
        out = doc.join([reverse(s) for s in lines], reversal)
        assert time.perf_counter() - start < 10
        assert sorted(visible(out).split()) == sorted(visible(fragment).split())
        markup = [t.raw for t in tokens(fragment) if t.kind not in ("text", "rawtext")]
        assert sorted(t.raw for t in tokens(out) if t.kind not in ("text", "rawtext")) == sorted(markup)
        if line is not None:
            assert lines == [line]
