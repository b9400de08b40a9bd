"""Step time and peak memory of one GPT training step under DDP and five FSDPs.

Usage::

    python bench/fsdp_step.py --preset gpt-937m                    # spawns one rank per GPU
    torchrun --nproc-per-node 8 bench/fsdp_step.py --preset latency
    python bench/fsdp_step.py --preset tiny --world-size 2 --steps 3 --warmup 1   # CPU smoke

Modes (``--modes``, comma separated, default all), each run in the same process
group one after the other, from the same initial weights and on the same data:

- ``ddp``: ``DistributedDataParallel``, fp32 parameters, bf16 autocast.
- ``torch-fsdp1``: ``torch.distributed.fsdp.FullyShardedDataParallel``.
- ``torch-fsdp2``: ``torch.distributed.fsdp.fully_shard`` on each block, then the root.
- ``local-fsdp2``: this project's ``fsdp.fully_shard`` (FSDP2), the same way.
- ``local`` / ``local-flat``: this project's ``fsdp.FullyShardedDataParallel`` with
  ``use_orig_params=True`` / ``False``.

Every FSDP mode has one unit per transformer block (plus the root) and, with
``--dtype bf16``, bf16 parameters with fp32 gradient reduction. Rank 0 prints a
table (median and min step time, spread, peak memory, TFLOP/s per GPU, final
loss), says whether the final losses agree, and with ``--json`` writes it all.
``--profile MODE[,MODE...]`` also writes a chrome trace of two more steps of those modes.
``--rounds R`` times the modes in R interleaved rounds instead of one after the other
(see [Note: Interleaved rounds]).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime
import gc
import json
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import fsdp
from fsdp.wrap import ModuleWrapPolicy

ROOT = Path(__file__).resolve().parents[1]
MODES = ("ddp", "torch-fsdp1", "torch-fsdp2", "local-fsdp2", "local", "local-flat")
LR = 1e-4
PROFILE_STEPS = 2
# The reference every other mode's final loss is compared with (relative error).
# bf16 keeps 8 mantissa bits, and DDP's autocast keeps LayerNorm and softmax in fp32 while
# the FSDPs run them in bf16, so their losses differ by bf16 rounding, well under 2e-2.
# In fp32 the modes differ only in the order gradients are summed. The difference of final
# losses is taken relative to the first step's loss of the reference: every mode trains on
# one repeated batch, its loss falls about 100-fold, and relative to a loss near zero bf16
# rounding over 20 steps reads as a few percent (2026-11-23: 2.9e-2 between DDP and
# FSDP1 at a final loss of 0.11). A wrong gradient still moves the final loss by a
# sizeable part of where training started.
LOSS_RTOL = {"bf16": 2e-2, "fp32": 1e-4}

# [Note: Parameter count]
# The model has biases on every Linear but the LM head, and an untied LM head:
#   params = 2 * vocab * d                        (token embedding + LM head)
#          + seq * d                              (learned position embedding)
#          + n_layers * (12 * d^2 + 13 * d)       (qkv, proj, fc, fc2 with biases, 2 LayerNorms)
#          + 2 * d                                (final LayerNorm)
# gpt-937m (d 2048, 16 layers, seq 2048) has 809,930,752 parameters besides the vocabulary
# ones; vocab 31,040 (a multiple of 64) adds 127,139,840, for 937,070,592 in all.
# ``ModelConfig.param_count`` is this formula; ``GPT`` asserts that it matches.
#
# [Note: Model FLOPs]
# Per rank and step, with N the parameters outside the two embedding tables (lookups do no
# matmul; the LM head, biases and LayerNorms are counted) and B, T, L, d as in the config:
#   flops = 6 * N * B * T  +  12 * L * T^2 * d * B
# The first term is forward (2) plus backward (4) FLOPs per parameter and token; the second is
# QK^T and AV (2 * 2 * B * T^2 * d forward per layer, times 3 with backward). Causal masking is
# not discounted (the PaLM/Megatron convention), so this overstates the attention work that a
# flash kernel does by up to 2x; for gpt-937m the attention term is 13% of the total.
# TFLOP/s per GPU = flops / median step time.
#
# [Note: What is measured]
# A step is zero_grad, forward, loss, backward and optimizer step. On CUDA each step is timed
# by events on the current stream, recorded without host synchronisation, so the host may run
# ahead and a step's time is the GPU timeline between its events (launch gaps included when
# the host is the bottleneck). On the CPU a step is timed by perf_counter: CPU work and gloo
# collectives finish before the step returns. A step's time is the maximum over ranks.
# Spread = (max - min) / median of the timed steps. Peak memory is the maximum over ranks of
# torch.cuda.max_memory_allocated, reset after the model is wrapped and the optimizer built,
# so it covers the training steps, not the transient unsharded model built before sharding.
# The final loss is the mean over ranks of the last timed step's loss (before its update).
#
# [Note: Interleaved rounds]
# On a shared host the step time of a CPU-bound configuration (the latency preset: the GPU is
# busy for about a fifth of a step) moves by tens of percent within minutes, so modes timed
# one after the other are compared across different host conditions: in one run DDP's median
# was 118.6 ms and three minutes later 147.7 ms. With ``--rounds R`` every mode is built and
# warmed up first, then the timed steps are taken in R rounds, each round timing
# ``ceil(steps / R)`` steps of every mode, the order reversed every other round: slow spells of
# the host fall on all modes alike and the ratios of medians are comparable. All models are
# resident at once, so peak memory is not a mode's own and is not reported (run the modes
# one after the other, the default, for memory).
#
# [Note: Launch]
# Under torchrun (RANK and WORLD_SIZE set) the process group is initialised from the
# environment. Otherwise the script spawns ``--world-size`` ranks that rendezvous through a
# file in a temporary directory, so no TCP port has to be picked and raced for.


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the GPT decoder; ``batch`` is per rank."""

    d_model: int
    n_layers: int
    n_heads: int
    seq_len: int
    batch: int
    vocab: int = 32768

    def param_count(self) -> int:
        """See [Note: Parameter count]."""
        d = self.d_model
        blocks = self.n_layers * (12 * d * d + 13 * d)
        return 2 * self.vocab * d + self.seq_len * d + blocks + 2 * d

    def matmul_param_count(self) -> int:
        """Parameters outside the embedding tables, see [Note: Model FLOPs]."""
        return self.param_count() - (self.vocab + self.seq_len) * self.d_model

    def flops_per_step(self) -> int:
        """Model FLOPs of one training step on one rank, see [Note: Model FLOPs]."""
        tokens = self.batch * self.seq_len
        attention = 12 * self.n_layers * self.seq_len**2 * self.d_model * self.batch
        return 6 * self.matmul_param_count() * tokens + attention


