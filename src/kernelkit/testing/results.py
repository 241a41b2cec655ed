"""The results table of a GPU: `benchmarks/results/<gpu>.csv`, one measured number a row.

`kernelkit bench` appends to it and `kernelkit profile` reads it. Rows are never rewritten: a new
measurement of the same key (op, impl, shape, dtype, mode, metric) is a new row, and `latest` keeps the
newest by timestamp. Which file a number came from never decides anything.
"""

from __future__ import annotations

import csv
import math
import re
from datetime import datetime
from pathlib import Path
from typing import Iterable, Mapping

from ..hw.specs import DATASHEETS, lookup

COLUMNS = ("op", "impl", "shape", "dtype", "mode", "metric", "value", "unit", "gpu", "torch", "triton", "commit",
           "timestamp")
KEY = ("op", "impl", "shape", "dtype", "mode", "metric")
MODES = ("fwd", "bwd", "fwd+bwd", "")
# metric -> unit. pct_roof is the roofline floor over the end-to-end time (host included), kernel_pct_roof
# over the summed device time of the call's kernels; max_err is max |out - eager| / max |eager|.
METRICS = {"ms": "ms", "kernel_ms": "ms", "gbps": "GB/s", "kernel_gbps": "GB/s", "tflops": "TFLOP/s",
           "pct_roof": "%", "kernel_pct_roof": "%", "max_err": "rel"}
REQUIRED = ("op", "impl", "shape", "metric", "gpu", "timestamp")  # not empty; the others may be ''

RESULTS = Path(__file__).resolve().parents[3] / "benchmarks" / "results"  # in a source checkout


def parse_time(text: str) -> datetime:
    """An ISO 8601 timestamp with its time zone ("2026-11-23T11:56:22Z")."""
    t = datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith("Z") else text)
    if t.tzinfo is None:
        raise ValueError(f"timestamp {text!r} has no time zone: write UTC as '...Z' or '+00:00'")
    return t


def _checked(row: Mapping, where: str) -> dict:
    if not isinstance(row, Mapping):
        raise TypeError(f"{where}: a row is a mapping of the columns {', '.join(COLUMNS)}, not {type(row).__name__}")
    missing = [c for c in COLUMNS if c not in row]
    extra = [c for c in row if c not in COLUMNS]
    if missing or extra:
        raise ValueError(f"{where}: the columns are {', '.join(COLUMNS)}"
                         + (f"; missing {', '.join(missing)}" if missing else "")
                         + (f"; unknown {', '.join(map(str, extra))}" if extra else ""))
    out = {}
    for c in COLUMNS:
        v = row[c]
        if c == "value":
            if isinstance(v, str):
                try:
                    v = float(v)
                except ValueError:
                    raise ValueError(f"{where}: value {v!r} is not a number") from None
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError(f"{where}: value must be a number, not {type(v).__name__}")
            v = float(v)
            if not math.isfinite(v) and row["metric"] != "max_err":  # a NaN error is a finding; a NaN time is not
                raise ValueError(f"{where}: value of {row['metric']} is {v}: only max_err may be non-finite")
        elif not isinstance(v, str):
            raise TypeError(f"{where}: {c} must be a string, not {type(v).__name__} ({v!r})")
        elif c in REQUIRED and not v.strip():
            raise ValueError(f"{where}: {c} is empty")
        elif "\n" in v or "\r" in v:
            raise ValueError(f"{where}: {c} holds a line break")
        out[c] = v
    if out["mode"] not in MODES:
        raise ValueError(f"{where}: mode {out['mode']!r} is not one of {', '.join(map(repr, MODES))}")
    if out["metric"] not in METRICS:
        raise ValueError(f"{where}: metric {out['metric']!r} is not one of {', '.join(METRICS)} "
                         "(a new metric goes into results.METRICS with its unit)")
    if out["unit"] != METRICS[out["metric"]]:
        raise ValueError(f"{where}: the unit of {out['metric']} is {METRICS[out['metric']]!r}, not {out['unit']!r}")
    if out["commit"] and not re.fullmatch(r"[0-9a-f]{4,40}", out["commit"]):
        raise ValueError(f"{where}: commit {out['commit']!r} is not a git hash (or '' outside a checkout)")
    try:
        parse_time(out["timestamp"])
    except ValueError as e:
        raise ValueError(f"{where}: timestamp {out['timestamp']!r}: {e}") from None
    return out


