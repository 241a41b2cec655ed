"""The persistent tuning cache: the config `triton.autotune` chose per (kernel, autotune key), kept on disk so
that the next process launches it without tuning again.

What Triton 3.6 offers, and why kernelkit keeps its own file: `triton.autotune(cache_results=True)` (or
TRITON_CACHE_AUTOTUNING=1) stores each tuning's timings in Triton's cache directory under a hash of Triton's
own key, the compile target (ptxas version and architecture), the kernel's `JITFunction.cache_key`, the
cache-invalidating environment variables, the tuning key and the pruned configs; each file is written
atomically (temp file + os.replace). What it lacks here: the GPU model and SM count (an H100 SXM and an H100
PCIe are both sm_90 and would share tunings), the driver, torch and kernelkit versions; a corrupt file raises
inside the launch (`json.load`) instead of tuning again; its files sit under one-way hashes inside the
compiled-kernel cache, so they cannot be listed, exported to another machine and validated there, or cleared
without throwing the compiled kernels away; and it lives in `Autotuner.run`, which `tune.launch` leaves after
the first call. So kernelkit leaves `cache_results` off and keeps this file; from Triton it takes the tuning
key (computed as `Autotuner.run` computes it), the kernel's `cache_key` (its source, the line it starts on,
the jit functions it calls and the constexpr globals it reads) and `triton.Config`'s fields.

Layout: `$KERNELKIT_CACHE/tune/<digest>.json` (default `~/.cache/kernelkit`, as the measured ceilings), one
file per machine fingerprint (GPU name, capability and SM count, driver, CUDA, torch, Triton, kernelkit);
in it one entry per (kernel, source hash, candidate-config hash, tuning key). A change in any of them is
another file or another entry: the kernel is tuned again, a stale config is never used. Writers take a file
lock and read-merge-write through a temp file and os.replace, so two ranks tuning at once both land and a
reader never sees half a file. An unreadable or foreign file is a miss with a one-line warning, and is
rewritten by the next store. KERNELKIT_TUNE_CACHE=0 turns the cache off.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import re
import tempfile
import time
import warnings
from pathlib import Path

import triton
from triton.runtime.jit import JITFunction

from .._version import __version__
from ..hw.ceilings import cache_dir as ceilings_cache_dir

FORMAT, VERSION = "kernelkit-tune-cache", 1
EXPORT_FORMAT = "kernelkit-tune-export"
LOCK_TIMEOUT_S = 60.0  # a store that waits longer is skipped (with a warning): a launch never hangs on a lock
_SCALARS = (int, float, bool, str, type(None))
FINGERPRINT_KEYS = ("gpu", "capability", "sms", "driver", "cuda", "torch", "triton", "kernelkit")

_loaded: dict[Path, tuple] = {}  # path -> (stat signature, entries): re-read only when the file changed
_warned: set[str] = set()


def enabled() -> bool:
    return os.environ.get("KERNELKIT_TUNE_CACHE", "1") != "0"


def cache_dir() -> Path:
    """Where the tuning files live: `tune/` under the directory of the measured ceilings (KERNELKIT_CACHE)."""
    return ceilings_cache_dir() / "tune"


# --- the key ---

def _driver_version() -> str:
    # /proc costs microseconds where nvidia-smi (the ceilings' source) costs a process: this runs on a first launch
    try:
        m = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)",
                      Path("/proc/driver/nvidia/version").read_text())
        if m:
            return m.group(1)
    except OSError:
        pass
    try:
        import ctypes

        v = ctypes.c_int()
        ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(v))
        return f"cuda-driver-api-{v.value}"
    except (OSError, AttributeError):
        return "unknown"


@functools.lru_cache(maxsize=None)
def _fingerprint(index: int) -> tuple:
    import torch

    props = torch.cuda.get_device_properties(index)
    return (("gpu", props.name), ("capability", f"{props.major}.{props.minor}"), ("sms", props.multi_processor_count),
            ("driver", _driver_version()), ("cuda", torch.version.cuda or f"hip-{torch.version.hip}"),
            ("torch", torch.__version__), ("triton", triton.__version__), ("kernelkit", __version__))


def fingerprint() -> dict:
    """What a tuning depends on besides the kernel and its arguments, for the current CUDA device."""
    import torch

    return dict(_fingerprint(torch.cuda.current_device()))


def digest(fp: dict) -> str:
    return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]


def file_for(fp: dict) -> Path:
    return cache_dir() / f"{digest(fp)}.json"


def tuning_key(kernel, args: tuple, kwargs: dict) -> tuple:
    """The key `Autotuner.run` (Triton 3.6) tunes under: the values of its `key` arguments, then the dtype of
    every argument that has one, in argument order."""
    names = kernel.arg_names
    bound = {k: v for k, v in {**dict(zip(names, args)), **kwargs}.items() if k in names}
    key = [bound[k] for k in kernel.keys if k in bound]
    key += [str(v.dtype) for v in bound.values() if hasattr(v, "dtype")]
    return tuple(key)


def _name(kernel) -> str:
    return f"{kernel.base_fn.__module__}.{kernel.base_fn.__name__}"


def source_hash(kernel) -> str:
    """The kernel's `JITFunction.cache_key` (under the interpreter, where there is none: its source's hash)."""
    fn = kernel.fn
    while not isinstance(fn, JITFunction) and hasattr(fn, "fn"):  # through Heuristics and the interpreter
        fn = fn.fn
    if isinstance(fn, JITFunction):
        return fn.cache_key
    return hashlib.sha256(inspect.getsource(kernel.base_fn).encode()).hexdigest()


def config_json(cfg) -> dict | None:
    """A triton.Config as JSON, or None when it cannot be one (a pre_hook, a non-scalar meta-parameter)."""
    if cfg.pre_hook is not None or not all(isinstance(k, str) and isinstance(v, _SCALARS)
                                           for k, v in cfg.kwargs.items()):
        return None
    return {"kwargs": dict(cfg.kwargs), "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
            "num_ctas": cfg.num_ctas, "maxnreg": cfg.maxnreg, "ir_override": cfg.ir_override}


def describe(cfg) -> str:
    """"ROWS=4, num_warps=8, num_stages=3": a config's meta-parameters and the launch options that are not
    Triton's defaults (num_ctas 1, no maxnreg)."""
    parts = [f"{k}={v}" for k, v in cfg.kwargs.items()] + [f"num_warps={cfg.num_warps}", f"num_stages={cfg.num_stages}"]
    parts += [f"num_ctas={cfg.num_ctas}"] if cfg.num_ctas != 1 else []
    parts += [f"maxnreg={cfg.maxnreg}"] if cfg.maxnreg is not None else []
    return ", ".join(parts)