PRESETS = {
    "gpt-937m": ModelConfig(
        d_model=2048, n_layers=16, n_heads=16, seq_len=2048, batch=4, vocab=31040
    ),
    "latency": ModelConfig(d_model=256, n_layers=64, n_heads=4, seq_len=2048, batch=1),
    "tiny": ModelConfig(d_model=64, n_layers=2, n_heads=4, seq_len=32, batch=2, vocab=128),
}


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark run. ``profile=()`` profiles no mode; ``json_path=None`` writes no JSON."""

    preset: str
    model: ModelConfig
    modes: tuple[str, ...]
    world_size: int
    dtype: str
    warmup: int
    steps: int
    seed: int
    profile: tuple[str, ...]
    held: tuple[str, ...]  # modes whose memory held between steps is attributed
    out_dir: Path
    json_path: Path | None
    rounds: int = 1  # see [Note: Interleaved rounds]

    @property
    def low_precision(self) -> torch.dtype | None:
        return torch.bfloat16 if self.dtype == "bf16" else None


class RankEnv(NamedTuple):
    rank: int
    world_size: int
    device: torch.device


class Batch(NamedTuple):
    inputs: torch.Tensor
    targets: torch.Tensor


class Wrapped(NamedTuple):
    """What a mode builder returns; ``autocast`` is the dtype to autocast the forward to."""

    module: nn.Module
    autocast: torch.dtype | None


class Run(NamedTuple):
    """A model ready to train: wrapped, with its optimizer; ``autocast`` for DDP in bf16."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    autocast: torch.dtype | None


