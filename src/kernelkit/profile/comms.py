"""Communication on a GPU timeline: which kernels are NCCL's, what each collective moved, its bus bandwidth
against the link's measured ceiling (`kernelkit doctor`'s sweep, hw/collectives.py), and the time it ran with
no compute kernel beside it on any stream: the exposed communication a step waits for.

Bytes come from the trace, never from a guess: the NCCL kernel's own args, or the `record_param_comms` event
around its launch ("In msg nelems", "Out msg nelems", "dtype", "Group size", which recent torch emits for NCCL).
A collective without them counts its time but no bytes, and the report says how many those were.
"""

from __future__ import annotations

import statistics

from ..hw.collectives import COLLECTIVES, bus_factor, size_reaching

NCCL_PREFIXES = ("ncclDevKernel", "ncclKernel")
PARAM_COMMS = "record_param_comms"
# c10 ScalarType names (record_param_comms' "dtype") and torch's, in bytes per element.
DTYPE_BYTES = {"Float": 4, "float": 4, "float32": 4, "BFloat16": 2, "bfloat16": 2, "Half": 2, "float16": 2,
               "Double": 8, "float64": 8, "Int": 4, "int32": 4, "Long": 8, "int64": 8, "Byte": 1, "uint8": 1,
               "Char": 1, "int8": 1, "Bool": 1, "bool": 1, "Float8_e4m3fn": 1, "float8_e4m3fn": 1,
               "Float8_e5m2": 1, "float8_e5m2": 1}
# Longest names first: "reducescatter" and "allreduce" both hold "reduce".
_KINDS = (("reducescatter", "reduce_scatter"), ("allgather", "all_gather"), ("allreduce", "all_reduce"),
          ("alltoall", "all_to_all"), ("broadcast", "broadcast"), ("sendrecv", "send_recv"), ("send", "send_recv"),
          ("recv", "send_recv"), ("reduce", "reduce"))
# Below this share of the link's ceiling a collective's bandwidth is a finding.
LOW_BUSBW_PCT = 50.0
# A swept size is "large enough" once the sweep reached this share of its peak there (hw.collectives.size_reaching).
FULL_SPEED_SHARE = 0.8


def is_nccl_kernel(name: str) -> bool:
    return name.startswith(NCCL_PREFIXES)


def collective_kind(text: str) -> str | None:
    """"ncclDevKernel_AllGather_RING_LL(...)", "_allgather_base", "reduce_scatter_tensor_coalesced" -> the
    collective (a name of hw.collectives.COLLECTIVES); None when the text names none (ncclDevKernel_Generic)."""
    flat = text.split("(", 1)[0].lower().replace("_", "").replace(" ", "")
    for prefix in ("nccldevkernel", "ncclkernel"):
        flat = flat.removeprefix(prefix)
    return next((kind for word, kind in _KINDS if word in flat), None)


def message_bytes(kind: str | None, args: dict) -> int | None:
    """nccl-tests' size of one collective from trace args: all-gather its output, the others their input;
    None when the args lack the count or a known dtype."""
    esize = DTYPE_BYTES.get(str(args.get("dtype", "")))
    count = args.get("Out msg nelems" if kind == "all_gather" else "In msg nelems")
    if kind is None or esize is None or not isinstance(count, int) or count < 0:
        return None
    return count * esize


def comm_record(name: str, start: float, end: float, kernel_args: dict, param_args: dict | None) -> dict:
    """One NCCL kernel of a timeline: interval, stream, collective, size and group size where the trace says."""
    meta = kernel_args if "In msg nelems" in kernel_args else (param_args or {})
    kind = collective_kind(str(meta.get("Collective name", ""))) or collective_kind(name)
    group = meta.get("Group size")
    return {"start_us": start, "end_us": end, "kernel": name[:80], "stream": kernel_args.get("stream"),
            "collective": kind, "bytes": message_bytes(kind, meta), "group_size": group if isinstance(group, int)
            else None}


