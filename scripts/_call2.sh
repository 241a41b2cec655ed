export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
M=benchmarks/experiments/h100/2026-11-26-overhead-idle/models.py
for t in llama1b_patched llama1b llama8b_patched llama8b; do
  echo "== $t $(date +%T)"
  timeout 140 python3 -m kernelkit profile $M:$t --overhead 1 --json-only --out /tmp/p_$t 2>&1 | grep -v Warn | tail -4
  python3 - /tmp/p_$t/profile.json $OUT/$t.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
keep = {k: d.get(k) for k in ("gpu", "step_ms", "gpu_ms", "overhead", "findings")}
json.dump(keep, open(sys.argv[2], "w"), indent=1)
o = d["overhead"]
print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in o.items() if k not in ("graph_errors",)})
print([f for f in d["findings"] if "launch overhead" in f])
PY
done
