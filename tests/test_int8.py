"""`--dtype int8`: every linear map, the tied output projection included, in 8 bits, close to fp32."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import sacrebleu
import torch
from torch import nn
from typer.testing import CliRunner

from nmt.cli import app
from nmt.config import Precision
from nmt.device import cpu_bf16_native, resolve_dtype
from nmt.errors import NmtError
from nmt.model import Transformer
from nmt.translate import int8
from nmt.translate.int8 import Int8Linear, quantize_int8
from nmt.translate.prepacked import available as prepacked_available

from .synthetic import make_config, translate_summary

# numerics: trains or compares numbers, so `make test` runs it again with the AVX2 kernels forced
pytestmark = [pytest.mark.numerics, pytest.mark.usefixtures("one_torch_thread")]


def test_an_int8_linear_map_is_within_a_few_percent_of_float():
    torch.manual_seed(0)
    linear = nn.Linear(256, 1024)
    x = torch.randn(12, 1, 256)
    exact, approx = linear(x), Int8Linear(linear.weight, linear.bias)(x)
    assert approx.shape == exact.shape == (12, 1, 1024)
    error = (approx - exact).norm() / exact.norm()
    assert 0 < error < 0.03, f"relative error {error:.4f}"  # 0: it must not be fp32 in disguise


def test_fbgemms_product_does_not_ask_its_packed_weights_for_a_torch_function(monkeypatch):
    """torch looks __torch_function__ up on every argument of an operator called from Python; on fbgemm's
    packed weights, a TorchScript object, that lookup threw and caught a C++ exception at every call, half
    of a one-row product's time (nmt.translate.int8._Fbgemm.linear). The product asks for none, and gives
    the bits of the operator called plainly."""
    torch.manual_seed(0)
    weight, bias = torch.randn(32, 64) / 8, torch.randn(32)
    product = int8._Fbgemm(weight, bias, 7)
    rows = torch.randn(5, 64)
    asked = []
    lookup = torch.ScriptObject.__getattr__

    def spy(obj, name):
        asked.append(name)
        return lookup(obj, name)

    monkeypatch.setattr(torch.ScriptObject, "__getattr__", spy)
    with torch.inference_mode():
        got = product(rows)
        assert asked == []
        a = rows.abs().amax(dim=1, keepdim=True)
        plain = torch.ops.quantized.linear_dynamic(product.spanned(rows, a), product.weight, True)
        assert asked == ["__torch_function__"]  # the spy sees the lookup where it is made
    assert torch.equal(got, torch.addcmul(bias, plain, a))


def test_fbgemms_product_skips_the_python_check_of_its_arguments_for_a_traces_fake_objects(monkeypatch):
    """torch's Python wrapper of an operator with a TorchScript argument (fbgemm's packed weights) looks
    through the arguments of every call for a trace's fake objects: 5 us of a one-row product's 13-18.
    The product calls the operator's C++ function, which the wrapper itself calls after that check."""
    torch.manual_seed(0)
    product = int8._Fbgemm(torch.randn(32, 64) / 8, torch.randn(32), 7)
    checked = []
    check = torch._ops._must_dispatch_in_python

    def spy(args, kwargs):
        checked.append(len(args))
        return check(args, kwargs)

    monkeypatch.setattr(torch._ops, "_must_dispatch_in_python", spy)
    rows = torch.randn(3, 64)
    with torch.inference_mode():
        got = product(rows)
        assert checked == []
        a = rows.abs().amax(dim=1, keepdim=True)
        plain = torch.ops.quantized.linear_dynamic(product.spanned(rows, a), product.weight, True)
        assert checked == [3]  # the spy sees the wrapper's check where it is made
    assert torch.equal(got, torch.addcmul(product.bias, plain, a))


