#!/usr/bin/env bash
# Install Horovod 0.28.1 (PyTorch + Gloo; no MPI, TensorFlow or MXNet) into a venv. Run by `make setup`.
#
#   scripts/build_horovod.sh PATH/TO/VENV/bin/python
#
# Horovod 0.28.1 as published does not build against torch >= 2.1 (its CMake files ask for C++14,
# torch's headers need C++17; see shared DESIGN.md "Facts measured on these machines"). So:
#   1. `import horovod.torch` already works in that venv        -> nothing to do.
#   2. a wheel for this horovod + torch version + Python tag is cached -> pip install it (seconds).
#   3. otherwise download the sdist, raise the C++ standard to 17, build a wheel (about 11 minutes
#      on 2 cores), check it imports, cache it, install it.
# The cache lives outside the clone: ${MEDSEG_WHEEL_CACHE:-$HOME/.cache/medseg/wheels}.
# The extension is ABI-bound to torch, so the cache folder names the torch version, e.g.
#   $CACHE/horovod-0.28.1-torch2.13.0+cpu-cp311/horovod-0.28.1-cp311-cp311-linux_x86_64.whl
# NCCL (GPU) operations are built when MEDSEG_HOROVOD_GPU=1, or, when it is unset, when nvidia-smi
# works and torch is a CUDA build; MEDSEG_HOROVOD_GPU=0 forces a CPU-only build. Such a wheel is
# cached in a folder ending in -nccl.
set -euo pipefail

HOROVOD_VERSION=0.28.1
# Horovod's run-time requirements (setup.py install_requires, cffi because PyTorch is built);
# with build isolation off they are also its setup_requires, so they must be there before the build.
RUNTIME_DEPS=(cloudpickle psutil pyyaml packaging "cffi>=1.4.0")

die() {
	echo "build_horovod.sh: error: $*" >&2
	exit 1
}
log() { echo "build_horovod.sh: $*" >&2; }

[[ $# -eq 1 ]] || die "usage: $0 PATH/TO/VENV/bin/python"
PY=$1
[[ -x $PY ]] || die "$PY is not an executable Python (create the venv first)"
VENV_BIN=$(cd "$(dirname "$PY")" && pwd)
PY="$VENV_BIN/$(basename "$PY")"
# A pip-installed cmake lives here, and so does horovodrun; put them first on PATH.
export PATH="$VENV_BIN:$PATH"
START=$SECONDS

check_build() {
	"$VENV_BIN/horovodrun" --check-build
}

# 1. Already importable: done.
if have=$("$PY" -c "import horovod.torch, horovod; print(horovod.__version__)" 2>/dev/null); then
	log "horovod $have: horovod.torch already imports in $VENV_BIN; nothing to do"
	exit 0
fi

TAGS=$("$PY" - <<'EOF'
import sys
try:
    import torch
except Exception as e:  # noqa: BLE001
    sys.exit(f"torch does not import ({e}); install torch into the venv first")
print(f"cp{sys.version_info.major}{sys.version_info.minor}", torch.__version__, "cuda" if torch.version.cuda else "cpu")
EOF
) || die "cannot read the Python tag and torch version from $PY"
read -r PYTAG TORCH_VERSION TORCH_KIND <<<"$TAGS"

GPU=0
case "${MEDSEG_HOROVOD_GPU:-auto}" in
1) GPU=1 ;;
0) GPU=0 ;;
auto)
	if [[ $TORCH_KIND == cuda ]] && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
		GPU=1
	fi
	;;
*) die "MEDSEG_HOROVOD_GPU must be 0, 1 or unset (got '${MEDSEG_HOROVOD_GPU}')" ;;
esac

CACHE_ROOT=${MEDSEG_WHEEL_CACHE:-$HOME/.cache/medseg/wheels}
CACHE_DIR="$CACHE_ROOT/horovod-$HOROVOD_VERSION-torch$TORCH_VERSION-$PYTAG"
[[ $GPU == 1 ]] && CACHE_DIR="$CACHE_DIR-nccl"
mkdir -p "$CACHE_DIR"

pip_install() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }

install_wheel() {
	local whl=$1
	# Called after `||`, where set -e is off: chain each step explicitly.
	pip_install "${RUNTIME_DEPS[@]}" || return 1
	# --force-reinstall: a horovod built against another torch may be installed (and fail to import).
	pip_install --no-deps --force-reinstall "$whl" || return 1
	MEDSEG_HOROVOD_CHECK_NCCL=$GPU "$PY" - <<'EOF' || return 1
import os
import horovod.torch as hvd
from horovod.common.util import extension_available
checks = [("PyTorch", extension_available("torch")), ("Gloo", hvd.gloo_built())]
if os.environ["MEDSEG_HOROVOD_CHECK_NCCL"] == "1":
    checks.append(("NCCL", hvd.nccl_built()))
missing = [name for name, ok in checks if not ok]
if missing:
    raise SystemExit("horovod imports but is built without " + ", ".join(missing))
EOF
}

summary() {
	local how=$1 whl=$2
	local ops=GLOO
	[[ $GPU == 1 ]] && ops="GLOO+NCCL"
	echo "horovod $HOROVOD_VERSION ($ops, torch $TORCH_VERSION, $PYTAG) $how in $((SECONDS - START)) s: $whl"
	check_build
}

