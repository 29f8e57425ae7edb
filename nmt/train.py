"""`nmt train`: label-smoothed training of the Transformer on one CPU, one GPU or many (torchrun + DDP).

The loop in `train` reads top to bottom: set the learning rate, forward/backward over the update's
micro-batches, skip non-finite updates, clip, step, log, validate, save, stop. Everything it needs is set
up once before it (`Session`), so the hot path does no avoidable work and no host-device sync beyond one
finiteness check per update and the figures a log line needs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import math
import os
import random
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from nmt.checkpoint import load_checkpoint, save_checkpoint, step_checkpoints
from nmt.config import Config
from nmt.data.batching import collate, epoch_batches
from nmt.device import resolve_device, resolve_dtype
from nmt.errors import CheckpointError, DataError, Interrupted, NmtError
from nmt.loss import label_smoothed_nll, perplexity
from nmt.model import PAD_ID, Transformer, count_parameters
from nmt.optim import build_optimizer, inverse_sqrt_lr, lr_scale

# ---------------------------------------------------------------------------------------------------------
# Devices, precision and processes


@dataclass(frozen=True)
class Runtime:
    """Where this process runs: its device, precision and place in a distributed job."""

    device: torch.device
    dtype: torch.dtype  # autocast dtype; float32 means no autocast
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


def setup_runtime(cfg: Config) -> Runtime:
    """Join the torchrun job when launched by it (NCCL on GPU, gloo on CPU); otherwise run alone."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    device = resolve_device(cfg.train.device, local)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    dtype = resolve_dtype(cfg.train.precision, device)
    if dtype == torch.float16 and device.type != "cuda":
        raise NmtError("train.precision: fp16 needs a CUDA GPU; use bf16 or fp32 on the CPU")
    return Runtime(device=device, dtype=dtype, rank=rank, world_size=world, local_rank=local)


def accumulation(cfg: Config, world_size: int) -> int:
    """Micro-batches per update: the fewest that bring train.update_tokens within the device budgets."""
    return max(1, math.ceil(cfg.train.update_tokens / (cfg.train.batch_tokens * world_size)))


def device_batch_tokens(cfg: Config, world_size: int) -> int:
    """Token budget of one micro-batch on one device: train.batch_tokens at most, less when there are so
    many devices that full budgets would overshoot train.update_tokens. So an update holds about
    update_tokens whatever the GPU count (the paper's batch is a property of the recipe, not the machine)."""
    per_device = math.ceil(cfg.train.update_tokens / (world_size * accumulation(cfg, world_size)))
    return min(cfg.train.batch_tokens, per_device)


# ---------------------------------------------------------------------------------------------------------
# Training state: everything a resumed run needs beyond the weights and the optimizer


@dataclass
class TrainProgress:
    step: int = 0  # optimizer updates done
    epoch: int = 0
    cursor: int = 0  # micro-batches of this epoch's shard already consumed
    elapsed: float = 0.0  # training seconds, over all runs
    best_score: float | None = None
    best_step: int = 0
    bad_validations: int = 0
    nonfinite_in_row: int = 0
    last_bleu: float | None = None


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1])}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((3, tuple(state["python"]), None))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------------------------------------------------
# Data


@dataclass
class TrainData:
    train: object  # nmt.data.binarized.ParallelData
    valid: object
    valid_src: list[str]
    valid_ref: list[str]
    subword: object  # nmt.subword.Subword


def load_data(cfg: Config, workdir: Path) -> TrainData:
    from nmt.data.binarized import ParallelData
    from nmt.subword import Subword

    data_dir = workdir / "data"
    spm = data_dir / "spm.model"
    if not spm.exists() or not (data_dir / "train.src.idx").exists():
        raise DataError(f"{data_dir}: no preprocessed data; run `nmt preprocess` with the same recipe first")
    subword = Subword.load(spm)
    if subword.vocab_size > cfg.data.vocab_size:
        raise DataError(
            f"{spm}: {subword.vocab_size} subwords, recipe says data.vocab_size {cfg.data.vocab_size}"
        )
    read = lambda p: p.read_text(encoding="utf-8").split("\n")[:-1]  # noqa: E731
    return TrainData(
        train=ParallelData(data_dir / "train"),
        valid=ParallelData(data_dir / "valid"),
        valid_src=read(data_dir / f"valid.{cfg.data.src_lang}"),
        valid_ref=read(data_dir / f"valid.{cfg.data.tgt_lang}"),
        subword=subword,
    )


