"""Which device and precision to run on, from the names users write (`auto`, `cuda:1`, `bf16`)."""

from __future__ import annotations

import ctypes
import functools
import os
import sys

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


# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
# Freed buffers up to this size stay in the heap for the next step (keep_freed_buffers)
KEPT_BUFFERS = 1 << 30


@functools.cache
def keep_freed_buffers() -> bool:
    """Let glibc keep freed buffers of up to KEPT_BUFFERS bytes for reuse, rather than give each back to
    the system and fault the next one in page by page. Process-wide; True where it was set.

    glibc maps a buffer over its mmap threshold (which adapts, up to 32 MiB) on its own and unmaps it when
    freed. A CPU search allocates a few buffers of the same size at every step: the logits and their
    float32 scores, (rows x vocabulary), 58 MiB for 409 rows of a 37,000-subword vocabulary. So each
    step mapped them anew and the kernel zeroed them a page at a time: 37.8 ms against 14.2 to convert
    and normalize that buffer in one reused. With freed memory kept (both thresholds raised), a
    wmt14-en-de-base model's search took 0.83x the time in bf16, 0.87x in int8 and 0.96x in fp32, at a
    peak 8-23 MiB higher (benchmarks/RESULTS.md, 2026-11-28). Memory is then given back to the system
    only where the server goes idle (release_freed_memory). The demo model's buffers are below the
    threshold already: no change there. Left as it is where the user set glibc's MALLOC_*_ variables,
    and where the C library is not glibc."""
    users = os.environ.get("MALLOC_MMAP_THRESHOLD_") or os.environ.get("MALLOC_TRIM_THRESHOLD_")
    if not sys.platform.startswith("linux") or users or "malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        libc = ctypes.CDLL(None)  # the process's own symbols, its C library's among them
        if not hasattr(libc, "gnu_get_libc_version"):  # musl also has mallopt, which does nothing
            return False
        return all(libc.mallopt(param, KEPT_BUFFERS) for param in (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD))
    except (OSError, AttributeError):
        return False


# release_freed_memory gives memory back once the process has grown this much since it last did: less is
# what one sentence's search faults in again next time (a few MiB), not worth it on a server answering
# lines one by one
RELEASE_FROM = 64 << 20


def resident_bytes() -> int:
    """This process's resident memory, bytes (Linux)."""
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Released:
    """The resident size just after the kept memory was last given back, bytes."""

    resident = 0


def release_freed_memory() -> bool:
    """Give the memory that freed buffers kept (keep_freed_buffers) back to the system, where the process
    grew by RELEASE_FROM bytes or more since it last did: for a process that waits, as the server once its
    queue is empty. True where it did; a no-op where nothing was kept."""
    if not (keep_freed_buffers.cache_info().currsize and keep_freed_buffers()):  # called, and it kept
        return False
    if resident_bytes() - _Released.resident < RELEASE_FROM:
        return False
    ctypes.CDLL(None).malloc_trim(0)
    _Released.resident = resident_bytes()
    return True


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

    On a CPU with native bf16 auto translates in bf16, its products prepacked for oneDNN
    (nmt.translate.prepacked). On a Xeon with AMX, in one process, alternated (the demo model, 2
    threads), it was 1.62x float32's speed on 500 test lines and took 0.66x float32's time for one
    sentence; with oneDNN held to AVX-512 BF16 (ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16, as on a CPU with
    AVX-512 BF16 and no AMX) 1.22x and 0.77x. Its translations scored 0.08 BLEU below float32's on the
    demo test set (benchmarks/RESULTS.md, 2026-11-27 21:30), and a sentence's does not depend on its
    batch (tests/test_search.py, tests/test_prepacked.py). On such a CPU itself, an AMD EPYC with
    AVX512-BF16 and no AMX, one thread: 1.37x float32's speed on 1,000 test lines, 0.68x its time for one
    sentence, 0.01 BLEU below it (2026-12-04 19:00). `--dtype fp32` translates as validation did.
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
