"""Which code runs a patched call: kernelkit's kernel or the model's own, chosen by measurement.

A switch of `kernelkit.patch` in mode "auto" (the default) swaps kernelkit in only where kernelkit is
measured faster than what the model ran before the patch, at that call's shape, dtype and GPU:
- The first call at a new key (the switch, the shapes, the dtype, whether a backward follows, and what
  the model ran before) times both paths. They run on fresh random inputs of the call's shapes, drawn
  from a private generator under `torch.random.fork_rng`: the user's data and random stream are not
  touched. Each path runs forward, then backward through `torch.autograd.grad` when the call needs
  gradients, so nothing accumulates into `.grad`. Paths alternate rep by rep; the median decides.
- Decisions are cached in the process and on disk, next to the tuning cache
  (`$KERNELKIT_CACHE/patch/<machine digest>.json`, one file per GPU model, driver, torch, Triton and
  kernelkit; KERNELKIT_TUNE_CACHE=0 keeps them in memory only).
- Under torch.compile the decision is taken while Dynamo traces (`torch._dynamo.assume_constant_result`):
  the compiled graph holds the chosen path and no measurement happens at run time.
- Under CUDA-graph capture a decision that is not cached cannot be measured (timing synchronizes): it
  raises, asking for one eager call at that shape before capture.
- In the Triton interpreter (CPU tests) nothing is measured: kernelkit runs ("interpreter: not measured").

Mode "kernelkit" forces kernelkit at every shape. Each decision lands in the patch's report
(`PatchReport.choices`), with both times and the ratio. A choice is made per rank: ranks measuring
close paths differently would run different (equally exact) code, so under torch.distributed share the
cache file or force a mode.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from .. import switches
from ..runtime import cache, capturing, interpreting, next_pow2

MODES = ("auto", "kernelkit")
# Per-path measuring budget: reps are added until a path has run this long (at least MIN_REPS, at most MAX_REPS).
BUDGET_MS, MIN_REPS, MAX_REPS = 30.0, 3, 25
WARMUP = 2  # untimed calls of each path first (they compile and tune)
# The unfused loss's logits may take at most this share of the free memory to be measured; beyond, kernelkit's
# fused loss (which never materializes them) is chosen without timing the original.
LOGITS_SHARE = 0.4


def mode(argument: str, value) -> Optional[str]:
    """A switch's value as a mode: "auto" or "kernelkit" as given, True -> KERNELKIT_PATCH_CHOICE (default
    "auto"), False / None -> None (off)."""
    if value is True:
        return switches.value("KERNELKIT_PATCH_CHOICE")
    if value is False or value is None:
        return None
    if isinstance(value, str) and value in MODES:
        return value
    raise ValueError(f"kernelkit.patch: {argument}={value!r} is not one of True, False, 'auto', 'kernelkit' "
                     f"('auto' and True: kernelkit only where measured faster; 'kernelkit': always)")


@dataclass
class Choice:
    """One decision: at `shape`, `path` runs ("kernelkit" or the model's own, named as in `original`)."""
    kind: str
    shape: str
    original: str  # what the model ran before the patch ("sdpa", "LlamaRMSNorm.forward", ...)
    use_kernelkit: bool
    source: str  # "measured", "cache", "forced", "interpreter", "memory"
    kernelkit_ms: Optional[float] = None
    original_ms: Optional[float] = None

    @property
    def path(self) -> str:
        return "kernelkit" if self.use_kernelkit else self.original

    @property
    def ratio(self) -> Optional[float]:
        """The original's time over kernelkit's (above 1: kernelkit is faster)."""
        if not self.kernelkit_ms or self.original_ms is None:
            return None
        return self.original_ms / self.kernelkit_ms

    def describe(self) -> str:
        r = self.ratio
        if self.source == "forced":
            return "kernelkit (forced)"
        if self.source == "interpreter":
            return "kernelkit (interpreter: not measured)"
        if self.source == "memory":
            return f"kernelkit ({self.original} would not fit in free memory to be measured)"
        timed = f"{self.kernelkit_ms:.3f} vs {self.original_ms:.3f} ms" if r is not None else ""
        if self.use_kernelkit:
            return f"kernelkit: {r:.2f}x faster than {self.original} ({timed}{', cached' if self.source == 'cache' else ''})"
        return (f"kept {self.original}: {1 / r:.2f}x faster than kernelkit "
                f"({timed}{', cached' if self.source == 'cache' else ''})")


@dataclass
class Trial:
    """Both paths on fresh inputs: `kernelkit()` and `original()` return the output (a tensor or a tuple
    of tensors); `wrt` are the tensors a backward differentiates by (empty: forward only). `in_flight`: calls
    timed back to back per sample (each sample's time divided by it). With 1, a call's time is its host time
    plus the GPU's, as for an op the model waits on; with several, the longer of the two, as for an op in a
    step whose host runs ahead of the GPU: a path that launches many short kernels is not charged its host
    time where the GPU would be busy anyway, only where the host is the bottleneck."""
    kernelkit: Callable
    original: Callable
    wrt: list
    in_flight: int = 1


class Site:
    """One patched place (a module class of one model, or its rope function), registered under an integer
    token so that a decision taken while Dynamo traces needs only constants: `build(owner, key)` makes the
    Trial at a key, `describe(key)` names the key's shape, `original` names the model's own path."""

    def __init__(self, kind: str, modes: dict, report, build: Callable, describe: Callable, original: str,
                 owner=None):
        self.kind, self.modes, self.report = kind, modes, report
        self.build, self.describe, self.original = build, describe, original
        self.owner = weakref.ref(owner) if owner is not None else (lambda: None)
        self.token = len(_SITES)
        _SITES.append(self)

    def use_kernelkit(self, key: tuple) -> bool:
        """Whether this call runs kernelkit (True) or the model's own code (False)."""
        return decide(self.token, key)


_SITES: list[Site] = []
_memory: dict[str, Choice] = {}  # by switch, original path and key: shared by every patched model
_fast: dict[tuple, Choice] = {}  # by (site token, key): what a site already recorded


def _cache_key(kind: str, key: tuple, original: str) -> str:
    return json.dumps([kind, original, [str(k) for k in key]])


@torch._dynamo.assume_constant_result
def decide(token: int, key: tuple) -> bool:
    """The choice at `key` for the site `token`, from memory, disk or a measurement; recorded in the report."""
    choice = _fast.get((token, key))
    if choice is not None:  # the eager path's per-call cost: one dict lookup
        return choice.use_kernelkit
    site = _SITES[token]
    m = site.modes.get(site.kind, "auto")
    ck = _cache_key(site.kind, key, site.original)
    if m == "kernelkit":
        choice = Choice(site.kind, site.describe(key), site.original, True, "forced")
    elif ck in _memory:
        choice = _memory[ck]
    elif not can_measure():
        choice = Choice(site.kind, site.describe(key), site.original, True, "interpreter")
    else:
        shape = site.describe(key)
        choice = _from_disk(ck, site.kind, shape, site.original)
        if choice is None:
            if capturing():
                raise RuntimeError(
                    f"kernelkit.patch: the {site.kind} call at {shape} is new and is measured before it runs "
                    f"(kernelkit or {site.original}); measuring cannot happen inside a CUDA graph capture. Run "
                    f"one step eagerly at this shape before capturing, or pass {site.kind}='kernelkit' (or False).")
            choice = _measure_choice(site, key, shape)
            _to_disk(ck, choice)
        _memory[ck] = choice
    if site.report is not None:
        site.report.chose(choice)
    _fast[(token, key)] = choice
    return choice.use_kernelkit


def can_measure() -> bool:
    """Whether paths are timed (a CUDA GPU, not the Triton interpreter)."""
    return torch.cuda.is_available() and not interpreting()


_MEASURING = [0]  # trials under way (a trial may run other patched modules: the MLP's Linears)


def measuring() -> bool:
    """Whether a trial is running: state a patched forward keeps between the model's calls (the fp8 Linears'
    shared quantizations) must not see the trial's inputs."""
    return _MEASURING[0] > 0


def _measure_choice(site: Site, key: tuple, shape: str) -> Choice:
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    cuda = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    _MEASURING[0] += 1
    try:
        with unset_fake_temporarily(), torch.random.fork_rng(devices=cuda):
            trial = site.build(site.owner(), key)
            if trial is None:  # the builder decided without timing (the original would not fit in memory)
                return Choice(site.kind, shape, site.original, True, "memory")
            kk_ms, orig_ms = measure(trial)
    finally:
        _MEASURING[0] -= 1
    return Choice(site.kind, shape, site.original, kk_ms <= orig_ms, "measured", kk_ms, orig_ms)


def _run(fn: Callable, wrt: list, grads: dict, name: str) -> None:
    out = fn()
    outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,))
            if isinstance(o, torch.Tensor) and o.requires_grad]
    if not wrt or not outs:
        return
    if name not in grads:
        g = torch.Generator(device=outs[0].device).manual_seed(1)
        grads[name] = [torch.randn(o.shape, generator=g, device=o.device, dtype=o.dtype) for o in outs]
    torch.autograd.grad(outs, wrt, grads[name], allow_unused=True)


