"""Communication in a profile (issue 31 item 4), on the CPU: NCCL kernels classified from synthetic Kineto traces,
bytes and bus bandwidth from record_param_comms, exposed time by interval arithmetic, the findings' advice, the
doctor's collective sweep (arithmetic, the one-GPU skip, and end to end on 2 gloo ranks), and the profile command
under a process group (FSDP2 over gloo, a file per rank)."""

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernelkit.hw import DATASHEETS, Ceilings
from kernelkit.hw import collectives as coll
from kernelkit.profile import Trace, analyze
from kernelkit.profile.comms import collective_kind, comm_findings, communication, message_bytes, uncovered_us
from kernelkit.profile.kineto import attribute
from kernelkit.profile.trace import OpRecord

H100 = Ceilings.from_spec(DATASHEETS["h100-sxm"])
AG = "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
RS = "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"


def _x(name, ts, dur, cat="user_annotation", tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1 if cat != "kernel" else 0, "tid": tid, "ts": ts, "dur": dur,
            "args": args}


def _comms_args(name, n_in, n_out, dtype="BFloat16", group=4):
    return {"Collective name": name, "In msg nelems": n_in, "Out msg nelems": n_out, "dtype": dtype, "Group size": group}


@pytest.mark.parametrize("text, kind", [
    (AG, "all_gather"), (RS, "reduce_scatter"), ("ncclKernel_AllReduce_RING_LL_Sum_float(ncclWorkElem)", "all_reduce"),
    ("ncclDevKernel_Broadcast_RING_LL(x)", "broadcast"), ("ncclDevKernel_SendRecv(x)", "send_recv"),
    ("ncclDevKernel_Reduce_Sum_f32_RING_LL", "reduce"), ("_allgather_base", "all_gather"),
    ("reduce_scatter_tensor_coalesced", "reduce_scatter"), ("allreduce", "all_reduce"),
    ("ncclDevKernel_Generic(x)", None)])
def test_collective_kind_from_kernel_and_collective_names(text, kind):
    assert collective_kind(text) == kind


def test_message_bytes_follow_nccl_tests_and_never_guess():
    args = _comms_args("_allgather_base", 1024, 4096, "BFloat16")
    assert message_bytes("all_gather", args) == 4096 * 2  # all-gather: the gathered output
    assert message_bytes("reduce_scatter", _comms_args("x", 4096, 1024, "Float")) == 4096 * 4  # the input
    assert message_bytes("all_gather", {**args, "dtype": "Quux"}) is None
    assert message_bytes("all_gather", {"dtype": "BFloat16"}) is None
    assert message_bytes(None, args) is None


def test_bus_bandwidth_arithmetic():
    assert coll.bus_factor("all_gather", 4) == coll.bus_factor("reduce_scatter", 4) == 0.75
    assert coll.bus_factor("all_reduce", 4) == 1.5 and coll.bus_factor("send_recv", 8) == 1.0
    alg, bus = coll.bandwidth_gbps("all_gather", 2e9, 0.01, 8)
    assert alg == pytest.approx(200.0) and bus == pytest.approx(175.0)
    with pytest.raises(ValueError, match="kind"):
        coll.bus_factor("gossip", 2)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 60), st.integers(1, 15)), min_size=1, max_size=8),
       st.lists(st.tuples(st.integers(0, 60), st.integers(1, 15)), max_size=8))
def test_uncovered_time_is_the_set_difference(comm, compute):
    a = [(float(s), float(s + d)) for s, d in comm]
    b = [(float(s), float(s + d)) for s, d in compute]
    want = {t for s, e in a for t in range(int(s), int(e))} - {t for s, e in b for t in range(int(s), int(e))}
    assert uncovered_us(a, b) == len(want)


def _fsdp_like_trace():
    """One step, 4 ranks: an all-gather with nothing before it (exposed), one under a GEMM on another stream
    (hidden), a small reduce-scatter half under compute, and an all-reduce whose sizes the trace lacks."""
    return [
        _x("kkstep::0", 0, 2000),
        _x("record_param_comms", 10, 20, "cpu_op", **_comms_args("_allgather_base", 2**20, 2**22)),
        _x("cudaLaunchKernelExC", 15, 3, "cuda_runtime", correlation=1),
        _x(AG, 100, 100, "kernel", tid=20, correlation=1, stream=20),  # 0..200: exposed 100 us
        _x("cudaLaunchKernel", 40, 3, "cuda_runtime", correlation=2),
        _x("sm90_gemm", 200, 300, "kernel", tid=7, correlation=2, stream=7),
        _x("record_param_comms", 50, 20, "cpu_op", **_comms_args("_allgather_base", 2**20, 2**22)),
        _x("cudaLaunchKernelExC", 55, 3, "cuda_runtime", correlation=3),
        _x(AG, 250, 100, "kernel", tid=20, correlation=3, stream=20),  # under the GEMM: hidden
        _x("record_param_comms", 60, 20, "cpu_op", tid=2, **_comms_args("_reduce_scatter_base", 2**21, 2**19)),
        _x("cuLaunchKernelEx", 65, 3, "cuda_driver", tid=2, correlation=4),
        _x(RS, 400, 200, "kernel", tid=21, correlation=4, stream=21),  # 400..600: 100 us under the GEMM
        _x("cudaLaunchKernel", 90, 3, "cuda_runtime", correlation=5),
        _x("ncclKernel_AllReduce_RING_LL_Sum_float", 700, 50, "kernel", tid=22, correlation=5, stream=22),
    ]


