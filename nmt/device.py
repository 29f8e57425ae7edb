"""Which device and precision to run on, from the names users write (`auto`, `cuda:1`, `bf16`)."""

from __future__ import annotations

import os

import torch

from nmt.config import Precision, parse_device
from nmt.errors import NmtError

# The precisions that are a torch dtype (int8 is a kind of kernel: nmt.translate.int8). Keyed by
# Precision, a str enum, so DTYPES["bf16"] works too.
DTYPES = {Precision.FP32: torch.float32, Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}


def resolve_device(name: str, local_rank: int = 0, key: str = "--device") -> torch.device:
    """auto (this rank's GPU when there is one, else the CPU), cpu, cuda or cuda:N (config.parse_device);
    NmtError naming `key` otherwise."""
    parsed = parse_device(name)
    if parsed is None:
        raise NmtError(f"{key} {name.strip()!r}: expected auto, cpu, cuda or cuda:N")
    kind, index = parsed
    if kind == "auto":
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    if kind == "cpu":
        return torch.device("cpu")
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    number = index if index is not None else local_rank
    if number >= found:
        raise NmtError(f"{key} {name.strip()!r}: no such CUDA device ({found} found)")
    return torch.device(f"cuda:{number}")


def attention_for_varying_shapes(device: torch.device) -> None:
    """On a CUDA GPU, leave cuDNN out of the kernels that F.scaled_dot_product_attention chooses from.

    cuDNN's attention builds an execution plan for every new shape: about 6 ms of CPU a call, and a
    training batch or a decoding batch has a shape of its own nearly every time. On an H200 (torch 2.11,
    bf16, the wmt14-en-de-base recipe's batches) an update took 597 ms with it, 86 ms without: 32,564
    against 225,512 target tokens/s, with the same 126 ms of GPU work a profiled update (the rest was the
    CPU planning). The flash and memory-efficient kernels take any shape without a plan. Process-wide,
    as torch's own switch is; a no-op on the CPU.
    """
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


# oneDNN's instruction sets (ONEDNN_MAX_CPU_ISA) without a bf16 product: held to one of them, oneDNN converts
# bf16 and multiplies in fp32, or emulates it
ISAS_WITHOUT_BF16 = frozenset(
    {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"}
)


def onednn_isa_cap() -> str:
    """The instruction set oneDNN is held to (ONEDNN_MAX_CPU_ISA; DNNL_MAX_CPU_ISA, its older name), upper
    case; ALL where it is free."""
    return (
        (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "ALL").strip().upper()
    )


def cpu_bf16_native() -> bool:
    """Whether this CPU multiplies bf16 in hardware, AVX512-BF16 or AMX, and oneDNN may use it
    (ONEDNN_MAX_CPU_ISA does not hold it below: `make test-avx2` holds it to AVX2, where bf16 is emulated).

    Not oneDNN's `_is_mkldnn_bf16_supported`, which is true on any AVX-512 CPU (Skylake-SP, Cascade
    Lake, Ice Lake: it converts bf16 with AVX512BW and multiplies in fp32): there the Multi30k recipe
    trained at 815 target tokens/s in bf16 autocast against 2,800 in fp32 (medians; a Xeon with avx512bw
    and avx512_vnni, no avx512_bf16: benchmarks/RESULTS.md, "bf16 autocast on an AVX-512 CPU without BF16").
    """
    hardware = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return hardware and onednn_isa_cap() not in ISAS_WITHOUT_BF16


def resolve_dtype(precision: Precision, device: torch.device) -> torch.dtype:
    """auto is bf16 where the hardware multiplies bf16 natively, else fp32.

    On a GPU that is any bf16-capable CUDA device; on a CPU it takes AVX512-BF16 or AMX
    (cpu_bf16_native): there bf16 matmuls run several times faster than fp32, while elsewhere they are
    converted or emulated and slower (3.4x on AVX-512 without BF16, hundreds of times on AVX2).
    Translation follows the same rule (inference_choice says why).
    """
    if precision is Precision.AUTO:
        if device.type == "cuda":
            bf16 = torch.cuda.is_bf16_supported()
        else:
            bf16 = device.type == "cpu" and cpu_bf16_native()
        return torch.bfloat16 if bf16 else torch.float32
    if precision not in DTYPES:
        raise NmtError(f"precision {precision}: not a torch dtype (int8 is for translating on the CPU)")
    return DTYPES[precision]


def inference_dtype(precision: Precision, device: torch.device) -> torch.dtype:
    """Weights' dtype for translation: auto is bf16 on a CUDA GPU that has it and on a CPU with native
    bf16 (inference_choice), fp32 elsewhere."""
    return resolve_dtype(precision, device)


def inference_choice(precision: Precision, device: torch.device) -> str:
    """Why `--dtype auto` chose what it did for translation, a clause for the log; "" where the user chose.

    On a CPU with native bf16 auto translates in bf16, the decoder's products prepacked for oneDNN
    (nmt.translate.prepacked). On a Xeon with AMX, in one process, alternated (the demo model, 2
    threads), it was 1.62x float32's speed on 500 test lines and took 0.66x float32's time for one
    sentence; with oneDNN held to AVX-512 BF16 (ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16, as on a CPU with
    AVX-512 BF16 and no AMX) 1.22x and 0.77x. Its translations scored 0.08 BLEU below float32's on the
    demo test set (benchmarks/RESULTS.md, 2026-11-27 21:30), and a sentence's does not depend on its
    batch (tests/test_search.py, tests/test_prepacked.py). `--dtype fp32` translates as validation did.
    """
    if precision is not Precision.AUTO or device.type != "cpu":
        return ""
    if cpu_bf16_native():
        cap = onednn_isa_cap()
        amx = torch.cpu._is_amx_tile_supported() and (cap in ("ALL", "DEFAULT") or "AMX" in cap)
        return (
            f"the default on a CPU with native bf16 ({'AMX' if amx else 'AVX-512 BF16'} here; --dtype fp32 "
            "translates as validation did)"
        )
    return "the default on a CPU without native bf16 (AVX-512 BF16 or AMX)"
