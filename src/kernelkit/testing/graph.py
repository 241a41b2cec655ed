"""Does an op survive torch.compile as one graph node, with gradients through its registered backward?"""

from __future__ import annotations

from typing import Callable, Sequence

import torch


def compile_as_one_node(fn: Callable, args: Sequence, op_name: str):
    """Run `fn(*args)` under `torch.compile(fullgraph=True)` with a recording backend and backpropagate.

    Asserts one graph with a `kernelkit::<op_name>` node and a gradient on every input that requires
    one; returns the compiled outputs for value checks.
    """
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    outs = [o for o in ([out] if isinstance(out, torch.Tensor) else out) if isinstance(o, torch.Tensor)]
    torch.autograd.backward([o for o in outs if o.requires_grad],
                            [torch.randn_like(o) for o in outs if o.requires_grad])
    assert len(graphs) == 1, f"{len(graphs)} graphs: torch.compile broke the graph"
    targets = [str(n.target) for n in graphs[0].graph.nodes]
    assert any(f"kernelkit.{op_name}" in t for t in targets), f"no kernelkit.{op_name} node in {targets}"
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and a.requires_grad:
            assert a.grad is not None and torch.isfinite(a.grad).all(), f"args[{i}] got no finite gradient"
    return out
