"""fp32 and bf16 translation with the weights prepacked for oneDNN: the products of F.linear, a row's
result the same in every batch, and the same translations as the model as trained."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nmt.checkpoint import load_model
from nmt.config import Precision
from nmt.model import Transformer
from nmt.translate import Translator
from nmt.translate.builder import inference_model
from nmt.translate.prepacked import (
    PAD_BELOW,
    PAD_SHARE,
    ROW_BUCKETS,
    PrepackedLinear,
    available,
    in_row_buckets,
    keeps_bits_on,
    prepack_model,
    row_pieces,
    row_range,
)
from nmt.translate.search import beam_search

from .synthetic import make_config

# numerics: trains or compares numbers, so `make test` runs it again with the AVX2 kernels forced
pytestmark = [
    pytest.mark.numerics,
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.skipif(not available(), reason="this torch lacks oneDNN's linear operators"),
]


def test_the_product_is_f_linears_on_any_leading_shape():
    torch.manual_seed(0)
    linear = nn.Linear(96, 200)
    for x in (torch.randn(5, 96), torch.randn(7, 1, 96), torch.randn(300, 96)):
        with torch.inference_mode():
            got, want = PrepackedLinear(linear.weight, linear.bias)(x), linear(x)
        assert got.shape == want.shape
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    no_bias = torch.randn(30, 96)
    with torch.inference_mode():
        got = PrepackedLinear(linear.weight, None)(no_bias)
    assert torch.allclose(got, F.linear(no_bias, linear.weight), rtol=1e-5, atol=1e-5)


def test_a_rows_result_is_the_same_in_every_batch():
    """Bit for bit, alone or among up to 2,100 rows (padded, cut in pieces): translations cannot depend on
    what else is in the batch."""
    torch.manual_seed(0)
    linear = PrepackedLinear(torch.randn(300, 64) / 8, torch.randn(300))
    rows = torch.randn(2100, 64)
    with torch.inference_mode():
        alone = torch.cat([linear(rows[i : i + 1]) for i in (0, 5, 63, 64, 100, 999, 2099)])
        for m in (7, 65, 100, 300, 1000, 2100):
            batch = linear(rows[:m])
            for j, i in enumerate((0, 5, 63, 64, 100, 999, 2099)):
                if i < m:
                    assert torch.equal(batch[i], alone[j]), f"row {i} of {m}"


def test_the_fused_relu_is_the_plain_ones_bits():
    """fc1 of a decoder's feed-forward applies the ReLU in its oneDNN call; fusing must change no bit, alone
    or in a batch, or translations would change with it."""
    torch.manual_seed(0)
    weight, bias, rows = torch.randn(256, 64) / 8, torch.randn(256), torch.randn(300, 64)
    plain, fused = PrepackedLinear(weight, bias), PrepackedLinear(weight, bias, "relu")
    with torch.inference_mode():
        for m in (1, 4, 65, 300):
            assert torch.equal(fused(rows[:m]), F.relu(plain(rows[:m]))), m
    model = Transformer(make_config().model, 64).eval()
    assert prepack_model(model)
    assert all(layer.ffn.fc1.activation == "relu" for layer in model.decoder)
    assert all(layer.ffn.activation is F.relu for layer in model.encoder)  # the encoder keeps its own


def test_rows_run_at_a_few_counts_and_only_a_few_are_padding():
    counts = set()
    for m in range(1, 5000):
        pieces = row_pieces(m)
        assert sum(rows for rows, _ in pieces) == m
        assert all(bucket in ROW_BUCKETS and rows <= bucket for rows, bucket in pieces)
        padded = [(rows, bucket) for rows, bucket in pieces if rows != bucket]
        assert len(padded) <= 1 and pieces[-1] == (padded or pieces)[-1]  # only the last piece is padded
        assert all(rows <= PAD_BELOW or (bucket - rows) * PAD_SHARE <= rows for rows, bucket in padded)
        assert len(pieces) <= 6  # 4999 rows: 2048 + 2048 + 512 + 256 + 128 + 7 padded to 8
        counts.update(bucket for _, bucket in pieces)
    assert counts == set(ROW_BUCKETS)  # every row count from 1 to 4999 runs at these 12 shapes only
    assert len(ROW_BUCKETS) <= 12  # each count is a kernel per product shape (memory): the powers of two


@pytest.mark.parametrize("m", [0, 1, 3, 64, 65, 452, 1000])
def test_rows_cut_into_pieces_give_the_whole_product_holding_one_piece_at_a_time(m):
    """in_row_buckets gives the product of all the rows at once, and no piece's output outlives its copy
    into the whole: when a piece is multiplied, no earlier piece's output is still alive (a decoder step's
    output projection is where a batch's memory peaks)."""
    weight = torch.randn(24, 16, generator=torch.Generator().manual_seed(m))
    rows = torch.randn(m, 16, generator=torch.Generator().manual_seed(m + 1))
    alive: list[weakref.ref] = []

    def product(piece: torch.Tensor) -> torch.Tensor:
        assert piece.shape[0] == 0 or piece.shape[0] in ROW_BUCKETS
        assert all(ref() is None for ref in alive)
        y = piece @ weight.t()
        alive.append(weakref.ref(y))
        return y

    out = in_row_buckets(rows, product, 1, 128)
    assert out.shape == (m, 24)
    torch.testing.assert_close(out, rows @ weight.t(), rtol=1e-6, atol=1e-6)
    assert len(alive) == max(1, len(row_pieces(m, 1, 128)))


