"""kernelkit under PyTorch's distributed engine (issue 31): FSDP2, distributed checkpoints, tensor parallelism.

One group of 2 processes (gloo on CPU, the kernels in the Triton interpreter) runs every check in `rank_checks`
once, each on a tiny Llama; the tests below read their outcome. The same checks run on N GPUs with NCCL:

    torchrun --nproc_per_node=N -m tests.test_distributed OUT_DIR      (scripts/multi_gpu_check.sh)

A check that fails stops the ones after it on that rank (a rank that skipped a collective would leave the
other waiting in it).
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
import traceback

import pytest
import torch

from tests.test_patch import batch, close, tiny_model

import kernelkit  # noqa: E402
from kernelkit.testing import distributed as kkdist  # noqa: E402

FP32_ATTENTION = ("attention", "dtype float32 (the kernel takes bfloat16 / float16)")


def _grads(model) -> dict:
    return {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _steps(model, ids, labels, steps, lr=0.1):
    """`steps` SGD steps; the losses and each step's gradients (whole tensors)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, grads = [], []
    for _ in range(steps):
        loss = model(ids, labels=labels).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append(_grads(model))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads


def _same_training(model, ref, ids, labels, steps, what):
    got, want = _steps(model, ids, labels, steps), _steps(ref, ids, labels, steps)
    for i in range(steps):
        close(got[0][i], want[0][i], what=f"{what} step {i} loss")
        assert got[1][i].keys() == want[1][i].keys()
        for n in want[1][i]:
            close(got[1][i][n], want[1][i][n], what=f"{what} step {i} grad {n}")
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        close(_full(p), _full(q), what=f"{what} param {n} after {steps} steps")


def _rank_batch(device, rank):
    ids, labels = batch(seed=1 + rank)  # data parallel: each rank its own batch
    return ids.to(device), labels.to(device)


def check_fsdp2(rank, world, device, ckpt_dir):
    """FSDP2 per decoder layer + root, patched before sharding vs unpatched: fp32, 2 layers, 2 SGD steps."""
    ref = tiny_model("llama", device=device).train()
    model = copy.deepcopy(ref)
    report = kernelkit.patch(model)
    mesh = kkdist.device_mesh()
    for m in (model, ref):
        kkdist.fully_shard_model(m, mesh)
    assert type(model.model.layers[0].mlp.gate_proj.weight).__name__ == "DTensor"
    _same_training(model, ref, *_rank_batch(device, rank), 2, "fsdp2")
    assert report.fallback_count("rms_norm") == report.fallback_count("mlp") == report.fallback_count("rope") == 0
    assert set(report.fallbacks) <= {FP32_ATTENTION}, report.fallbacks
    return {}


def check_fsdp2_checkpointing(rank, world, device, ckpt_dir):
    """FSDP2 + activation checkpointing (HF's, non-reentrant), patched after sharding: fp32, 1 layer, 2 steps."""
    ref = tiny_model("llama", device=device, layers=1).train()
    model = copy.deepcopy(ref)
    for m in (model, ref):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        kkdist.fully_shard_model(m)
    report = kernelkit.patch(model)
    assert report.count("rms_norm") == 3 and report.count("mlp") == 1
    _same_training(model, ref, *_rank_batch(device, rank), 2, "fsdp2+checkpointing")
    assert set(report.fallbacks) <= {FP32_ATTENTION}, report.fallbacks
    return {}


def check_fsdp2_bf16_attention(rank, world, device, ckpt_dir):
    """bf16 under FSDP2, where the attention kernel runs too: as close to the fp32 model as HF's own bf16."""
    ref = tiny_model("llama", device=device, layers=1).train()
    hf16 = copy.deepcopy(ref).to(torch.bfloat16)
    kk16 = copy.deepcopy(hf16)
    report = kernelkit.patch(kk16)
    for m in (ref, hf16, kk16):
        kkdist.fully_shard_model(m)
    ids, labels = _rank_batch(device, rank)
    outs = [m(ids, labels=labels).loss for m in (kk16, hf16, ref)]
    for o in outs:
        o.backward()
    got, hf, want = (_grads(m) for m in (kk16, hf16, ref))
    close(outs[0], outs[2], rtol=2e-2, what="bf16 loss")
    for n in want:
        err, hf_err = (got[n].float() - want[n]).abs().max(), (hf[n].float() - want[n]).abs().max()
        assert err <= 2 * hf_err + 1e-2 * want[n].abs().max(), f"grad {n}: {err:.3g} vs HF bf16 {hf_err:.3g}"
    assert report.fallback_count() == 0, report.fallbacks
    return {}


