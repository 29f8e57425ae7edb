"""One `nmt serve` for many pairs: every target of a model of several (>>fra<<), every pair of several
models (each with a worker of its own), /languages as LibreTranslate lists them, source "auto" among the
served sources, a 400 naming the served pairs, the page's pairs, isolation between models, and
LibreTranslate's own Python client. The models are tiny and random: answers are compared with what the
library translates for the same pair, never with fixed text."""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from .conftest import cli, one_error_line, sentences
from .servers import Server

pytestmark = pytest.mark.slow  # servers of several models, each its own process


pytest.importorskip("uvicorn", reason="nmt serve needs its extra: pip install 'nmt[serve]'")

TARGETS = ("de", "fr", "cs")
GERMAN = "Ein Hund läuft durch den Park und spielt mit einem roten Ball."
ENGLISH = "A dog runs through the park and plays with a red ball."


def model_config(src: str, tgt: str, targets: tuple[str, ...] = ()):
    """A tiny model's config: one pair, or (`targets`) one corpus per target, as a recipe of several
    directions names them (recipes/multi30k-en-de-fr-cs.yaml)."""
    from nmt.config import config_from_dict

    files = {"url": "http://127.0.0.1/x", "sha256": "0" * 64}
    train = [
        {"name": "x", "src": files, "tgt": files, **({"tgt_lang": t} if targets else {})} for t in targets
    ]
    return config_from_dict(
        {
            "data": {
                "src_lang": src,
                "tgt_lang": tgt,
                "train": train or [{"name": "x", "src": files, "tgt": files}],
                "valid": [{"name": "x", "src": files, "tgt": files}],
            },
            "model": {
                "encoder_layers": 1,
                "decoder_layers": 1,
                "d_model": 32,
                "d_ff": 64,
                "heads": 4,
                "max_positions": 64,
            },
            "decode": {"beam": 2, "lenpen": 0.6, "max_len_a": 1.0, "max_len_b": 5},
        }
    )


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """en -> de, fr, cs in one model (target tags as control symbols, as nmt prep trains them), and
    bilingual de -> en, xx -> yy and yy -> xx models, all random."""
    from nmt.subword import train_sentencepiece
    from nmt.untrained import save_random_model

    d = tmp_path_factory.mktemp("pairs")
    text = [*sentences(3000, 0), ENGLISH, GERMAN]
    tags = ",".join(f">>{t}<<" for t in ("deu", "fra", "ces"))
    multi_sub = train_sentencepiece(text, d / "multi", 150, character_coverage=1.0, control_symbols=tags)
    sub = train_sentencepiece(text, d / "spm", 150, character_coverage=1.0)
    assert multi_sub.targets == ["deu", "fra", "ces"] and not sub.targets
    return {
        "multi": save_random_model(d / "multi.pt", model_config("en", "de", TARGETS), multi_sub, seed=1),
        "de-en": save_random_model(d / "de-en.pt", model_config("de", "en"), sub, seed=2),
        "xx-yy": save_random_model(d / "xx-yy.pt", model_config("xx", "yy"), sub, seed=3),
        "yy-xx": save_random_model(d / "yy-xx.pt", model_config("yy", "xx"), sub, seed=4),
    }


def library(model: Path, lines: list[str], target: str | None = None) -> list[str]:
    """What nmt translate (--target) gives for the lines, in this process."""
    from nmt.translate import build_translator

    built = build_translator(model, device="cpu", dtype="fp32", target=target, command="nmt serve")
    return built.translator.translate(lines)


@pytest.fixture(scope="module")
def many(models):
    """The model of three targets and the de -> en model in one server."""
    s = Server(
        models["multi"], "-m", str(models["de-en"]), "--dtype", "fp32", "--batch-wait-ms", "5",
        "--max-chars", "2000000",
    )  # fmt: skip
    yield s
    if s.proc.poll() is None:
        s.proc.kill()


def ask(server: Server, lines: list[str], source: str, target: str):
    return server.request(
        "/translate", {"q": lines, "source": source, "target": target, "split_sentences": False}
    )


def test_a_model_of_several_targets_answers_each_of_them(many, models, one_torch_thread):
    lines = sentences(6, 7)
    got = {}
    for target in TARGETS:
        status, body = ask(many, lines, "en", target)
        assert status == 200, body
        got[target] = body["translatedText"]
        assert got[target] == library(models["multi"], lines, target), target
    # the target reached the model: the three tags give three sets of answers
    assert len({tuple(v) for v in got.values()}) == 3, got
    assert all(">>" not in t for v in got.values() for t in v)


