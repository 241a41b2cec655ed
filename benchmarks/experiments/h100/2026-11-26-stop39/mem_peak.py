"""Where a training step's peak memory goes: the tensors alive at the peak, grouped by where they were allocated.

Issue 30: the fp8 patch's compiled 1B-shape step peaked 0.23 GiB above the bf16 patch's. This builds the model
as `kernelkit bench model` does, runs warm-up steps, then records the allocator's history over one step and
replays it: the peak instant, and the bytes alive then, by the innermost kernelkit / transformers / torch frame
of each allocation. Allocations made before the recorded step (parameters) count as one "before the step" line.

    python mem_peak.py --variant kernelkit-fp8 --example llama-1b --layers 4 --batch 8 --out mem.json
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict


def _short(f) -> str:
    name = f.get("filename", "")
    return f"{name.split('site-packages/')[-1].split('src/')[-1]}:{f.get('line')} {f.get('name')}"


def where(frames, depth: int = 3) -> str:
    """The innermost `depth` frames in kernelkit (the allocator wrappers skipped), else in transformers, else in
    torch, joined innermost first."""
    for key in ("kernelkit/", "transformers/", "torch/_functorch", "torch/autograd", "torch/"):
        got = [f for f in frames if key in f.get("filename", "")
               and not f.get("filename", "").endswith(("runtime/alloc.py", "memory.py"))]
        if got:
            return " < ".join(_short(f) for f in got[:depth])
    return "(no Python frame)"


def analyse(snapshot, before: int) -> dict:
    events = [e for trace in snapshot["device_traces"] for e in trace]

    def replay(stop=None):
        live: dict[int, tuple[int, str]] = {}
        cur = peak = peak_at = 0
        for i, e in enumerate(events[:stop]):
            if e["action"] == "alloc":
                live[e["addr"]] = (e["size"], e.get("frames", []))
                cur += e["size"]
            elif e["action"] == "free_completed" and e["addr"] in live:
                cur -= live.pop(e["addr"])[0]
            if cur > peak:
                peak, peak_at = cur, i
        return live, peak, peak_at

    _, peak, peak_at = replay()
    at_peak = {a: (size, where(frames)) for a, (size, frames) in replay(peak_at + 1)[0].items()}
    peak_event = [_short(f) for f in events[peak_at].get("frames", [])
                  if any(k in f.get("filename", "") for k in ("kernelkit/", "transformers/", "torch/"))][:12]
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, site in at_peak.values():
        groups[site][0] += size
        groups[site][1] += 1
    top = sorted(groups.items(), key=lambda kv: -kv[1][0])[:40]
    return {"before_step_gib": before / 2**30, "peak_in_step_gib": peak / 2**30,
            "peak_total_gib": (before + peak) / 2**30,
            "peak_event": peak_event, "peak_event_index": [peak_at, len(events)],
            "alive_at_peak": [{"site": s, "gib": b / 2**30, "tensors": n} for s, (b, n) in top]}


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from kernelkit.testing.model_bench import apply_variant, build_config

    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", default="kernelkit-fp8")
    ap.add_argument("--example", default="llama-1b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--out", default="mem.json")
    a = ap.parse_args()
    config = build_config(a.example, None, a.layers, a.seq)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    model.train()
    ids = torch.randint(0, config.vocab_size, (a.batch, a.seq), device="cuda")
    apply_variant(model, a.variant)
    run = torch.compile(model) if a.compile else model

    def step():
        model.zero_grad(set_to_none=True)
        run(input_ids=ids, labels=ids).loss.backward()

    for _ in range(3):
        step()
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000)
    run(input_ids=ids, labels=ids).loss.backward()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    res = {"variant": a.variant, "compile": a.compile, "example": a.example, "layers": a.layers, "batch": a.batch,
           "seq": a.seq, "max_memory_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
           **analyse(snap, before)}
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"{a.variant}{' +compile' if a.compile else ''}: peak {res['max_memory_allocated_gib']:.2f} GiB "
          f"(before the step {res['before_step_gib']:.2f})")
    print("  the allocation at the peak:", " < ".join(res["peak_event"][:6]))
    for g in res["alive_at_peak"][:25]:
        print(f"  {g['gib']:7.3f} GiB  {g['tensors']:4d}  {g['site']}")


if __name__ == "__main__":
    main()
