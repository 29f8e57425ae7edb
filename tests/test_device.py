"""Which precision `auto` picks on the CPU at hand."""

import pytest
import torch

from nmt.config import Precision
from nmt.device import inference_choice, inference_dtype, resolve_dtype


@pytest.mark.parametrize(
    "avx512_bf16, amx, chosen",
    [(False, False, torch.float32), (True, False, torch.bfloat16), (False, True, torch.bfloat16)],
)
def test_auto_trains_in_bf16_only_where_the_cpu_multiplies_it_natively(monkeypatch, avx512_bf16, amx, chosen):
    """An AVX-512 CPU without BF16 (oneDNN calls bf16 supported there: it converts, and trained 3.4x
    slower than fp32) stays at fp32; AVX512-BF16 or AMX takes bf16. Translation keeps fp32 on any CPU."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    cpu = torch.device("cpu")
    assert resolve_dtype(Precision.AUTO, cpu) is chosen
    assert inference_dtype(Precision.AUTO, cpu) is torch.float32
    native = chosen is torch.bfloat16
    assert ("bf16, native here" in inference_choice(Precision.AUTO, cpu)) == native
    assert resolve_dtype(Precision.BF16, cpu) is torch.bfloat16  # asked for, it is what the user gets
