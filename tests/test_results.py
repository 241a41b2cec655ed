"""The results table of a GPU (testing.results): its schema checked on every append and read, the newest row of a
key wins whatever the order in the file, and `kernelkit bench`'s rows land in the table of the GPU they ran on."""

import csv
import subprocess

import pytest

from kernelkit.hw import DATASHEETS, Ceilings
from kernelkit.testing import results
from kernelkit.testing.bench import Row, append_to_table, git_commit, table_rows


def row(**kw) -> dict:
    r = {"op": "rms_norm", "impl": "kernelkit", "shape": "16384x4096", "dtype": "bfloat16", "mode": "fwd",
         "metric": "pct_roof", "value": 93.5, "unit": "%", "gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11.0",
         "triton": "3.6.0", "commit": "cc58d02", "timestamp": "2026-11-23T11:56:22Z"}
    return {**r, **kw}


def test_append_creates_the_table_and_read_gives_it_back(tmp_path):
    path = tmp_path / "sub" / "h100.csv"
    assert results.append(path, [row(), row(metric="ms", value=0.0947, unit="ms")]) == 2
    assert results.append(path, [row(mode="bwd", value=88)]) == 1
    with open(path, newline="") as f:
        lines = list(csv.reader(f))
    assert lines[0] == list(results.COLUMNS) and len(lines) == 4  # one header
    got = results.read(path)
    assert [r["value"] for r in got] == [93.5, 0.0947, 88.0] and got[2] == row(mode="bwd", value=88.0)


@pytest.mark.parametrize("bad, message", [
    ({"metric": "speed"}, "metric 'speed' is not one of"),
    ({"unit": "ms"}, "the unit of pct_roof is '%'"),
    ({"mode": "forward"}, "mode 'forward' is not one of"),
    ({"value": "fast"}, "value 'fast' is not a number"),
    ({"value": None}, "value must be a number"),
    ({"value": True}, "value must be a number"),
    ({"value": float("nan")}, "only max_err may be non-finite"),
    ({"op": ""}, "op is empty"),
    ({"gpu": " "}, "gpu is empty"),
    ({"dtype": 16}, "dtype must be a string"),
    ({"shape": "4x\n4"}, "shape holds a line break"),
    ({"commit": "HEAD"}, "commit 'HEAD' is not a git hash"),
    ({"timestamp": "2026-11-23T11:56:22"}, "has no time zone"),
    ({"timestamp": "yesterday"}, "timestamp 'yesterday'"),
    ({"regime": "memory"}, "unknown regime"),
])
def test_append_refuses_a_row_off_the_schema_and_writes_nothing(tmp_path, bad, message):
    path = tmp_path / "h100.csv"
    with pytest.raises((ValueError, TypeError), match=message) as e:
        results.append(path, [row(), row(**bad)])
    assert "row 1" in str(e.value) and not path.exists()
    missing = row()
    del missing["unit"]
    with pytest.raises(ValueError, match="missing unit"):
        results.append(path, [missing])
    with pytest.raises(TypeError, match="a row is a mapping"):
        results.append(path, [list(row().values())])


def test_max_err_may_be_nan_and_an_empty_commit_is_outside_a_checkout(tmp_path):
    path = tmp_path / "h100.csv"
    results.append(path, [row(metric="max_err", value=float("nan"), unit="rel", commit="")])
    (got,) = results.read(path)
    assert got["value"] != got["value"] and got["commit"] == ""


def test_append_and_read_refuse_a_file_that_is_not_a_results_table(tmp_path):
    other = tmp_path / "other.csv"
    other.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="not the results schema"):
        results.append(other, [row()])
    with pytest.raises(ValueError, match="not the results schema"):
        results.read(other)
    table = tmp_path / "h100.csv"
    results.append(table, [row()])
    with open(table, "a") as f:
        f.write("rms_norm,kernelkit,1x1\n")
    with pytest.raises(ValueError, match=r"h100.csv:3: 13 fields expected, the line has 3"):
        results.read(table)