def check_state_dict(rank, world, device, ckpt_dir):
    """A patched sharded model's state dict has the unpatched model's keys; saved with torch.distributed.checkpoint
    and loaded into a fresh patched sharded model (other weights), it gives back the same weights and loss."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    plain_keys = tiny_model("llama", device=device).state_dict().keys()
    model, fresh = tiny_model("llama", device=device), tiny_model("llama", device=device, seed=5)
    for m in (model, fresh):
        kernelkit.patch(m)
        kkdist.fully_shard_model(m)
    sd = get_model_state_dict(model)
    assert sd.keys() == plain_keys, sorted(set(sd) ^ set(plain_keys))
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    assert full.keys() == plain_keys if rank == 0 else not full  # cpu_offload: the whole dict on rank 0 only
    dcp.save(sd, checkpoint_id=ckpt_dir)
    target = get_model_state_dict(fresh)
    dcp.load(target, checkpoint_id=ckpt_dir)
    set_model_state_dict(fresh, target)
    for (n, p), (_, q) in zip(model.named_parameters(), fresh.named_parameters()):
        assert torch.equal(_full(p), _full(q)), n
    ids, labels = _rank_batch(device, rank)
    with torch.no_grad():
        assert torch.equal(model(ids, labels=labels).loss, fresh(ids, labels=labels).loss)
    return {}


def _tp_model(device, world, dtype=torch.float32):
    # heads divisible by the world size: each rank rotates and attends over whole local heads
    return tiny_model("llama", device=device, dtype=dtype, layers=1, num_attention_heads=2 * world,
                      num_key_value_heads=world).train()


def check_tensor_parallel(rank, world, device, ckpt_dir):
    """Colwise q/k/v, gate/up; Rowwise o/down: the patched model's ops run on local shards (norms on replicated
    rows, swiglu on local columns, rope on local heads, the loss on replicated logits) and give the single-process
    unpatched model's loss and gradients (fp32; every rank the same batch). bf16 logits: the attention kernel on
    the local heads, as close to the unpatched TP model as the fp32 one's."""
    ref = _tp_model(device, world)
    tp_ref, tp_kk = copy.deepcopy(ref), copy.deepcopy(ref)
    report = kernelkit.patch(tp_kk)
    for m in (tp_ref, tp_kk):
        kkdist.tensor_parallel(m)
    ids, labels = _rank_batch(device, 0)
    outs = [m(ids, labels=labels).loss for m in (tp_kk, tp_ref, ref)]
    for o in outs:
        o.backward()
    got, tpr, want = (_grads(m) for m in (tp_kk, tp_ref, ref))
    close(outs[0], outs[2], what="tp loss")
    close(outs[1], outs[2], what="tp loss (unpatched)")
    for n in want:
        close(got[n], want[n], what=f"tp grad {n}")
    assert report.fallback_count("rms_norm") == report.fallback_count("mlp") == report.fallback_count("rope") == 0
    assert set(report.fallbacks) <= {FP32_ATTENTION}, report.fallbacks

    ref16 = _tp_model(device, world, torch.bfloat16).eval()
    tp16, kk16 = copy.deepcopy(ref16), copy.deepcopy(ref16)
    report16 = kernelkit.patch(kk16)
    for m in (tp16, kk16):
        kkdist.tensor_parallel(m)
    with torch.no_grad():
        want32 = _tp_model(device, world)(ids).logits
        got16, hf16 = kk16(ids).logits.float(), tp16(ids).logits.float()
    err, hf_err = (got16 - want32).abs().max(), (hf16 - want32).abs().max()
    assert err <= 2 * hf_err + 1e-2 * want32.abs().max(), f"bf16 TP logits {err:.3g} vs unpatched {hf_err:.3g}"
    assert report16.fallback_count() == 0, report16.fallbacks
    return {}