def config_from_json(d) -> triton.Config:
    """ValueError when `d` is not what config_json writes."""
    ints = ("num_warps", "num_stages", "num_ctas")
    if not (isinstance(d, dict) and set(d) == {"kwargs", *ints, "maxnreg", "ir_override"}
            and isinstance(d["kwargs"], dict) and all(isinstance(v, _SCALARS) for v in d["kwargs"].values())
            and all(type(d[k]) is int for k in ints) and (d["maxnreg"] is None or type(d["maxnreg"]) is int)
            and (d["ir_override"] is None or isinstance(d["ir_override"], str))):
        raise ValueError("not a config")
    return triton.Config(dict(d["kwargs"]), num_warps=d["num_warps"], num_stages=d["num_stages"],
                         num_ctas=d["num_ctas"], maxnreg=d["maxnreg"], ir_override=d["ir_override"])


def entry_name(kernel, key: tuple) -> str | None:
    """The entry's name in its fingerprint's file, or None when the kernel or key cannot be stored. The
    source hash re-tunes an edited kernel; the hash of the candidate configs one whose config list changed."""
    if not all(isinstance(v, _SCALARS) for v in key):
        return None
    configs = [config_json(c) for c in kernel.configs]
    if any(c is None for c in configs):  # pre_hooks cannot be written down (Triton's cache skips them too)
        return None
    candidates = hashlib.sha256(json.dumps(configs, sort_keys=True).encode()).hexdigest()[:8]
    return f"{_name(kernel)}:{source_hash(kernel)[:16]}:{candidates}:{key!r}"


