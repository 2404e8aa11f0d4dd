#!/bin/bash
# Issue 12's training comparisons: plans of the synthetic CT and MR sets against the hand-written
# demo config, scored on held-out cases. CPU seconds (user+sys, /usr/bin/time) are the comparison,
# since wall seconds follow the machine's load. Results: docs/benchmarks.md "Planning".
set -euo pipefail
cd "$(dirname "$0")/.."
M=.venv/bin/medseg
T() { /usr/bin/time -f "CPU %U user %S sys %e wall s: $*" "$@"; }
[ -d data/synth-seg ] || $M data synth-seg --out data/synth-seg --cases 16 --test 2
[ -d data/synth-seg-holdout ] || $M data synth-seg --out data/synth-seg-holdout --cases 6 --test 0 --seed 1
[ -d data/synth-mr ] || $M data synth-seg --out data/synth-mr --cases 16 --test 2 --modality mr
[ -d data/synth-mr-holdout ] || $M data synth-seg --out data/synth-mr-holdout --cases 6 --test 0 --seed 1 --modality mr
$M plan data/synth-seg --out configs/plan-synth-ct.yaml --verify --name plan-synth-ct
$M plan data/synth-mr --out configs/plan-synth-mr.yaml --name plan-synth-mr
for spec in "plan-synth-ct|configs/plan-synth-ct.yaml|data/synth-seg-holdout|" \
            "plan-synth-ct-80ep|configs/plan-synth-ct.yaml|data/synth-seg-holdout|train.epochs=80 name=plan-synth-ct-80ep" \
            "anchor-demo|configs/demo-seg.yaml|data/synth-seg-holdout|name=anchor-demo" \
            "plan-synth-mr|configs/plan-synth-mr.yaml|data/synth-mr-holdout|" \
            "mr-ctwindow|configs/demo-seg.yaml|data/synth-mr-holdout|data.dir=data/synth-mr name=mr-ctwindow"; do
  IFS='|' read -r name cfg hold over <<< "$spec"
  rm -rf "runs/$name"
  # shellcheck disable=SC2086 # $over holds zero or more key=value overrides
  T $M train --config "$cfg" --no-progress $over
  echo "EVAL $name: $($M evaluate --run "runs/$name" --data "$hold" | grep summary)"
done