def _header(path: Path) -> list[str] | None:
    with open(path, newline="") as f:
        return next(csv.reader(f), None)


def append(path: str | Path, rows: Iterable[Mapping]) -> int:
    """Validate every row against the schema, then append them to the table at `path` (created with its
    header, and its folder, when missing). Nothing is written when any row is wrong. Returns the count."""
    path = Path(path)
    checked = [_checked(r, f"row {i}") for i, r in enumerate(rows)]
    exists = path.exists() and path.stat().st_size > 0
    if exists and _header(path) != list(COLUMNS):
        raise ValueError(f"{path}: its header is not the results schema ({','.join(COLUMNS)}); "
                         "append to a results table, not another CSV")
    if not checked:
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, COLUMNS, lineterminator="\n")
        if not exists:
            w.writeheader()
        for r in checked:
            w.writerow({**r, "value": format(r["value"], ".6g")})
    return len(checked)


def read(path: str | Path) -> list[dict]:
    """Every row of the table at `path`, in file order, `value` as a float; a malformed row raises
    ValueError with its line number."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames != list(COLUMNS):
            raise ValueError(f"{path}: the header is {reader.fieldnames}, not the results schema {list(COLUMNS)}")
        rows = []
        for r in reader:
            where = f"{path}:{reader.line_num}"
            if None in r or None in r.values():
                raise ValueError(f"{where}: {len(COLUMNS)} fields expected, the line has "
                                 f"{len(COLUMNS) + len(r.get(None, [])) - list(r.values()).count(None)}")
            rows.append(_checked(r, where))
        return rows


def latest(rows: Iterable[Mapping], **filters) -> list[dict]:
    """The rows matching `filters` (column=value, or column=(values...) for any of them), one per key
    (op, impl, shape, dtype, mode, metric): the one with the newest timestamp; on equal timestamps the one
    appended last. In the order the kept rows appear."""
    unknown = [k for k in filters if k not in COLUMNS]
    if unknown:
        raise TypeError(f"latest() filters on the columns {', '.join(COLUMNS)}, not {', '.join(unknown)}")
    wanted = {k: set(v) if isinstance(v, (tuple, list, set, frozenset)) else {v} for k, v in filters.items()}
    best: dict[tuple, tuple[datetime, int, Mapping]] = {}
    for i, r in enumerate(rows):
        if any(r[k] not in vs for k, vs in wanted.items()):
            continue
        key, t = tuple(r[k] for k in KEY), parse_time(r["timestamp"])
        if key not in best or t >= best[key][0]:
            best[key] = (t, i, r)
    return [dict(r) for _, _, r in sorted(best.values(), key=lambda b: b[1])]


def table_name(gpu: str) -> str:
    """The name of a GPU's table: its datasheet model ("h100" for "NVIDIA H100 80GB HBM3" and for the
    datasheet's "NVIDIA H100 SXM5 80GB"), else its name in lower case ("rtx-a6000")."""
    spec = lookup(gpu)
    if spec is not None:
        return next(k for k, s in DATASHEETS.items() if s is spec).split("-")[0]
    name = re.sub(r"[^a-z0-9]+", "-", gpu.lower().replace("nvidia", "")).strip("-")
    if not name:
        raise ValueError(f"gpu {gpu!r} has no name to call its table by")
    return name


def table_path(gpu: str, root: str | Path = RESULTS) -> Path:
    """`<root>/<table_name(gpu)>.csv`, whether or not it exists yet."""
    return Path(root) / f"{table_name(gpu)}.csv"