def _timeline(events):
    att = attribute(events)
    return [{"wall_us": st["last_end_us"] - st["start_us"], "kernels": st["kernels"], "comm": st["comm"]}
            for st in att.steps]


def test_nccl_kernels_are_communication_with_their_bytes():
    tl = _timeline(_fsdp_like_trace())
    comm = tl[0]["comm"]
    assert [c["collective"] for c in comm] == ["all_gather", "all_gather", "reduce_scatter", "all_reduce"]
    assert [c["bytes"] for c in comm] == [2**23, 2**23, 2**22, None]  # bf16: 2 bytes per element
    assert comm[0]["stream"] == 20 and comm[0]["group_size"] == 4 and len(tl[0]["kernels"]) == 5


def test_exposed_communication_and_bus_bandwidth_per_collective():
    link = {"busbw_gbps": 100.0, "rows": [], "peak_busbw_gbps": {}}
    c = communication(_timeline(_fsdp_like_trace()), {"world_size": 4, "rank": 0, "link": link})
    assert c["comm_ms"] == pytest.approx(0.45)  # 100 + 100 + 200 + 50 us, disjoint except the hidden gather
    assert c["exposed_ms"] == pytest.approx(0.25)  # 100 (first gather) + 100 (scatter's tail) + 50 (all-reduce)
    assert c["first_all_gather_exposed_ms"] == pytest.approx(0.1)
    assert c["exposed_pct"] == pytest.approx(100 * 250 / 750)
    rows = {r["collective"]: r for r in c["collectives"]}
    ag = rows["all_gather"]
    # 2 x 8 MiB in 200 us: algbw 83.9 GB/s, busbw x 3/4
    assert ag["busbw_gbps"] == pytest.approx(2 * 2**23 / 200e-6 / 1e9 * 0.75)
    assert ag["pct_of_link"] == pytest.approx(ag["busbw_gbps"])  # of 100 GB/s
    assert rows["all_reduce"]["busbw_gbps"] is None and rows["all_reduce"]["calls_without_bytes"] == 1
    assert rows["reduce_scatter"]["exposed_ms"] == pytest.approx(0.1)


def test_findings_say_what_to_change_from_what_was_measured():
    # The sweep: reduce-scatter reaches 80% of its peak from 64 MiB; the trace's are 4 MiB.
    rows = [{"collective": "reduce_scatter", "bytes": b, "busbw_gbps": bw} for b, bw in
            ((2**20, 10.0), (2**22, 40.0), (2**26, 90.0), (2**30, 100.0))]
    link = coll.link_summary([{**r, "ms": 1.0, "algbw_gbps": 0.0} for r in rows], 4, "nccl")
    ev = _fsdp_like_trace()
    ev += [_x("record_param_comms", 95, 2, "cpu_op", tid=2, **_comms_args("_reduce_scatter_base", 2**21, 2**19)),
           _x("cuLaunchKernelEx", 96, 1, "cuda_driver", tid=2, correlation=6),
           _x(RS, 800, 100, "kernel", tid=21, correlation=6, stream=21),
           # the backward's first all-gather (the last layer's), nothing to hide under
           _x("record_param_comms", 97, 2, "cpu_op", **_comms_args("_allgather_base", 2**20, 2**22)),
           _x("cudaLaunchKernelExC", 98, 1, "cuda_runtime", correlation=7),
           _x(AG, 900, 100, "kernel", tid=20, correlation=7, stream=20)]
    c = communication(_timeline(ev), {"world_size": 4, "link": link})
    text = comm_findings(c)
    head = text[0]
    assert head.startswith("communication: 0.45 ms of the step (45.0%) is communication not hidden under compute")
    assert "all-gathers 0.20 ms exposed: the step's first 0.10 ms" in head
    assert "the others 0.10 ms" in head and "reshard_after_forward=False" in head
    assert "below 64.0 MiB" in head and "fewer fully_shard units" in head
    assert any("reduce-scatters ran at" in t and "the message size (4.0 MiB median" in t for t in text)
    assert any("sizes unknown for 1 of 6 collectives" in t for t in text)
    no_link = comm_findings(communication(_timeline(ev), {"world_size": 4}))
    assert any("no link sweep for 4 GPUs" in t for t in no_link)
    assert communication([{"wall_us": 1.0, "kernels": [(0, 1)], "comm": []}]) == {} and comm_findings({}) == []