def test_languages_lists_each_source_with_its_targets(many):
    status, languages = many.request("/languages")
    assert status == 200
    assert languages == [
        {"code": "en", "name": "English", "targets": ["de", "fr", "cs"]},
        {"code": "de", "name": "German", "targets": ["en"]},
        {"code": "fr", "name": "French", "targets": []},
        {"code": "cs", "name": "Czech", "targets": []},
    ]
    status, health = many.request("/health")
    assert health["pairs"] == ["en-de", "en-fr", "en-cs", "de-en"] and health["model"] == "multi.pt, de-en.pt"


def test_a_pair_nobody_serves_is_a_400_naming_the_served_pairs(many):
    for source, target in (("en", "es"), ("de", "fr"), ("fr", "en"), ("auto", "es")):
        status, body = many.request("/translate", {"q": "a b", "source": source, "target": target})
        assert status == 400, (source, target, body)
        error = body["error"]
        assert "\n" not in error and "en to de, en to fr, en to cs, de to en" in error, error
    # no target, where the pairs have several: the client is told which there are
    status, body = many.request("/translate", {"q": "a b", "source": "en"})
    assert status == 422 and "de, fr, cs, en" in body["error"]
    # the codes /languages lists, as LibreTranslate's clients send them
    assert ask(many, ["a b"], "en", "fra")[0] == 400 and ask(many, ["a b"], "en", "fr")[0] == 200


def test_source_auto_is_detected_among_the_served_sources(many, models, one_torch_thread):
    status, body = ask(many, [GERMAN], "auto", "en")  # only de -> en goes into English
    assert status == 200 and body["detectedLanguage"][0]["language"] == "de"
    assert body["translatedText"] == library(models["de-en"], [GERMAN])
    status, body = ask(many, [ENGLISH], "auto", "fr")
    assert status == 200 and body["detectedLanguage"][0]["language"] == "en"
    assert body["translatedText"] == library(models["multi"], [ENGLISH], "fr")
    # English surely, but nothing here translates English into English
    status, body = ask(many, [ENGLISH], "auto", "en")
    assert status == 400 and "the text is in en" in body["error"] and "into en from de" in body["error"]
    # one request goes to one model: texts of two languages are refused, not half translated
    status, body = ask(many, [GERMAN, ENGLISH], "auto", "de")
    assert status == 400, body


def test_the_page_offers_the_pairs(many):
    with urllib.request.urlopen(many.url + "/", timeout=30) as r:
        page = r.read().decode()
    options = re.findall(r"<option>([^<]*)</option>", page)
    assert options == [
        "English (en) to German (de)",
        "English (en) to French (fr)",
        "English (en) to Czech (cs)",
        "German (de) to English (en)",
    ]
    pairs = json.loads(re.search(r"const pairs = (\[.*?\]\]);", page).group(1))
    assert [p[:2] for p in pairs] == [["en", "de"], ["en", "fr"], ["en", "cs"], ["de", "en"]]


def test_libretranslates_own_client_lists_and_translates_every_target(many, models, one_torch_thread):
    libretranslatepy = pytest.importorskip(
        "libretranslatepy", reason="the dev extra: pip install libretranslatepy"
    )
    client = libretranslatepy.LibreTranslateAPI(many.url)
    languages = {lang["code"]: lang["targets"] for lang in client.languages()}
    assert languages["en"] == ["de", "fr", "cs"]
    q = sentences(1, 11)[0]
    for target in languages["en"]:
        assert client.translate(q, "en", target) == library(models["multi"], [q], target)[0]
    assert client.detect(GERMAN)[0]["language"] == "de"


@pytest.fixture(scope="module")
def two(models):
    """Two bilingual models, xx -> yy and yy -> xx: batches as large as 10,000 lines make one model's
    batch last seconds, so a one-line request held behind it would show."""
    s = Server(
        models["xx-yy"], "-m", str(models["yy-xx"]), "--dtype", "fp32",
        "--max-chars", "2000000", "--max-tokens", "400000", "--timeout", "40", "--batch-wait-ms", "5",
    )  # fmt: skip
    yield s
    if s.proc.poll() is None:
        s.proc.kill()