# --- reading and writing a file ---

def _warn_once(what: str, reason) -> None:
    if what not in _warned:
        _warned.add(what)
        warnings.warn(f"kernelkit: {what} ({reason})", stacklevel=4)


def _valid_fingerprint(fp) -> bool:
    return isinstance(fp, dict) and all(isinstance(k, str) and isinstance(v, _SCALARS) for k, v in fp.items())


def _valid_entry(e) -> bool:
    try:
        config_from_json(e["config"])
        return isinstance(e["kernel"], str) and isinstance(e["key"], str) and isinstance(e["seconds"], (int, float))
    except (TypeError, KeyError, ValueError):
        return False


def _parse(text: str, fp: dict | None) -> tuple[dict, dict, int]:
    """(fingerprint, valid entries, malformed entries) of a file's text; ValueError saying what is wrong
    with it as a whole. With `fp`, the file must be that fingerprint's."""
    d = json.loads(text)
    if not isinstance(d, dict) or d.get("format") != FORMAT or d.get("version") != VERSION:
        raise ValueError(f"not a {FORMAT} file of version {VERSION}")
    if not _valid_fingerprint(d.get("fingerprint")) or not isinstance(d.get("entries"), dict):
        raise ValueError("no fingerprint or entries")
    if fp is not None and d["fingerprint"] != fp:
        raise ValueError("it was written for another fingerprint")
    entries = {k: e for k, e in d["entries"].items() if _valid_entry(e)}
    return d["fingerprint"], entries, len(d["entries"]) - len(entries)


def _read(path: Path, fp: dict | None) -> tuple[dict | None, dict]:
    """(fingerprint, entries) of a file; (None, {}) for a missing one, and for an unreadable one with a warning."""
    try:
        found, entries, bad = _parse(path.read_text(encoding="utf-8"), fp)
    except FileNotFoundError:
        return None, {}
    except (OSError, UnicodeDecodeError, ValueError) as e:  # json.JSONDecodeError is a ValueError
        _warn_once(f"ignoring the tuning cache {path}; its kernels are tuned again and the file rewritten", e)
        return None, {}
    if bad:
        _warn_once(f"ignoring {bad} malformed entries of the tuning cache {path}", "they are tuned again")
    return found, entries


def _signature(path: Path):
    st = os.stat(path)
    return st.st_mtime_ns, st.st_size, st.st_ino


def _entries(path: Path, fp: dict) -> dict:
    try:
        sig = _signature(path)
    except (FileNotFoundError, NotADirectoryError):  # no cache yet (the store says so if it cannot make one)
        return {}
    hit = _loaded.get(path)
    if hit is not None and hit[0] == sig:
        return hit[1]
    entries = _read(path, fp)[1]
    _loaded[path] = (sig, entries)
    return entries