def device() -> torch.device:
    """Where trials run: the current CUDA device (the CPU when there is none: the interpreter's tests)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _timed(fn: Callable) -> float:
    """ms of one call: CUDA events on a GPU, the host clock on the CPU."""
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def measure(trial: Trial) -> tuple[float, float]:
    """Median ms per call (forward, and backward when `trial.wrt`) of kernelkit's path and the original's,
    alternating rep by rep after a warm-up of each (which compiles and tunes). A path that runs out of
    memory counts as infinitely slow."""
    grads: dict = {}
    paths = {"kernelkit": trial.kernelkit, "original": trial.original}
    times: dict[str, list] = {"kernelkit": [], "original": []}
    dead: set = set()
    with torch.enable_grad() if trial.wrt else torch.no_grad():
        for name, fn in paths.items():
            try:
                for _ in range(WARMUP):
                    _run(fn, trial.wrt, grads, name)
            except torch.OutOfMemoryError:
                dead.add(name)
        reps = MIN_REPS
        for i in range(MAX_REPS):
            for name, fn in paths.items():
                if name in dead:
                    continue
                times[name].append(_timed(lambda: [_run(fn, trial.wrt, grads, name)
                                                   for _ in range(trial.in_flight)]) / trial.in_flight)
            if i == 0:
                slowest = max([t[0] for t in times.values() if t] or [BUDGET_MS])
                reps = max(MIN_REPS, min(MAX_REPS, int(BUDGET_MS / max(slowest, 1e-3))))
            if i + 1 >= reps:
                break
    inf = float("inf")
    return (statistics.median(times["kernelkit"]) if times["kernelkit"] else inf,
            statistics.median(times["original"]) if times["original"] else inf)


# --- the decisions on disk, one file per machine fingerprint ---

def _file() -> Optional[Path]:
    if not cache.enabled() or not torch.cuda.is_available():
        return None
    fp = cache.fingerprint()
    return cache.cache_dir() / "patch" / f"{cache.digest(fp)}.json"


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data["choices"] if isinstance(data.get("choices"), dict) else {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def _from_disk(ck: str, kind: str, shape: str, original: str) -> Optional[Choice]:
    path = _file()
    if path is None:
        return None
    e = _read(path).get(ck)
    try:
        return Choice(kind, shape, original, bool(e["kernelkit"]), "cache", float(e["kernelkit_ms"]),
                      float(e["original_ms"]))
    except (TypeError, KeyError, ValueError):
        return None


def _to_disk(ck: str, choice: Choice) -> None:
    path = _file()
    if path is None or choice.source != "measured":
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        choices = _read(path) if path.exists() else {}
        choices[ck] = {"kernelkit": choice.use_kernelkit, "kernelkit_ms": choice.kernelkit_ms,
                       "original_ms": choice.original_ms}
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"format": "kernelkit-patch-choices", "fingerprint": cache.fingerprint(), "choices": choices},
                      f, indent=1, default=str)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache folder: the decision stays in memory


def forget() -> None:
    """Drop the decisions kept in memory (tests; the disk file stays)."""
    _memory.clear()
    _fast.clear()


def needs_grad(*tensors) -> bool:
    """Whether a backward can follow this call: grad mode on and any input or parameter requires grad."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def bucket(n: int) -> int:
    """`n` rounded up to a power of two: the token counts (and sequence lengths) that share one decision, so
    that a stream of varying batch shapes measures a handful of sizes, not one per batch."""
    return next_pow2(int(n))


def dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def randn(shape, dtype, device, generator, requires_grad=False, scale=1.0) -> torch.Tensor:
    t = torch.randn(shape, dtype=torch.float32, device=device, generator=generator) * scale
    return t.to(dtype).requires_grad_(requires_grad)


def generator(device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(0)