def test_two_bilingual_models_answer_both_pairs(two, models, one_torch_thread):
    lines = sentences(5, 3)
    for pair in ("xx-yy", "yy-xx"):
        source, target = pair.split("-")
        status, body = ask(two, lines, source, target)
        assert status == 200 and body["translatedText"] == library(models[pair], lines), pair
    assert two.request("/languages")[1] == [
        {"code": "xx", "name": "xx", "targets": ["yy"]},
        {"code": "yy", "name": "yy", "targets": ["xx"]},
    ]
    status, body = ask(two, ["a b"], "xx", "xx")
    assert status == 400 and "xx to yy, yy to xx" in body["error"]
    # each model is loaded once, and says so once
    assert sum("serving" in line for line in two.log) == 2


def metric(server: Server, name: str) -> float:
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def beside_a_long_request(server: Server, long_pair: tuple[str, str], short_pair: tuple[str, str]) -> float:
    """Seconds one line to `short_pair` takes while 10,000 lines to `long_pair` are being translated
    (and are still, when it is answered)."""
    long_lines = sentences(10000, 5)
    long_answer: list = []

    def send() -> None:
        try:
            long_answer.append(ask(server, long_lines, *long_pair))
        except OSError as e:  # the server stopped at the end of the tests, before answering it
            long_answer.append(e)

    threading.Thread(target=send, daemon=True).start()
    deadline = time.monotonic() + 30
    while metric(server, "nmt_queue_lines") < 1000:  # encoded and queued: its batches are under way
        assert time.monotonic() < deadline and not long_answer, long_answer
        time.sleep(0.1)
    time.sleep(0.5)
    start = time.monotonic()
    status, body = ask(server, ["a b c"], *short_pair)
    seconds = time.monotonic() - start
    print(f"one line to {short_pair} answered in {seconds:.2f} s beside 10,000 to {long_pair}")
    assert status == 200 and isinstance(body["translatedText"], list)
    assert not long_answer, "the long request was over before the short one was sent: nothing was shown"
    # The long request is still being handled (this /metrics request is the other one in flight).
    assert metric(server, "nmt_requests_in_flight") >= 2
    return seconds


def test_a_long_request_to_one_model_does_not_hold_a_short_one_to_another(two):
    """Batches of 8,000 lines (seconds each) to xx -> yy: one line to yy -> xx is answered within 3 s,
    its model's worker being free (7 s when both went to one model's worker)."""
    assert beside_a_long_request(two, ("xx", "yy"), ("yy", "xx")) < 3


def test_a_pair_claimed_twice_or_a_glossary_for_several_pairs_is_one_line(models, tmp_path):
    shutil.copy(models["xx-yy"], tmp_path / "again.pt")
    result = cli("serve", "-m", models["xx-yy"], "-m", tmp_path / "again.pt", "--port", "0")
    assert result.returncode == 2
    one_error_line(result.stderr, "again.pt", "xx to yy", "xx-yy.pt")
    result = cli("serve", "-m", models["xx-yy"], "-m", models["xx-yy"], "--port", "0")
    assert result.returncode == 2 and "given twice" in one_error_line(result.stderr)
    glossary = tmp_path / "terms.tsv"
    glossary.write_text("a\tb\n")
    result = cli("serve", "-m", models["xx-yy"], "-m", models["yy-xx"], "--glossary", glossary, "--port", "0")
    assert result.returncode == 2
    one_error_line(result.stderr, "--glossary", "xx to yy, yy to xx")


def test_markup_is_placed_by_the_attention_of_the_tagged_source(many, models):
    """HTML goes through the word aligner, which reads the source with the pair's tag as the model
    translated it; the tag itself is aligned to no word of the text."""
    from nmt.checkpoint import read_model
    from nmt.translate.align import Aligner

    status, body = many.request(
        "/translate", {"q": "<p>a dog <b>runs</b> here</p>", "source": "en", "target": "fr", "format": "html"}
    )
    assert status == 200 and body["translatedText"].startswith("<p>"), body
    (model, subword, _), _ = read_model(models["multi"], "cpu")
    aligner = Aligner(model.eval(), subword)
    source, translation = "a dog runs here", "un chien court ici"
    for tag in (None, ">>fra<<", ">>ces<<"):  # each word a subword of its own: alignments to trust
        links = aligner.align(source, translation, tag=tag)
        assert links is not None and len(links) == 4, (tag, links)
        assert all(i is None or 0 <= i < 4 for i in links), (tag, links)


