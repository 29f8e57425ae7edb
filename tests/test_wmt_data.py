"""The WMT14 recipes' data path end to end, against a local server holding small fakes of the real archives.

The fakes have the member layout of the statmt.org archives as fairseq's prepare-wmt14en2{de,fr}.sh unpack
them, and of sacrebleu's newstest2013/2014 archives (SGML); the shipped recipes are used as they are, with
--mirror pointing at the server and only the checksums replaced by those of the fakes.
"""

from __future__ import annotations

import copy
import dataclasses
import gzip
import hashlib
import random
from pathlib import Path

import pytest
from sacrebleu.dataset import DATASETS

from nmt.config import RECIPES_DIR, load_config
from nmt.data.binarized import ParallelData
from nmt.data.preprocess import preprocess
from nmt.subword import Subword

from .test_fetch import served, tar_bytes  # noqa: F401  (served is a fixture)

WORDS = {
    "en": "the house is small and old we see a green tree near water today people work here".split(),
    "de": "das haus ist klein und alt wir sehen einen grunen baum nahe wasser heute leute hier".split(),
    "fr": "la maison est petite et vieille nous voyons un arbre vert pres eau aujourd hui les gens".split(),
}


def sentences(lang: str, n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS[lang]) for _ in range(rng.randint(4, 9))) for _ in range(n)]


def text(lines: list[str]) -> bytes:
    return "".join(line + "\n" for line in lines).encode()


def sgml(lines: list[str], lang: str) -> bytes:
    segs = "".join(f'<seg id="{i + 1}">{line}</seg>\n' for i, line in enumerate(lines))
    doc = f'<doc sysid="ref" docid="d1" genre="news" origlang="{lang}">\n<p>\n{segs}</p>\n</doc>\n'
    return f'<refset setid="newstest" srclang="any" trglang="{lang}">\n{doc}</refset>\n'.encode()


def parallel(members: str, tgt: str, n: int, seed: int) -> dict[str, bytes]:
    """Members `<prefix>.en` and `<prefix>.<tgt>` of n aligned lines (members is the prefix)."""
    return {
        f"{members}.en": text(sentences("en", n, seed)),
        f"{members}.{tgt}": text(sentences(tgt, n, seed)),
    }


def fake_statmt(tgt: str) -> dict[str, bytes]:
    """The archives' names and member layouts as on statmt.org (for the pair en-<tgt>)."""
    pair = f"{tgt}-en"
    cc = parallel(f"commoncrawl.{pair}", tgt, 40, 2)
    cc[f"commoncrawl.{pair}.en"] += b"a line with a stray\rcarriage return\n\n"  # Common Crawl has these
    cc[f"commoncrawl.{pair}.{tgt}"] += text(["une ligne", "kept only in the raw text"])
    archives = {
        "training-parallel-europarl-v7.tgz": tar_bytes(parallel(f"training/europarl-v7.{pair}", tgt, 60, 1)),
        "training-parallel-commoncrawl.tgz": tar_bytes(cc),
        "training-parallel-nc-v9.tgz": tar_bytes(parallel(f"training/news-commentary-v9.{pair}", tgt, 30, 3)),
    }
    if tgt == "fr":
        archives["training-parallel-un.tgz"] = tar_bytes(parallel("un/undoc.2000.fr-en", "fr", 30, 4))
        giga = parallel("giga-fren.release2.fixed", "fr", 50, 5)
        archives["training-giga-fren.tar"] = tar_bytes(
            {f"{k}.gz": gzip.compress(v) for k, v in giga.items()}, "w"
        )
    valid = {lang: sentences(lang, 20, 6) for lang in WORDS}
    archives["test.tgz"] = tar_bytes(
        {f"test/newstest2013-src.{lang}.sgm": sgml(valid[lang], lang) for lang in WORDS}
    )
    test = {lang: sentences(lang, 25, 7) for lang in ("en", tgt)}
    archives["test-full.tgz"] = tar_bytes(
        {
            f"test-full/newstest2014-{tgt}en-src.en.sgm": sgml(test["en"], "en"),
            f"test-full/newstest2014-{tgt}en-ref.{tgt}.sgm": sgml(test[tgt], tgt),
        }
    )
    return archives


@pytest.mark.parametrize("recipe", ["wmt14-en-de-base", "wmt14-en-fr-big"])
def test_wmt14_recipe_data_path(recipe, served, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("NMT_CACHE", str(tmp_path / "cache"))
    cfg = load_config(RECIPES_DIR / f"{recipe}.yaml", ["data.vocab_size=80"])
    tgt = cfg.data.tgt_lang
    archives = fake_statmt(tgt)
    for name, data in archives.items():
        served.add(f"/statmt/{name}", data)
    sha = {name: hashlib.sha256(data).hexdigest() for name, data in archives.items()}

    def fake_checksum(corpus):
        def spec(f):
            return dataclasses.replace(f, sha256=sha[Path(f.url).name])

        return dataclasses.replace(corpus, src=spec(corpus.src), tgt=spec(corpus.tgt))

    cfg = dataclasses.replace(
        cfg, data=dataclasses.replace(cfg.data, train=tuple(fake_checksum(c) for c in cfg.data.train))
    )
    for name, archive in (("wmt13", "test.tgz"), ("wmt14/full", "test-full.tgz")):
        dataset = copy.copy(DATASETS[name])
        dataset.md5 = [hashlib.md5(archives[archive]).hexdigest()]
        monkeypatch.setitem(DATASETS, name, dataset)

    stats = preprocess(cfg, tmp_path / "work", mirror=served.url + "/statmt")

    data = tmp_path / "work" / "data"
    train_lines = {"de": 60 + 42 + 30, "fr": 60 + 42 + 30 + 30 + 50}[tgt]
    assert stats["train"]["lines"] == train_lines
    assert stats["train"]["dropped"]["empty"] == 1  # the empty Common Crawl line
    assert stats["train"]["kept"] == len(ParallelData(data / "train"))
    assert stats["valid"]["lines"] == 20 == len(ParallelData(data / "valid"))
    assert stats["test"] == {"newstest2014": 25}
    # sacrebleu unwrapped the SGML: the raw test text is the sentences, every line kept
    assert (data / "test" / f"newstest2014.{tgt}").read_text().splitlines() == sentences(tgt, 25, 7)
    assert (data / f"valid.{tgt}").read_text().splitlines() == sentences(tgt, 20, 6)
    assert Subword.load(data / "spm.model").vocab_size == 80
    # every archive was fetched once, through the mirror, by its upstream file name
    assert sorted(p for p, _ in served.requests) == sorted(f"/statmt/{name}" for name in archives)
