export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
timeout 100 python3 -m pytest -q -m gpu tests/test_profile_overhead.py -p no:cacheprovider 2>&1 | tail -3
M=benchmarks/experiments/h100/2026-11-26-overhead-idle/models.py
for t in llama1b_patched llama1b llama8b_patched llama8b; do
  echo "== $t $(date +%T)"
  timeout 140 python3 -m kernelkit profile $M:$t --overhead 1 --json-only --out /tmp/p_$t 2>&1 | grep -v Warn | tail -4
  python3 - /tmp/p_$t/profile.json $OUT/$t.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
keep = {k: d.get(k) for k in ("gpu", "step_ms", "gpu_ms", "overhead", "findings")}
from collections import defaultdict
by = defaultdict(float)
for r in d["rows"]:
    by[r["op"]] += r["ms"] / d.get("steps", 1) if False else r["ms"]
keep["ms_by_op"] = dict(sorted(by.items(), key=lambda kv: -kv[1])[:15])
print("ms by op:", {k: round(v, 2) for k, v in keep["ms_by_op"].items()})
json.dump(keep, open(sys.argv[2], "w"), indent=1)
o = d["overhead"]
print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in o.items() if k not in ("graph_errors",)})
print([f for f in d["findings"] if "launch overhead" in f])
PY
done
