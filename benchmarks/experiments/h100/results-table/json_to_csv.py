"""One-off (2026-11-25): the `kernelkit bench` JSONs of benchmarks/results/h100/ (an `env` and `rows` each) turned
into rows of the results table benchmarks/results/h100.csv, oldest run first. commit = the commit that last
touched the JSON, timestamp = its env.time; kernel_pct_roof (not recorded then) = pct_roof * ms / kernel_ms, the
floor over the kernels' time, as the harness now computes it.

    python benchmarks/experiments/h100/results-table/json_to_csv.py benchmarks/results/h100.csv FILE.json...
"""
import dataclasses
import json
import subprocess
import sys

from kernelkit.testing import results
from kernelkit.testing.bench import Row, table_rows

FIELDS = {f.name for f in dataclasses.fields(Row)}


def convert(path: str) -> tuple[str, list[dict]]:
    doc = json.load(open(path))
    env = doc["env"]
    commit = subprocess.run(["git", "log", "-1", "--format=%h", "--", path], capture_output=True, text=True,
                            check=True).stdout.strip()
    rows = []
    for r in doc["rows"]:
        row = Row(**{k: v for k, v in r.items() if k in FIELDS})
        if row.kernel_ms and row.ms and row.pct_roof:
            row.kernel_pct_roof = row.pct_roof * row.ms / row.kernel_ms
        rows.append(row)
    return env["time"], table_rows(rows, env, commit)


if __name__ == "__main__":
    table, paths = sys.argv[1], sys.argv[2:]
    runs = sorted((convert(p) + (p,) for p in paths), key=lambda run: run[0])
    for _, rows, path in runs:
        print(f"{path}: {results.append(table, rows)} rows")