# 2. A cached wheel: install it.
shopt -s nullglob
cached=("$CACHE_DIR"/horovod-"$HOROVOD_VERSION"-"$PYTAG"-*.whl)
shopt -u nullglob
if [[ ${#cached[@]} -gt 0 ]]; then
	whl=${cached[0]}
	log "installing cached wheel $whl"
	if install_wheel "$whl"; then
		summary "installed from cache" "$whl"
		exit 0
	fi
	log "cached wheel $whl does not work here; removing it and building again"
	rm -f "$whl"
fi

# 3. Build from the sdist.
command -v c++ >/dev/null 2>&1 || die "no C++ compiler (c++) on PATH; install one (Debian: apt-get install build-essential)"
command -v make >/dev/null 2>&1 || die "no make on PATH; install it (Debian: apt-get install build-essential)"

# Build isolation is off, so the build requirements go into the venv itself.
pip_install setuptools wheel "${RUNTIME_DEPS[@]}"

# Horovod needs CMake >= 3.13 (otherwise its setup.py pip-installs cmake 3.13 into a temp dir).
cmake_ok() {
	local v
	v=$("$1" --version 2>/dev/null | sed -n 's/^cmake version \([0-9][0-9.]*\).*/\1/p') || return 1
	[[ -n $v ]] && "$PY" -c "import sys; from packaging.version import Version as V; sys.exit(V('$v') < V('3.13'))"
}
CMAKE_BIN=$(command -v cmake || true)
if [[ -z $CMAKE_BIN ]] || ! cmake_ok "$CMAKE_BIN"; then
	log "no cmake >= 3.13 on PATH; installing cmake from PyPI into the venv"
	pip_install cmake
	CMAKE_BIN="$VENV_BIN/cmake"
	cmake_ok "$CMAKE_BIN" || die "cmake from PyPI does not run: $CMAKE_BIN"
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/medseg-horovod-build.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
BUILD_LOG="$CACHE_ROOT/horovod-$HOROVOD_VERSION-build.log"

log "downloading the horovod $HOROVOD_VERSION sdist"
"$PY" -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: --no-build-isolation \
	"horovod==$HOROVOD_VERSION" -d "$WORK/dl" || die "could not download the horovod==$HOROVOD_VERSION sdist"
SDIST="$WORK/dl/horovod-$HOROVOD_VERSION.tar.gz"
[[ -f $SDIST ]] || die "expected $SDIST after pip download; got: $(ls "$WORK/dl")"
tar -xzf "$SDIST" -C "$WORK"
SRC="$WORK/horovod-$HOROVOD_VERSION"

# torch >= 2.1 headers need C++17; Horovod 0.28.1 asks for C++14 (upstream fix PR #3998, unreleased).
for f in "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"; do
	[[ -f $f ]] || die "$f is missing from the sdist"
	sed -i -E 's/set\(CMAKE_CXX_STANDARD 14\)/set(CMAKE_CXX_STANDARD 17)/' "$f"
	if grep -q 'CMAKE_CXX_STANDARD 14' "$f" || ! grep -q 'set(CMAKE_CXX_STANDARD 17)' "$f"; then
		die "patching $f to C++17 failed; its CMAKE_CXX_STANDARD lines are: $(grep -n CMAKE_CXX_STANDARD "$f" | tr '\n' ' ')"
	fi
done

BUILD_ENV=(
	HOROVOD_WITH_PYTORCH=1
	HOROVOD_WITHOUT_TENSORFLOW=1
	HOROVOD_WITHOUT_MXNET=1
	HOROVOD_WITHOUT_MPI=1
	HOROVOD_WITH_GLOO=1
	HOROVOD_CPU_OPERATIONS=GLOO
	HOROVOD_CMAKE="$CMAKE_BIN"
	# cmake 4.x (PyPI's) refuses the bundled gloo's cmake_minimum_required(2.8.12) without this.
	CMAKE_POLICY_VERSION_MINIMUM=3.5
	MAKEFLAGS="-j$(nproc)"
)
[[ $GPU == 1 ]] && BUILD_ENV+=(HOROVOD_GPU_OPERATIONS=NCCL)

log "building the horovod $HOROVOD_VERSION wheel against torch $TORCH_VERSION with $(nproc) jobs" \
	"(about 11 minutes on 2 cores); log: $BUILD_LOG"
if ! env "${BUILD_ENV[@]}" "$PY" -m pip wheel -v --disable-pip-version-check --no-deps --no-build-isolation \
	-w "$WORK/wheel" "$SRC" >"$BUILD_LOG" 2>&1; then
	tail -n 60 "$BUILD_LOG" >&2
	die "building the horovod wheel failed; full log: $BUILD_LOG"
fi
shopt -s nullglob
built=("$WORK"/wheel/horovod-"$HOROVOD_VERSION"-*.whl)
shopt -u nullglob
[[ ${#built[@]} -eq 1 ]] || die "expected one horovod wheel in $WORK/wheel; got: $(ls "$WORK/wheel")"
whl=${built[0]}

# Install and check it before caching it, so a broken wheel never lands in the cache.
install_wheel "$whl" || die "the freshly built wheel $whl does not import with PyTorch and Gloo"
name=$(basename "$whl")
tmp="$CACHE_DIR/.$name.$$.tmp"
cp "$whl" "$tmp"
mv -f "$tmp" "$CACHE_DIR/$name"
summary "built and cached" "$CACHE_DIR/$name"