def test_every_map_is_prepacked_and_the_decoder_steps_as_before():
    torch.manual_seed(0)
    model = Transformer(make_config().model, 64).eval()
    src = torch.randint(4, 64, (3, 9))
    tokens = torch.randint(4, 64, (3, 5))
    with torch.inference_mode():
        eager = model(src, tokens)
        assert prepack_model(model)
        memory, keep = model.encode(src)
        state = model.init_state(memory, keep, max_len=8)
        steps = torch.stack([model.step(tokens[:, t], state)[0] for t in range(tokens.shape[1])], 1)
    assert torch.allclose(steps, eager, atol=1e-4)
    # every map, the encoder's too: F.linear would give a sentence's rows other bits alone than in a batch
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    packed = {name for name, m in model.named_modules() if isinstance(m, PrepackedLinear)}
    assert {"encoder.0.ffn.fc2", "decoder.0.cross_attn.kv_proj", "output_kernel"} <= packed


def test_a_float16_model_is_not_prepacked_and_bfloat16_where_its_probe_passes():
    half = Transformer(make_config().model, 64).to(torch.float16)
    assert not prepack_model(half)
    assert half.output_kernel is None
    assert not any(isinstance(m, PrepackedLinear) for m in half.modules())
    bf16 = Transformer(make_config().model, 64).to(torch.bfloat16)
    assert prepack_model(bf16) == available(torch.bfloat16)
    assert isinstance(bf16.output_kernel, PrepackedLinear) == available(torch.bfloat16)


@pytest.mark.parametrize("beam", [1, 4])
def test_bfloat16_prepacked_searches_a_sentence_alone_as_in_a_batch_and_as_f_linear_nearly(beam):
    """bf16 (`--dtype bf16`, auto with AMX) prepacked: a sentence's hypotheses and scores the same bits
    alone and in a batch, and its steps F.linear's within bf16's rounding."""
    if not available(torch.bfloat16):
        pytest.skip("oneDNN's prepacked bf16 products fail their probe here (missing, or batch-dependent)")
    torch.manual_seed(0)
    eager = Transformer(make_config().model, 64).eval()
    for p in eager.parameters():  # spread the logits, so that the search is not decided by near-ties alone
        p.data.mul_(2.0)
    eager = eager.to(torch.bfloat16)
    model = copy.deepcopy(eager)
    assert prepack_model(model)
    src = torch.randint(4, 64, (6, 11))
    src[:, -1] = 3  # EOS
    tokens = torch.randint(4, 64, (6, 5))
    with torch.inference_mode():
        stepped = []
        for m in (eager, model):
            memory, keep = m.encode(src)
            state = m.init_state(memory, keep, max_len=8)
            stepped.append(torch.stack([m.step(tokens[:, t], state)[0] for t in range(5)], 1).float())
        assert torch.allclose(stepped[1], stepped[0], rtol=0.05, atol=0.05 * stepped[0].abs().max().item())
        batch = beam_search(model, src, beam=beam, lenpen=0.6, max_len_a=0, max_len_b=12, nbest=beam)
        assert any(len(h.tokens) > 1 for hyps in batch for h in hyps)  # searched, not ended at once
        for i in range(6):
            alone = beam_search(
                model, src[i : i + 1], beam=beam, lenpen=0.6, max_len_a=0, max_len_b=12, nbest=beam
            )
            assert [(h.tokens, h.score) for h in alone[0]] == [(h.tokens, h.score) for h in batch[i]]