def merged(intervals) -> list[tuple[float, float]]:
    """The union of intervals as sorted disjoint ones."""
    out: list[list[float]] = []
    for s, e in sorted((float(s), float(e)) for s, e in intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def uncovered_us(intervals, cover) -> float:
    """Microseconds of the union of `intervals` that no interval of `cover` overlaps."""
    total, cover, j = 0.0, merged(cover), 0
    for s, e in merged(intervals):
        while j < len(cover) and cover[j][1] <= s:
            j += 1
        k, t = j, s
        while k < len(cover) and cover[k][0] < e:
            total += max(0.0, min(cover[k][0], e) - t)
            t = max(t, cover[k][1])
            k += 1
        total += max(0.0, e - t)
    return total


def _compute(step: dict) -> list:
    comm = {(c["start_us"], c["end_us"]) for c in step.get("comm", [])}
    return [k for k in step["kernels"] if (float(k[0]), float(k[1])) not in comm]


def step_exposure(step: dict) -> dict:
    """One step: communication time (the union of its NCCL kernels), the part of it no compute kernel overlaps,
    the same per collective, and the exposed part of the step's first all-gather."""
    comm, compute = step.get("comm", []), _compute(step)
    by_kind: dict[str, list] = {}
    for c in comm:
        by_kind.setdefault(c["collective"] or "unknown", []).append((c["start_us"], c["end_us"]))
    gathers = sorted((c for c in comm if c["collective"] == "all_gather"), key=lambda c: c["start_us"])
    first = uncovered_us([(gathers[0]["start_us"], gathers[0]["end_us"])], compute) if gathers else 0.0
    return {"comm_us": uncovered_us([(c["start_us"], c["end_us"]) for c in comm], []),
            "exposed_us": uncovered_us([(c["start_us"], c["end_us"]) for c in comm], compute),
            "exposed_by_kind_us": {k: uncovered_us(v, compute) for k, v in by_kind.items()},
            "first_all_gather_exposed_us": first}


def _per_kind(timeline: list[dict], ranks: int | None, link_gbps: float | None, exposed: dict) -> list[dict]:
    steps, kinds = len(timeline), {}
    for step in timeline:
        for c in step.get("comm", []):
            kinds.setdefault(c["collective"] or "unknown", []).append(c)
    rows = []
    for kind, calls in sorted(kinds.items()):
        known = [c for c in calls if c["bytes"] is not None]
        us = sum(c["end_us"] - c["start_us"] for c in calls)
        known_us = sum(c["end_us"] - c["start_us"] for c in known)
        n = next((c["group_size"] for c in calls if c["group_size"]), None) or ranks
        busbw = None
        if known and known_us > 0 and n and kind in COLLECTIVES:
            busbw = sum(c["bytes"] for c in known) / (known_us * 1e-6) / 1e9 * bus_factor(kind, n)
        rows.append({"collective": kind, "calls": len(calls) / steps, "ms": us / steps / 1e3,
                     "exposed_ms": exposed.get(kind, 0.0) / 1e3, "bytes": sum(c["bytes"] for c in known) / steps,
                     "calls_without_bytes": (len(calls) - len(known)) / steps, "group_size": n,
                     "median_bytes": statistics.median(c["bytes"] for c in known) if known else None,
                     "busbw_gbps": busbw,
                     "pct_of_link": 100.0 * busbw / link_gbps if busbw is not None and link_gbps else None})
    return rows


def communication(timeline: list[dict], dist_info: dict | None = None) -> dict:
    """Per step (averaged): NCCL time, exposed time and its share of the step's wall time, and per collective
    its calls, time, bytes, bus bandwidth and % of the link's ceiling. {} when the timeline has no NCCL kernel.
    `dist_info`: the trace's `distributed` record (ranks, and `link`: doctor's sweep, when one was measured)."""
    if not any(step.get("comm") for step in timeline):
        return {}
    dist_info = dist_info or {}
    link = dist_info.get("link") or {}
    n = len(timeline)
    per_step = [step_exposure(s) for s in timeline]
    exposed_kind: dict[str, float] = {}
    for e in per_step:
        for k, us in e["exposed_by_kind_us"].items():
            exposed_kind[k] = exposed_kind.get(k, 0.0) + us / n
    wall = sum(s["wall_us"] for s in timeline) / n
    exposed = sum(e["exposed_us"] for e in per_step) / n
    comm = sum(e["comm_us"] for e in per_step) / n
    return {"wall_ms": wall / 1e3, "comm_ms": comm / 1e3, "exposed_ms": exposed / 1e3,
            "exposed_pct": 100.0 * exposed / wall if wall else 0.0,
            "hidden_pct": 100.0 * (comm - exposed) / comm if comm else 0.0,
            "first_all_gather_exposed_ms": sum(e["first_all_gather_exposed_us"] for e in per_step) / n / 1e3,
            "ranks": dist_info.get("world_size"), "rank": dist_info.get("rank"),
            "link_busbw_gbps": link.get("busbw_gbps"), "link": link,
            "collectives": _per_kind(timeline, dist_info.get("world_size"), link.get("busbw_gbps"), exposed_kind)}


def _mib(b: float) -> str:
    return f"{b / 2**20:.1f} MiB"


def _gather_advice(c: dict, ag: dict) -> str:
    first = c["first_all_gather_exposed_ms"]
    rest = max(ag["exposed_ms"] - first, 0.0)
    parts = []
    if first > 0:
        parts.append(f"the step's first {first:.2f} ms (nothing runs before it: paid once per step, amortized by "
                     f"more tokens per step)")
    if rest > 0:
        parts.append(f"the others {rest:.2f} ms: gather further ahead (FSDP2 prefetches one unit; "
                     f"layer.set_modules_to_forward_prefetch / set_modules_to_backward_prefetch with the next two "
                     f"layers) and fully_shard the last decoder layer(s) with reshard_after_forward=False (the "
                     f"backward starts with them and has nothing to hide their all-gather under; costs their "
                     f"unsharded parameters' memory)")
    return f"all-gathers {ag['exposed_ms']:.2f} ms exposed: " + "; ".join(parts)


def _scatter_advice(c: dict, rs: dict) -> str:
    full = size_reaching(c["link"], "reduce_scatter", FULL_SPEED_SHARE) if c["link"] else None
    med = rs["median_bytes"]
    text = f"reduce-scatters {rs['exposed_ms']:.2f} ms exposed ({rs['calls']:g} per step"
    text += f", median {_mib(med)})" if med is not None else ", sizes unknown)"
    if med is not None and full is not None and med < full and rs["calls"] >= 2:
        return (text + f": below {_mib(full)}, where doctor's sweep first reached {FULL_SPEED_SHARE:.0%} of the "
                f"link's peak: fewer, larger reduce-scatters (bigger buckets: fewer fully_shard units, e.g. one "
                f"per two decoder layers)")
    return text + ": the backward's last reduce-scatter has no compute after it to hide under (a smaller last " \
                  "unit shortens it)"


def _bandwidth_advice(c: dict, row: dict) -> str | None:
    if row["pct_of_link"] is None or row["pct_of_link"] >= LOW_BUSBW_PCT:
        return None
    kind = row["collective"].replace("_", "-")
    full = size_reaching(c["link"], row["collective"], FULL_SPEED_SHARE)
    head = (f"{kind}s ran at {row['busbw_gbps']:.0f} GB/s bus bandwidth, {row['pct_of_link']:.0f}% of the "
            f"link's {c['link_busbw_gbps']:.0f} GB/s")
    if row["median_bytes"] is not None and full is not None and row["median_bytes"] < full:
        return head + f": the message size ({_mib(row['median_bytes'])} median; the sweep reaches full speed " \
                      f"from {_mib(full)}): larger units, fewer collectives"
    return head + " at sizes the sweep ran at full speed: the link (other traffic, a PCIe path, NCCL's algorithm: " \
                  "NCCL_DEBUG=INFO says which), or ranks arriving late (a kernel's time includes the wait)"


def comm_findings(c: dict, min_pct: float = 1.0) -> list[str]:
    """The communication of a report in words: exposed time with what to change, per pattern measured."""
    if not c:
        return []
    rows = {r["collective"]: r for r in c["collectives"]}
    head = (f"communication: {c['exposed_ms']:.2f} ms of the step ({c['exposed_pct']:.1f}%) is communication not "
            f"hidden under compute ({c['comm_ms']:.2f} ms of NCCL kernels per step, {c['hidden_pct']:.0f}% hidden)")
    out = []
    advice = []
    if c["exposed_pct"] >= min_pct:
        ag, rs = rows.get("all_gather"), rows.get("reduce_scatter")
        if ag and ag["exposed_ms"] >= 0.25 * c["exposed_ms"]:
            advice.append(_gather_advice(c, ag))
        if rs and rs["exposed_ms"] >= 0.25 * c["exposed_ms"]:
            advice.append(_scatter_advice(c, rs))
    out.append(head + ("; " + "; ".join(advice) if advice else ""))
    out += [t for t in (_bandwidth_advice(c, r) for r in c["collectives"]) if t]
    if not c["link_busbw_gbps"]:
        out.append(f"communication: bus bandwidth not set against a ceiling: no link sweep for "
                   f"{c['ranks'] or 'these'} GPUs in the cache (kernelkit doctor with them visible measures it)")
    unknown = sum(r["calls_without_bytes"] for r in c["collectives"])
    if unknown:
        total = sum(r["calls"] for r in c["collectives"])
        out.append(f"communication: message sizes unknown for {unknown:g} of {total:g} collectives per step (the "
                   f"trace carried no record_param_comms sizes for them): their bandwidth is not reported")
    return out
