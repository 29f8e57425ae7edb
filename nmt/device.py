"""Which device and precision to run on, from the names users write (`auto`, `cuda:1`, `bf16`)."""

from __future__ import annotations

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


def cpu_bf16_native() -> bool:
    """Whether this CPU multiplies bf16 in hardware: AVX512-BF16 or AMX.

    Not oneDNN's `_is_mkldnn_bf16_supported`, which is true on any AVX-512 CPU (Skylake-SP, Cascade
    Lake, Ice Lake: it converts bf16 with AVX512BW and multiplies in fp32): there the Multi30k recipe
    trained at 815 target tokens/s in bf16 autocast against 2,800 in fp32 (medians; a Xeon with avx512bw
    and avx512_vnni, no avx512_bf16: benchmarks/RESULTS.md, "bf16 autocast on an AVX-512 CPU without BF16").
    """
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def resolve_dtype(precision: Precision, device: torch.device, cpu_bf16: bool = True) -> torch.dtype:
    """auto is bf16 where the hardware multiplies bf16 natively, else fp32.

    On a GPU that is any bf16-capable CUDA device; on a CPU it takes AVX512-BF16 or AMX
    (cpu_bf16_native): there bf16 matmuls run several times faster than fp32, while elsewhere they are
    converted or emulated and slower (3.4x on AVX-512 without BF16, hundreds of times on AVX2).
    `cpu_bf16=False` keeps the CPU at fp32 (translation: see inference_dtype).
    """
    if precision is Precision.AUTO:
        if device.type == "cuda":
            bf16 = torch.cuda.is_bf16_supported()
        else:
            bf16 = cpu_bf16 and device.type == "cpu" and cpu_bf16_native()
        return torch.bfloat16 if bf16 else torch.float32
    if precision not in DTYPES:
        raise NmtError(f"precision {precision}: not a torch dtype (int8 is for translating on the CPU)")
    return DTYPES[precision]


def inference_dtype(precision: Precision, device: torch.device) -> torch.dtype:
    """Weights' dtype for translation: auto is bf16 on a CUDA GPU that has it, fp32 elsewhere.

    On a CPU, bf16 weights change translations against the fp32 model that validation and the reported
    scores use, and make them depend on the batch; CPU translation keeps fp32 unless asked.
    """
    return resolve_dtype(precision, device, cpu_bf16=False)


def inference_choice(precision: Precision, device: torch.device) -> str:
    """Why `--dtype auto` chose what it did for translation, a clause for the log; "" where the user chose.

    On the CPU auto keeps float32 also where bf16 is native (AMX, AVX-512 BF16). On a Xeon with AMX bf16
    was 1.36-1.53x float32's speed on files, about its one-sentence latency, 0.08 BLEU below it on the
    demo test set and 112-130 MiB above its memory (benchmarks/RESULTS.md, 2026-11-27 19:12), but it has
    not been measured on AVX-512 BF16 without AMX, and its translations differ from the float32 ones
    validation scored. `--dtype bf16` asks for it.
    """
    if precision is not Precision.AUTO or device.type != "cpu":
        return ""
    if cpu_bf16_native():
        return "the default on the CPU (bf16, native here, translates unlike validation's fp32: --dtype bf16)"
    return "the default on a CPU without native bf16 (AVX-512 BF16 or AMX)"
