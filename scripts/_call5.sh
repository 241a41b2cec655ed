export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
timeout 170 python3 -m kernelkit bench model --example llama-1b --layers 4 --batch 8 --variants eager,kernelkit,kernelkit-fp8 --out $OUT/m1b 2>&1 | tail -3
