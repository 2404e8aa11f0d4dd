#!/usr/bin/env bash
# GPU check for medseg.kernels: one call on a fresh NVIDIA machine, under 10 minutes in all.
#
#   scripts/gpu_check.sh [OUT_DIR]        (default: $OUT if set, else runs/gpu-check)
#
# Needs a Python with a CUDA build of torch (PYTHON=..., else .venv/bin/python, python3, python: the
# first whose torch sees a GPU), a C++ compiler and nvcc for the native build, and monai, pyyaml,
# pytest, ninja importable (missing ones are pip-installed, from MEDSEG_WHEELS=dir when given).
# medseg itself is not installed: a symlink shim on PYTHONPATH maps kernels/ to medseg.kernels (every
# step runs with PYTHONSAFEPATH (`python -P`) and pytest's append import mode, so the checkout's own medseg/, which
# lacks those links, is not found first).
#
# Steps, each under its own time limit, each recorded in OUT_DIR/gpu_check.json as it finishes
# (a killed run still leaves what passed):
#   0. the GPU step of `medseg bench real-sites`' planned network (real_sites.PLAN: forward, Dice-CE,
#      backward, AdamW on 2 x 24x40x32 patches), float32 and under bfloat16 autocast as `medseg
#      train` runs on CUDA, median of 200 synchronised steps: report["gpu_step"], which the
#      benchmark's time dilation takes (--gpu-step-s; docs/benchmarks.md);
#   1. build the native extension with its CUDA sources, for this GPU's architecture only;
#   2. compile-check of the CUDA host glue is implied by 1 (norm_act_cpu.cpp and dice_ce_cpu.cpp
#      with -DMEDSEG_WITH_CUDA); the .cu files alone are compiled by nvcc in `make test`;
#   3. pytest on CUDA tensors (tests/kernels/): native CUDA kernels against the reference
#      (test_kernels_native.py), fused layers and converted networks (test_kernels.py), the fused
#      loss against MONAI (test_kernels_loss.py) and fused with the head (test_kernels_head.py);
#      JUnit XML per file in OUT_DIR;
#   (GPU_CHECK_STEPS=step,build,tests,memory names the steps to run, all by default: on a short lease
#   the memory bench is best given a call of its own; GPU_CHECK_TF32=off runs the tests with TF32
#   off for cuDNN convolutions and matmuls, to tell TF32 rounding from a kernel's error)
#   4. the memory benchmark on the GPU (max_memory_allocated), 96^3, baseline / fused / checkpoint,
#      every case, with the time that is left: OUT_DIR/bench-memory-gpu.json and .md.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
OUT_DIR=${1:-${OUT:-runs/gpu-check}}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)

PY=""
for cand in "${PYTHON:-}" .venv/bin/python python3 python; do
  [ -n "$cand" ] && command -v "$cand" >/dev/null 2>&1 || continue
  if "$cand" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    PY=$cand
    break
  fi
done
if [ -n "$PY" ] && ! "$PY" -c "import sys; sys.exit(sys.version_info < (3, 11))"; then
  # PYTHONSAFEPATH (below) needs 3.11: without it the checkout's own medseg/ shadows the shim
  echo '{"ok": false, "error": "gpu_check needs Python 3.11 or newer"}' >"$OUT_DIR/gpu_check.json"
  echo "gpu_check: $PY is older than Python 3.11" >&2
  exit 2
fi
if [ -z "$PY" ]; then
  echo '{"ok": false, "error": "no Python whose torch sees a CUDA device"}' >"$OUT_DIR/gpu_check.json"
  echo "gpu_check: no Python whose torch sees a CUDA device" >&2
  exit 2
fi

for mod in monai yaml pytest ninja; do
  if ! "$PY" -c "import $mod" 2>/dev/null; then
    pkg=$mod
    [ "$mod" = yaml ] && pkg=pyyaml
    "$PY" -m pip install -q ${MEDSEG_WHEELS:+--no-index --find-links "$MEDSEG_WHEELS"} "$pkg" ||
      echo "gpu_check: could not install $pkg" >&2
  fi
done

SHIM=$(mktemp -d)
cp -rs "$REPO/medseg" "$SHIM/medseg"
for sub in kernels datasets distributed apps; do ln -s "$REPO/$sub" "$SHIM/medseg/$sub"; done
export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONSAFEPATH=1  # `python -P` in every step and its children: the shim's medseg, not ./medseg
export PATH="$(dirname "$(command -v "$PY")"):$PATH"

exec "$PY" - "$OUT_DIR" <<'PYEOF'
import json, os, subprocess, sys, time

out_dir = sys.argv[1]
start = time.monotonic()
LIMIT = float(os.environ.get("GPU_CHECK_LIMIT_S", 570))  # seconds for everything, inside the 10-minute call
report: dict = {"ok": False, "steps": {}}
stdout: dict[str, str] = {}  # each step's whole standard output
STEPS = set(os.environ.get("GPU_CHECK_STEPS", "step,build,tests,memory").split(","))
TF32_OFF = os.environ.get("GPU_CHECK_TF32", "on") == "off"
report["tf32"] = "off" if TF32_OFF else "on (PyTorch's default for cuDNN convolutions)"
path = os.path.join(out_dir, "gpu_check.json")


