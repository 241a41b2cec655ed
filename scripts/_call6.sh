export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
timeout 110 python3 -m pytest -q -m gpu tests/test_fp8_fusion.py -k "swiglu or patched_llama" -p no:cacheprovider 2>&1 | tail -4
compute-sanitizer --tool memcheck --error-exitcode 3 python3 -c "
import torch
from kernelkit.ops.glu import swiglu_fp8
for rows, d in ((333, 8192), (7, 14336), (5, 100)):
    g, u = (torch.randn(rows, d, device='cuda', dtype=torch.bfloat16) for _ in range(2))
    swiglu_fp8(g, u); swiglu_fp8(torch.cat([g, u], -1), None)
torch.cuda.synchronize(); print('swiglu_fp8 memcheck ran')" 2>&1 | tail -2; echo "swiglu_fp8 memcheck rc=${PIPESTATUS[0]}"
timeout 70 python3 benchmarks/fp8_fusion.py --part swiglu --out $OUT/swiglu.json 2>&1 | tail -6
timeout 90 python3 -m kernelkit bench model --example llama-1b --layers 4 --batch 8 --variants eager,kernelkit-fp8 --out $OUT/m1b 2>&1 | tail -6