class ModeResult(NamedTuple):
    mode: str
    step_ms: list[float]
    peak_gib: float | None
    final_loss: float
    tflops: float
    first_loss: float  # the first (warm-up) step's, mean over ranks
    phases_gib: dict[str, float] | None = None  # see phase_peaks()

    @property
    def median_ms(self) -> float:
        return statistics.median(self.step_ms)

    @property
    def spread_pct(self) -> float:
        """See [Note: What is measured]."""
        return 100.0 * (max(self.step_ms) - min(self.step_ms)) / self.median_ms


# ---------------------------------------------------------------------------------------------
# Model


class CausalSelfAttention(nn.Module):
    n_heads: int
    qkv: nn.Linear
    proj: nn.Linear

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        heads = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(heads[0], heads[1], heads[2], is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    fc: nn.Linear
    fc2: nn.Linear

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.fc2 = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block; the unit every FSDP mode shards on its own."""

    ln1: nn.LayerNorm
    attn: CausalSelfAttention
    ln2: nn.LayerNorm
    mlp: MLP

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """GPT decoder with learned positions and an untied LM head (see [Note: Parameter count])."""

    tok_emb: nn.Embedding
    pos_emb: nn.Embedding
    blocks: nn.ModuleList
    ln_f: nn.LayerNorm
    head: nn.Linear

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.apply(_init_weights)
        assert sum(p.numel() for p in self.parameters()) == cfg.param_count()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _init_weights(module: nn.Module) -> None:
    """GPT-2 initialisation: N(0, 0.02) weights, zero biases, LayerNorm left at (1, 0)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def build_model(cfg: BenchConfig, env: RankEnv) -> GPT:
    """Same weights on every rank and in every mode: one seed, built on the compute device."""
    torch.manual_seed(cfg.seed)
    with env.device:
        return GPT(cfg.model)


def make_batch(cfg: BenchConfig, env: RankEnv) -> Batch:
    """Fixed random tokens, seeded by rank; targets are the inputs shifted by one."""
    gen = torch.Generator().manual_seed(cfg.seed + 1000 * (env.rank + 1))
    shape = (cfg.model.batch, cfg.model.seq_len + 1)
    tokens = torch.randint(cfg.model.vocab, shape, generator=gen).to(env.device)
    return Batch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


# ---------------------------------------------------------------------------------------------
# Mode builders: each wraps a freshly built model. torch's FSDPs are imported here, per mode,
# so that ``--modes local,local-flat`` runs on a torch without them.


def build_ddp(model: GPT, cfg: BenchConfig, env: RankEnv) -> Wrapped:
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [env.device.index] if env.device.type == "cuda" else None
    return Wrapped(DistributedDataParallel(model, device_ids=device_ids), cfg.low_precision)


def build_torch_fsdp1(model: GPT, cfg: BenchConfig, env: RankEnv) -> Wrapped:
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchModuleWrapPolicy

    mp_policy = None
    if cfg.low_precision is not None:
        mp_policy = MixedPrecision(param_dtype=cfg.low_precision, reduce_dtype=torch.float32)
    wrapped = FullyShardedDataParallel(
        model,
        auto_wrap_policy=TorchModuleWrapPolicy({Block}),
        mixed_precision=mp_policy,
        device_id=env.device,
        use_orig_params=True,
    )
    return Wrapped(wrapped, None)


def build_torch_fsdp2(model: GPT, cfg: BenchConfig, env: RankEnv) -> Wrapped:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(env.device.type, (env.world_size,))
    mp_policy = MixedPrecisionPolicy(param_dtype=cfg.low_precision, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp_policy)
    return Wrapped(fully_shard(model, mesh=mesh, mp_policy=mp_policy), None)


def build_local_fsdp2(model: GPT, cfg: BenchConfig, env: RankEnv) -> Wrapped:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(env.device.type, (env.world_size,))
    mp_policy = fsdp.MixedPrecisionPolicy(param_dtype=cfg.low_precision, reduce_dtype=torch.float32)
    for block in model.blocks:
        fsdp.fully_shard(block, mesh=mesh, mp_policy=mp_policy)
    return Wrapped(fsdp.fully_shard(model, mesh=mesh, mp_policy=mp_policy), None)


def _build_local(model: GPT, cfg: BenchConfig, env: RankEnv, use_orig_params: bool) -> nn.Module:
    mp_policy = None
    if cfg.low_precision is not None:
        mp_policy = fsdp.MixedPrecision(param_dtype=cfg.low_precision, reduce_dtype=torch.float32)
    return fsdp.FullyShardedDataParallel(
        model,
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        mixed_precision=mp_policy,
        device_id=env.device,
        use_orig_params=use_orig_params,
    )


def build_local(model: GPT, cfg: BenchConfig, env: RankEnv) -> Wrapped:
    return Wrapped(_build_local(model, cfg, env, use_orig_params=True), None)


def build_local_flat(model: GPT, cfg: BenchConfig, env: RankEnv) -> Wrapped:
    return Wrapped(_build_local(model, cfg, env, use_orig_params=False), None)


Builder = Callable[[GPT, BenchConfig, RankEnv], Wrapped]
BUILDERS: dict[str, Builder] = {
    "ddp": build_ddp,
    "torch-fsdp1": build_torch_fsdp1,
    "torch-fsdp2": build_torch_fsdp2,
    "local-fsdp2": build_local_fsdp2,
    "local": build_local,
    "local-flat": build_local_flat,
}


def build_run(mode: str, cfg: BenchConfig, env: RankEnv) -> Run:
    model, autocast = BUILDERS[mode](build_model(cfg, env), cfg, env)
    # Fused AdamW on CUDA; on the CPU torch picks foreach where it can.
    fused = True if env.device.type == "cuda" else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=fused)
    return Run(model, optimizer, autocast)