def check_sequence_parallel_falls_back(rank, world, device, ckpt_dir):
    """A sequence-parallel plan hands a patched norm a DTensor sharded along the sequence: the call runs the
    module's own code (counted with the reason, never a kernel on a shard it cannot compute) and gives the
    unpatched norm's result; an op called directly with a DTensor refuses by name."""
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    model = _tp_model(device, world)
    ref_norm = copy.deepcopy(model.model.norm)
    report = kernelkit.patch(model, mlp=False, rope=False, attention=False, cross_entropy=False)
    mesh = kkdist.device_mesh()
    for norm in (model.model.norm, ref_norm):
        parallelize_module(norm, mesh, SequenceParallel())  # weight replicated, input sharded along the sequence
    full = torch.randn(2, 4 * world, model.config.hidden_size, generator=torch.Generator().manual_seed(3)).to(device)
    local = full.chunk(world, 1)[rank]
    got, want = model.model.norm(local), ref_norm(local)
    torch.testing.assert_close(got.full_tensor(), want.full_tensor(), rtol=1e-5, atol=1e-6)
    x = distribute_tensor(full, mesh, [Shard(1)])
    reasons = {reason for (_, reason) in report.fallbacks}
    assert any("DTensor" in r for r in reasons), report.fallbacks
    with pytest.raises(TypeError, match=r"x is a DTensor .*to_local\(\).*replicated/local") as e:
        kernelkit.rms_norm(x, torch.ones(full.shape[-1], device=device))
    return {"message": str(e.value), "fallbacks": sorted(reasons)}


def check_ops_refuse_dtensor(rank, world, device, ckpt_dir):
    """Every op refuses a DTensor argument by name, and on the local shard of a dim it does not reduce over gives
    the shard of the whole tensor's result."""
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = kkdist.device_mesh()
    g = torch.Generator().manual_seed(7)
    x, w, b = (torch.randn(s, generator=g).to(device) for s in ((8, 3, 32), (32,), (32,)))  # rows: 2, 4, 8 ranks
    tgt = torch.randint(0, 32, (24,), generator=g).to(device)
    q, k = (torch.randn(s, generator=g).to(device) for s in ((2, 5, 2 * world, 16), (2, 5, world, 16)))
    cos, sin = (torch.randn((2, 5, 16), generator=g).to(device) for _ in range(2))
    lin_w = torch.randn((24, 32), generator=g).to(device)
    qa, ka, va = (torch.randn((2, 5, 2 * world, 16), generator=g).to(device, torch.bfloat16) for _ in range(3))

    def dt(t, dim=0):
        return distribute_tensor(t, mesh, [Shard(dim)])

    def shard(t, dim=0):
        return t.chunk(world, dim)[rank]

    cases = {  # name: (call with a DTensor, the argument it names, call on the local shard, the whole result's shard)
        "rms_norm": (lambda: kernelkit.rms_norm(dt(x), w), "x",
                     lambda: kernelkit.rms_norm(dt(x).to_local(), w), lambda: shard(kernelkit.rms_norm(x, w))),
        "rms_norm weight": (lambda: kernelkit.rms_norm(x, dt(w)), "weight", None, None),
        "layer_norm": (lambda: kernelkit.layer_norm(dt(x), w, b), "x",
                       lambda: kernelkit.layer_norm(dt(x).to_local(), w, b), lambda: shard(kernelkit.layer_norm(x, w, b))),
        "softmax": (lambda: kernelkit.softmax(dt(x)), "x",
                    lambda: kernelkit.softmax(dt(x).to_local()), lambda: shard(kernelkit.softmax(x))),
        "swiglu": (lambda: kernelkit.swiglu(dt(x, 2), dt(x, 2)), "gate",
                   lambda: kernelkit.swiglu(dt(x, 2).to_local(), dt(x, 2).to_local()), lambda: shard(kernelkit.swiglu(x, x), 2)),
        "cross_entropy": (lambda: kernelkit.cross_entropy(dt(x.view(24, 32)), tgt, reduction="none"), "logits",
                          lambda: kernelkit.cross_entropy(dt(x.view(24, 32)).to_local(), shard(tgt), reduction="none"),
                          lambda: shard(kernelkit.cross_entropy(x.view(24, 32), tgt, reduction="none"))),
        "rope": (lambda: kernelkit.rope(dt(q, 2), dt(k, 2), cos, sin), "q",
                 lambda: torch.cat(kernelkit.rope(dt(q, 2).to_local(), dt(k, 2).to_local(), cos, sin), 2),
                 lambda: torch.cat([shard(t, 2) for t in kernelkit.rope(q, k, cos, sin)], 2)),
        "linear": (lambda: kernelkit.linear(x, dt(lin_w)), "weight",
                   lambda: kernelkit.linear(x, dt(lin_w).to_local()), lambda: shard(kernelkit.linear(x, lin_w), 2)),
        "attention": (lambda: kernelkit.attention(dt(qa, 2), dt(ka, 2), dt(va, 2), causal=True), "q",
                      lambda: kernelkit.attention(*(dt(t, 2).to_local() for t in (qa, ka, va)), causal=True),
                      lambda: shard(kernelkit.attention(qa, ka, va, causal=True), 2)),
    }
    messages = {}
    for name, (call, arg, local, want) in cases.items():
        with pytest.raises(TypeError, match=rf"^{arg} is a DTensor .*\({arg}\.to_local\(\)") as e:
            call()
        messages[name] = str(e.value)
        if local is not None:
            close(local(), want(), rtol=1e-5 if name != "attention" else 1e-2, what=f"{name} on a local shard")
    return {"messages": messages}