def micro_batches(data, batches, rt: Runtime):
    """The pairs of each batch, collated and moved to the device (pinned, non-blocking on a GPU)."""
    for idx in batches:
        src, tgt_in, tgt_out = collate([(data.src(i), data.tgt(i)) for i in idx.tolist()])
        if rt.device.type == "cuda":
            src, tgt_in, tgt_out = (
                t.pin_memory().to(rt.device, non_blocking=True) for t in (src, tgt_in, tgt_out)
            )
        yield src, tgt_in, tgt_out


def token_counts(data, chunk: list[torch.Tensor]) -> tuple[int, int, int]:
    """An update's target tokens (with EOS), and its real and padded tokens over both sides."""
    target = real = padded = 0
    for idx in chunk:
        src, tgt = data.src_lens[idx] + 1, data.tgt_lens[idx] + 1  # + EOS / BOS
        target += int(tgt.sum())
        real += int(src.sum()) + int(tgt.sum())
        padded += len(idx) * (int(src.max()) + int(tgt.max()))
    return target, real, padded


def update_plan(data, cfg: Config, rt: Runtime, prog: TrainProgress, accum: int):
    """Endless stream of updates, each a list of this rank's batch indices; advances prog.epoch/cursor."""
    cache: dict[int, list] = {}
    while True:
        if prog.epoch not in cache:
            cache.clear()
            batches = epoch_batches(
                data.src_lens,
                data.tgt_lens,
                device_batch_tokens(cfg, rt.world_size),
                cfg.train.seed,
                prog.epoch,
                rt.world_size,
            )
            if not batches:
                raise DataError("the training data holds fewer batches than there are processes")
            cache[prog.epoch] = batches[rt.rank :: rt.world_size]
        shard = cache[prog.epoch]
        if prog.cursor >= len(shard):
            prog.epoch, prog.cursor = prog.epoch + 1, 0
            continue
        chunk = shard[prog.cursor : prog.cursor + accum]
        prog.cursor += len(chunk)
        yield chunk


# ---------------------------------------------------------------------------------------------------------
# Summary (also `nmt train --dry-run`)


def summary_lines(cfg: Config, model: Transformer, world_size: int) -> list[str]:
    t, m = cfg.train, cfg.model
    accum = accumulation(cfg, world_size)
    peak = inverse_sqrt_lr(t.warmup, m.d_model, t.warmup, lr_scale(m, t))
    return [
        f"parameters: {count_parameters(model):,}",
        f"model: {m.encoder_layers}+{m.decoder_layers} layers, d_model {m.d_model}, d_ff {m.d_ff}, "
        f"{m.heads} heads, dropout {m.dropout}, {m.norm}-norm, vocabulary {model.vocab_size}",
        f"batch: {device_batch_tokens(cfg, world_size)} tokens per device x {world_size} device(s) x {accum} "
        f"accumulation = {device_batch_tokens(cfg, world_size) * world_size * accum} tokens per update "
        f"(recipe: {t.update_tokens}; padding included)",
        f"steps: {t.max_steps}" + (f", at most {t.max_minutes:g} minutes" if t.max_minutes else ""),
        f"schedule: inverse square root, warmup {t.warmup}, peak lr {peak:.3g} at step {t.warmup}, "
        f"Adam({t.adam_beta1}, {t.adam_beta2}, eps {t.adam_eps:g}), label smoothing {t.label_smoothing}",
        disk_line(count_parameters(model), t.keep_last),
    ]


