"""The GPU path: bf16 training, the fused loss, the pinned loader, cached bf16 decoding, compiled training,
device-to-CPU checkpoints and exact resume, each against its reference.

Every test takes the device as a parameter. The `cuda` case carries `@pytest.mark.gpu` and skips without
a CUDA GPU (benchmarks/gpu_check.py runs `pytest -m gpu` on one); the `cpu` case runs in the normal suite,
so each test's logic has run before a GPU ever sees it.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console

from nmt.data.binarized import ParallelData
from nmt.data.loader import Loader, Update, prepare, to_device, update_plan
from nmt.device import DTYPES, resolve_device
from nmt.model import Transformer
from nmt.tokens import BOS, EOS, PAD
from nmt.train.loss import label_smoothed_nll, projected_label_smoothed_nll
from nmt.train.runtime import Runtime
from nmt.train.update import Learner, forward_backward, optimizer_step

from .synthetic import make_config, make_workdir, reverse

# numerics: trains or compares numbers, so `make test` runs it again with the AVX2 kernels forced
pytestmark = pytest.mark.numerics

CUDA = torch.cuda.is_available()
NO_CUDA = "needs a CUDA GPU (torch.cuda.is_available() is False here)"
ON_CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason=NO_CUDA)])
DEVICES = pytest.mark.parametrize("device", ["cpu", ON_CUDA])
VOCAB = 64


@pytest.fixture(autouse=True)
def exact_fp32():
    """fp32 means fp32: no TF32 matmuls (nmt's runtime turns them on for training on a GPU)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture(scope="module")
def reversal(tmp_path_factory) -> Path:
    """Preprocessed data of the reversal task (tests/synthetic.py), shared by this module's tests."""
    root = tmp_path_factory.mktemp("reversal")
    make_workdir(root, n_train=2000, n_valid=40)
    return root / "data"


def fresh_workdir(tmp_path: Path, data: Path, name: str = "run") -> Path:
    workdir = tmp_path / name
    workdir.mkdir()
    (workdir / "data").symlink_to(data)
    return workdir


def random_update(device: str, seed: int, sizes=((6, 9, 8), (4, 12, 11))) -> Update:
    """An update of micro-batches (rows, source length, target length) of random ids with padding."""
    g = torch.Generator().manual_seed(seed)
    batches, targets = [], 0
    for rows, s, t in sizes:
        src = torch.randint(4, VOCAB, (rows, s), generator=g)
        tgt = torch.randint(4, VOCAB, (rows, t), generator=g)
        for r in range(1, rows, 2):  # every other row shorter: padding on both sides
            src[r, s - 1 - r // 2 :] = PAD
            tgt[r, t - 1 - r // 2 :] = PAD
        src[torch.arange(rows), (src != PAD).sum(1) - 1] = EOS
        # y is a row's real tokens but the last: tgt_in = BOS y, tgt_out = y EOS, as collate makes them
        tgt_in = torch.cat([torch.full((rows, 1), BOS), tgt[:, :-1]], 1)
        tgt_out = tgt.clone()
        tgt_out[torch.arange(rows), (tgt != PAD).sum(1) - 1] = EOS
        targets += int((tgt_out != PAD).sum())
        batches.append((src, tgt_in, tgt_out))
    update = Update(batches, torch.tensor([float(targets)]), targets, 0, 0, 0, 0)
    return to_device(update, resolve_device(device))


def tiny_model(device: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> Transformer:
    torch.manual_seed(seed)
    cfg = dataclasses.replace(make_config().model, dropout=0.0, **overrides)
    return Transformer(cfg, VOCAB).to(device=device, dtype=dtype)


def learner(model: Transformer, rt: Runtime, net: torch.nn.Module | None = None) -> Learner:
    """The trainer's Learner around `model`: label smoothing 0.1, no clipping, a plain SGD step."""
    train = dataclasses.replace(make_config().train, label_smoothing=0.1, clip_norm=0.0)
    net = model if net is None else net  # a compiled module has no truth value
    return Learner(net, model, torch.optim.SGD(model.parameters(), lr=0.01), None, train, rt)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want||, in float64."""
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp(min=1e-30)).item()


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


# ---------------------------------------------------------------------------------------------------------
# Training in bf16


def jitter_to_bf16_rounding(model: torch.nn.Module, seed: int) -> None:
    """Move every weight by up to half a bf16 unit in the last place (relative 2^-9): a model that bf16
    cannot tell from the original, whose bf16 rounding may fall the other way."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 + (torch.rand(p.shape, generator=g) - 0.5).to(p.device) * 2**-8)


@DEVICES
def test_a_bf16_update_gives_the_fp32_loss_and_gradients(device):
    """One update of two micro-batches through the trainer's forward/backward under bf16 autocast gives
    the fp32 loss and gradients to within bf16's own rounding, the weights and gradients still fp32
    (autocast keeps fp32 master weights).

    The bound is measured, not a constant that one CPU happens to meet (native bf16 kernels round
    otherwise than emulated ones): the spread between bf16 updates of models that differ only below
    bf16's resolution (`jitter_to_bf16_rounding`). Both are draws of bf16's rounding noise, so the bf16
    error is about 1/sqrt(2) of that spread; twice the spread allows for the draw."""
    update = random_update(device, seed=1)
    norm = 1 / update.target_tokens
    rt = {
        dtype: Runtime(device=resolve_device(device), dtype=dtype)
        for dtype in (torch.float32, torch.bfloat16)
    }

    def run(dtype: torch.dtype, jitter: int | None = None):
        model = tiny_model(device).train()
        if jitter is not None:
            jitter_to_bf16_rounding(model, jitter)
        sums = forward_backward(learner(model, rt[dtype]), update.batches, norm)
        return sums.cpu(), gradients(model)

    sums32, grads32 = run(torch.float32)
    sums16, grads16 = run(torch.bfloat16)
    spread = [run(torch.bfloat16, jitter) for jitter in (1, 2, 3)]
    assert sums16.dtype == torch.float32
    assert not torch.equal(sums16, sums32)  # bf16 really ran: some rounding differs
    loss_spread = max((s - sums16).abs().max().item() for s, _ in spread)
    assert (sums16 - sums32).abs().max().item() <= 2 * loss_spread
    assert grads16.keys() == grads32.keys() and len(grads32) == len(list(tiny_model("cpu").parameters()))
    for name, g in grads16.items():
        assert g.dtype == torch.float32, name
        bound = 2 * max(relative_error(grads[name], g) for _, grads in spread)
        assert relative_error(g, grads32[name]) <= bound, (name, relative_error(g, grads32[name]), bound)


# ---------------------------------------------------------------------------------------------------------
# The fused output projection and loss


@DEVICES
@pytest.mark.parametrize("chunk", ["one", "default", "odd"])
def test_the_fused_loss_on_the_device_equals_the_reference(device, chunk):
    """projected_label_smoothed_nll in fp32 against the plain loss of the projected logits in float64,
    values and gradients. On a GPU at WMT's shapes (37,000 subwords, d_model 512): the default chunk
    there is 2^26 logits, ~1,800 rows, so 6,000 rows are several chunks; `one` is a single chunk of
    all rows, `odd` chunks that do not divide them."""
    rows, vocab, d = (6000, 37000, 512) if device == "cuda" else (300, 1000, 32)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(rows // 20, 20, d, generator=g).to(device).requires_grad_()
    weight = (torch.randn(vocab, d, generator=g) / d**0.5).to(device).requires_grad_()
    target = torch.randint(4, vocab, (rows // 20, 20), generator=g)
    target[::3, 15:] = PAD
    target = target.to(device)
    size = {"one": rows, "default": 0, "odd": 97}[chunk]
    loss, nll = projected_label_smoothed_nll(hidden, weight, target, 0.1, PAD, chunk=size)
    got = torch.autograd.grad(loss, (hidden, weight))

    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    ref_loss, ref_nll = label_smoothed_nll(h64 @ w64.t(), target, 0.1, PAD)
    want = torch.autograd.grad(ref_loss, (h64, w64))
    assert loss.dtype == torch.float32 and loss.device.type == device
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
    assert nll.item() == pytest.approx(ref_nll.item(), rel=1e-5)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == torch.float32
        assert relative_error(a, b) < 1e-4
    assert got[0][0, 15:].abs().max() == 0  # padding rows get no gradient


@DEVICES
def test_the_fused_loss_under_bf16_autocast_matches_autocast_linear(device):
    """Under autocast the fused loss projects in bf16 as F.linear would, and sums in fp32."""
    rows, vocab, d = (4000, 37000, 512) if device == "cuda" else (300, 1000, 32)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(rows, d, generator=g).to(device).requires_grad_()
    weight = (torch.randn(vocab, d, generator=g) / d**0.5).to(device).requires_grad_()
    target = torch.randint(4, vocab, (rows,), generator=g).to(device)
    with torch.autocast(device, dtype=torch.bfloat16):
        loss, _ = projected_label_smoothed_nll(hidden, weight, target, 0.1, PAD, chunk=0)
        ref, _ = label_smoothed_nll(F.linear(hidden, weight), target, 0.1, PAD)
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(ref.item(), rel=2e-3)
    got = torch.autograd.grad(loss, (hidden, weight))
    want = torch.autograd.grad(ref, (hidden, weight))
    for a, b in zip(got, want, strict=True):
        assert a.dtype == torch.float32
        assert relative_error(a, b) < 0.02


# ---------------------------------------------------------------------------------------------------------
# The loader


def spin_cycles(seconds: float) -> int:
    """GPU clock cycles that torch.cuda._sleep spins for at least `seconds`."""
    cycles = 1 << 20
    while True:
        torch.cuda.synchronize()
        start = time.perf_counter()
        torch.cuda._sleep(cycles)
        torch.cuda.synchronize()
        if time.perf_counter() - start >= seconds:
            return cycles
        cycles *= 4


@DEVICES
def test_the_loader_pins_and_copies_without_blocking(device, reversal):
    """The background loader gives the updates that `prepare` collates, on the device. On a GPU the
    host tensors are pinned and the copies are queued: they return while a kernel still runs before
    them on the stream, and arrive intact."""
    data = ParallelData(reversal / "train")
    cfg = make_config(batch_tokens=256, update_tokens=512)  # two micro-batches an update
    plan = update_plan(data, cfg, 0, 1, 0, 0)
    want = [prepare(data, next(plan), pin=False) for _ in range(3)]
    # resolve_device: cuda:0, as the trainer passes it; the loader's thread selects the GPU by its index
    with Loader(data, update_plan(data, cfg, 0, 1, 0, 0), resolve_device(device)) as loader:
        got = [next(loader) for _ in range(3)]
    for a, b in zip(got, want, strict=True):
        assert len(a.batches) == len(b.batches) == 2 and a.targets == b.targets
        assert a.target_tokens.device.type == device
        for x, y in zip(a.batches, b.batches, strict=True):
            assert all(t.device.type == device for t in x)
            assert all(torch.equal(s.cpu(), t) for s, t in zip(x, y, strict=True))
    if device != "cuda":
        return
    pinned = prepare(data, next(update_plan(data, cfg, 0, 1, 0, 0)), pin=True)
    assert pinned.target_tokens.is_pinned() and all(t.is_pinned() for b in pinned.batches for t in b)
    host = [t.clone() for b in pinned.batches for t in b]
    cycles = spin_cycles(0.2)
    torch.cuda._sleep(cycles)  # the stream is busy for 0.2 s or more
    moved = to_device(pinned, resolve_device(device))
    still_busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert still_busy, "to_device waited for the stream: the copies were not asynchronous"
    arrived = [t.cpu() for b in moved.batches for t in b]
    assert all(torch.equal(a, b) for a, b in zip(arrived, host, strict=True))


# ---------------------------------------------------------------------------------------------------------
# Decoding


@DEVICES
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cached_decoding_equals_recomputation(device, precision):
    """Logits of step-by-step decoding with the key/value cache, as search runs it, against the whole
    prefix recomputed, in the weights' dtype. bf16: within 2% of the logits' range (the two orders of
    summation round differently) and the same best token nearly everywhere."""
    dtype = DTYPES[precision]
    model = tiny_model(device, seed=2, dtype=dtype, norm="pre").eval()
    g = torch.Generator().manual_seed(3)
    src = torch.randint(4, VOCAB, (4, 9), generator=g)
    src[1, 5:] = PAD
    tgt = torch.randint(4, VOCAB, (4, 12), generator=g)
    src, tgt = src.to(device), tgt.to(device)
    with torch.inference_mode():
        full = model(src, tgt).float()  # (B, T, V)
        memory, keep = model.encode(src)
        state = model.init_state(memory, keep, max_len=tgt.shape[1])
        steps = []
        for t in range(tgt.shape[1]):
            logits, state = model.step(tgt[:, t], state)
            steps.append(logits.float())
    cached = torch.stack(steps, 1)  # (B, T, V)
    assert cached.dtype == torch.float32 and steps[0].device.type == device
    if dtype == torch.float32:
        torch.testing.assert_close(cached, full, rtol=1e-4, atol=1e-4)
        return
    span = (full.amax() - full.amin()).item()
    assert (cached - full).abs().max().item() < 0.02 * span
    assert (cached.argmax(-1) == full.argmax(-1)).float().mean().item() >= 0.9


# ---------------------------------------------------------------------------------------------------------
# Compiled training


@pytest.mark.parametrize(
    "device, precision",
    [
        pytest.param("cpu", "fp32", marks=pytest.mark.slow),  # compiling takes 30 s to minutes on a CPU
        pytest.param("cuda", "fp32", marks=ON_CUDA.marks),
        pytest.param("cuda", "bf16", marks=ON_CUDA.marks),
    ],
)
def test_the_compiled_training_step_equals_eager(device, precision, monkeypatch):
    """Three updates of the trainer's step, compiled as `nmt train` compiles it and eager, from the same
    weights: the same losses and gradients at every update, the same weights after. fp32 within 1e-4; in
    bf16, compiled kernels fuse and so round elsewhere than eager ones, so each gradient is held to twice
    bf16's own noise at that update, measured as in the bf16 test above: the spread of eager updates of
    copies jittered below bf16's resolution (a fixed 5% failed on an H200: 5.2% on one decoder matrix).
    A compile failure fails the test (the trainer would fall back to eager)."""
    import torch._dynamo
    import torch.fx.experimental._config as fx_config
    from torch._dynamo.utils import counters

    from nmt.train.runtime import compile_for_training

    # compile_for_training sets these for the process; put them back after the test
    monkeypatch.setattr(torch._dynamo.config, "suppress_errors", torch._dynamo.config.suppress_errors)
    monkeypatch.setattr(fx_config, "use_duck_shape", fx_config.use_duck_shape)
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch._dynamo.reset()
    counters.clear()
    rt = Runtime(device=resolve_device(device), dtype=DTYPES[precision])
    eager = tiny_model(device).train()
    compiled = copy.deepcopy(eager)
    learners = learner(eager, rt), learner(compiled, rt, compile_for_training(compiled))
    torch._dynamo.config.suppress_errors = False  # here a failure to compile is what we look for
    try:
        exact = precision == "fp32"
        worst: dict[str, float] = {}  # each parameter's largest gradient bound
        for seed in range(3):  # other shapes each update: the dynamic graph serves them all
            sizes = ((5 + seed, 7 + 2 * seed, 6 + seed), (3, 10 + seed, 9))
            update = random_update(device, seed=10 + seed, sizes=sizes)
            norm = 1 / update.target_tokens
            jittered = []
            for jitter in () if exact else (1, 2, 3):  # eager has no gradients between updates
                twin = copy.deepcopy(eager)
                jitter_to_bf16_rounding(twin, jitter + 10 * seed)
                forward_backward(learner(twin, rt), update.batches, norm)
                jittered.append(gradients(twin))
            s_e, s_c = (forward_backward(each, update.batches, norm) for each in learners)
            torch.testing.assert_close(s_c, s_e, rtol=1e-4 if exact else 0.02, atol=0)
            g_e, g_c = gradients(eager), gradients(compiled)
            assert g_c.keys() == g_e.keys()
            for name in g_e:
                noise = max((relative_error(g[name], g_e[name]) for g in jittered), default=0.0)
                bound = 1e-4 if exact else 2 * noise
                assert relative_error(g_c[name], g_e[name]) <= bound, (name, bound)
                worst[name] = max(worst.get(name, 0.0), bound)
            for each in learners:  # a plain SGD step: weights move alike
                optimizer_step(each)
        # A weight that started at 0 (the biases) is only the sum of its updates, so it may differ as much
        # as its gradients were allowed to
        for (name, a), b in zip(eager.state_dict().items(), compiled.state_dict().values(), strict=True):
            assert relative_error(b, a) <= (1e-4 if exact else max(0.02, worst.get(name, 0.0))), name
        assert counters["stats"]["unique_graphs"] >= 1, "nothing was compiled"
    finally:
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------------------
# Checkpoints and resume


@pytest.mark.slow  # trains on the device, then translates on both
@DEVICES
def test_a_checkpoint_trained_on_the_device_translates_the_same_on_the_cpu(device, reversal, tmp_path):
    """`nmt train` on the device (bf16 autocast where the GPU has it, the recipe default), then the
    checkpoint translated in fp32 on the device and on the CPU: the same lines."""
    from nmt.config import DecodeOverrides
    from nmt.train import train
    from nmt.translate import build_translator

    workdir = fresh_workdir(tmp_path, reversal)
    steps = 300 if device == "cuda" else 120  # seconds either way; a surer model has fewer near-ties
    cfg = make_config(max_steps=steps, save_every=steps, device=device, threads=1, peak_lr=0.002)
    threads = torch.get_num_threads()
    try:
        best = train(cfg, workdir, console=Console(quiet=True))
    finally:
        torch.set_num_threads(threads)  # train() set the process's threads to the recipe's
    lines = (reversal / "valid.xx").read_text().splitlines()[:40]
    quiet = Console(quiet=True)
    on_cpu = build_translator(best, DecodeOverrides(), "cpu", "fp32", "torch", quiet).translator
    on_device = build_translator(best, DecodeOverrides(), device, "fp32", "torch", quiet).translator
    got, want = on_device.translate(lines), on_cpu.translate(lines)
    assert got == want
    # a model that has learned something (ties, where devices could differ, are then rare): words in
    # the right place, of 16 letters
    pairs = [zip(h.split(), reverse(s).split(), strict=False) for h, s in zip(got, lines, strict=True)]
    right = [a == b for words in pairs for a, b in words]
    assert sum(right) / len(right) > 0.3


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.slow), ON_CUDA])  # three runs
def test_a_killed_run_on_the_device_resumes_bit_exact_in_fp32_eager(device, reversal, tmp_path):
    """As tests/test_train.py's resume test, on the device: straight, and SIGKILLed after its first
    checkpoint then resumed, in fp32 without compiling: bit-identical final weights. On a GPU the run
    is longer, so that the kill lands before the end."""
    from .test_train import ENV, killed_and_resumed_equals_straight

    steps, every = (300, 20) if device == "cuda" else (30, 10)
    cfg = make_config(max_steps=steps, save_every=every, device=device, precision="fp32", compile=False)
    killed_and_resumed_equals_straight(tmp_path, reversal, cfg, env=ENV)


def test_attention_leaves_cudnn_out_on_a_gpu_only(monkeypatch):
    """cuDNN's attention plans every new shape (6 ms of CPU a call: 32,564 against 225,512 target
    tokens/s for the base recipe on an H200): training and decoding on a GPU turn it off, the CPU's
    settings are left alone."""
    from nmt.device import attention_for_varying_shapes

    enabled = torch.backends.cuda.cudnn_sdp_enabled()
    monkeypatch.setattr(torch.backends.cuda, "enable_cudnn_sdp", lambda on: calls.append(on))
    calls: list[bool] = []
    attention_for_varying_shapes(torch.device("cpu"))
    assert calls == []
    attention_for_varying_shapes(torch.device("cuda", 0))
    assert calls == [False] and torch.backends.cuda.cudnn_sdp_enabled() == enabled
    cfg = make_config()  # and the training log says so, on a GPU only
    assert "without cuDNN" in Runtime(torch.device("cuda", 0), torch.bfloat16).describe(cfg)
    assert "cuDNN" not in Runtime(torch.device("cpu"), torch.float32).describe(cfg)
