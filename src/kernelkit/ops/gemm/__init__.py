"""The one GEMM engine under the GEMM-family ops: private to ops/, it registers no op (the public ops above it do).

    tiles.py    what every GEMM kernel shares: tile configs, the grouped tile order (Triton and Gluon), the K step
                of a plain or gate-up (SwiGLU) product, tl.dot's input precision, the Gluon warp-specialized
                ring's barriers, and GEMM_TMA (KERNELKIT_GEMM_TMA, read once for linear and the grouped kernels)
    mx.py       MXFP8 (OCP MX v1.0) encode / decode: the element encoders, mx_encode, e8m0_to_fp32, the quantize
                and dequantize kernels and launchers
    fp8.py      rowwise / columnwise / per-segment e4m3 quantizers and the in-kernel pieces they share with
                kernels that quantize their own output (fp8_scale, fp8_clamp, e4m3_bits, round_to: rms_norm_fp8),
                the MX tile dequantizer, the kept quantized weights (keep_quantized_weights)
    grouped.py  the grouped GEMM over experts (pointer and persistent TMA kernels, their modes as the frozen
                records GroupedMode / GroupedTmaMode), the per-expert wgrads, their launchers
    precise.py  the Gluon warp-specialized fp8 kernel of scaled_matmul's precise mode (Hopper, Triton 3.6+)

Who uses what: ops/linear/ (tiles), ops/scaled_matmul.py (tiles, precise), ops/mxfp8.py (mx), ops/moe/ (tiles,
fp8, grouped), ops/fp8_linear.py and ops/rms_norm/ (fp8), ladder/hgemm_gluon.py (tiles). Imports point down:
tiles and mx import nothing of ops but _validate; fp8 imports mx; grouped imports tiles, fp8 and mx; precise imports
tiles.
"""
