"""quantize_rows_and_cols_t's tile (BLOCK_R, BLOCK_C, num_warps), swept on the GPU at the fp8 steps' dy shapes:
do_bench medians (L2 flushed) of the two kernels together, GB/s of the bytes the two reads move (2 reads of dy,
both e4m3 copies and the scales written) and bit-exactness against quantize_rows / quantize_cols_t."""

import json
import sys

import torch
from triton.testing import do_bench

import kernelkit.ops.gemm.fp8 as f

SHAPES = ((8192, 4096), (8192, 1024), (8192, 14336), (16384, 2048), (16384, 8192))
TILES = ((64, 128, 8), (64, 128, 4), (128, 128, 8), (64, 256, 8), (32, 256, 8), (128, 64, 8), (128, 256, 8),
         (32, 128, 4))
rows = []
for m, n in SHAPES:
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    want = (f.quantize_rows(dy), f.quantize_cols_t(dy))
    for tile in TILES:
        f.ROWS_COLS_TILE = tile
        (qr, sr), (qc, sc) = f.quantize_rows_and_cols_t(dy)
        exact = bool(torch.equal(qr.view(torch.uint8), want[0][0].view(torch.uint8)) and torch.equal(sr, want[0][1])
                     and torch.equal(qc.view(torch.uint8), want[1][0].view(torch.uint8)) and torch.equal(sc, want[1][1]))
        ms = do_bench(lambda: f.quantize_rows_and_cols_t(dy), return_mode="median")
        gbs = m * n * (2 + 2 + 1 + 1) / ms / 1e6
        rows.append({"tokens": m, "out_features": n, "tile": tile, "us": ms * 1e3, "gbps_two_reads": gbs,
                     "bit_exact": exact})
        print(f"{m}x{n} tile {tile}: {ms * 1e3:.0f} us, {gbs:.0f} GB/s (two reads), exact {exact}", flush=True)
json.dump(rows, open(sys.argv[1] if len(sys.argv) > 1 else "dy_tiles.json", "w"), indent=1)
