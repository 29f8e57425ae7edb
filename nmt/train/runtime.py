"""Where a training process runs: its device, precision, threads and place in a torchrun job."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nmt.config import Config
from nmt.device import attention_for_varying_shapes, resolve_device, resolve_dtype
from nmt.errors import NmtError


@dataclass(frozen=True)
class Runtime:
    """This process's device, autocast dtype (float32: no autocast) and rank in a distributed job."""

    device: torch.device
    dtype: torch.dtype
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def autocast(self):
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def describe(self, cfg: Config) -> str:
        """What the run chose, in one line for the log (device, processes, threads, precision, compile, and
        on a GPU the attention kernels)."""
        precision = (
            "fp32" if self.dtype == torch.float32 else f"{str(self.dtype).removeprefix('torch.')} autocast"
        )
        return (
            f"running on: {self.device} x {self.world_size} process(es), {torch.get_num_threads()} threads "
            f"each, precision {precision} (train.precision={cfg.train.precision}), "
            f"compile {'on' if cfg.train.compile else 'off'}"
            + (", attention without cuDNN (it plans every new shape)" if self.device.type == "cuda" else "")
        )


def setup_runtime(cfg: Config) -> Runtime:
    """Join the torchrun job when launched by it (NCCL on GPU, gloo on CPU); otherwise run alone."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    device = resolve_device(cfg.train.device, local, "train.device")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        attention_for_varying_shapes(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    dtype = resolve_dtype(cfg.train.precision, device)
    if dtype == torch.float16 and device.type != "cuda":
        raise NmtError("train.precision: fp16 needs a CUDA GPU; use bf16 or fp32 on the CPU")
    return Runtime(device=device, dtype=dtype, rank=rank, world_size=world, local_rank=local)


def elastic_notes() -> list[str]:
    """What this process should log about torchrun's restarts (`--max-restarts`): which one this is, and
    a warning when the launch cannot recover.

    By default torchrun's c10d rendezvous shares its own TCP store with the workers and keeps it across
    restarts, unprefixed (pytorch/pytorch#135712): restarted workers then read the addresses that the
    dead ones published, and gloo fails with "connectFullMesh failed ... Connection refused" (NCCL with
    a stale unique id) until the restarts run out. TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in the
    launchers' environment gives each round a store of its own, hosted by the new rank 0.
    """
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if not restarts:
        return []
    notes = []
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart:
        notes.append(f"torchrun restart {restart} of at most {restarts} on this node")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        notes.append(
            f"[yellow]warning:[/] torchrun --max-restarts {restarts} with its shared store: restarted "
            "workers can find the dead ones' addresses and fail again; launch with "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 and --rdzv-backend c10d for restarts that resume"
        )
    return notes


def check_same_start(step: int, rt: Runtime) -> None:
    """Every process must resume from the same checkpoint, or they would stop at different updates and
    wait forever in collectives the others never reach. Nodes that do not share the work directory, or
    a network file system still showing one node an older last.pt, would do that. One all-reduce."""
    if rt.world_size == 1:
        return
    steps = torch.tensor([step, -step], dtype=torch.int64, device=rt.device)  # max and -min at once
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)
    high, low = int(steps[0]), -int(steps[1])
    if high != low:
        raise NmtError(
            f"the processes of this job resume from different steps ({low} to {high}): every node must "
            "see the same --workdir (a shared file system) so that all read the same checkpoints/last.pt"
        )


def compile_for_training(net):
    """torch.compile for variable batch shapes, computing the same numbers in every run.

    Inductor's CPU kernels add into shared outputs from several threads in whatever order the threads
    finish (embedding gradients, say): two identical runs with 2 threads ended 0.006 apart after 40
    updates, so a resumed run could not be exact. Deterministic algorithms make those kernels keep one
    order; and without duck sizing, a batch whose source and target lengths happen to be equal does
    not get a graph of its own (which graph serves a batch would otherwise depend on which came first,
    and so differ between an uninterrupted and a resumed run). Where compiling fails (no C++ compiler
    for the CPU backend, say), dynamo falls back to eager.
    """
    import torch.fx.experimental._config as fx_config

    torch._dynamo.config.suppress_errors = True
    torch.use_deterministic_algorithms(True, warn_only=True)
    fx_config.use_duck_shape = False
    return torch.compile(net, dynamic=True)