def test_fbgemms_few_rows_divide_into_a_buffer_of_their_threads_kept_between_calls():
    """A call of a few rows (a sentence's decoder step) divides them into a buffer this thread keeps, not
    into a tensor of its own built in four operators; each thread has its own (`nmt translate`'s workers
    and `nmt serve` share one model), and it is no inference tensor, so a call outside inference mode
    after one inside still writes it. Calls of more rows build their own."""
    import threading

    torch.manual_seed(0)
    product = int8._Fbgemm(torch.randn(32, 64) / 8, torch.randn(32), 7)
    rows = torch.randn(2, 64)
    with torch.inference_mode():
        first = product(rows)
        kept = product.spanned(rows, 1.0)
    with torch.no_grad():
        assert torch.equal(product(rows), first)
        assert product.spanned(rows * 2, 1.0) is kept and torch.equal(kept[:, :64], rows * 2)
        large = torch.randn(int8.KEPT_ROWS + 1, 64)
        assert product.spanned(large, 1.0) is not product.spanned(large, 1.0)
        elsewhere = []
        thread = threading.Thread(target=lambda: elsewhere.append(product.spanned(rows * 3, 1.0)))
        thread.start()
        thread.join()
        assert elsewhere[0] is not kept and torch.equal(kept[:, :64], rows * 2)
        assert torch.equal(elsewhere[0][:, :64], rows * 3) and torch.equal(kept[:, 64:], elsewhere[0][:, 64:])


def test_fbgemms_output_projection_gives_a_union_its_integers_without_prepacking_row_by_row(monkeypatch):
    """A shortlist builds its union of the output projection's rows for every batch. fbgemm prepacks a
    matrix of one scale per row one row's scale at a time, each through item() (1.37 ms for one
    sentence's 320 rows, against 0.28 for one scale over all), and quantizing the rows' floats again
    took 0.73 ms more: the output projection's product (built to `gather`) keeps one scale of 1 in
    fbgemm's copy and its rows' own scales beside it, and a union gathers its integers."""
    torch.manual_seed(0)
    weight, bias = torch.randn(500, 64) / 8, torch.randn(500)
    ids = torch.randperm(500)[:96].sort().values
    full = Int8Linear(weight, bias, gather=True, product=int8._Fbgemm(weight, bias, 7, gather=True))

    def refused(*args, **kwargs):
        raise AssertionError("quantized again")

    monkeypatch.setattr(torch, "quantize_per_channel", refused)
    with torch.inference_mode():
        union = full.over(ids, lambda: (weight[ids], bias[ids]))
        packed = torch.ops.quantized.linear_unpack(union.product.weight)[0]
        assert packed.qscheme() == torch.per_tensor_affine and packed.q_scale() == 1.0
        x = torch.randn(7, 64)
        assert torch.equal(union(x), full(x)[:, ids])
    assert torch.equal(union.product.integers(), full.product.integers()[ids])


def test_every_linear_map_and_the_output_projection_are_quantized():
    torch.manual_seed(0)
    model = Transformer(make_config().model, 64).eval()
    src = torch.randint(4, 64, (3, 9))
    tgt = torch.randint(4, 64, (3, 7))
    with torch.inference_mode():
        exact = model(src, tgt)
        quantize_int8(model)
        approx = model(src, tgt)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert isinstance(model.output_kernel, Int8Linear)
    # the output projection gives a shortlist's unions its integers (oneDNN's prepacked copy keeps none)
    if int8.kernel()[0] is not int8._OneDNN:
        assert model.output_kernel.product.gathered(torch.arange(8)) is not None
    error = (approx - exact).norm() / exact.norm()
    assert 0 < error < 0.05, f"relative error of the logits {error:.4f}"


def test_the_output_bias_of_an_imported_marian_model_stays_in_the_int8_projection():
    import dataclasses

    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(make_config().model, output_bias=True), 64).eval()
    model.output_bias.normal_(0, 3.0)  # large enough to dominate the logits where it were lost
    y = torch.randn(5, model.cfg.d_model)
    with torch.inference_mode():
        exact = model.output(y)
        quantize_int8(model)
        approx = model.output(y)
    error = (approx - exact).norm() / exact.norm()
    assert error < 0.05, f"relative error of the logits {error:.4f}"


def test_each_member_of_an_ensemble_is_quantized():
    from nmt.translate.builder import inference_model
    from nmt.translate.ensemble import Ensemble

    members = [Transformer(make_config().model, 64) for _ in range(2)]
    inference_model(Ensemble(members), Precision.INT8, torch.device("cpu"))
    assert all(isinstance(m.output_kernel, Int8Linear) for m in members)
    assert not any(isinstance(m, nn.Linear) for member in members for m in member.modules())