def test_checkpoints_and_ctranslate2_folders_in_one_server(models, tmp_path, one_torch_thread):
    """--engine ctranslate2 decodes the exported folder; the checkpoint beside it runs on torch."""
    pytest.importorskip("ctranslate2", reason="needs CTranslate2 (the dev extra)")
    from nmt.translate import build_translator

    folder = tmp_path / "yy-xx-ct2"
    result = cli("export", "-m", models["yy-xx"], "--format", "ctranslate2", "-o", folder)
    assert result.returncode == 0, result.stderr
    s = Server(models["xx-yy"], "-m", str(folder), "--engine", "ctranslate2", "--dtype", "fp32")
    try:
        lines = sentences(4, 9)
        assert ask(s, lines, "xx", "yy") == (200, {"translatedText": library(models["xx-yy"], lines)})
        ct2 = build_translator(folder, device="cpu", dtype="fp32", engine="ctranslate2", command="nmt serve")
        assert ask(s, lines, "yy", "xx") == (200, {"translatedText": ct2.translator.translate(lines)})
    finally:
        s.proc.kill()
    served = [line for line in s.log if line.startswith("serving")]
    assert len(served) == 2 and "CTranslate2" not in served[0] and "CTranslate2" in served[1], served


def test_the_page_translates_into_the_pair_chosen_in_a_real_browser(many, models, tmp_path, one_torch_thread):
    from .test_serve import Browser, chromium_binary

    binary = chromium_binary()
    if binary is None:
        pytest.skip("no chromium binary: apt-get install chromium (.ci/run installs it)")
    pytest.importorskip("websockets", reason="drives the browser: pip install websockets (the dev extra)")
    browser = Browser(binary, tmp_path / "profile")
    try:
        browser.call("Page.navigate", url=many.url + "/")
        browser.wait_for("document.readyState === 'complete' && !!document.getElementById('pair')")
        assert not browser.evaluate("document.getElementById('pair').closest('p').hidden")
        browser.evaluate(
            "const s = document.getElementById('pair'); s.selectedIndex = 2;"
            "s.dispatchEvent(new Event('change'))"
        )
        assert browser.evaluate("document.querySelector('h1').textContent") == "Translate English to Czech"
        assert browser.evaluate("document.getElementById('tgtname').textContent") == "Czech (cs)"
        assert '"target":"cs"' in browser.evaluate("document.getElementById('curl').textContent")
        q = sentences(1, 13)[0]
        body = browser.call(
            "Runtime.evaluate",
            expression=f"request({json.dumps(q)}, 0)",
            awaitPromise=True,
            returnByValue=True,
        )["result"]["value"]
        assert body["translatedText"] == library(models["multi"], [q], "cs")[0]
    finally:
        browser.close()


CODES = ["en", "de", "fr", "cs", "es", "auto", "fra", "EN", "", " en", ">>fra<<", "en\u0000"]


def test_any_source_and_target_is_answered_or_refused_naming_the_served_pairs(many):
    """Hostile or odd language fields: a translation exactly when the pair is served, else a client's
    error (a 400 naming the served pairs, or a 422 for a field that is not a language code at all)."""
    hypothesis = pytest.importorskip("hypothesis", reason="property tests: the dev extra")
    from hypothesis import strategies as st

    served = {("en", "de"), ("en", "fr"), ("en", "cs"), ("de", "en")}
    code = st.one_of(
        st.sampled_from(CODES), st.text(max_size=8), st.integers(), st.none(), st.lists(st.text())
    )

    @hypothesis.settings(max_examples=40, deadline=None, database=None)
    @hypothesis.given(source=code, target=code, leave_out=st.sampled_from(["", "source", "target"]))
    def check(source, target, leave_out):
        body = {"q": "a b", "source": source, "target": target, "split_sentences": False}
        body.pop(leave_out, None)
        status, answer = many.request("/translate", body)
        source, target = body.get("source", "auto"), body.get("target")
        codes = isinstance(source, str) and isinstance(target, str)
        # "auto": "a b" is too short to detect, so it is taken as a source served into the target
        auto_ok = codes and source == "auto" and target in {t for _, t in served}
        if codes and (source, target) in served or auto_ok:
            assert status == 200 and isinstance(answer["translatedText"], str), (body, answer)
        else:
            assert status in (400, 422) and "\n" not in answer["error"], (body, answer)
            if status == 400 and codes:
                assert "en to de, en to fr, en to cs, de to en" in answer["error"], (body, answer)

    check()
    assert not any("Traceback" in line for line in many.log)


def test_a_long_request_to_one_target_does_not_hold_a_short_one_to_another_of_the_same_model(many):
    """Two pairs of one model share its worker: its batches take the next piece of every waiting request
    in turn (the default budget, 8192), so one line to en -> fr waits about one batch of the 10,000 to
    en -> de. Last in this file: the long request may still run after it."""
    assert beside_a_long_request(many, ("en", "de"), ("en", "fr")) < 3