def save() -> None:
    report["elapsed_s"] = round(time.monotonic() - start, 1)
    with open(path + ".tmp", "w") as fh:
        json.dump(report, fh, indent=2)
    os.replace(path + ".tmp", path)


def left() -> float:
    return LIMIT - (time.monotonic() - start)


def run(name: str, cmd: list[str], limit: float) -> bool:
    t0 = time.monotonic()
    limit = max(min(limit, left()), 5)
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
        ok, tail = p.returncode == 0, (p.stdout + p.stderr)[-3000:]
        stdout[name] = p.stdout
    except subprocess.TimeoutExpired as exc:
        ok, tail = False, f"timed out after {limit:.0f} s: " + str((exc.stdout or b"")[-2000:])
    report["steps"][name] = {"ok": ok, "seconds": round(time.monotonic() - t0, 1), "tail": tail}
    save()
    print(f"gpu_check: {name}: {'ok' if ok else 'FAILED'} ({time.monotonic() - t0:.0f} s)", flush=True)
    return ok


import torch  # noqa: E402

major, minor = torch.cuda.get_device_capability(0)
os.environ.setdefault("TORCH_CUDA_ARCH_LIST", f"{major}.{minor}")  # build for this GPU only
report["device"] = {
    "name": torch.cuda.get_device_name(0),
    "capability": f"{major}.{minor}",
    "torch": torch.__version__,
    "cuda": torch.version.cuda,
    "memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
}
save()
gpu_step = (
    "import json; from medseg.bench.real_sites import measure_plan_step;"
    "print('GPU_STEP', json.dumps(measure_plan_step('cuda', 200)))"
)
if "step" in STEPS and run("GPU step of the real-sites plan", [sys.executable, "-c", gpu_step], 90):
    lines = [ln for ln in stdout["GPU step of the real-sites plan"].splitlines() if ln.startswith("GPU_STEP ")]
    try:
        report["gpu_step"] = json.loads(lines[-1].split(" ", 1)[1])
    except (IndexError, ValueError) as exc:
        report["steps"]["GPU step of the real-sites plan"]["ok"] = False
        report["gpu_step"] = {"error": f"no GPU_STEP line in its output: {exc}"}
    save()
build = (
    "import time; t=time.time(); from medseg.kernels import native; m = native.load(); "
    "print('backend for cuda tensors:', native.backend_name('cuda'), 'in %.0f s' % (time.time()-t)); "
    "assert native.backend_name('cuda') == 'native-cuda', 'CUDA kernels did not build (see warning)'"
)
if "build" in STEPS:
    report["native_cuda"] = run("build native CUDA extension (host glue + .cu)", [sys.executable, "-c", build], 300)
tests = {
    "test_kernels_native.py": "cuda",
    "test_kernels_loss.py": "cuda",
    "test_kernels_head.py": "cuda",
    "test_kernels.py": "cuda",
}
pytest = "import sys, pytest; sys.exit(pytest.main(sys.argv[1:]))"
if TF32_OFF:
    pytest = "import torch; torch.backends.cudnn.allow_tf32 = False; torch.backends.cuda.matmul.allow_tf32 = False; " + pytest
for name, sel in tests.items() if "tests" in STEPS else ():
    xml = os.path.join(out_dir, name.replace(".py", ".xml"))
    cmd = [sys.executable, "-c", pytest, "-q", "-p", "no:cacheprovider", "--noconftest", "--import-mode=append"]
    cmd += [f"tests/kernels/{name}", "-k", sel]
    run(f"pytest {name} -k {sel}", cmd + ["--junitxml", xml], 150)
bench = (  # one net at a time, the report rewritten after each: a step cut by the limit keeps what finished
    "import json, sys; from medseg.bench.memory import CASES, bench_memory, check_targets, format_table, write_report;"
    "from pathlib import Path;"
    "r = None\n"
    "for net in CASES:\n"
    "    part = bench_memory(quick=False, device='cuda', nets=(net,), variants=('baseline', 'fused', 'checkpoint'), steps=5)\n"
    "    if r is None: r = part\n"
    "    else: [r[key].update(part[key]) for key in ('nets', 'cases', 'patches')]\n"
    f"    write_report(r, Path({out_dir!r}) / 'bench-memory-gpu.json', None)\n"
    f"    Path({out_dir!r}, 'bench-memory-gpu.md').write_text(format_table(r) + '\\n\\n' + "
    "'\\n'.join(f\"- {'met' if ok else 'MISSED'}: {n}\" for n, ok in check_targets(r)) + '\\n')\n"
    "print(format_table(r))"
)
if "memory" in STEPS:
    run("bench memory --device cuda (96^3, full width)", [sys.executable, "-c", bench], left() - 5)
bench_json = os.path.join(out_dir, "bench-memory-gpu.json")
if os.path.exists(bench_json):
    with open(bench_json) as fh:
        r = json.load(fh)
    report["gpu_memory"] = {
        case: {v: {k: m.get(k) for k in ("peak_bytes", "saved_bytes", "loss_saved_bytes", "step_s")} for v, m in vs.items()}
        for case, vs in r["nets"].items()
    }
report["ok"] = all(s["ok"] for s in report["steps"].values())
save()
print(f"gpu_check: {'all passed' if report['ok'] else 'FAILURES'}; {path} ({report['elapsed_s']} s)")
sys.exit(0 if report["ok"] else 1)
PYEOF