def test_int8_is_refused_off_float32():
    model = Transformer(make_config().model, 64).to(torch.bfloat16)
    with pytest.raises(NmtError, match="int8"):
        quantize_int8(model)


def translate(model: Path, source: Path, *options: str) -> list[str]:
    result = CliRunner().invoke(app, ["translate", "-m", str(model), "-i", str(source), *options])
    assert result.exit_code == 0, result.output
    return result.stdout.split("\n")[:-1]


def test_the_log_says_what_the_products_run_in_and_why(synthetic_run: Path):
    """The summary line of `nmt translate`: int8's kernel and bits as the probe found them on this CPU,
    and for --dtype auto what it chose and why (bf16 with AMX, else fp32, and whether bf16 is native);
    nothing to explain for a choice the user made."""

    def summary(*options: str) -> str:
        return translate_summary(synthetic_run, *options)

    kernel, bits = int8.kernel()
    assert f"device cpu, int8, by {kernel.name} with {bits}-bit " in summary("--dtype", "int8")
    native = cpu_bf16_native()
    auto = summary("--device", "cpu")
    dtype = "bfloat16" if native else "float32"
    packed = (
        " (products prepacked for oneDNN)"
        if prepacked_available(resolve_dtype(Precision.AUTO, torch.device("cpu")))
        else ""
    )
    assert f"device cpu, {dtype}{packed}, the default on a CPU " in auto
    assert ("with native bf16 (" in auto) == native and ("without native bf16" in auto) == (not native)
    fp32 = summary("--device", "cpu", "--dtype", "fp32")
    assert "prepacked for oneDNN)" in fp32
    # how many rows each runs for depends on the row counts oneDNN keeps a row's bits at on this CPU
    scripted = (
        r", encoder( \(up to \d+ source tokens\))?(,| and) decoder steps( \(up to \d+ rows\))?"
        r"( and the searches \(up to \d+ rows\))? in TorchScript$"
    )
    assert re.search(scripted, fp32), fp32


def test_int8_translations_score_as_fp32s(synthetic_run: Path):
    """The trained reversal model through `nmt translate --dtype int8`: BLEU against the references
    within a point of fp32's, and most lines the same as fp32's."""
    model, source = synthetic_run / "checkpoints" / "best.pt", synthetic_run / "data" / "valid.xx"
    refs = (synthetic_run / "data" / "valid.yy").read_text().split("\n")[:-1]
    fp32 = translate(model, source, "--dtype", "fp32", "--device", "cpu")
    int8 = translate(model, source, "--dtype", "int8", "--device", "cpu")
    assert len(int8) == len(fp32) == len(refs)
    bleu_fp32 = sacrebleu.corpus_bleu(fp32, [refs]).score
    bleu_int8 = sacrebleu.corpus_bleu(int8, [refs]).score
    assert bleu_int8 >= bleu_fp32 - 1.0, f"int8 {bleu_int8:.2f} vs fp32 {bleu_fp32:.2f}"
    same = sum(a == b for a, b in zip(int8, fp32, strict=True)) / len(fp32)
    assert same >= 0.9, f"{same:.0%} of lines as fp32's"


@pytest.mark.slow  # an nmt serve process of its own
def test_nmt_serve_loads_int8(synthetic_run: Path):
    pytest.importorskip("uvicorn", reason="nmt serve needs its extra: pip install 'nmt[serve]'")
    from .servers import Server

    server = Server(synthetic_run / "checkpoints" / "best.pt", "--dtype", "int8", "--device", "cpu")
    try:
        kernel, bits = int8.kernel()
        assert f", int8, by {kernel.name} with {bits}-bit " in "".join(server.log)  # what runs, and why
        status, body = server.request("/translate", {"q": "a b c", "source": "xx", "target": "yy"})
        assert (status, body) == (200, {"translatedText": "c b a"})
    finally:
        assert server.stop() == 0


def test_int8_on_a_gpu_is_refused_in_one_line():
    from nmt.translate.builder import inference_model

    model = Transformer(make_config().model, 64)
    with pytest.raises(NmtError, match="--dtype int8 runs on the CPU"):
        inference_model(model, Precision.INT8, torch.device("cuda"))