def test_where_the_operators_fail_their_probe_the_model_keeps_f_linear(monkeypatch):
    import nmt.translate.prepacked as prepacked

    monkeypatch.setattr(prepacked, "available", lambda dtype: False)  # missing, disagreeing, batch-dependent
    model = Transformer(make_config().model, 64)
    assert not prepack_model(model)
    assert model.output_kernel is None
    assert not any(isinstance(m, PrepackedLinear) for m in model.modules())
    assert available()  # the real probe passes on this CPU, or this module would have been skipped


def test_beam_search_of_a_sentence_is_the_same_alone_and_in_a_batch():
    torch.manual_seed(0)
    model = Transformer(make_config().model, 64).eval()
    prepack_model(model)
    src = torch.randint(4, 64, (6, 11))
    src[:, -1] = 3  # EOS
    with torch.inference_mode():
        batch = beam_search(model, src, beam=4, lenpen=0.6, max_len_a=0, max_len_b=12, nbest=4)
        for i in range(6):
            alone = beam_search(model, src[i : i + 1], beam=4, lenpen=0.6, max_len_a=0, max_len_b=12, nbest=4)
            assert [(h.tokens, h.score) for h in alone[0]] == [(h.tokens, h.score) for h in batch[i]]


def test_translations_are_the_trained_models(synthetic_run: Path):
    """The trained reversal model, eager and prepacked: the same lines, and the same scores to 1e-4."""
    checkpoint = synthetic_run / "checkpoints" / "best.pt"
    lines = (synthetic_run / "data" / "valid.xx").read_text().split("\n")[:-1]
    outputs = []
    for prepack in (False, True):
        model, subword, cfg = load_model(checkpoint, torch.device("cpu"))
        model = inference_model(model, Precision.FP32, torch.device("cpu"), prepack=prepack)
        assert any(isinstance(m, PrepackedLinear) for m in model.modules()) == prepack
        translator = Translator(model, subword, cfg.decode, torch.device("cpu"))
        outputs.append(translator.translate(lines))
    assert outputs[0] == outputs[1]


@pytest.mark.slow  # an nmt serve process of its own
def test_nmt_serve_says_it_prepacked_the_decoder(synthetic_run: Path):
    pytest.importorskip("uvicorn", reason="nmt serve needs its extra: pip install 'nmt[serve]'")
    from .servers import Server

    # fp32 named: auto is bf16 on a CPU with AMX (nmt.device.inference_choice), which is not prepacked
    server = Server(synthetic_run / "checkpoints" / "best.pt", "--device", "cpu", "--dtype", "fp32")
    try:
        assert "device cpu, float32 (products prepacked for oneDNN)" in "".join(server.log)
        status, body = server.request("/translate", {"q": "a b c", "source": "xx", "target": "yy"})
        assert (status, body) == (200, {"translatedText": "c b a"})
    finally:
        assert server.stop() == 0


