"""`--dtype int8` quantizes activations per row, so a sentence's int8 translation is the same alone and
inside any batch (nmt.translate.int8): byte-identical hypotheses and scores, not merely close ones."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from nmt.config import DecodeConfig, Precision
from nmt.model import Transformer
from nmt.translate import Translator, inference_model
from nmt.translate.int8 import PROBE_ROWS, Int8Linear, _exact_with, quantize_int8, weight_bits
from nmt.translate.search import beam_search, greedy_search
from nmt.translate.torch_engine import padded_sources, padded_width

from .synthetic import make_config

# numerics: compares numbers, so `make test` runs it again with the AVX2 kernels forced (7-bit weights)
pytestmark = [pytest.mark.numerics, pytest.mark.usefixtures("one_torch_thread")]

VOCAB = 64


@pytest.fixture(scope="module")
def model() -> Transformer:
    torch.manual_seed(0)
    model = Transformer(make_config().model, VOCAB).eval()
    for p in model.parameters():  # spread the logits, so that the search is not decided by near-ties alone
        p.data.mul_(2.0)
    return quantize_int8(model)


def sentences(n: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 20, (n,), generator=gen).tolist()
    return [torch.randint(4, VOCAB, (length,), generator=gen).tolist() for length in lengths]


def test_an_int8_row_is_the_same_alone_and_among_any_rows():
    torch.manual_seed(0)
    linear = nn.Linear(96, 200)
    x = torch.randn(300, 96) * torch.logspace(-2, 2, 300)[:, None]  # rows of very different ranges
    x[7] = 0  # an all-zero row: only the bias
    with torch.inference_mode():
        int8 = Int8Linear(linear.weight, linear.bias)
        alone = torch.cat([int8(x[i : i + 1]) for i in range(len(x))])
        assert torch.equal(alone[7], linear.bias)
        for rows in (2, 3, 17, 64, 299, 300):
            for start in (0, 300 - rows):
                assert torch.equal(int8(x[start : start + rows]), alone[start : start + rows]), (rows, start)


def test_the_weights_have_the_bits_the_cpu_multiplies_exactly():
    # 8 with VNNI; 7 where pairs of products add in int16 (AVX2, as `make test` forces for numerics tests)
    assert weight_bits() in (7, 8)
    linear = Int8Linear(torch.randn(16, 32), None)
    level = (1 << (weight_bits() - 1)) - 1
    assert linear.weight_t.abs().max() == level


@pytest.mark.parametrize("wrong_at", [1, 64, 512])
def test_the_bits_probe_checks_the_product_at_several_row_counts(monkeypatch, wrong_at):
    """oneDNN may choose another kernel by shape: a product wrong at one row count alone is found."""
    assert wrong_at in PROBE_ROWS
    int_mm = torch._int_mm

    def wrong(a, b):
        out = int_mm(a, b)
        return out + 1 if a.shape[0] == wrong_at else out

    assert _exact_with(7)
    monkeypatch.setattr(torch, "_int_mm", wrong)
    assert not _exact_with(7)


@pytest.mark.parametrize("beam", [1, 4])
def test_a_sentence_translates_the_same_alone_and_in_batches_of_any_size(model, beam):
    """Each of 6 sentences alone against inside batches of 2, 7 and 16 with other companions, shorter and
    longer: padded to its own width (padded_width) and batched only with sentences of that width, as the
    front end batches, the same tokens and the same scores to the bit."""

    def search(sources: list[list[int]]) -> list[tuple[list[int], float]]:
        with torch.inference_mode():
            src = padded_sources(sources, torch.device("cpu"))
            if beam == 1:
                found = greedy_search(model, src, 0.0, 12)
            else:
                found = [n[0] for n in beam_search(model, src, beam, 0.6, 0.0, 12)]
        return [(h.tokens, h.score) for h in found]

    probes = sentences(6, seed=1)
    alone = [search([s])[0] for s in probes]
    assert len({tuple(t) for t, _ in alone}) > 1  # the model does not say one thing to everything
    for size, seed in ((2, 2), (7, 3), (16, 4)):
        for i, probe in enumerate(probes):
            batch, position = sentences(size - 1, seed=seed + 10 * i), i % size
            # the companions' lengths within the probe's width: shorter and longer than the probe
            width = padded_width(len(probe) + 1)
            batch = [s[: width - 1] + [5] * max(0, width - 8 - len(s)) for s in batch]
            assert all(padded_width(len(s) + 1) == width for s in batch)
            batch.insert(position, probe)
            assert search(batch)[position] == alone[i], (size, i)


class Ids:
    """A subword model that writes ids as numbers: the front end's texts, checked to the token."""

    def decode(self, seqs: list[list[int]]) -> list[str]:
        return [" ".join(map(str, s)) for s in seqs]


@pytest.mark.parametrize("dtype", ["fp32", "int8"])
@pytest.mark.parametrize("beam", [1, 4])
def test_the_front_end_translates_a_sentence_the_same_alone_and_among_longer_ones(dtype, beam):
    """Through the front end (Translator, as build_translator makes it; fp32 prepacked as inference_model
    builds it): each sentence alone, and among 40 companions of every length, 1 to 30 subwords, in one
    call that batches them by length and width. The same n-best texts and scores to the bit. Before
    sources were padded to a width of their own, a longer companion padded a sentence further, which
    moved its scores in the last bits in fp32 and, through int8's per-row rounding, could change a word."""
    torch.manual_seed(0)
    base = Transformer(make_config().model, VOCAB).eval()
    for p in base.parameters():
        p.data.mul_(2.0)
    cpu = torch.device("cpu")
    model = inference_model(copy.deepcopy(base), Precision(dtype), cpu)
    decode = DecodeConfig(beam=beam, max_len_a=0.0, max_len_b=12, nbest=min(beam, 2))
    translator = Translator(model, Ids(), decode, cpu)
    gen = torch.Generator().manual_seed(7)
    others = [torch.randint(4, VOCAB, (n,), generator=gen).tolist() for n in range(1, 31) for _ in (0, 1)]
    probes = sentences(8, seed=5)
    alone = [translator.search_sources(1, {0: p})[0] for p in probes]
    assert len({a[0][0] for a in alone}) > 1
    every = [*others, *probes]
    together = translator.search_sources(len(every), dict(enumerate(every)))
    for i, found in enumerate(alone):
        assert together[len(others) + i] == found, i