# ---------------------------------------------------------------------------------------------
# Training and timing


def train_step(run: Run, batch: Batch) -> torch.Tensor:
    run.optimizer.zero_grad(set_to_none=True)
    enabled = run.autocast is not None
    with torch.autocast(batch.inputs.device.type, dtype=run.autocast, enabled=enabled):
        logits = run.model(batch.inputs)
    loss = F.cross_entropy(logits.float().flatten(0, 1), batch.targets.flatten())
    loss.backward()
    run.optimizer.step()
    return loss.detach()


def timed_steps(
    step: Callable[[], torch.Tensor], n: int, device: torch.device
) -> tuple[list[float], torch.Tensor]:
    """The timing loop of every mode: ``n`` steps, their times in ms and the last loss.

    See [Note: What is measured].
    """
    if device.type == "cuda":
        return _cuda_timed_steps(step, n)
    times: list[float] = []
    loss = torch.tensor(float("nan"))
    for _ in range(n):
        start = time.perf_counter()
        loss = step()
        times.append(1e3 * (time.perf_counter() - start))
    return times, loss


def _cuda_timed_steps(step: Callable[[], torch.Tensor], n: int) -> tuple[list[float], torch.Tensor]:
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(n)
    ]
    loss = torch.tensor(float("nan"))
    torch.cuda.synchronize()
    for start, end in events:
        start.record()
        loss = step()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events], loss


def reset_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def measure_mode(mode: str, cfg: BenchConfig, env: RankEnv, batch: Batch) -> ModeResult:
    run = build_run(mode, cfg, env)
    reset_memory(env.device)
    step = lambda: train_step(run, batch)
    first = step()  # the first warm-up step (see LOSS_RTOL)
    for _ in range(cfg.warmup - 1):
        step()
    times, loss = timed_steps(step, cfg.steps, env.device)
    result = summarize(mode, times, (first, loss), cfg, env)
    result = result._replace(phases_gib=phase_peaks(run, batch, env))
    if mode in cfg.held and env.device.type == "cuda":
        print_held_memory(run, batch, mode, env)
    if mode in cfg.profile:
        profile_steps(step, mode, cfg, env)
    return result


