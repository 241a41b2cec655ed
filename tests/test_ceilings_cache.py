"""The measured-ceilings cache: keyed on kernelkit's version, a bad file is a miss, writes are atomic."""

import hashlib
import json
import os
import threading

import pytest
import torch

from kernelkit import _version
from kernelkit.hw import Ceilings
from kernelkit.hw import ceilings as ceil_mod

FP = {"gpu": "Fake GPU", "capability": "9.0", "sms": 132, "driver": "1.0", "cuda": "13.0", "torch": "x",
      "triton": "y", "python": "3.11"}


@pytest.fixture
def fake_gpu(tmp_path, monkeypatch):
    """A visible 'GPU' whose measurement is a counter: no CUDA, no timing."""
    monkeypatch.setenv("KERNELKIT_CACHE", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ceil_mod, "device_fingerprint", lambda: dict(FP))
    calls = []

    def measure(fp, progress=None):
        calls.append(fp)
        return Ceilings(gpu="Fake GPU", fingerprint=fp, copy_gbps=1000.0 + len(calls),
                        tflops={"bf16": 100.0, "fp8": None}, launch_us=5.0, l2_bytes=1 << 20, sms=132)

    monkeypatch.setattr(ceil_mod, "_measure", measure)
    return calls


def _cache_file(tmp_path):
    files = list((tmp_path / "ceilings").glob("*.json"))
    assert len(files) == 1, files
    return files[0]


def test_second_call_reads_the_cache(fake_gpu, tmp_path):
    first = ceil_mod.measure_ceilings()
    again = ceil_mod.measure_ceilings()
    assert len(fake_gpu) == 1 and again == first
    assert ceil_mod.measure_ceilings(force=True).copy_gbps == 1002.0


def test_cache_key_includes_kernelkit_version(fake_gpu, tmp_path, monkeypatch):
    ceil_mod.measure_ceilings()
    monkeypatch.setattr(ceil_mod, "__version__", "999.0.0")  # what the key reads: kernelkit._version's
    ceil_mod.measure_ceilings()
    assert len(fake_gpu) == 2
    assert len(list((tmp_path / "ceilings").glob("*.json"))) == 2


def test_a_cache_version_bump_measures_again(fake_gpu, tmp_path, monkeypatch):
    # A changed measurement (other shapes, other timing) bumps CACHE_VERSION: what the old one cached is not read.
    ceil_mod.measure_ceilings()
    monkeypatch.setattr(ceil_mod, "CACHE_VERSION", ceil_mod.CACHE_VERSION + 1)
    ceil_mod.measure_ceilings()
    ceil_mod.measure_ceilings()
    assert len(fake_gpu) == 2
    assert len(list((tmp_path / "ceilings").glob("*.json"))) == 2


def test_ceilings_cached_by_the_unversioned_release_are_measured_again(fake_gpu, tmp_path):
    # The file the previous release keyed on (fingerprint, kernelkit's version, six NN shapes: a 300 ms median
    # each, bf16 738 TF/s on the H100 where a profile saw 844) holds a valid but outdated figure: a miss.
    old_shapes = [[4096, 4096, 4096], [8192, 8192, 8192], [8192, 8192, 32768], [8192, 2048, 32768],
                  [8192, 32000, 2048], [8192, 128256, 4096]]
    keyed = {**FP, "kernelkit": _version.__version__, "matmul_shapes": old_shapes}
    old = tmp_path / "ceilings" / f"{hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:16]}.json"
    old.parent.mkdir(parents=True)
    old.write_text(json.dumps(GOOD))
    c = ceil_mod.measure_ceilings()
    assert len(fake_gpu) == 1 and c.copy_gbps == 1001.0
    assert json.loads(old.read_text())["copy_gbps"] == 900.0  # left alone; the new figures went beside it


GOOD = Ceilings(gpu="Fake GPU", fingerprint=dict(FP), copy_gbps=900.0, tflops={"bf16": 90.0}, launch_us=4.0,
                l2_bytes=1, sms=132, mem_gbps=950.0).to_json()


# What version 2 (the fastest call of a burst; the copy as the memory roof) keyed its files on: its sweep's cases.
V2_SHAPES = [(8192, 128256, 4096), (128256, 4096, 8192), (8192, 32000, 2048), (8192, 2048, 32768), (8192, 8192, 8192),
             (12288, 12288, 12288), (16384, 16384, 16384), (4096, 4096, 4096)]
V2_LAYOUTS = {"bf16": ("NT", "NN"), "fp16": ("NT", "NN"), "tf32": ("NT", "NN"), "fp32": ("NT", "NN"),
              "fp8": ("tensorwise", "rowwise")}


def _v2_path(tmp_path):
    cases = {key: [f"{m}x{n}x{k} {lay}" for m, n, k in (V2_SHAPES[-1:] if key == "fp32" else V2_SHAPES) for lay in lays]
             for key, lays in V2_LAYOUTS.items()}
    keyed = {**FP, "kernelkit": _version.__version__, "cache_version": 2, "matmul_cases": cases}
    return tmp_path / "ceilings" / f"{hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:16]}.json"