def test_report_rows_of_collectives_are_communication_and_the_finding_is_in_the_report():
    tl = _timeline(_fsdp_like_trace())
    recs = [OpRecord("c10d::_allgather_base_", "model.layers.0:LlamaDecoderLayer", "fwd", 0, ((4096,), (1024,)),
                     ("bfloat16",) * 2, 5120.0, 10240.0, "bf16", kernels=[[100.0, 200.0]]),
            OpRecord("aten::mm", "model.layers.0.mlp:Linear", "fwd", 0, ((512, 512), (512, 512)), ("bfloat16",) * 2,
                     2 * 512**3, 3 * 512 * 512 * 2, "bf16", kernels=[[200.0, 500.0]])]
    tr = Trace(records=recs, steps=1, measured=True, timeline=tl, distributed={"rank": 1, "world_size": 4})
    tr = Trace.from_json(json.loads(json.dumps(tr.to_json())))  # the saved trace keeps both
    rep = analyze(tr, H100)
    row = next(r for r in rep.rows if r.op.startswith("c10d::"))
    assert row.regime == "communication" and row.verdict.startswith("leave: communication")
    assert rep.communication["exposed_ms"] == pytest.approx(0.25) and rep.distributed == {"rank": 1, "world_size": 4}
    assert any(f.startswith("communication: 0.25 ms of the step") for f in rep.findings)


def test_sweep_rows_and_ceiling_from_timings(monkeypatch):
    class _Dist:
        get_world_size = staticmethod(lambda: 4)
        get_backend = staticmethod(lambda: "nccl")

    monkeypatch.setattr(torch, "distributed", _Dist)
    ms = {2**20: 0.05, 2**30: 10.0}
    doc = coll.sweep(sizes=tuple(ms), time_fn=lambda kind, nbytes: ms[nbytes] / 1e3 * (2 if kind == "all_gather" else 1))
    assert [(r["collective"], r["bytes"]) for r in doc["rows"]] == [
        ("all_gather", 2**20), ("all_gather", 2**30), ("reduce_scatter", 2**20), ("reduce_scatter", 2**30)]
    rs = doc["rows"][3]
    assert rs["algbw_gbps"] == pytest.approx(2**30 / 10e-3 / 1e9) and rs["busbw_gbps"] == pytest.approx(rs["algbw_gbps"] * 0.75)
    assert doc["busbw_gbps"] == pytest.approx(rs["busbw_gbps"]) == doc["peak_busbw_gbps"]["reduce_scatter"]
    assert coll.size_reaching(doc, "reduce_scatter") == 2**30


def test_link_cache_round_trip(monkeypatch, tmp_path):
    monkeypatch.setenv("KERNELKIT_CACHE", str(tmp_path))
    fp = {"gpu": "NVIDIA H100 80GB HBM3", "driver": "x"}
    link = coll.link_summary([{"collective": "all_gather", "bytes": 2**20, "ms": 1.0, "algbw_gbps": 1.0,
                               "busbw_gbps": 0.75}], 2, "nccl")
    path = coll.save_link(link, fp)
    assert path.parent == tmp_path / "ceilings" and coll.load_link(2, fp)["busbw_gbps"] == 0.75
    assert coll.load_link(4, fp) is None and coll.load_link(2, {**fp, "driver": "y"}) is None


def _small_sweep(rank, world):
    return coll.sweep(sizes=(2**12, 2**16))


# Two spawned processes import kernelkit (~6 s each): `make test-all` runs it; test_distributed.py's group runs the
# same sweep (check_collectives_and_profile) beside its other checks, and on GPUs under NCCL.
@pytest.mark.slow
def test_the_sweep_runs_on_two_gloo_ranks():
    """End to end on CPU tensors: gloo has all_gather_into_tensor and reduce_scatter_tensor (NCCL on GPUs)."""
    from kernelkit.testing.distributed import spawn

    docs = spawn(_small_sweep, 2)
    assert [len(d["rows"]) for d in docs] == [4, 4] and docs[0]["backend"] == "gloo" and docs[0]["ranks"] == 2
    for r in docs[0]["rows"]:  # the slowest rank's time: both ranks report the same
        assert r["ms"] > 0 and r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] / 2)
    assert [r["ms"] for r in docs[0]["rows"]] == [r["ms"] for r in docs[1]["rows"]]


def test_doctor_skips_the_link_sweep_with_one_gpu(monkeypatch):
    from rich.console import Console

    from kernelkit.commands.distributed import link_sweep

    console = Console(record=True, width=200)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert link_sweep(console) is None
    assert "link sweep skipped: 1 GPU visible: all-gather and reduce-scatter need >= 2" in console.export_text()


def test_cli_doctor_without_a_gpu_says_why_no_link(tmp_path):
    from typer.testing import CliRunner

    from kernelkit.commands.cli import app

    res = CliRunner().invoke(app, ["doctor", "--json", str(tmp_path / "d.json")])
    assert res.exit_code == 0, res.output
    assert "link sweep skipped: no CUDA GPU is visible" in res.output
    assert json.loads((tmp_path / "d.json").read_text())["link"] is None
    assert "link sweep" not in CliRunner().invoke(app, ["doctor", "--no-link"]).output