def check_collectives_and_profile(rank, world, device, ckpt_dir):
    """doctor's link sweep at two small sizes, and the profiler's dispatch mode over an FSDP2 step: the
    collectives are records of their own, rows of the communication regime."""
    from kernelkit.hw.collectives import sweep
    from kernelkit.hw.specs import DATASHEETS
    from kernelkit.hw.ceilings import Ceilings
    from kernelkit.profile import analyze
    from kernelkit.profile.trace import predict

    link = sweep(sizes=(2**12, 2**16))
    assert len(link["rows"]) == 4 and link["busbw_gbps"] > 0
    model = tiny_model("llama", device=device).train()
    kkdist.fully_shard_model(model)
    ids, labels = _rank_batch(device, rank)
    trace = predict(model, {"input_ids": ids, "labels": labels})
    ops = {r.op for r in trace.records}
    assert {"c10d::_allgather_base_", "c10d::_reduce_scatter_base_"} <= ops, sorted(ops)
    rows = analyze(trace, Ceilings.from_spec(DATASHEETS["h100-sxm"]), tables=None).rows
    assert {r.regime for r in rows if r.op.startswith("c10d::")} == {"communication"}
    return {"link_busbw_gbps": link["busbw_gbps"]}


def check_ranks_must_agree(rank, world, device, ckpt_dir):
    """check_ranks_agree: the same facts pass; a rank with another tuning mode, or another patch decision at the
    same shape, fails on every rank with a message naming the ranks."""
    from types import SimpleNamespace

    kkdist.check_ranks_agree()
    old = os.environ.get("KERNELKIT_TUNE")
    os.environ["KERNELKIT_TUNE"] = "first" if rank == 1 else "all"
    try:
        with pytest.raises(RuntimeError, match=r"KERNELKIT_TUNE differs: 'all' on rank\(s\) 0.*'first' on rank\(s\) 1"):
            kkdist.check_ranks_agree()
    finally:
        os.environ.pop("KERNELKIT_TUNE") if old is None else os.environ.__setitem__("KERNELKIT_TUNE", old)
    choice = SimpleNamespace(kind="attention", shape="b1 h4 s8 d16", path="kernelkit" if rank else "sdpa")
    with pytest.raises(RuntimeError, match=r"chose differently for attention at b1 h4 s8 d16: sdpa on rank\(s\) 0"):
        kkdist.check_ranks_agree(SimpleNamespace(choices={"k": choice}))
    return {}


CHECKS = [check_fsdp2, check_fsdp2_checkpointing, check_fsdp2_bf16_attention, check_state_dict,
          check_tensor_parallel, check_sequence_parallel_falls_back, check_ops_refuse_dtensor,
          check_collectives_and_profile, check_ranks_must_agree]


def rank_checks(rank, world, device, ckpt_dir) -> dict:
    """Every check in this process group, in order; per check: ok, seconds, the traceback or what it returned."""
    out, failed = {}, None
    for check in CHECKS:
        if failed is not None:
            out[check.__name__] = {"ok": False, "error": f"not run: {failed} failed first"}
            continue
        t0 = time.perf_counter()
        try:
            extra = check(rank, world, device, os.path.join(ckpt_dir, check.__name__))
            out[check.__name__] = {"ok": True, "seconds": round(time.perf_counter() - t0, 2), **extra}
        except BaseException:  # noqa: BLE001 - pytest's outcome exceptions too: reported in the parent
            failed = check.__name__
            out[check.__name__] = {"ok": False, "seconds": round(time.perf_counter() - t0, 2),
                                   "error": traceback.format_exc()}
    return out


