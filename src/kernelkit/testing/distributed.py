"""kernelkit under PyTorch's own distributed engine: process groups for tests, FSDP2 and tensor-parallel plans
for Hugging Face decoder models (the multi-GPU throughput comparison that uses them: fsdp_bench.py).

kernelkit needs nothing of its own to run distributed. Under FSDP2 (`fully_shard`) a module's parameters are
gathered into plain tensors before its forward, so a patched forward hands kernelkit plain tensors. Under tensor
parallelism a plan whose Colwise/Rowwise layers return local tensors (`use_local_output=True`, the default) gives
the ops between them local shards on which they are exact (norms of replicated rows, the elementwise GLU of
sharded columns, rope and attention of the local heads). A plan that hands an op a DTensor (SequenceParallel on a
norm kernelkit replaced) is refused by the op's validation with a TypeError: a Triton kernel would read only the
local shard's storage, a silently wrong result.

    spawn(fn, world_size=2)            # fn(rank, world_size, *args) in N processes, gloo on CPU; returns their values
    mesh = device_mesh()               # a 1-D DeviceMesh over the group (needs init_process_group first)
    fully_shard_model(model, mesh)     # FSDP2: each decoder layer, then the root
    tensor_parallel(model, mesh)       # Colwise q/k/v, gate/up; Rowwise o/down (sequence_parallel=True: + norms)
"""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
from pathlib import Path
from typing import Callable

import torch

from .. import switches
from .._version import __version__


