# medseg: `make demo` and `make test` each do every setup step first.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
MEDSEG := $(BIN)/medseg
# The CPU build on this machine's disk; a CUDA machine can pass e.g. TORCH="torch==2.13.0 --index-url ...".
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.medseg-setup
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

# Test tiers (markers set in tests/conftest.py): unit, train, mp, sites, browser, gpu.
.PHONY: setup demo test test-fast bench lint app browser sites-deps dicom-deps vendor nnunet-deps

setup: $(STAMP) vendor

# The viewer's WebGL viewport: NiiVue's prebuilt browser bundle, taken from the npm registry's
# package (npm pack checks the tarball against the registry's integrity hash) into the Python
# package, so the page loads it from the viewer's own server and never from a CDN. Git-ignored.
NIIVUE_VERSION := 0.69.0
NIIVUE_JS := apps/frontend/niivue.umd.js
vendor: $(NIIVUE_JS)
$(NIIVUE_JS):
	command -v npm >/dev/null || ($(SUDO) apt-get update -q && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q npm)
	rm -rf build/niivue && mkdir -p build/niivue
	cd build/niivue && npm pack --silent @niivue/niivue@$(NIIVUE_VERSION) >/dev/null && tar xzf niivue-niivue-$(NIIVUE_VERSION).tgz
	test "$$(node -p 'require("./build/niivue/package/package.json").license')" = BSD-2-Clause
	cp build/niivue/package/dist/niivue.umd.js $@.tmp && mv $@.tmp $@

# Re-runs only when pyproject.toml changes; a second `make setup` takes seconds.
$(STAMP): pyproject.toml scripts/build_horovod.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip setuptools wheel
	# Keep an installed torch; otherwise install the pinned one before anything can pull a CUDA build.
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q --no-build-isolation -e ".[dev]"
	# Horovod 0.28.1 patched for torch's C++17 headers, built once and cached outside the clone.
	scripts/build_horovod.sh $(BIN)/python
	touch $(STAMP)

demo: setup
	rm -rf runs/demo-seg runs/demo-cls
	$(MEDSEG) data synth-seg --out data/synth-seg --cases 16 --test 2
	$(MEDSEG) data synth-seg --out data/synth-seg-holdout --cases 6 --test 0 --seed 1
	$(MEDSEG) data validate data/synth-seg
	$(MEDSEG) train --config configs/demo-seg.yaml
	$(MEDSEG) evaluate --run runs/demo-seg --data data/synth-seg-holdout
	$(MEDSEG) data to-dicom data/synth-seg/imagesTs/synth_016.nii.gz data/dicom-demo --overwrite
	$(MEDSEG) infer --run runs/demo-seg --input data/dicom-demo --output runs/demo-seg/dicom-demo-mask.nii.gz
	$(MEDSEG) data convert data/dicom-demo runs/demo-seg/dicom-demo.nii.gz
	$(MEDSEG) data synth-cls --out data/synth-cls --cases 160 --test 2
	$(MEDSEG) data synth-cls --out data/synth-cls-holdout --cases 40 --test 0 --seed 1
	$(MEDSEG) train --config configs/demo-cls.yaml
	$(MEDSEG) evaluate --run runs/demo-cls --data data/synth-cls-holdout
	$(BIN)/python scripts/demo_report.py

test: setup browser sites-deps dicom-deps
	$(BIN)/python -m pytest -q tests

# The unit tier alone: no training, no Horovod ranks, no namespaces, no browser (a few minutes).
test-fast: setup
	$(BIN)/python -m pytest -q -m unit tests

# The viewer on http://localhost:8501 (RUNS=dir, PORT=n to change).
app: setup
	$(MEDSEG) app --runs $(or $(RUNS),runs) --port $(or $(PORT),8501)

# Debian's chromium and its driver, for the real-browser viewer test (as root in CI, else with sudo).
browser:
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	  ($(SUDO) apt-get update -q && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q chromium chromium-driver)

# Debian's sshd, iproute2 (ip, tc) and util-linux (unshare, nsenter) for the emulated hospital
# network (`medseg sites`, tests/testbed/test_sites.py); wireguard-go and wireguard-tools (wg) for
# the encrypted site link (`medseg sites up --secure`, tests/secure/), tcpdump for its capture test.
# Installed only when missing; without recommends (wireguard-tools would pull the kernel module's
# package, which this kernel cannot load: wireguard-go runs in user space over TUN instead).
sites-deps:
	test -x /usr/sbin/sshd && command -v ssh >/dev/null && command -v ip >/dev/null && command -v tc >/dev/null && \
	  command -v unshare >/dev/null && command -v nsenter >/dev/null && command -v wireguard-go >/dev/null && \
	  command -v wg >/dev/null && command -v tcpdump >/dev/null || \
	  ($(SUDO) apt-get update -q && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q --no-install-recommends \
	    openssh-server openssh-client iproute2 util-linux wireguard-go wireguard-tools tcpdump)

# Debian's dcm2niix, the independent DICOM -> NIfTI converter that tests/datasets/test_dicom_multiframe.py
# checks medseg's DICOM geometry against; installed only when missing.
dicom-deps:
	command -v dcm2niix >/dev/null || \
	  ($(SUDO) apt-get update -q && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q dcm2niix)

# Writes docs/benchmarks.md's sites and memory sections and their PNGs (about 10 minutes with QUICK=1).
bench: setup
	$(MEDSEG) bench sites $(if $(QUICK),--quick) --json docs/bench-sites.json --markdown docs/benchmarks.md
	$(MEDSEG) bench memory $(if $(QUICK),--quick) --json docs/bench-memory.json --markdown docs/benchmarks.md

lint: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

# nnU-Net v2 for scripts/bench_real.py only, in its own venv: never a dependency of medseg. torch 2.14.1
# with torchvision 0.29.1 from this machine's disk, because nnU-Net's trainer lookup imports timm, which
# needs torchvision, and PyPI's torchvision does not load beside the 2.13.0 CPU build medseg uses.
NNUNET_VENV := .venv-nnunet
nnunet-deps:
	test -x $(NNUNET_VENV)/bin/python || $(PYTHON) -m venv $(NNUNET_VENV)
	$(NNUNET_VENV)/bin/python -m pip install -q torch==2.14.1 torchvision==0.29.1
	$(NNUNET_VENV)/bin/python -m pip install -q nnunetv2==2.8.1