@pytest.fixture(scope="module")
def group_results(tmp_path_factory):
    import torch.distributed as dist
    from kernelkit.runtime import interpreting

    if not interpreting():
        pytest.skip("the CPU distributed checks run the kernels in the Triton interpreter (TRITON_INTERPRET=1)")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    t0 = time.perf_counter()
    results = kkdist.spawn(rank_checks, 2, "gloo", env={"KERNELKIT_PATCH_CHOICE": "kernelkit"},
                           args=("cpu", str(tmp_path_factory.mktemp("dcp"))))
    print(f"\n2 gloo ranks, {time.perf_counter() - t0:.1f} s in all:")
    for name, r in results[0].items():
        print(f"  {name}: {'ok' if r['ok'] else 'FAILED'} {r.get('seconds', '')} s")
    return results


# Two gloo processes running every check take ~75 s in the interpreter: `make test-all` runs them (CI time).
@pytest.mark.slow
def test_distributed_checks(group_results):
    """Every check on every rank (one test: the group is spawned once, not once per xdist worker)."""
    failed = [f"{check.__name__} on rank {rank}: {results[check.__name__].get('error')}"
              for check in CHECKS for rank, results in enumerate(group_results) if not results[check.__name__]["ok"]]
    assert not failed, "\n".join(failed)
    msg = group_results[0]["check_sequence_parallel_falls_back"]["message"]  # an op given a DTensor refuses by name
    assert "x.to_local()" in msg and "SequenceParallel" in msg and "Shard(dim=1)" in msg


def test_helpers_need_a_process_group():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    for call in (kkdist.device_mesh, lambda: kkdist.fully_shard_model(torch.nn.Linear(2, 2)),
                 lambda: kkdist.tensor_parallel(torch.nn.Linear(2, 2))):
        with pytest.raises(RuntimeError, match=r"needs a process group: call torch\.distributed\.init_process_group"):
            call()
    with pytest.raises(ValueError, match="world_size"):
        kkdist.spawn(rank_checks, 0)
    with pytest.raises(ValueError, match="backend"):
        kkdist.spawn(rank_checks, 2, backend="mpi")


def main(out_dir: str) -> int:
    """Under torchrun: the same checks on this host's ranks (NCCL on GPUs, else gloo); one JSON per rank."""
    import torch.distributed as dist

    os.environ.setdefault("KERNELKIT_PATCH_CHOICE", "kernelkit")
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        results = rank_checks(rank, world, "cuda" if cuda else "cpu", os.path.join(out_dir, "dcp"))
    finally:
        dist.destroy_process_group()
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"parity-rank{rank}.json"), "w") as f:
        json.dump({"world_size": world, "backend": "nccl" if cuda else "gloo", "checks": results}, f, indent=1)
    for name, r in results.items():
        print(f"rank {rank} {name}: {'ok' if r['ok'] else 'FAILED'} {r.get('seconds', '')}", flush=True)
        if not r["ok"] and rank == 0:
            print(r["error"], flush=True)
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "multi_gpu_out"))


def test_rank_disagreements_name_the_ranks_and_the_fix():
    same = {"kernelkit": "0.1.0", "KERNELKIT_PATCH_CHOICE": "auto", "KERNELKIT_TUNE": "",
            "choices": {"rms_norm at 8 rows": "kernelkit"}}
    assert kkdist.disagreements([same, dict(same)]) == []
    assert kkdist.disagreements([same, {**same, "choices": {}}]) == []  # a shape one rank has not met yet
    other = {**same, "kernelkit": "0.2.0", "choices": {"rms_norm at 8 rows": "LlamaRMSNorm.forward"}}
    got = kkdist.disagreements([same, same, other])
    assert len(got) == 2
    assert got[0].startswith("kernelkit differs: '0.1.0' on rank(s) 0, 1; '0.2.0' on rank(s) 2; install one")
    assert "chose differently for rms_norm at 8 rows: kernelkit on rank(s) 0, 1; LlamaRMSNorm.forward on rank(s) 2" \
        in got[1] and "rms_norm='kernelkit'" in got[1]
