"""The cooperative-row kernels (ops/_coop.py) at sizes that take them, for compute-sanitizer memcheck on the GPU:
softmax/log_softmax, RMSNorm/add+RMSNorm and LayerNorm, forward and backward, bf16 and fp32, several splits per row, row
counts that leave groups uneven. Exits non-zero on a wrong result (float64 reference) as well."""

import sys

import torch

import kernelkit

if not torch.cuda.is_available():
    sys.exit("coop_sanitize: needs a CUDA GPU (the cooperative launch is GPU-only; the interpreter runs it phased)")
torch.manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for m, n in ((37, 100003), (5, 393216)):
        x = (3 * torch.randn(m, n, device="cuda")).to(dtype).requires_grad_()
        dy = torch.randn(m, n, device="cuda", dtype=dtype)
        for fn, ref in ((kernelkit.softmax, torch.softmax), (kernelkit.log_softmax, torch.log_softmax)):
            y = fn(x)
            (g,) = torch.autograd.grad(y, x, dy)
            xr = x.detach().double().requires_grad_()
            yr = ref(xr, -1)
            (gr,) = torch.autograd.grad(yr, xr, dy.double())
            for got, want, what in ((y, yr, "y"), (g, gr, "dx")):
                err = ((got.double() - want).norm() / want.norm()).item()
                assert err < tol, (fn.__name__, dtype, m, n, what, err)
    for m, n in ((37, 70001), (300, 20000)):
        x = torch.randn(m, n, device="cuda", dtype=dtype, requires_grad=True)
        r = torch.randn(m, n, device="cuda", dtype=dtype, requires_grad=True)
        w = (1 + 0.1 * torch.randn(n, device="cuda")).to(dtype).requires_grad_()
        y = kernelkit.rms_norm(x, w)
        dy = torch.randn_like(y)
        gx, gw = torch.autograd.grad(y, (x, w), dy)
        xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
        yr = xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-6) * wr
        gxr, gwr = torch.autograd.grad(yr, (xr, wr), dy.double())
        for got, want, what in ((y, yr, "y"), (gx, gxr, "dx"), (gw, gwr, "dw")):
            err = ((got.double() - want).norm() / want.norm()).item()
            assert err < tol, ("rms_norm", dtype, m, n, what, err)
        b = torch.randn(n, device="cuda", dtype=dtype, requires_grad=True)
        xs = (x.detach() + 50).requires_grad_()  # LayerNorm's merge of chunk means: rows with a large mean
        y = kernelkit.layer_norm(xs, w, b)
        gx, gw, gb = torch.autograd.grad(y, (xs, w, b), dy)
        xr, wr, br = (t.detach().double().requires_grad_() for t in (xs, w, b))
        yr = torch.nn.functional.layer_norm(xr, (n,), wr, br, 1e-5)
        grads = torch.autograd.grad(yr, (xr, wr, br), dy.double())
        for got, want, what in ((y, yr, "y"), (gx, grads[0], "dx"), (gw, grads[1], "dw"), (gb, grads[2], "db")):
            err = ((got.double() - want).norm() / want.norm()).item()
            assert err < tol, ("layer_norm", dtype, m, n, what, err)
        out = kernelkit.add_rms_norm(x, r, w)
        y2, s2 = out if isinstance(out, tuple) else (out, None)
        torch.autograd.grad([t for t in (y2, s2) if t is not None], (x, r, w),
                            [torch.randn_like(t) for t in (y2, s2) if t is not None])
torch.cuda.synchronize()
print("cooperative rows: all results within tolerance")