def disk_line(parameters: int, keep_last: int) -> str:
    """What the checkpoints folder will hold at most: weights-only step files, best.pt and average.pt,
    and last.pt + last.prev.pt with Adam's two moments besides the weights (fp32 throughout)."""
    weights = parameters * 4
    total = (keep_last + 2) * weights + 2 * 3 * weights
    return (
        f"disk: about {total / 2**30:.2f} GiB of checkpoints ({keep_last} step files and best/average of "
        f"{weights / 2**30:.2f} GiB, last.pt and last.prev.pt of {3 * weights / 2**30:.2f} GiB)"
    )


def dry_run(cfg: Config, console: Console | None = None) -> int:
    """Build the model from the recipe alone (vocabulary = data.vocab_size) and print its summary."""
    console = console or Console(stderr=True)
    with torch.device("meta"):
        model = Transformer(cfg.model, cfg.data.vocab_size)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    for line in summary_lines(cfg, model, world):
        console.print(line, highlight=False)
    return count_parameters(model)


# ---------------------------------------------------------------------------------------------------------
# Validation and checkpoints


@torch.no_grad()
def validate(model: Transformer, data: TrainData, cfg: Config, rt: Runtime) -> dict:
    """Loss and perplexity on the validation pairs, and BLEU of their greedy translations."""
    model.eval()
    loss_sum = nll_sum = tokens = 0.0
    batches = epoch_batches(data.valid.src_lens, data.valid.tgt_lens, cfg.train.batch_tokens, 0, 0)
    for src, tgt_in, tgt_out in micro_batches(data.valid, batches, rt):
        with rt.autocast():
            logits = model(src, tgt_in)
        loss, nll = label_smoothed_nll(logits, tgt_out, cfg.train.label_smoothing, PAD_ID)
        loss_sum, nll_sum = loss_sum + loss.item(), nll_sum + nll.item()
        tokens += int((tgt_out != PAD_ID).sum())
    result = {
        "loss": loss_sum / tokens,
        "nll": nll_sum / tokens,
        "ppl": perplexity(nll_sum / tokens),
        "bleu": None,
    }
    if cfg.train.valid_bleu:
        from nmt.score import bleu
        from nmt.translate import Translator

        greedy = dataclasses.replace(cfg.decode, beam=1, nbest=1)
        with rt.autocast():
            hyps = Translator(model, data.subword, greedy, rt.device).translate(data.valid_src)
        result["bleu"] = bleu(hyps, [data.valid_ref])
    model.train()
    return result


def save_training_checkpoint(
    ckpt_dir: Path,
    model: Transformer,
    optimizer,
    scaler,
    cfg: Config,
    subword,
    prog: TrainProgress,
    best: bool,
    facts: dict,
) -> Path:
    """step-N.pt with the weights (what averaging and translation need), last.pt with everything a resume
    needs, the previous last.pt kept as last.prev.pt in case the newest cannot be read.

    Only last.pt carries the optimizer's state (twice the weights for Adam): with keep_last 20, big
    EN-DE needs 20 x 0.9 GB of step files instead of 20 x 2.6 GB. Free space is checked first, and a
    disk that fills up anyway leaves every earlier file as it was.
    """
    path = ckpt_dir / f"step-{prog.step}.pt"
    state = {
        "progress": dataclasses.asdict(prog),
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict() if scaler is not None else None,
        "rng": rng_state(),
        "run": facts,
    }
    weights = model.state_dict()
    check_free_space(ckpt_dir, tensor_bytes(weights) * 2 + tensor_bytes(state["optimizer"]))
    common = dict(model_state=weights, config=cfg, subword_proto=subword.proto, vocab_size=model.vocab_size)
    last = ckpt_dir / "last.pt"
    try:
        save_checkpoint(path, **common)
        if last.exists():
            publish(last, ckpt_dir / "last.prev.pt")
        save_checkpoint(last, **common, train_state=state)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise CheckpointError(
                f"{ckpt_dir}: the disk filled up while saving step {prog.step}; the earlier checkpoints "
                "are intact: free some space and run the same command to resume"
            ) from None
        raise
    if best:
        publish(path, ckpt_dir / "best.pt")
    for old in step_checkpoints(ckpt_dir)[: -cfg.train.keep_last]:
        old.unlink(missing_ok=True)
    return path