def interleaved_modes(cfg: BenchConfig, env: RankEnv, batch: Batch) -> list[ModeResult]:
    """See [Note: Interleaved rounds]."""
    steps: dict[str, Callable[[], torch.Tensor]] = {}
    first: dict[str, torch.Tensor] = {}
    for mode in cfg.modes:
        run = build_run(mode, cfg, env)
        steps[mode] = lambda run=run: train_step(run, batch)
        first[mode] = steps[mode]()
        for _ in range(cfg.warmup - 1):
            steps[mode]()
    times: dict[str, list[float]] = {mode: [] for mode in cfg.modes}
    last: dict[str, torch.Tensor] = {}
    per_round = -(-cfg.steps // cfg.rounds)
    for index in range(cfg.rounds):
        for mode in cfg.modes if index % 2 == 0 else cfg.modes[::-1]:
            dist.barrier()
            round_times, last[mode] = timed_steps(steps[mode], per_round, env.device)
            times[mode].extend(round_times)
    return [
        summarize(mode, times[mode], (first[mode], last[mode]), cfg, env, own_peak=False)
        for mode in cfg.modes
    ]


def run_mode(mode: str, cfg: BenchConfig, env: RankEnv, batch: Batch) -> ModeResult:
    """Measures one mode; everything it built is freed before the next mode starts."""
    dist.barrier()
    result = measure_mode(mode, cfg, env, batch)
    reset_memory(env.device)
    return result


def summarize(
    mode: str,
    times: list[float],
    losses: tuple[torch.Tensor, torch.Tensor],
    cfg: BenchConfig,
    env: RankEnv,
    own_peak: bool = True,
) -> ModeResult:
    """Combines the ranks' measurements (collectives: every rank calls it);
    ``losses`` are the first and the last step's; ``own_peak``: the device's peak
    memory is this mode's alone."""
    step_ms = torch.tensor(times, dtype=torch.float64, device=env.device)
    dist.all_reduce(step_ms, op=dist.ReduceOp.MAX)
    mean_loss = torch.stack([loss.float().reshape(()) for loss in losses]).to(env.device)
    dist.all_reduce(mean_loss)
    median_s = statistics.median(step_ms.tolist()) / 1e3
    return ModeResult(
        mode=mode,
        step_ms=step_ms.tolist(),
        peak_gib=peak_gib(env) if own_peak else None,
        final_loss=mean_loss[1].item() / env.world_size,
        first_loss=mean_loss[0].item() / env.world_size,
        tflops=cfg.model.flops_per_step() / median_s / 1e12,
    )


def phase_peaks(run: Run, batch: Batch, env: RankEnv) -> dict[str, float] | None:
    """One more step, untimed, with the peak of allocated memory per phase: what
    is held when the step starts, and the peaks of forward, backward and the
    optimizer step (GiB, the maximum over ranks; CUDA only)."""
    if env.device.type != "cuda":
        return None
    marks: dict[str, float] = {}

    def mark(name: str, peak: bool = True) -> None:
        torch.cuda.synchronize()
        value = torch.cuda.max_memory_allocated() if peak else torch.cuda.memory_allocated()
        marks[name] = value / 2**30
        torch.cuda.reset_peak_memory_stats()

    run.optimizer.zero_grad(set_to_none=True)
    mark("held at start", peak=False)
    enabled = run.autocast is not None
    with torch.autocast(batch.inputs.device.type, dtype=run.autocast, enabled=enabled):
        logits = run.model(batch.inputs)
    loss = F.cross_entropy(logits.float().flatten(0, 1), batch.targets.flatten())
    del logits
    mark("forward")
    loss.backward()
    mark("backward")
    run.optimizer.step()
    mark("optimizer")
    values = torch.tensor(list(marks.values()), dtype=torch.float64, device=env.device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return dict(zip(marks, values.tolist()))


def print_held_memory(run: Run, batch: Batch, mode: str, env: RankEnv, top: int = 12) -> None:
    """What is allocated when a step starts (after ``zero_grad``), by where it was
    allocated: CUDA's allocator history records two steps, and the live blocks
    are grouped by the innermost frames of this repository (or of torch's
    optimizer and FSDP). Blocks from before the recording (the parameters) show
    as such."""
    history = torch.cuda.memory._record_memory_history
    history(max_entries=1_000_000)
    try:
        for _ in range(2):
            train_step(run, batch)
        run.optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        history(enabled=None)
    sites: collections.Counter[str] = collections.Counter()
    for segment in snapshot["segments"]:
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                sites[_allocation_site(block.get("frames", []))] += block["size"]
    if env.rank == 0:
        total = sum(sites.values()) / 2**30
        print(f"\n== memory held at the start of a step of {mode}: {total:.2f} GiB")
        for site, size in sites.most_common(top):
            print(f"  {size / 2**30:8.3f} GiB  {site}")


def _allocation_site(frames: list[dict[str, Any]]) -> str:
    if not frames:
        return "(allocated before the recording)"
    ours = [f for f in frames if str(ROOT) in f["filename"] or "torch/optim" in f["filename"]]
    picked = (ours or frames)[:2]
    return " <- ".join(f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in picked)


def format_phases(results: list[ModeResult]) -> str | None:
    rows = [(r.mode, r.phases_gib) for r in results if r.phases_gib is not None]
    if not rows:
        return None
    names = list(rows[0][1])
    lines = ["peak GiB per phase of one more step: " + ", ".join(names)]
    for mode, phases in rows:
        lines.append(f"  {mode:>12}: " + "  ".join(f"{phases[n]:7.2f}" for n in names))
    return "\n".join(lines)


def peak_gib(env: RankEnv) -> float | None:
    if env.device.type != "cuda":
        return None
    peak = torch.tensor([torch.cuda.max_memory_allocated()], device=env.device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return peak.item() / 2**30


# ---------------------------------------------------------------------------------------------
# Profiling


def profile_steps(
    step: Callable[[], torch.Tensor], mode: str, cfg: BenchConfig, env: RankEnv
) -> None:
    """Traces ``PROFILE_STEPS`` more steps on every rank; rank 0 prints the top ops."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if env.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for _ in range(PROFILE_STEPS):
            step()
        if env.device.type == "cuda":
            torch.cuda.synchronize()
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    trace = cfg.out_dir / f"trace-{mode}-rank{env.rank}.json"
    prof.export_chrome_trace(str(trace))
    if env.rank == 0:
        print_profile(prof, mode, trace, env)


def print_profile(prof: Any, mode: str, trace: Path, env: RankEnv) -> None:
    from torch.autograd import DeviceType

    averages = prof.key_averages()
    print(f"\n== profile of {mode}: {PROFILE_STEPS} steps, trace {trace} (one per rank)")
    if env.device.type == "cuda":
        # GPU-side user annotations (a module's forward, the optimizer step) are not kernels.
        kernels = [
            e for e in averages if e.device_type == DeviceType.CUDA and not e.is_user_annotation
        ]
        kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
        print("top 15 CUDA kernels by total time:")
        for e in kernels[:15]:
            total = e.self_device_time_total / 1e3
            print(f"  {total:10.2f} ms  {e.count:6d} calls  {e.key[:100]}")
    print(averages.table(sort_by="self_cpu_time_total", row_limit=15))


# ---------------------------------------------------------------------------------------------
# Report


def losses_agree(results: list[ModeResult], dtype: str) -> tuple[bool, str]:
    """Compares every final loss with the first mode's; the line says what was compared."""
    ref = results[0]
    rtol = LOSS_RTOL[dtype]
    scale = abs(ref.first_loss)
    worst = max(abs(r.final_loss - ref.final_loss) / scale for r in results)
    what = f"max diff {worst:.2e} of {ref.mode}'s first loss {scale:.4g}"
    if worst <= rtol:
        return True, f"final losses AGREE ({what} <= {rtol:g})"
    return False, f"final losses DISAGREE ({what} > {rtol:g}): the comparison is VOID"


def format_table(results: list[ModeResult]) -> str:
    header = ("mode", "median ms", "min ms", "spread %", "peak GiB", "TFLOP/s", "final loss")
    rows = [header]
    for r in results:
        peak = "n/a" if r.peak_gib is None else f"{r.peak_gib:.2f}"
        rows.append(
            (
                r.mode,
                f"{r.median_ms:.2f}",
                f"{min(r.step_ms):.2f}",
                f"{r.spread_pct:.1f}",
                peak,
                f"{r.tflops:.3g}",
                f"{r.final_loss:.6f}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [" | ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def describe_run(cfg: BenchConfig, env: RankEnv) -> str:
    m = cfg.model
    return (
        f"preset {cfg.preset}: d_model {m.d_model}, {m.n_layers} layers, {m.n_heads} heads, "
        f"seq {m.seq_len}, batch {m.batch}/rank, vocab {m.vocab} (untied LM head)\n"
        f"{m.param_count():,} parameters ({m.matmul_param_count():,} outside embeddings), "
        f"{m.flops_per_step() / 1e12:.4g} TFLOP per rank and step\n"
        f"{env.world_size} ranks on {device_name(env.device)}, {cfg.dtype}, "
        f"torch {torch.__version__}, {cfg.warmup} warmup + {cfg.steps} timed steps"
        + (f" in {cfg.rounds} interleaved rounds" if cfg.rounds > 1 else "")
    )


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def git_commit() -> str:
    """HEAD's short hash; ``FSDP_BENCH_COMMIT`` names it where the tree was copied
    without its history."""
    if os.environ.get("FSDP_BENCH_COMMIT"):
        return os.environ["FSDP_BENCH_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out.stdout.strip()


def write_json(
    path: Path, cfg: BenchConfig, env: RankEnv, results: list[ModeResult], agree: bool
) -> None:
    config = {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(cfg).items()}
    payload = {
        "config": config,
        "param_count": cfg.model.param_count(),
        "flops_per_step_per_rank": cfg.model.flops_per_step(),
        "device": device_name(env.device),
        "torch": torch.__version__,
        "git_commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "losses_agree": agree,
        "results": [
            {**r._asdict(), "median_ms": r.median_ms, "spread_pct": r.spread_pct} for r in results
        ],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")


def report(cfg: BenchConfig, env: RankEnv, results: list[ModeResult]) -> None:
    print()
    print(format_table(results))
    phases = format_phases(results)
    if phases is not None:
        print(phases)
    agree, line = losses_agree(results, cfg.dtype)
    print(line)
    if cfg.json_path is not None:
        write_json(cfg.json_path, cfg, env, results, agree)
        print(f"wrote {cfg.json_path}")


# ---------------------------------------------------------------------------------------------
# Processes


@contextlib.contextmanager
def process_group(init_method: str, rank: int, world_size: int) -> Iterator[RankEnv]:
    """Initialises this rank's process group and device; see [Note: Launch]."""
    # NVLink SHARP multicast stays off on the lent machines (KINDS.md).
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        # Ranks share the cores instead of each starting a thread per core.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        device_id=device if device.type == "cuda" else None,
    )
    try:
        yield RankEnv(rank, world_size, device)
    finally:
        dist.destroy_process_group()


def worker(cfg: BenchConfig, env: RankEnv) -> None:
    if env.rank == 0:
        print(describe_run(cfg, env), flush=True)
    batch = make_batch(cfg, env)
    results = interleaved_modes(cfg, env, batch) if cfg.rounds > 1 else []
    for mode in cfg.modes if cfg.rounds == 1 else ():
        results.append(run_mode(mode, cfg, env, batch))
        if env.rank == 0:
            print(f"  {mode}: median {results[-1].median_ms:.2f} ms", flush=True)
    if env.rank == 0:
        report(cfg, env, results)


def spawned_worker(rank: int, cfg: BenchConfig, init_method: str) -> None:
    with process_group(init_method, rank, cfg.world_size) as env:
        worker(cfg, env)


def launch(cfg: BenchConfig) -> None:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        with process_group("env://", int(os.environ["RANK"]), cfg.world_size) as env:
            worker(cfg, env)
        return
    with tempfile.TemporaryDirectory() as tmp:
        init_method = f"file://{Path(tmp) / 'rendezvous'}"
        mp.spawn(spawned_worker, args=(cfg, init_method), nprocs=cfg.world_size, join=True)


# ---------------------------------------------------------------------------------------------
# Command line


def parse_args(argv: list[str] | None = None) -> BenchConfig:
    on_cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), help="default gpt-937m, tiny on CPU")
    shape = parser.add_argument_group("model shape (overrides the preset)")
    for field in dataclasses.fields(ModelConfig):
        shape.add_argument(f"--{field.name.replace('_', '-')}", type=int, dest=field.name)
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma list of {MODES}")
    parser.add_argument("--world-size", type=int, help="default: GPU count, or 2 on CPU")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), help="default bf16, fp32 on CPU")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--rounds", type=int, default=1, help="time the modes in this many interleaved rounds"
    )
    parser.add_argument(
        "--profile",
        metavar="MODES",
        default="",
        help="trace 2 more steps of these modes (comma list)",
    )
    parser.add_argument(
        "--held-memory",
        metavar="MODES",
        default="",
        help="attribute the memory held between steps of these modes (comma list, CUDA)",
    )
    parser.add_argument("--out-dir", type=Path, default=Path(tempfile.gettempdir()) / "fsdp_step")
    parser.add_argument("--json", type=Path, dest="json_path")
    opts = parser.parse_args(argv)
    modes = tuple(m for m in opts.modes.split(",") if m)
    profiled = tuple(m for m in opts.profile.split(",") if m)
    unknown = [m for m in (*modes, *profiled) if m not in MODES]
    if unknown or not modes:
        parser.error(f"unknown or no modes {unknown}; choose from {MODES}")
    if not set(profiled) <= set(modes):
        parser.error(f"--profile {opts.profile} names modes not in --modes")
    if opts.steps < 1:
        parser.error("--steps must be at least 1")
    if opts.rounds < 1 or opts.rounds > opts.steps:
        parser.error("--rounds must be between 1 and --steps")
    if opts.rounds > 1 and (profiled or opts.held_memory):
        parser.error("--rounds > 1 keeps every mode resident: no --profile or --held-memory")
    if opts.warmup < 1:
        parser.error("--warmup must be at least 1 (the first step's loss is the loss scale)")
    preset = opts.preset or ("gpt-937m" if on_cuda else "tiny")
    overrides = {
        f.name: getattr(opts, f.name)
        for f in dataclasses.fields(ModelConfig)
        if getattr(opts, f.name) is not None
    }
    return BenchConfig(
        preset=preset,
        model=dataclasses.replace(PRESETS[preset], **overrides),
        modes=modes,
        world_size=world_size(opts.world_size, on_cuda),
        dtype=opts.dtype or ("bf16" if on_cuda else "fp32"),
        warmup=opts.warmup,
        steps=opts.steps,
        seed=opts.seed,
        profile=profiled,
        held=tuple(m for m in opts.held_memory.split(",") if m),
        out_dir=opts.out_dir,
        json_path=opts.json_path,
        rounds=opts.rounds,
    )


def world_size(requested: int | None, on_cuda: bool) -> int:
    """torchrun's WORLD_SIZE wins; else ``--world-size``; else the GPU count, or 2 on CPU."""
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    if requested is not None:
        return requested
    return torch.cuda.device_count() if on_cuda else 2


def main() -> None:
    launch(parse_args())


if __name__ == "__main__":
    main()
