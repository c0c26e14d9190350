#!/usr/bin/env bash
# The report as a browser shows it: writes the report of a finished default ablation's
# results (results.json here, 4 variants x 3 seeds with the serving sweep, the cache-dtype
# frontier and the paired evaluation) with `kvlab report`, then renders it in headless
# Chromium with render.js (1300 px wide; no console errors, every plot drawn, the findings on
# the first screen). Usage: run.sh /path/to/kvlab. Exits 77 (skipped) without node, chromium
# or playwright-core.
set -u
KVLAB=${1:?usage: run.sh /path/to/kvlab}
here=$(cd "$(dirname "$0")" && pwd)

if ! command -v node >/dev/null 2>&1; then
  echo "SKIP: node is not on PATH (scripts/setup.sh --tests installs it)"
  exit 77
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if ! "$KVLAB" report "$here/results.json" --out "$work" >"$work/report.log" 2>&1; then
  echo "FAIL: kvlab report"
  tail -20 "$work/report.log"
  exit 1
fi
node "$here/render.js" "$work/report.html"