def tensor_bytes(tree) -> int:
    """Bytes of every tensor in a nest of dicts and lists (a state dict, an optimizer's state)."""
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(tensor_bytes(v) for v in tree.values())
    if isinstance(tree, list | tuple):
        return sum(tensor_bytes(v) for v in tree)
    return 0


def check_free_space(folder: Path, needed: int) -> None:
    """Refuse to start a save that cannot fit: a clear stop beats a half-written file and a traceback."""
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    margin = 64 * 2**20  # the file's own framing, the metrics and logs written meanwhile
    if free < needed + margin:
        raise CheckpointError(
            f"{folder}: {free / 2**30:.2f} GiB free, a checkpoint needs {(needed + margin) / 2**30:.2f} GiB; "
            "the earlier checkpoints are intact: free some space (or lower train.keep_last) and run the "
            "same command to resume"
        )


def publish(src: Path, dst: Path) -> None:
    """Atomically point `dst` at the same bytes as `src` (a hard link where possible, else a copy)."""
    tmp = dst.with_name(f".{dst.name}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def run_facts(data: TrainData, rt: Runtime) -> dict:
    """What a saved data position and saved weights mean: checked again when a run resumes."""
    return {
        "vocabulary_sha256": hashlib.sha256(data.subword.proto).hexdigest(),
        "train_pairs": len(data.train),
        "world_size": rt.world_size,
    }


# Keys a resumed run must keep: the weights' shapes and what the saved data position points into.
# Budgets, logging, checkpoint counts, devices and decoding may change between runs.
RESUME_KEYS = ("model", "train.batch_tokens", "train.update_tokens", "train.seed", "data.vocab_size")


def check_resume(path: Path, ckpt, cfg: Config, facts: dict) -> None:
    """One line naming what changed since the checkpoint was written, rather than a traceback or a
    run that silently continues on something else."""
    from nmt.config import config_to_dict

    hint = "; resume needs the same (or start anew in another --workdir)"
    old, new = config_to_dict(ckpt.config), config_to_dict(cfg)
    for key in RESUME_KEYS:
        before, now = old, new
        for part in key.split("."):
            before, now = before[part], now[part]
        if key == "model":
            for name in before:
                if before[name] != now[name]:
                    raise CheckpointError(
                        f"{path}: trained with model.{name} {before[name]}, "
                        f"the recipe now says {now[name]}{hint}"
                    )
        elif before != now:
            raise CheckpointError(f"{path}: trained with {key} {before}, the recipe now says {now}{hint}")
    saved = ckpt.train_state.get("run", {})
    if saved.get("vocabulary_sha256", facts["vocabulary_sha256"]) != facts["vocabulary_sha256"]:
        raise CheckpointError(
            f"{path}: trained with another SentencePiece model than data/spm.model "
            f"(was preprocessing redone?){hint}"
        )
    if saved.get("train_pairs", facts["train_pairs"]) != facts["train_pairs"]:
        raise CheckpointError(
            f"{path}: trained on {saved['train_pairs']:,} pairs, "
            f"data/train now holds {facts['train_pairs']:,}{hint}"
        )


def find_resume_checkpoint(ckpt_dir: Path, console: Console):
    """last.pt, or when that is unreadable last.prev.pt; None for a fresh start."""
    candidates = [ckpt_dir / "last.pt", ckpt_dir / "last.prev.pt"]
    for path in candidates:
        if not path.exists():
            continue
        try:
            ckpt = load_checkpoint(path)
        except CheckpointError as e:
            console.print(f"[yellow]warning:[/] {e}; trying an older checkpoint", highlight=False)
            continue
        if ckpt.train_state is None:
            continue
        return path, ckpt
    if any(p.exists() for p in candidates):
        raise CheckpointError(f"{ckpt_dir}: no readable checkpoint to resume from")
    return None


# ---------------------------------------------------------------------------------------------------------
# The loop


def forward_backward(net, batches, norm: torch.Tensor, cfg: Config, rt: Runtime, scaler) -> torch.Tensor:
    """Accumulate the gradients of one update; returns the summed (loss, nll, target tokens).

    `norm` scales each micro-batch's summed loss (1 / tokens of the whole update, times the world size
    that DDP's averaging divides by again), so the gradients equal those of one big batch. Only the last
    micro-batch all-reduces gradients under DDP.
    """
    stats = torch.zeros(3, device=rt.device)
    batches = list(batches)
    for i, (src, tgt_in, tgt_out) in enumerate(batches):
        sync = i == len(batches) - 1 or rt.world_size == 1
        with contextlib.nullcontext() if sync else net.no_sync(), rt.autocast():
            logits = net(src, tgt_in)
            loss, nll = label_smoothed_nll(logits, tgt_out, cfg.train.label_smoothing, PAD_ID)
        (scaler.scale(loss * norm) if scaler else loss * norm).backward()
        stats += torch.stack([loss.detach(), nll.detach(), (tgt_out != PAD_ID).sum().float()])
    return stats


def optimizer_step(model: Transformer, optimizer, scaler, clip_norm: float) -> torch.Tensor | None:
    """Clip (when asked) and step; returns the gradient norm, or None when it was not finite (skipped)."""
    if scaler is not None:
        scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm or math.inf)
    finite = bool(torch.isfinite(grad_norm))  # the one host-device sync of an update
    if scaler is not None:
        scaler.step(optimizer)  # skips by itself on inf/NaN
        scaler.update()
    elif finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm if finite else None


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