def require_process_group(what: str):
    """torch.distributed, once a default process group exists; else a RuntimeError naming `what` and the fix."""
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError(f"{what} needs torch.distributed, which this PyTorch build lacks")
    if not dist.is_initialized():
        raise RuntimeError(f"{what} needs a process group: call torch.distributed.init_process_group(...) first "
                           f"(torchrun sets its environment), or run the function under "
                           f"kernelkit.testing.distributed.spawn(fn, world_size)")
    return dist


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_entry(rank: int, fn: Callable, world_size: int, backend: str, port: int, env: dict, args: tuple,
                out_dir: str, timeout_s: float) -> None:
    import torch.distributed as dist

    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))  # ranks share the host's cores
    if backend == "nccl":
        torch.cuda.set_device(rank)
    # a rank that dies mid-collective must not leave the others waiting for ever
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable, world_size: int = 2, backend: str = "gloo", env: dict | None = None, args: tuple = (),
          timeout_s: float = 300.0) -> list:
    """Run ``fn(rank, world_size, *args)`` in `world_size` fresh processes joined in one process group, and return
    each rank's return value (it must be picklable), in rank order. A rank's exception is raised here with its
    traceback. `env` is set in each process before `fn` runs (switches read at call time, KERNELKIT_PATCH_CHOICE);
    switches read at import (TRITON_INTERPRET) must already be in this process's environment, which the ranks
    inherit. `fn` must be importable by name (a module-level function). A collective waits at most `timeout_s`."""
    import torch.multiprocessing as mp

    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' (CPU) or 'nccl' (one GPU per rank), got {backend!r}")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(f"backend='nccl' needs one GPU per rank: world_size={world_size}, "
                         f"{torch.cuda.device_count()} GPU(s) here")
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_rank_entry, args=(fn, world_size, backend, free_port(), dict(env or {}), tuple(args), out_dir,
                                         timeout_s),
                 nprocs=world_size, join=True)
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def device_mesh(device_type: str | None = None):
    """A 1-D DeviceMesh over every rank of the default group, on "cuda" when the group is NCCL, else "cpu"."""
    dist = require_process_group("kernelkit.testing.distributed.device_mesh")
    from torch.distributed.device_mesh import init_device_mesh

    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """A Hugging Face causal LM's decoder layers (``model.model.layers``)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no model.layers ModuleList of decoder layers")
    return layers


def rank_facts(report=None) -> dict:
    """What must be the same on every rank for the ranks to compute alike: kernelkit's version, how the patch
    chooses (KERNELKIT_PATCH_CHOICE) and tunes (KERNELKIT_TUNE), and, given a PatchReport, every decision taken so
    far (switch, shape -> path)."""
    facts = {"kernelkit": __version__, "KERNELKIT_PATCH_CHOICE": switches.value("KERNELKIT_PATCH_CHOICE"),
             "KERNELKIT_TUNE": os.environ.get("KERNELKIT_TUNE", "")}
    if report is not None:
        facts["choices"] = {f"{c.kind} at {c.shape}": c.path for c in report.choices.values()}
    return facts


def disagreements(per_rank: list[dict]) -> list[str]:
    """Each fact of `rank_facts` on which the ranks differ, as a sentence naming the ranks and the fix."""
    out = []
    for key in ("kernelkit", "KERNELKIT_PATCH_CHOICE", "KERNELKIT_TUNE"):
        values = {}
        for r, facts in enumerate(per_rank):
            values.setdefault(facts.get(key), []).append(r)
        if len(values) > 1:
            seen = "; ".join(f"{v!r} on rank(s) {', '.join(map(str, rs))}" for v, rs in values.items())
            fix = ("install one kernelkit version on every rank" if key == "kernelkit" else
                   f"set {key} alike on every rank (torchrun passes the launcher's environment to all)")
            out.append(f"{key} differs: {seen}; {fix}")
    shared = set().union(*(f.get("choices", {}) for f in per_rank)) if per_rank else set()
    for where in sorted(shared):
        paths = {}
        for r, facts in enumerate(per_rank):
            if where in facts.get("choices", {}):
                paths.setdefault(facts["choices"][where], []).append(r)
        if len(paths) > 1:
            seen = "; ".join(f"{p} on rank(s) {', '.join(map(str, rs))}" for p, rs in paths.items())
            out.append(f"the patch chose differently for {where}: {seen}; each rank measured on its own: force "
                       f"the switch (e.g. kernelkit.patch(model, {where.split(' at ')[0]}='kernelkit') or "
                       f"KERNELKIT_PATCH_CHOICE=kernelkit), or give every rank the same decision cache "
                       f"(KERNELKIT_CACHE on a shared file system, filled by one run first)")
    return out


def check_ranks_agree(report=None, group=None) -> dict:
    """Raise RuntimeError where the ranks of the group would compute differently (`disagreements`): a different
    kernelkit version, choice or tuning mode, or a different patch decision at the same shape (each rank measures
    on its own; two close paths can land either way, and ranks that hold replicated tensors, as under tensor
    parallelism, would drift apart). Call it after the first step to compare decisions too. Returns this rank's
    facts."""
    dist = require_process_group("kernelkit.testing.distributed.check_ranks_agree")
    facts = rank_facts(report)
    per_rank: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(per_rank, facts, group=group)
    problems = disagreements(per_rank)
    if problems:
        raise RuntimeError("kernelkit: the ranks differ: " + " | ".join(problems))
    return facts


def fully_shard_model(model: torch.nn.Module, mesh=None, **fsdp_kwargs) -> torch.nn.Module:
    """FSDP2 as the PyTorch docs apply it: `fully_shard` each decoder layer, then the root (embedding, final
    norm, head). Patch before or after: the patched forwards see the gathered (plain) parameters either way.
    First checks that every rank runs the same kernelkit version and choice/tuning modes (`check_ranks_agree`)."""
    require_process_group("kernelkit.testing.distributed.fully_shard_model")
    from torch.distributed.fsdp import fully_shard

    check_ranks_agree()

    mesh = mesh if mesh is not None else device_mesh()
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, **fsdp_kwargs)
    fully_shard(model, mesh=mesh, **fsdp_kwargs)
    return model


def tensor_parallel_plan(sequence_parallel: bool = False) -> dict:
    """Megatron-style plan for a Llama-like decoder: q/k/v and gate/up split by output features (each rank
    holds whole heads and whole MLP columns), o/down by input features (an all-reduce after). Every op between
    them gets local tensors. `sequence_parallel=True` adds SequenceParallel on the norms, which hands the norm
    a DTensor: kernelkit's rms_norm refuses it (TypeError) — unpatch the norms or keep this False."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    layer = "model.layers.*."
    plan = {layer + f"self_attn.{p}_proj": ColwiseParallel() for p in "qkv"}
    plan.update({layer + "mlp.gate_proj": ColwiseParallel(), layer + "mlp.up_proj": ColwiseParallel(),
                 layer + "self_attn.o_proj": RowwiseParallel(), layer + "mlp.down_proj": RowwiseParallel()})
    if sequence_parallel:
        plan.update({layer + "input_layernorm": SequenceParallel(), layer + "post_attention_layernorm": SequenceParallel(),
                     "model.norm": SequenceParallel()})
    return plan


def tensor_parallel(model: torch.nn.Module, mesh=None, sequence_parallel: bool = False) -> torch.nn.Module:
    """`parallelize_module` with `tensor_parallel_plan`. Heads must divide by the world size (each rank
    keeps num_heads / world query heads and num_kv_heads / world KV heads; HF's attention reads the local
    count from the projections' shapes)."""
    dist = require_process_group("kernelkit.testing.distributed.tensor_parallel")
    from torch.distributed.tensor.parallel import parallelize_module

    world, cfg = dist.get_world_size(), getattr(model, "config", None)
    for attr in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        n = getattr(cfg, attr, None)
        if n is not None and n % world:
            raise ValueError(f"config.{attr}={n} does not divide by the world size {world}")
    check_ranks_agree()
    return parallelize_module(model, mesh if mesh is not None else device_mesh(), tensor_parallel_plan(sequence_parallel))