@contextlib.contextmanager
def kernel_off(monkeypatch, off):
    """oneDNN's product as `off(rows, output)` makes it, probed afresh (row_range), for the block; yields
    it. The probes are forgotten after, so that later tests meet the real kernel."""
    real = PrepackedLinear.product

    def product(self, rows):
        return off(rows, real(self, rows))

    monkeypatch.setattr(PrepackedLinear, "product", product)
    row_range.cache_clear()
    try:
        yield product
    finally:
        monkeypatch.setattr(PrepackedLinear, "product", real)
        row_range.cache_clear()
        available.cache_clear()


def test_where_one_row_alone_sums_otherwise_a_single_row_is_multiplied_as_two(monkeypatch):
    """As oneDNN did in fp32 with 2,048 inputs or more on an Intel Xeon with AMX: the probe finds one row's
    kernel off, and a row alone then gets the bits it has among others."""

    def one_row_off(rows, y):
        return y + 1e-3 if rows.shape[0] == 1 else y

    with kernel_off(monkeypatch, one_row_off) as product:
        assert row_range(torch.float32, 64, 300) == (2, 512)
        torch.manual_seed(0)
        linear = PrepackedLinear(torch.randn(300, 64) / 8, torch.randn(300))
        rows = torch.randn(40, 64)
        with torch.inference_mode():
            among = linear(rows)
            assert all(torch.equal(linear(rows[i : i + 1]), among[i : i + 1]) for i in (0, 7, 39))
            assert not torch.equal(product(linear, rows[:1]), among[:1])  # the kernel itself is off


def test_where_rows_change_from_some_count_on_no_product_runs_at_that_many(monkeypatch):
    """As oneDNN's bf16 kernel did with 512 inputs or more on an Intel Xeon with AMX: from 33 rows on, some
    rows got other bits (here the rows past the 32nd of a call). The probe stops at 32, and a product of
    any more rows runs in pieces of at most 32, each row with its bits alone."""

    def past_32_off(rows, y):
        if rows.shape[0] > 32:
            y[32:] += 1e-3
        return y

    with kernel_off(monkeypatch, past_32_off) as product:
        assert row_range(torch.float32, 64, 300) == (1, 32)
        torch.manual_seed(0)
        linear = PrepackedLinear(torch.randn(300, 64) / 8, torch.randn(300))
        assert linear.most == 32
        rows = torch.randn(700, 64)
        with torch.inference_mode():
            among = linear(rows)
            assert all(torch.equal(linear(rows[i : i + 1]), among[i : i + 1]) for i in (0, 31, 32, 33, 699))
            assert not torch.equal(product(linear, rows[:64])[32:], among[32:64])  # the kernel is off


def test_where_rows_change_on_more_threads_only_no_product_runs_at_that_many(monkeypatch):
    """A kernel that gives the rows past the 32nd other bits only when it splits the work among threads:
    the probe on one thread finds nothing, on one and two threads it stops at 32."""

    def threads_off(rows, y):
        if torch.get_num_threads() > 1 and rows.shape[0] > 32:
            y[32:] += 1e-3
        return y

    with kernel_off(monkeypatch, threads_off):
        assert row_range(torch.float32, 64, 300) == (1, 512)  # one thread: nothing is off
        assert row_range(torch.float32, 64, 300, threads=2) == (1, 32)


def test_a_model_whose_products_differ_on_more_threads_searches_on_one(monkeypatch, tmp_path):
    """Prepacked on one thread, the model is probed on two only when a batch would first run on two
    (nmt.translate.threads): with a kernel that changes rows past the 32nd on several threads, batches
    stay on one thread; with the real kernels, on two."""
    from nmt.translate.threads import SearchThreads

    calls = []

    def threads_off(rows, y):
        calls.append(torch.get_num_threads())
        if torch.get_num_threads() > 1 and rows.shape[0] > 32:
            y[32:] += 1e-3
        return y

    stat = tmp_path / "stat"  # /proc/stat of two idle CPUs: no core taken
    stat.write_text("cpu0 0 0 0 100 0 0 0 0\ncpu1 0 0 0 100 0 0 0 0\n")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert available(torch.float32)  # its own check of the real kernel, before the one made off
        with kernel_off(monkeypatch, threads_off):
            model = Transformer(make_config().model, 64)
            assert prepack_model(model) and set(calls) == {1}  # prepacked on one thread only
            assert not keeps_bits_on(model, 2)
            search = SearchThreads(stat, agrees=functools.partial(keeps_bits_on, model))
            assert search.count(400) == 1 and search.count(4) == 1
        row_range.cache_clear()
        plain = Transformer(make_config().model, 64)
        assert prepack_model(plain) and keeps_bits_on(plain, 2)
        assert SearchThreads(stat, agrees=functools.partial(keeps_bits_on, plain)).count(400) == 2
    finally:
        torch.set_num_threads(threads)
        row_range.cache_clear()


