"""Which precision `auto` picks on the CPU at hand, and how the process keeps its large buffers."""

import resource

import pytest
import torch

from nmt.config import Precision
from nmt.device import (
    RELEASE_FROM,
    inference_choice,
    inference_dtype,
    keep_freed_buffers,
    release_freed_memory,
    resident_bytes,
    resolve_dtype,
)


@pytest.mark.parametrize(
    "avx512_bf16, amx, chosen",
    [(False, False, torch.float32), (True, False, torch.bfloat16), (False, True, torch.bfloat16)],
)
def test_auto_runs_in_bf16_only_where_the_cpu_multiplies_it_natively(monkeypatch, avx512_bf16, amx, chosen):
    """An AVX-512 CPU without BF16 (oneDNN calls bf16 supported there: it converts, and trained 3.4x
    slower than fp32) stays at fp32; AVX512-BF16 or AMX takes bf16, to train and to translate, and the
    log says which and why."""
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    cpu = torch.device("cpu")
    assert resolve_dtype(Precision.AUTO, cpu) is chosen
    assert inference_dtype(Precision.AUTO, cpu) is chosen
    why = inference_choice(Precision.AUTO, cpu)
    native = chosen is torch.bfloat16
    assert ("with native bf16 (AMX here;" in why) == amx
    assert ("with native bf16 (AVX-512 BF16 here;" in why) == (avx512_bf16 and not amx)
    assert ("--dtype fp32 translates as validation did" in why) == native
    assert ("without native bf16" in why) == (not native)
    assert resolve_dtype(Precision.BF16, cpu) is torch.bfloat16  # asked for, it is what the user gets
    assert inference_dtype(Precision.FP32, cpu) is torch.float32
    assert inference_choice(Precision.FP32, cpu) == ""  # the user chose: nothing to explain


@pytest.mark.parametrize(
    "cap, chosen, says",
    [(None, torch.bfloat16, "AMX"), ("AVX512_CORE_AMX", torch.bfloat16, "AMX"),
     ("all", torch.bfloat16, "AMX"), ("AVX512_CORE_BF16", torch.bfloat16, "AVX-512 BF16"),
     ("AVX2", torch.float32, None), ("avx512_core_vnni", torch.float32, None)],
)  # fmt: skip
def test_where_onednn_is_held_below_bf16_auto_keeps_fp32(monkeypatch, cap, chosen, says):
    """ONEDNN_MAX_CPU_ISA below AVX-512 BF16 (as `make test-avx2` holds it to AVX2) converts or emulates
    bf16: auto then keeps fp32, on a CPU with AMX too; held to AVX-512 BF16, the log names that."""
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    if cap is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    cpu = torch.device("cpu")
    assert inference_dtype(Precision.AUTO, cpu) is chosen and resolve_dtype(Precision.AUTO, cpu) is chosen
    why = inference_choice(Precision.AUTO, cpu)
    assert (f"with native bf16 ({says} here;" in why) if says else ("without native bf16" in why)


def page_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_a_step_s_large_buffers_are_reused_not_faulted_in_anew_and_given_back_on_request():
    """A search step's logits of a WMT-size vocabulary (409 rows x 37,000 float32: 58 MiB, over glibc's
    mmap threshold) are allocated, written and freed at every step. Kept, the next step's reuse the same
    pages: without it every one is mapped and faulted in anew (14,800 faults each)."""
    if not keep_freed_buffers():
        pytest.skip("glibc on Linux without the user's own malloc settings only")
    shape, pages = (409, 37000), 409 * 37000 * 4 // resource.getpagesize()
    for _ in range(3):  # the heap settles: the first ones are faulted in
        torch.ones(shape)
    before = page_faults()
    for _ in range(5):
        torch.ones(shape)
    assert page_faults() - before < pages // 10
    kept = [torch.ones(shape) for _ in range(3)]  # 174 MiB, then freed: more than RELEASE_FROM
    del kept
    resident = resident_bytes()
    assert release_freed_memory()
    assert resident - resident_bytes() >= RELEASE_FROM
    assert not release_freed_memory()  # it has not grown since: nothing worth a call


def test_the_user_s_own_malloc_settings_are_left_alone(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    assert keep_freed_buffers.__wrapped__() is False
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=131072")
    assert keep_freed_buffers.__wrapped__() is False
