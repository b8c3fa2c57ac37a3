#!/usr/bin/env bash
# Every benchmark at its default settings, then the markdown tables from their JSON (report.py).
#
#   benchmarks/run_all.sh              # CPU: layers at the three CPU shapes, models at d 128 and at
#                                      # d 256 with torch.compile, randomized-depth activation memory,
#                                      # cached generation; then report.py
#   benchmarks/run_all.sh --check      # the same, and exit 1 if any script missed a goal (all still run)
#   DEVICE=cuda benchmarks/run_all.sh  # the GPU shapes (layers and models at d 768, 16 x 1024)
#   QUICK=1 benchmarks/run_all.sh      # every script's --quick path (smoke; results in a temporary
#                                      # folder, benchmarks/results/ untouched; not a measurement)
#
# Results: benchmarks/results/<script>-<tag>-<device>.json, tables: benchmarks/results/tables.md
# (also printed). PY overrides the interpreter (default .venv/bin/python, else python).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python
DEVICE=${DEVICE:-cpu}
CHECK=()
for arg in "$@"; do
  case "$arg" in
    --check) CHECK=(--check) ;;
    *) echo "run_all.sh: unknown argument '$arg'; expected --check" >&2; exit 2 ;;
  esac
done
RESULTS=benchmarks/results
QUICKARG=()
if [ -n "${QUICK:-}" ]; then
  RESULTS=$(mktemp -d)
  QUICKARG=(--quick)
fi

status=0
n=0
run() {
  echo "== $*" >&2
  local t0=$SECONDS out=()
  n=$((n + 1))
  [ -n "${QUICK:-}" ] && out=(--out "$RESULTS/$(basename "$1" .py)-quick$n.json")
  "$PY" "$@" "${CHECK[@]}" "${QUICKARG[@]}" "${out[@]}" --device "$DEVICE"
  local rc=$?
  echo "== exit $rc after $((SECONDS - t0)) s: $*" >&2
  if [ "$rc" -ne 0 ]; then status=1; fi
}

if [ "$DEVICE" = cpu ]; then
  run benchmarks/bench_layers.py
  run benchmarks/bench_models.py
  run benchmarks/bench_models.py --d-model 256 --compile
  run benchmarks/bench_depth.py
else
  run benchmarks/bench_layers.py --shapes gpu
  run benchmarks/bench_models.py --shape gpu --compile
fi
run benchmarks/bench_generate.py

"$PY" benchmarks/report.py --results "$RESULTS" --out "$RESULTS/tables.md" && cat "$RESULTS/tables.md"
exit $status