def test_where_not_even_two_rows_agree_the_model_keeps_f_linear(monkeypatch):
    def second_row_off(rows, y):
        if rows.shape[0] > 1:
            y[1] += 1e-3
        return y

    with kernel_off(monkeypatch, second_row_off):
        assert row_range(torch.float32, 64, 300) is None
        assert not prepack_model(Transformer(make_config().model, 64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_bits_are_the_same_at_every_count_in_wide_maps(dtype, threads):
    """The real kernels, at shapes where they change a row's bits with the row count on some CPUs (512 to
    4,096 inputs: feed-forward maps of the demo and wmt14 models): each row alone, and among 700, and among
    any first rows of them, gets the same bits, whatever this CPU's kernels do."""
    if not available(dtype):
        pytest.skip(f"oneDNN's prepacked {dtype} products are missing or fail their probe here")
    row_range.cache_clear()  # probed at this test's threads
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    try:
        for inputs, outputs in ((512, 96), (1024, 64), (2048, 48), (4096, 32)):
            weight = (torch.randn(outputs, inputs, generator=gen) / inputs**0.5).to(dtype)
            linear = PrepackedLinear(weight, torch.randn(outputs, generator=gen).to(dtype))
            rows = torch.randn(700, inputs, generator=gen).to(dtype)
            with torch.inference_mode():
                among = linear(rows)
                for m in (1, 2, 5, 33, 40, 64, 100, 129, 300, 513):
                    assert torch.equal(linear(rows[:m]), among[:m]), (inputs, m)
                for i in (0, 1, 31, 32, 33, 63, 64, 255, 256, 699):
                    assert torch.equal(linear(rows[i : i + 1]), among[i : i + 1]), (inputs, i)
    finally:
        row_range.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_wide_models_sentence_searches_the_same_alone_and_among_forty(dtype):
    """A model whose feed-forward maps have 1,024 inputs, on two threads, beam 4: 40 sentences make 160 rows
    a decoder step and hundreds an encoder product, where (in bf16 with AMX) the kernels change a row's
    bits; each sentence's hypotheses and scores are the same bits alone."""
    if not available(dtype):
        pytest.skip(f"oneDNN's prepacked {dtype} products are missing or fail their probe here")
    row_range.cache_clear()
    torch.set_num_threads(2)
    try:
        cfg = dataclasses.replace(make_config().model, d_ff=1024)
        torch.manual_seed(0)
        model = Transformer(cfg, 64).eval()
        for (
            p
        ) in model.parameters():  # spread the logits, so that the search is not decided by near-ties alone
            p.data.mul_(2.0)
        model = model.to(dtype)
        assert prepack_model(model)
        src = torch.randint(4, 64, (40, 16))
        src[:, -1] = 3  # EOS
        with torch.inference_mode():
            batch = beam_search(model, src, beam=4, lenpen=0.6, max_len_a=0, max_len_b=10, nbest=2)
            for i in range(0, 40, 3):
                alone = beam_search(
                    model, src[i : i + 1], beam=4, lenpen=0.6, max_len_a=0, max_len_b=10, nbest=2
                )
                assert [(h.tokens, h.score) for h in alone[0]] == [(h.tokens, h.score) for h in batch[i]], i
    finally:
        row_range.cache_clear()