def test_latest_keeps_the_newest_row_of_each_key_not_the_last_written():
    rows = [row(value=1.0, timestamp="2026-11-24T00:00:00Z"),
            row(value=2.0, timestamp="2026-11-23T23:00:00Z"),  # older, written later
            row(value=3.0, timestamp="2026-11-24T00:30:00+01:00"),  # 23:30 UTC: older still
            row(mode="bwd", value=4.0, timestamp="2026-11-20T00:00:00Z"),
            row(metric="kernel_pct_roof", value=5.0),
            row(impl="liger", value=6.0, timestamp="2026-11-25T00:00:00Z")]
    assert [r["value"] for r in results.latest(rows)] == [1.0, 4.0, 5.0, 6.0]
    assert [r["value"] for r in results.latest(rows, impl="kernelkit", mode="fwd")] == [1.0, 5.0]
    assert [r["value"] for r in results.latest(rows, metric=("pct_roof", "kernel_pct_roof"), mode="bwd")] == [4.0]
    tie = [row(value=7.0), row(value=8.0)]
    assert [r["value"] for r in results.latest(tie)] == [8.0]  # the same time: the one appended last
    with pytest.raises(TypeError, match="not regime"):
        results.latest(rows, regime="memory")


@pytest.mark.parametrize("gpu, name", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H100 SXM5 80GB", "h100"),
                                       ("NVIDIA H100 PCIe", "h100"), ("NVIDIA L40S", "l40s"), ("NVIDIA L4", "l4"),
                                       ("NVIDIA GeForce RTX 4090", "rtx4090"), ("NVIDIA RTX A6000", "rtx-a6000")])
def test_each_gpu_has_one_table(tmp_path, gpu, name):
    assert results.table_path(gpu, tmp_path) == tmp_path / f"{name}.csv"


def test_bench_rows_are_appended_to_the_table_of_their_gpu(tmp_path):
    rows = [Row("rms_norm", "16384x4096", "bfloat16", "fwd", "kernelkit", 0.1, 2700.0, 1.3, 89.0, 1.2, "memory",
                max_err=2e-3, kernel_ms=0.095, kernel_gbps=2850.0, kernel_pct_roof=93.7),
            Row("rms_norm", "16384x4096", "bfloat16", "fwd", "liger", 0.12, 2250.0, 1.1, 74.0),
            Row("rms_norm", "16384x4096", "bfloat16", "fwd", "flex", None, error="RuntimeError: boom")]
    ceilings = Ceilings.from_spec(DATASHEETS["h100-sxm"])
    assert append_to_table(rows, ceilings, tmp_path / "absent") is None  # an installed package: no table
    assert append_to_table(rows, ceilings, None) is None
    path = append_to_table(rows, ceilings, tmp_path)
    assert path == tmp_path / "h100.csv"
    got = results.read(path)
    kk = {r["metric"]: r["value"] for r in got if r["impl"] == "kernelkit"}
    assert kk == {"ms": 0.1, "kernel_ms": 0.095, "gbps": 2700.0, "kernel_gbps": 2850.0, "tflops": 1.3,
                  "pct_roof": 89.0, "kernel_pct_roof": 93.7, "max_err": 2e-3}
    assert {r["metric"] for r in got if r["impl"] == "liger"} == {"ms", "gbps", "tflops", "pct_roof"}
    assert all(r["gpu"] == ceilings.gpu and r["commit"] == "" and r["torch"] for r in got)  # tmp_path: no checkout
    assert len({r["timestamp"] for r in got}) == 1 and results.parse_time(got[0]["timestamp"])


def test_table_rows_carry_the_commit_of_the_checkout(tmp_path):
    repo, plain = tmp_path / "repo", tmp_path / "plain"
    repo.mkdir(), plain.mkdir()

    def git(*args):
        return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout

    git("init", "-q")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "x")
    commit = git("rev-parse", "--short", "HEAD").strip()
    assert git_commit(repo) == commit and git_commit(plain) == ""
    env = {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "triton": "3.6.0", "time": "2026-11-25T10:00:00Z"}
    (r,) = table_rows([Row("softmax", "4x4", "float32", "fwd", "eager", 0.5)], env, commit)
    assert r == {"op": "softmax", "impl": "eager", "shape": "4x4", "dtype": "float32", "mode": "fwd", "metric": "ms",
                 "value": 0.5, "unit": "ms", "gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "triton": "3.6.0",
                 "commit": commit, "timestamp": "2026-11-25T10:00:00Z"}
