"""Print the rows of kernelkit bench JSON files compactly: shape, mode, impl, ms, TFLOP/s or GB/s, speedup, error."""
import json
import sys

for path in sys.argv[1:]:
    d = json.load(open(path))
    print(f"# {d['op']} {d['dtype']}")
    for r in d["rows"]:
        val = f"{r['tflops']:.0f}TF" if r.get("regime") == "compute" and r.get("tflops") else \
            (f"{r['gbps']:.0f}GB/s" if r.get("gbps") else "")
        ms = f"{r['ms']:.4f}" if r.get("ms") else r.get("error", "")[:60]
        sp = f"{r['speedup']:.2f}x" if r.get("speedup") else ""
        err = f"err={r['max_err']:.1e}" if r.get("max_err") is not None else ""
        print(f"{r['shape']:<24} {r['mode']:<7} {r['impl']:<14} {ms:>9} {val:>9} {sp:>6} {err}")
