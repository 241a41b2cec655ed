"""GPU diagnostic for MXFP8 quantize: per config and cast path, count elements and scales that differ
from the plain-PyTorch spec reference, and show the first differing elements (x, block amax, bits).

    python scripts/diag_mxfp8.py            # writes nothing; prints a table
"""
import itertools

import torch
import triton

from kernelkit.ops import mxfp8 as mx

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def run(x, elem, rows, block_k, warps, hw):
    emax, mbits, bias, max_normal = mx.ELEM_FORMATS[elem]
    m, k = x.shape
    data = torch.full((m, k), 0xAB, dtype=torch.uint8, device=x.device)
    scales = torch.full((m, k // 32), 0xAB, dtype=torch.uint8, device=x.device)
    grid = (triton.cdiv(m, rows) * triton.cdiv(k, block_k),)
    mx.mxfp8_quantize_kernel.fn[grid](x, data, scales, m, k, x.stride(0), data.stride(0), scales.stride(0),
                                       EMAX=emax, MBITS=mbits, BIAS=bias, MAX_NORMAL=max_normal, HW_CAST=hw,
                                       ROWS=rows, BLOCK_K=block_k, num_warps=warps)
    return data, scales


def main():
    torch.manual_seed(0)
    print("dtype     elem  shape      rows bk   warps hw    bad_elems bad_scales")
    for dtype, elem, shape in itertools.product((torch.bfloat16, torch.float16, torch.float32),
                                                tuple(mx.ELEM_FORMATS), ((5, 4096), (64, 4096), (37, 96))):
        gen = torch.Generator(device=DEV).manual_seed(0)
        (x,), _ = mx.make_inputs(shape, dtype, DEV, gen)
        ref_d, ref_s = mx.reference_quantize(x, elem)
        ref_d = ref_d.view(torch.uint8)
        cpu_d, cpu_s = mx.reference_quantize(x.cpu(), elem)
        if not torch.equal(cpu_d.view(torch.uint8), ref_d.cpu()) or not torch.equal(cpu_s, ref_s.cpu()):
            n = (cpu_d.view(torch.uint8) != ref_d.cpu()).sum().item()
            print(f"  reference differs between CPU and CUDA torch: {n} elements")
        for rows, bk, warps, hw in [(8, 1024, 8, True), (8, 1024, 8, False), (8, 256, 4, True), (1, 1024, 4, True),
                                    (4, 1024, 4, True), (8, 2048, 16, True)]:
            if bk > max(256, triton.next_power_of_2(shape[-1])):
                continue
            d, s = run(x, elem, rows, bk, warps, hw)
            bad = (d != ref_d).nonzero()
            nbs = (s != ref_s).sum().item()
            print(f"{str(dtype)[6:]:9} {str(elem)[-6:]:5} {str(shape):10} {rows:4} {bk:4} {warps:5} {str(hw):5} "
                  f"{len(bad):9} {nbs:10}")
            for r, c in bad[:4].tolist():
                blk = x[r, c // 32 * 32:(c // 32 + 1) * 32].float()
                print(f"     x[{r},{c}]={x[r, c].item()!r} amax={blk.abs().max().item()!r} "
                      f"scale k={s[r, c // 32].item()} ref={ref_s[r, c // 32].item()} "
                      f"bits k=0x{d[r, c].item():02x} ref=0x{ref_d[r, c].item():02x}")


if __name__ == "__main__":
    main()