class StopRequest:
    """SIGINT/SIGTERM set a flag; the loop saves a checkpoint at the end of the update and exits."""

    def __init__(self):
        self.signal: int | None = None

    def __enter__(self):
        self.previous = {s: signal.signal(s, self.handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def handle(self, signum, _frame):
        self.signal = signum

    def __exit__(self, *exc):
        for s, h in self.previous.items():
            signal.signal(s, h)


def train(cfg: Config, workdir: Path, console: Console | None = None) -> Path:
    """Train until max_steps, max_minutes or early stopping, resuming from any checkpoint; returns best.pt."""
    console = console or Console(stderr=True)
    rt = setup_runtime(cfg)
    log = console if rt.is_main else Console(quiet=True)
    data = load_data(cfg, workdir)
    ckpt_dir = workdir / "checkpoints"
    torch.manual_seed(cfg.train.seed)
    random.seed(cfg.train.seed)

    model = Transformer(cfg.model, data.subword.vocab_size).to(rt.device)
    optimizer = build_optimizer(model.parameters(), cfg.train)
    scaler = torch.amp.GradScaler("cuda") if rt.dtype == torch.float16 else None
    prog = TrainProgress()
    facts = run_facts(data, rt)
    resumed = find_resume_checkpoint(ckpt_dir, log)
    if resumed is not None:
        path, ckpt = resumed
        check_resume(path, ckpt, cfg, facts)
        model.load_state_dict(ckpt.model_state)
        optimizer.load_state_dict(ckpt.train_state["optimizer"])
        if scaler is not None and ckpt.train_state["scaler"]:
            scaler.load_state_dict(ckpt.train_state["scaler"])
        prog = TrainProgress(**ckpt.train_state["progress"])
        set_rng_state(ckpt.train_state["rng"])
        log.print(f"resuming from {path} (step {prog.step})", highlight=False)
        saved_world = ckpt.train_state.get("run", {}).get("world_size", rt.world_size)
        if saved_world != rt.world_size:
            # Each process's shard of an epoch has another length now: keep the same share of the epoch.
            old = (
                len(
                    epoch_batches(
                        data.train.src_lens,
                        data.train.tgt_lens,
                        device_batch_tokens(cfg, saved_world),
                        cfg.train.seed,
                        prog.epoch,
                        saved_world,
                    )
                )
                // saved_world
            )
            new = (
                len(
                    epoch_batches(
                        data.train.src_lens,
                        data.train.tgt_lens,
                        device_batch_tokens(cfg, rt.world_size),
                        cfg.train.seed,
                        prog.epoch,
                        rt.world_size,
                    )
                )
                // rt.world_size
            )
            share = prog.cursor / max(old, 1)
            prog.cursor = min(new, round(share * new))
            log.print(
                f"{saved_world} processes before, {rt.world_size} now: epoch {prog.epoch} continues "
                f"{share:.0%} of the way through its batches, as cut for {rt.world_size} processes",
                highlight=False,
            )
    accum = accumulation(cfg, rt.world_size)
    for line in summary_lines(cfg, model, rt.world_size):
        log.print(line, highlight=False)
    precision = "fp32" if rt.dtype == torch.float32 else f"{str(rt.dtype).removeprefix('torch.')} autocast"
    log.print(
        f"running on: {rt.device} x {rt.world_size} process(es), {torch.get_num_threads()} threads each, "
        f"precision {precision} (train.precision={cfg.train.precision}), "
        f"compile {'on' if cfg.train.compile else 'off'}",
        highlight=False,
    )
    net = model
    if rt.world_size > 1:
        net = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[rt.device] if rt.device.type == "cuda" else None
        )
    if cfg.train.compile:
        net = compile_for_training(net)

    scale = lr_scale(cfg.model, cfg.train)
    plan = update_plan(data.train, cfg, rt, prog, accum)
    metrics = MetricsLog(workdir, rt.is_main)
    last_saved = prog.step
    started = time.monotonic() - prog.elapsed
    stats = torch.zeros(3, device=rt.device)  # running sums since the last log line: loss, nll, tokens
    ntokens_since_log, real_since_log, padded_since_log, log_start = 0, 0, 0, time.monotonic()
    stop_reason = finished(prog, cfg)
    if stop_reason:
        log.print(f"training already finished at step {prog.step}: {stop_reason}", highlight=False)
        return best_or_last(ckpt_dir)
    model.train()

    with StopRequest() as stop, ProgressDisplay(log, cfg, prog) as display:
        while stop_reason is None:
            # 1. learning rate for this update (paper, eq. 3)
            lr = inverse_sqrt_lr(prog.step + 1, cfg.model.d_model, cfg.train.warmup, scale)
            for group in optimizer.param_groups:
                group["lr"] = lr
            # 2. forward/backward over this update's micro-batches; the loss is normalised by the target
            #    tokens of the whole update on all ranks, so gradients equal a single big batch's.
            chunk = next(plan)
            local_tokens, real, padded = token_counts(data.train, chunk)
            total = torch.tensor(float(local_tokens), device=rt.device)
            if rt.world_size > 1:
                dist.all_reduce(total)
            norm = rt.world_size / total  # DDP averages over ranks; undo that and divide by all tokens
            stats += forward_backward(net, micro_batches(data.train, chunk, rt), norm, cfg, rt, scaler)
            ntokens_since_log += local_tokens
            real_since_log, padded_since_log = real_since_log + real, padded_since_log + padded
            # 3. clip and step, or skip a non-finite update
            grad_norm = optimizer_step(model, optimizer, scaler, cfg.train.clip_norm)
            if grad_norm is None:
                if scaler is not None and scaler.get_scale() >= 1.0:
                    continue  # fp16 overflow: the scaler lowers its scale and the update is retried
                prog.nonfinite_in_row += 1
                log.print(f"[yellow]warning:[/] non-finite loss or gradient at step {prog.step + 1}; skipped")
                if prog.nonfinite_in_row >= cfg.train.max_nonfinite:
                    raise NmtError(
                        f"{prog.nonfinite_in_row} non-finite updates in a row at step {prog.step + 1}: "
                        f"training diverged; lower train.peak_lr/lr_scale or raise train.warmup. "
                        f"Last good checkpoint: {ckpt_dir / 'last.pt'}"
                    )
                continue
            prog.nonfinite_in_row = 0
            prog.step += 1
            prog.elapsed = time.monotonic() - started
            # 4. stop? Every rank decides at the same update, or they would wait in different collectives.
            stop_reason = finished(prog, cfg, clock=False) or agree_to_stop(stop.signal, prog, cfg, rt)
            # 5. log
            if prog.step % cfg.train.log_every == 0 or stop_reason:
                if rt.world_size > 1:
                    dist.all_reduce(stats)
                loss_sum, nll_sum, tok = stats.tolist()
                now = time.monotonic()
                record = {
                    "kind": "train",
                    "step": prog.step,
                    "elapsed": round(prog.elapsed, 2),
                    "loss": loss_sum / tok,
                    "nll": nll_sum / tok,
                    "ppl": perplexity(nll_sum / tok),
                    "lr": lr,
                    "tokens_per_s": ntokens_since_log * rt.world_size / max(now - log_start, 1e-9),
                    "grad_norm": float(grad_norm),
                    "padding": round(1 - real_since_log / padded_since_log, 4),
                }
                metrics.write(record)
                display.update(record)
                stats.zero_()
                ntokens_since_log, real_since_log, padded_since_log, log_start = 0, 0, 0, now
            # 6. validate and save
            validating = prog.step % cfg.train.validate_every == 0 or (stop_reason and prog.step > last_saved)
            saving = prog.step % cfg.train.save_every == 0 or (stop_reason and prog.step > last_saved)
            better = False
            if validating and rt.is_main:
                v = validate(model, data, cfg, rt)
                score = v["bleu"] if v["bleu"] is not None else -v["nll"]
                better = prog.best_score is None or score > prog.best_score
                if better:
                    prog.best_score, prog.best_step, prog.bad_validations = score, prog.step, 0
                else:
                    prog.bad_validations += 1
                prog.last_bleu = v["bleu"]
                record = {"kind": "valid", "step": prog.step, "elapsed": round(prog.elapsed, 2), **v}
                metrics.write(record)
                display.validation(record)
                stop_reason = stop_reason or finished(prog, cfg)
            if saving or better:
                prog.elapsed = time.monotonic() - started
                if rt.is_main:
                    save_training_checkpoint(
                        ckpt_dir, model, optimizer, scaler, cfg, data.subword, prog, better, facts
                    )
                last_saved = prog.step
            if rt.world_size > 1 and validating:
                stop_reason = broadcast_stop(stop_reason, rt)

    log.print(f"training stopped at step {prog.step}: {stop_reason}", highlight=False)
    if rt.world_size > 1:
        dist.barrier()
    if stop_reason.startswith("stopped by SIG"):
        name = stop_reason.removeprefix("stopped by ")
        raise Interrupted(
            f"training stopped by {name} at step {prog.step}, {ckpt_dir / 'last.pt'} saved; "
            "run the same command to resume",
            signal.Signals[name],
        )
    return best_or_last(ckpt_dir)


def best_or_last(ckpt_dir: Path) -> Path:
    best = ckpt_dir / "best.pt"
    return best if best.exists() else ckpt_dir / "last.pt"


def finished(prog: TrainProgress, cfg: Config, clock: bool = True) -> str | None:
    """Why training is over at this point (budget spent, patience lost), or None to go on.

    `clock=False` leaves out the time budget: each rank's clock differs, so in the loop that is decided
    together (agree_to_stop).
    """
    t = cfg.train
    if prog.step >= t.max_steps:
        return f"reached train.max_steps={t.max_steps}"
    if clock and over_time(prog, cfg):
        return f"reached train.max_minutes={t.max_minutes:g}"
    if t.patience and prog.bad_validations >= t.patience:
        return f"no better validation for {t.patience} validations (early stopping)"
    return None


def over_time(prog: TrainProgress, cfg: Config) -> bool:
    return bool(cfg.train.max_minutes) and prog.elapsed >= cfg.train.max_minutes * 60


def agree_to_stop(signum: int | None, prog: TrainProgress, cfg: Config, rt: Runtime) -> str | None:
    """The reasons to stop that one rank alone can see, shared by all: a signal (schedulers send SIGTERM
    to one process or to all) and the time budget on its own clock. One tiny all-reduce an update."""
    flags = [signum == signal.SIGINT, signum == signal.SIGTERM, over_time(prog, cfg)]
    if rt.world_size > 1:
        shared = torch.tensor(flags, dtype=torch.float32, device=rt.device)
        dist.all_reduce(shared)
        flags = [f > 0 for f in shared.tolist()]
    sigint, sigterm, late = flags
    if sigterm or sigint:
        return f"stopped by {'SIGTERM' if sigterm else 'SIGINT'}"
    return f"reached train.max_minutes={cfg.train.max_minutes:g}" if late else None


def broadcast_stop(reason: str | None, rt: Runtime) -> str | None:
    """Rank 0 decides early stopping; every rank must leave the loop at the same update."""
    flag = torch.tensor([1.0 if reason else 0.0], device=rt.device)
    dist.broadcast(flag, src=0)
    return reason or ("early stopping (rank 0)" if flag.item() else None)


# ---------------------------------------------------------------------------------------------------------
# Logs and the live display


class MetricsLog:
    """Appends one JSON object per line to WORKDIR/metrics.jsonl (and a text line to train.log)."""

    def __init__(self, workdir: Path, enabled: bool):
        self.enabled = enabled
        self.workdir = workdir
        self.tensorboard = None
        if enabled:
            workdir.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(ImportError):
                from torch.utils.tensorboard import SummaryWriter

                self.tensorboard = SummaryWriter(str(workdir / "tensorboard"))

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        line = json.dumps(record)
        with open(self.workdir / "metrics.jsonl", "a", encoding="utf-8") as f:
            f.write(line + "\n")
        with open(self.workdir / "train.log", "a", encoding="utf-8") as f:
            f.write(
                " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items())
                + "\n"
            )
        if self.tensorboard is not None:
            for key, value in record.items():
                if isinstance(value, int | float) and key not in ("step", "kind"):
                    self.tensorboard.add_scalar(f"{record['kind']}/{key}", value, record["step"])
            self.tensorboard.flush()


class ProgressDisplay:
    """Rich live line: step, loss, ppl, lr, tokens/s, elapsed, ETA, last validation BLEU."""

    def __init__(self, console: Console, cfg: Config, prog: TrainProgress):
        self.cfg, self.prog = cfg, prog
        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            TextColumn("step {task.completed}/{task.total}"),
            TimeElapsedColumn(),
            TextColumn("{task.fields[eta]}"),
            TextColumn("{task.fields[info]}"),
            console=console,
            transient=False,
        )
        self.train_info = ""
        self.valid_info = ""

    def __enter__(self):
        self.progress.start()
        self.task = self.progress.add_task(
            "train", total=self.cfg.train.max_steps, completed=self.prog.step, eta="", info=""
        )
        return self

    def update(self, record: dict) -> None:
        self.train_info = (
            f"loss {record['loss']:.3f} ppl {record['ppl']:.2f} lr {record['lr']:.2e} "
            f"{record['tokens_per_s']:,.0f} tok/s"
        )
        if not self.progress.console.is_terminal:  # a log file or pipe gets plain lines instead of a bar
            self.progress.console.print(f"step {record['step']}: {self.train_info}", highlight=False)
        self.refresh(record["step"], record["elapsed"])

    def validation(self, record: dict) -> None:
        bleu = f" BLEU {record['bleu']:.2f}" if record.get("bleu") is not None else ""
        self.valid_info = f"| valid ppl {record['ppl']:.2f}{bleu}"
        self.progress.console.print(
            f"step {record['step']}: valid loss {record['loss']:.3f} ppl {record['ppl']:.2f}{bleu}",
            highlight=False,
        )
        self.refresh(record["step"], record["elapsed"])

    def refresh(self, step: int, elapsed: float) -> None:
        t = self.cfg.train
        left = (t.max_steps - step) * elapsed / max(step - 0, 1)
        if t.max_minutes:
            left = min(left, t.max_minutes * 60 - elapsed)
        eta = f"ETA {int(max(left, 0)) // 60}:{int(max(left, 0)) % 60:02d}"
        self.progress.update(self.task, completed=step, eta=eta, info=f"{self.train_info} {self.valid_info}")

    def __exit__(self, *exc):
        self.progress.stop()
