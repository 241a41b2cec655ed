export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
timeout 150 python3 -m pytest -q -m gpu tests/test_fp8_linear.py tests/test_fp8_fusion.py -p no:cacheprovider 2>&1 | tail -4
timeout 200 python3 -m kernelkit bench model --example llama-1b --layers 4 --batch 8 --variants eager,kernelkit+compile,kernelkit-fp8+compile --out $OUT/m1b 2>&1 | tail -9
timeout 200 python3 -m kernelkit bench model --example llama --layers 2 --batch 4 --variants eager,kernelkit+compile,kernelkit-fp8+compile --out $OUT/m8b 2>&1 | tail -9
