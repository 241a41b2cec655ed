"""KernelBench problem files: a reference and a candidate module built from two Python files.

`kernelkit check CANDIDATE.py --reference REFERENCE.py` reads them through `load_problem`, then verifies the
pair with `verify.check_module`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from .verify import exception_line


class ProblemError(ValueError):
    """Files that cannot be verified as given (`kernelkit check` exits 2): a missing file, no Model or
    ModelNew, a reference without get_inputs/get_init_inputs, or a reference that fails on its own."""


class CandidateError(RuntimeError):
    """The candidate file raised while importing or constructing its module: a failed candidate (exit 1)."""


@dataclass
class Problem:
    candidate: Any
    reference: torch.nn.Module
    make_inputs: Callable[[], Sequence]
    notes: list[str] = field(default_factory=list)


def _load_file(path, role: str):
    path = path.resolve()
    name = f"_kernelkit_{role}_{hashlib.sha1(str(path).encode()).hexdigest()[:12]}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # @triton.jit and dataclasses look their module up by name
    sys.path.insert(0, str(path.parent))  # helpers next to the file import as they would from its folder
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module


def load_problem(candidate_path, reference_path, seed: int = 0) -> Problem:
    """Build a candidate and a reference from files in the KernelBench convention.

    The reference file defines `Model(nn.Module)`, `get_inputs()` and `get_init_inputs()`; the candidate file
    defines `ModelNew` (or `Model`) with the same constructor. Both are constructed from
    `get_init_inputs()` under the same seed, and the reference's state_dict is loaded into the candidate when
    the keys and shapes match. Raises ProblemError (a usage error) or CandidateError (a failed candidate).
    """
    candidate_path, reference_path = Path(candidate_path), Path(reference_path)
    for p in (candidate_path, reference_path):
        if not p.is_file():
            raise ProblemError(f"{p}: no such file")
    try:
        ref_mod = _load_file(reference_path, "reference")
    except Exception as e:
        raise ProblemError(f"{reference_path}: importing it raised {exception_line(e)}") from e
    missing = [n for n in ("Model", "get_inputs", "get_init_inputs") if not hasattr(ref_mod, n)]
    if missing:
        raise ProblemError(f"{reference_path} defines no {', '.join(missing)} (a reference defines Model(nn.Module), "
                           f"get_inputs() and get_init_inputs())")
    try:
        cand_mod = _load_file(candidate_path, "candidate")
    except Exception as e:
        raise CandidateError(f"importing {candidate_path.name} raised {exception_line(e)}") from e
    cls = getattr(cand_mod, "ModelNew", None) or getattr(cand_mod, "Model", None)
    if cls is None:
        raise ProblemError(f"{candidate_path} defines neither ModelNew nor Model")

    try:
        torch.manual_seed(seed)
        reference = ref_mod.Model(*ref_mod.get_init_inputs())
    except Exception as e:
        raise ProblemError(f"{reference_path}: Model(*get_init_inputs()) raised {exception_line(e)}") from e
    try:
        torch.manual_seed(seed)  # the same seed: modules that create their weights alike start alike
        candidate = cls(*ref_mod.get_init_inputs())
    except Exception as e:
        raise CandidateError(f"{candidate_path.name}: {cls.__name__}(*get_init_inputs()) raised "
                             f"{exception_line(e)}") from e

    notes = []
    ref_state = reference.state_dict()
    if isinstance(candidate, torch.nn.Module) and ref_state:
        state = candidate.state_dict()
        if state.keys() == ref_state.keys() and all(state[k].shape == v.shape for k, v in ref_state.items()):
            candidate.load_state_dict(ref_state)
            notes.append(f"the candidate loaded the reference's state_dict ({len(ref_state)} tensors)")
        else:
            notes.append("the candidate's state_dict keys or shapes differ from the reference's: it keeps its "
                         "own weights, built under the same seed")
    for m in (candidate, reference):
        if isinstance(m, torch.nn.Module):
            m.eval()
    return Problem(candidate, reference, ref_mod.get_inputs, notes)