def test_ceilings_cached_by_version_2_are_measured_again(fake_gpu, tmp_path, monkeypatch):
    # Version 2's figures (bf16 798 TF/s from bursts, the 3018 GB/s copy as the memory roof) read up to 111% in a
    # profile of the llama example: its file, even one in today's format, is a miss.
    old = _v2_path(tmp_path)
    old.parent.mkdir(parents=True)
    old.write_text(json.dumps(GOOD))
    assert ceil_mod.CACHE_VERSION == 3
    c = ceil_mod.measure_ceilings()
    assert len(fake_gpu) == 1 and c.copy_gbps == 1001.0
    assert json.loads(old.read_text())["copy_gbps"] == 900.0
    # the check itself can fail: with version 2's key (cache version and sweep) the old file is what is read
    monkeypatch.setattr(ceil_mod, "CACHE_VERSION", 2)
    monkeypatch.setattr(ceil_mod, "MATMUL_SHAPES", tuple(V2_SHAPES))
    assert ceil_mod.measure_ceilings().copy_gbps == 900.0 and len(fake_gpu) == 1


def _edited(**changes):
    d = json.loads(json.dumps(GOOD))
    for k, v in changes.items():
        if v is _DROP:
            del d[k]
        else:
            d[k] = v
    return json.dumps(d)


_DROP = object()

BAD_FILES = {
    "garbage bytes": b"\xff\xfe\x00\x81garbage\x00",
    "empty": b"",
    "truncated json": json.dumps(GOOD).encode()[:40],
    "a list": b"[1, 2, 3]",
    "missing key": _edited(launch_us=_DROP).encode(),
    "missing defaulted key": _edited(details=_DROP).encode(),
    "extra key": _edited(extra=1).encode(),
    "copy_gbps a string": _edited(copy_gbps="fast").encode(),
    "copy_gbps zero": _edited(copy_gbps=0).encode(),
    "mem_gbps missing (version 2's fields)": _edited(mem_gbps=_DROP).encode(),
    "mem_gbps null": _edited(mem_gbps=None).encode(),
    "mem_gbps a string": _edited(mem_gbps="fast").encode(),
    "mem_gbps negative": _edited(mem_gbps=-1.0).encode(),
    "tflops a list": _edited(tflops=[1, 2]).encode(),
    "tflops value a string": _edited(tflops={"bf16": "90"}).encode(),
    "sms a float": _edited(sms=1.5).encode(),
    "fingerprint a string": _edited(fingerprint="h100").encode(),
    "another device": _edited(fingerprint={**FP, "gpu": "Other GPU"}).encode(),
}


@pytest.mark.parametrize("content", BAD_FILES.values(), ids=BAD_FILES.keys())
def test_unreadable_cache_file_is_a_miss_with_a_warning(fake_gpu, tmp_path, content):
    ceil_mod.measure_ceilings()
    path = _cache_file(tmp_path)
    path.write_bytes(content)
    with pytest.warns(UserWarning, match="unreadable ceilings cache") as rec:
        c = ceil_mod.measure_ceilings()
    assert str(path) in str(rec[0].message) and "\n" not in str(rec[0].message)
    assert len(fake_gpu) == 2 and c.copy_gbps == 1002.0
    # the re-measured figures replaced the bad file
    assert json.loads(path.read_text())["copy_gbps"] == 1002.0
    assert ceil_mod.measure_ceilings().copy_gbps == 1002.0 and len(fake_gpu) == 2


def test_a_valid_hand_written_file_is_read(fake_gpu, tmp_path):
    ceil_mod.measure_ceilings()
    path = _cache_file(tmp_path)
    path.write_text(json.dumps(GOOD))
    c = ceil_mod.measure_ceilings()
    assert c.copy_gbps == 900.0 and c.mem_gbps == 950.0 and len(fake_gpu) == 1


def test_a_directory_in_place_of_the_file_does_not_crash(fake_gpu, tmp_path):
    ceil_mod.measure_ceilings()
    path = _cache_file(tmp_path)
    path.unlink()
    path.mkdir()
    with pytest.warns(UserWarning):
        c = ceil_mod.measure_ceilings()
    assert c.copy_gbps == 1002.0


def test_write_is_atomic_through_os_replace(fake_gpu, tmp_path, monkeypatch):
    seen = []
    real_replace = os.replace

    def replace(src, dst):
        # at the moment of the swap the whole new file is already on disk beside the target
        assert os.path.dirname(os.fspath(src)) == os.path.dirname(os.fspath(dst))
        seen.append(json.loads(open(src).read())["copy_gbps"])
        real_replace(src, dst)

    monkeypatch.setattr(ceil_mod.os, "replace", replace)
    ceil_mod.measure_ceilings()
    assert seen == [1001.0]
    assert [p.name for p in (tmp_path / "ceilings").iterdir()] == [_cache_file(tmp_path).name]  # no temp left


def test_failed_write_leaves_no_partial_file(fake_gpu, tmp_path, monkeypatch):
    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(ceil_mod.os, "replace", boom)
    with pytest.warns(UserWarning, match="could not write"):
        c = ceil_mod.measure_ceilings()
    assert c.copy_gbps == 1001.0
    assert list((tmp_path / "ceilings").iterdir()) == []


def test_concurrent_readers_never_see_a_half_written_file(fake_gpu, tmp_path):
    ceil_mod.measure_ceilings()
    path = _cache_file(tmp_path)
    big = Ceilings(gpu="Fake GPU", fingerprint=dict(FP), copy_gbps=1.0, tflops={}, launch_us=1.0,
                   details={"pad": "x" * 1_000_000})
    stop, bad = threading.Event(), []

    def read():
        while not stop.is_set():
            try:
                json.loads(path.read_text())
            except ValueError as e:
                bad.append(e)

    t = threading.Thread(target=read)
    t.start()
    try:
        for _ in range(20):
            ceil_mod._write_cache(path, big)
    finally:
        stop.set()
        t.join()
    assert bad == []
