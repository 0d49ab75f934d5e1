#!/usr/bin/env bash
# On a GPU machine: capture the real profiler outputs that the parsing tests run on
# (tests/fixtures/h200/; run from the repository root). Writes under ${OUT:-fixtures-out}. Needs ncu on PATH.
set -uo pipefail
out=${OUT:-fixtures-out}; mkdir -p "$out"
ncu --version > "$out/ncu-version.txt" 2>&1
ncu --list-sections >> "$out/ncu-version.txt" 2>&1
for cfg in opt1 bf16-cl; do
  python3 -m medddpm.measure.profile.capture --config "$cfg" --size 32 --trace "$out/trace-$cfg.json" || echo "trace $cfg failed"
  ncu --clock-control none --nvtx --nvtx-include "medddpm_step/" --launch-count 12 --set full \
      --metrics sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active \
      -o "$out/ncu-$cfg" -f python3 -m medddpm.measure.profile.capture --config "$cfg" --size 32 > "$out/ncu-$cfg.log" 2>&1 || echo "ncu $cfg failed"
  ncu -i "$out/ncu-$cfg.ncu-rep" --csv --page details --print-units base --print-rule-details > "$out/ncu-$cfg-details.csv" 2>&1
done
gzip -9 "$out"/trace-*.json
# What the Python report interface exposes (rule results, estimated speedups) on this ncu version.
ncu_py="$(dirname "$(readlink -f "$(command -v ncu)")")/extras/python"
PYTHONPATH="$ncu_py:${PYTHONPATH:-}" python3 - "$out" <<'PY' > "$out/ncu-report-api.txt" 2>&1
import sys, json, ncu_report
out = sys.argv[1]
ctx = ncu_report.load_report(f"{out}/ncu-opt1.ncu-rep")
rng = ctx.range_by_idx(0)
print("actions", rng.num_actions())
a = rng.action_by_idx(0)
print("action attrs", [n for n in dir(a) if not n.startswith("_")])
print("name", a.name())
names = list(a.metric_names())
print("n metrics", len(names))
m = a.metric_by_name(names[0]); print("metric attrs", [n for n in dir(m) if not n.startswith("_")])
if hasattr(a, "rule_results"):
    rr = a.rule_results()
    print("n rules", len(rr))
    if rr:
        r = rr[0]; print("rule attrs", [n for n in dir(r) if not n.startswith("_")])
        for r in rr[:40]:
            row = {}
            for k in ("rule_identifier", "name", "section_identifier"):
                try: row[k] = getattr(r, k)()
                except Exception as e: row[k] = repr(e)
            try: row["speedup"] = [(str(t), r.speedup(t)) for t in (ncu_report.SpeedupType.LOCAL, ncu_report.SpeedupType.GLOBAL)]
            except Exception as e: row["speedup"] = repr(e)
            try: row["result_tokens"] = str(r.result_tokens())[:300]
            except Exception as e: row["result_tokens"] = repr(e)
            print(json.dumps(row, default=str))
PY