def _write(path: Path, doc: dict) -> None:
    """Through a temp file in the same directory and os.replace: a reader sees the old file or the new one."""
    tmp = None
    try:
        with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=path.parent, prefix=path.stem + ".",
                                         suffix=".tmp", delete=False) as f:
            tmp = f.name
            json.dump(doc, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _lock(path: Path):
    from filelock import FileLock  # a dependency of torch

    return FileLock(str(path) + ".lock", timeout=LOCK_TIMEOUT_S)


def merge(fp: dict, new: dict) -> dict:
    """Add `new` entries to `fp`'s file under its lock (read-merge-write); the entries now in the file."""
    path = file_for(fp)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _lock(path):
        entries = {**_read(path, fp)[1], **new}
        _write(path, {"format": FORMAT, "version": VERSION, "fingerprint": fp, "entries": entries})
        _loaded[path] = (_signature(path), entries)
    return entries


# --- what tune.launch calls on a first launch ---

def lookup(kernel, key: tuple):
    """The stored config for (kernel, key) on this machine, as the very object of `kernel.configs`; None on
    a miss. Never raises: a cache that cannot be read is a miss."""
    try:
        name = entry_name(kernel, key)
        if name is None:
            return None
        fp = fingerprint()
        entry = _entries(file_for(fp), fp).get(name)
        if entry is None:
            return None
        cfg = config_from_json(entry["config"])
        return next((c for c in kernel.configs if c == cfg), None)
    except Exception as e:  # noqa: BLE001 - the cache is an optimization: any failure is a miss
        _warn_once("could not read the tuning cache; tuning instead", f"{type(e).__name__}: {e}")
        return None


def store(kernel, key: tuple, cfg, seconds: float) -> None:
    """Keep `cfg` as the tuned config of (kernel, key) on this machine. Never raises (a warning instead)."""
    try:
        name, cfg_doc = entry_name(kernel, key), config_json(cfg)
        if name is None or cfg_doc is None:
            return
        merge(fingerprint(), {name: {"kernel": _name(kernel), "key": repr(key),
                                     "config": cfg_doc, "seconds": round(seconds, 3),
                                     "tuned_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}})
    except Exception as e:  # noqa: BLE001 - a cache that cannot be written costs a tuning next time, no more
        _warn_once(f"could not write the tuning cache under {cache_dir()}", f"{type(e).__name__}: {e}")


# --- what `kernelkit tune` calls ---

def files() -> list[tuple[Path, dict, dict]]:
    """(path, fingerprint, entries) of every readable file in the cache."""
    out = []
    for path in sorted(cache_dir().glob("*.json")) if cache_dir().is_dir() else []:
        fp, entries = _read(path, None)
        if fp is not None and path.stem == digest(fp):
            out.append((path, fp, entries))
    return out


def clear() -> int:
    """Remove every tuning file (all fingerprints); the number of entries they held. This process keeps the
    configs it has already chosen."""
    n = 0
    for path in sorted(cache_dir().glob("*.json")) if cache_dir().is_dir() else []:
        with _lock(path):
            n += len(_read(path, None)[1])
            path.unlink(missing_ok=True)
    _loaded.clear()
    return n


def export(path: str | os.PathLike) -> int:
    """Write every fingerprint's entries to one file for `import_` on other machines; the entry count."""
    blocks = [{"fingerprint": fp, "entries": entries} for _, fp, entries in files()]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _write(path, {"format": EXPORT_FORMAT, "version": VERSION, "files": blocks})
    return sum(len(b["entries"]) for b in blocks)


def import_(path: str | os.PathLike, here: dict | None) -> dict:
    """Merge an export into this cache. Each block goes to the file of its own fingerprint, so entries tuned
    on another machine (or another driver, torch, Triton, kernelkit) are kept but never used here. Imported
    entries replace local ones of the same name: every node that imports runs the same configs.
    `here`: this machine's fingerprint (None without a GPU). Returns counts: here, other, skipped."""
    try:
        d = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    if not isinstance(d, dict) or d.get("format") != EXPORT_FORMAT or not isinstance(d.get("files"), list):
        raise ValueError(f"{path} is not a kernelkit tuning export (expected format {EXPORT_FORMAT!r})")
    counts = {"here": 0, "other": 0, "skipped": 0}
    for block in d["files"]:
        fp = block.get("fingerprint") if isinstance(block, dict) else None
        entries = block.get("entries") if isinstance(block, dict) else None
        if not _valid_fingerprint(fp) or set(fp) != set(FINGERPRINT_KEYS) or not isinstance(entries, dict):
            counts["skipped"] += len(entries) if isinstance(entries, dict) else 1
            continue
        good = {k: e for k, e in entries.items() if isinstance(k, str) and _valid_entry(e)}
        counts["skipped"] += len(entries) - len(good)
        if good:
            merge(fp, good)
            counts["here" if fp == here else "other"] += len(good)
    return counts
