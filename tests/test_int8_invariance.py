"""`--dtype int8` quantizes activations per row, so a sentence's int8 translation is the same alone and
inside any batch (nmt.translate.int8): byte-identical hypotheses and scores, not merely close ones."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from nmt.config import DecodeConfig, Precision
from nmt.model import FeedForward, Transformer
from nmt.translate import Translator, inference_model
from nmt.translate.int8 import (
    ALL_ROWS,
    KERNELS,
    ONEDNN_EXACT_SUMS,
    PROBE_ROWS,
    Int8Linear,
    _row_integers,
    _shifted_sums,
    kernel,
    quantize_int8,
    weight_bits,
)
from nmt.translate.prepacked import applied
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


def runnable() -> list:
    """The kernels of KERNELS that run exactly on this CPU, each with its bits."""
    found = []
    for product in KERNELS:
        try:
            bits = product.probe()
        except (AttributeError, RuntimeError, NotImplementedError):
            continue  # not in this torch
        if bits is not None:
            found.append(pytest.param((product, bits), id=product.name))
    return found


@pytest.fixture(params=runnable())
def each_kernel(request, monkeypatch):
    """Every kernel that runs here in turn, not only the one `kernel` prefers."""
    monkeypatch.setattr("nmt.translate.int8.kernel", lambda: request.param)
    return request.param


def test_an_int8_row_is_the_same_alone_and_among_any_rows(each_kernel):
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


def test_a_relu_folded_into_the_next_maps_quantization_gives_its_very_bits(each_kernel):
    """fc2 of a feed-forward block quantizes max(0, x) itself (quantize_int8 folds the ReLU in): the same
    output as the ReLU before it, to the bit, at every row count, eagerly and in TorchScript; and
    quantize_int8 folds it into every ReLU block."""
    torch.manual_seed(1)
    linear = nn.Linear(160, 96)
    x = torch.randn(300, 160) * torch.logspace(-2, 2, 300)[:, None]
    x[5] = -x[5].abs()  # a row with no positive input: only the bias
    x[6, ::3] = 0.0
    with torch.inference_mode():
        plain, folded = Int8Linear(linear.weight, linear.bias), Int8Linear(linear.weight, linear.bias)
        folded.product.relu_input = True
        module, most = folded.scripted(8) or (None, 0)
        module = torch.jit.script(module) if module is not None else None
        for rows in (1, 2, 4, 7, 8, 64, 300):
            expected = plain(torch.relu(x[:rows]))
            assert torch.equal(folded(x[:rows]), expected), rows
            if module is not None and rows <= most:
                assert torch.equal(module(x[:rows]), expected), rows
        assert torch.equal(folded(x[5:6])[0], linear.bias)
    model = quantize_int8(Transformer(make_config().model, VOCAB).eval())
    ffns = [m for m in model.modules() if isinstance(m, FeedForward)]
    assert ffns and all(f.activation is applied and f.fc2.product.relu_input for f in ffns)


@pytest.mark.parametrize("few_rows", [0, 1, 3, 32])
def test_the_kernel_chosen_by_rows_gives_the_same_bits_on_both_sides_of_its_crossover(monkeypatch, few_rows):
    """int_mm+onednn multiplies up to `few_rows` rows by torch._int_mm and more by oneDNN, a crossover
    timed on the CPU at hand: whatever the timing says, a row's output is the same alone, among rows of
    either kernel, and as a product that runs one kernel only."""
    by_rows = next((p.values[0][0] for p in runnable() if p.id == "int_mm+onednn"), None)
    if by_rows is None:
        pytest.skip("int_mm and oneDNN are not both exact with 8 bits here (no VNNI, or AVX2 forced)")
    monkeypatch.setattr("nmt.translate.int8.kernel", lambda: (by_rows, 8))
    monkeypatch.setattr("nmt.translate.int8._few_rows", lambda *shape: few_rows)
    torch.manual_seed(0)
    linear = nn.Linear(256, 320)
    x = torch.randn(300, 256) * torch.logspace(-2, 2, 300)[:, None]
    with torch.inference_mode():
        int8 = Int8Linear(linear.weight, linear.bias)
        alone = torch.cat([int8(x[i : i + 1]) for i in range(len(x))])
        for rows in (2, 3, 4, 31, 32, 33, 300):
            for start in (0, 300 - rows):
                assert torch.equal(int8(x[start : start + rows]), alone[start : start + rows]), (rows, start)
        q, _ = _row_integers(x)
        onednn, int_mm = by_rows.probed(int8.product.few.weight_t.t(), int8.product.few.scales)
        assert torch.equal(onednn.multiply(q), int_mm.multiply(q))
        # a model's own product has oneDNN's copy of its weights before workers fork (they share it); one
        # built for one batch (a shortlist's union) makes it only once more rows than `few_rows` come
        assert Int8Linear(linear.weight, linear.bias).product.many is not None
        union = int8.over(torch.arange(64), lambda: (linear.weight[:64], linear.bias[:64]))
        assert torch.equal(union(x[:1]), alone[:1, :64])
        assert (union.product.many is None) == (few_rows >= 1)
        assert torch.equal(union(x), alone[:, :64])
        assert union.product.many is not None


def test_a_map_whose_sums_onednn_would_round_stays_on_int_mm_for_every_row_count():
    """oneDNN's kernel for many rows sums q + 128 and is exact only below 2^24; weights that let that sum
    pass it (a 1,040-wide map, rows all +-127, as a wmt14 big model's 4,096-wide maps may) are multiplied
    by _int_mm for every row count, so the rows that reach such sums are the same alone and in a batch."""
    by_rows = next((p.values[0][0] for p in runnable() if p.id == "int_mm+onednn"), None)
    if by_rows is None:
        pytest.skip("int_mm and oneDNN are not both exact with 8 bits here (no VNNI, or AVX2 forced)")
    gen = torch.Generator().manual_seed(0)
    width = 1040
    weight = torch.randn(64, width, generator=gen)
    weight[0], weight[1] = 1.0, -1.0  # integers all +127, all -127
    x = torch.randn(300, width, generator=gen)
    x[:, :4] = 127.0  # each row's scale set by its first inputs; q + 128 of the others around 128
    assert _shifted_sums(by_rows(weight[2:], torch.zeros(62), 8).integers()) < ONEDNN_EXACT_SUMS
    with torch.inference_mode():
        int8 = Int8Linear(weight, None, product=by_rows(weight, torch.zeros(64), 8))
        assert _shifted_sums(int8.product.integers()) >= ONEDNN_EXACT_SUMS
        assert int8.product.few_rows == ALL_ROWS and int8.product.many is None
        alone = torch.cat([int8(x[i : i + 1]) for i in range(len(x))])
        assert torch.equal(int8(x), alone)
        q, scale = _row_integers(x)
        assert scale.eq(1).all()  # so the output is the exact sums times the weights' scales
        exact = (q.long() @ int8.product.integers().long().t()).float()
        assert torch.equal(alone, exact.mul_(int8.product.scales))


@pytest.mark.parametrize("gather", [True, False], ids=["output-projection", "other-map"])
def test_a_union_of_output_rows_gives_the_full_maps_numbers(each_kernel, gather):
    """A shortlist's union of the output projection's rows (`Int8Linear.over`): its integers gathered
    where the kernel keeps them (the output projection is built to `gather`), else its floats quantized
    again; either way each column the full map's, to the bit, and the integers those rows quantized
    alone give."""
    torch.manual_seed(0)
    weight, bias = torch.randn(500, 64), torch.randn(500)
    ids = torch.randperm(500)[:96].sort().values
    x = torch.randn(40, 64) * torch.logspace(-2, 2, 40)[:, None]
    with torch.inference_mode():
        full = Int8Linear(weight, bias, gather=gather)
        union = full.over(ids, lambda: (weight[ids], bias[ids]))
        for rows in (1, 4, 40):
            assert torch.equal(union(x[:rows]), full(x[:rows])[:, ids]), rows
    kept = union.product.integers() if hasattr(union.product, "integers") else None
    if kept is not None:
        assert torch.equal(kept, Int8Linear(weight[ids], bias[ids], gather=gather).product.integers())


def test_the_preferred_kernel_is_exact_here_with_seven_or_eight_bits():
    # 8 with VNNI or AMX; 7 where pairs of products add in int16 (AVX2, as `make test` forces for numerics)
    product, bits = kernel()
    assert bits in (7, 8) and weight_bits() == bits
    assert product.exact_with(bits)


def test_an_int8_layer_is_within_its_quantization_error_of_float32(each_kernel):
    """Each kernel's output against F.linear, within the error its integers allow: every activation off
    by at most half a step of its row's grid (max |x_r| / 127 for 8 bits, twice that for 7), every weight
    by half a step of its row's (max |W_o| / 127, or / 63), summed over the row with the float32 part."""
    torch.manual_seed(0)
    linear, x = nn.Linear(64, 48), torch.randn(37, 64) * torch.logspace(-1, 1, 37)[:, None]
    product, bits = each_kernel
    with torch.inference_mode():
        y, exact = Int8Linear(linear.weight, linear.bias)(x).double(), linear(x).double()
    dx = x.abs().amax(1, keepdim=True).double() / 127  # (37, 1) half a step of 7-bit activations (or more)
    dw = linear.weight.abs().amax(1).double() / 63  # (48,) half a step of 7-bit weights (or more)
    w, a = linear.weight.abs().double(), x.abs().double()
    bound = dx * w.sum(1)[None, :] + a.sum(1, keepdim=True) * dw[None, :] + 64 * dx * dw[None, :]  # (37, 48)
    assert ((y - exact).abs() <= bound + 1e-5).all(), (product.name, bits)
    assert ((y - exact).abs() > 0).any()  # int8, not float32 by another name


@pytest.mark.parametrize("wrong_at", [1, 64, 512])
def test_the_bits_probe_checks_the_product_at_several_row_counts(monkeypatch, each_kernel, wrong_at):
    """A library may choose another kernel by shape: a product wrong at one row count alone is found."""
    assert wrong_at in PROBE_ROWS
    product, bits = each_kernel
    assert product.exact_with(bits)
    if hasattr(product, "multiply"):  # rows quantized here
        right = product.multiply
        monkeypatch.setattr(product, "multiply", lambda self, q: right(self, q) + (q.shape[0] == wrong_at))
    else:  # fbgemm quantizes itself
        right = product.linear
        monkeypatch.setattr(
            product, "linear", staticmethod(lambda x, w, r: right(x, w, r) + (x.shape[0] == wrong_at))
        )
    assert not product.exact_with(bits)


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
        got = together[len(others) + i]
        if dtype == "int8" or got == found:
            assert got == found, i
            continue
        # fp32 on a CPU whose kernels round a row by the batch it is in: on an Intel Xeon with AVX-512 (no
        # BF16) the scores moved by 4e-7 to 1.3e-6 relative, whatever ISA the kernels were held to, on the
        # code of every landing so far; the texts, which are what a user reads, may not move at all. 1e-5:
        # twelve steps, each a log-softmax and products of 64-256 terms rounded at 6e-8.
        assert [t for t, _ in got] == [t for t, _ in found], i
        for (_, a), (_, b) in zip(got, found, strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (i, a, b)
