"""Build (once, cached) and load the native fused norm + activation kernels in ``csrc/``.

``load()`` returns the compiled module, or None when it cannot be built or ``MEDSEG_NATIVE=0``; the
caller then uses the pure-PyTorch reference (``medseg.kernels.reference``), and one warning line
says so. The module's functions (integer codes in ``NORM_CODES`` / ``ACT_CODES``)::

    norm_stats(x, norm, groups, eps) -> (mean, invstd)
    forward(x, mean, invstd, weight, bias, norm, groups, act, param, prelu, out) -> None
    backward(saved, grad_out, mean, invstd, weight, bias, norm, groups, act, param, prelu,
             from_output, stats_grad, grad_in) -> (dweight | None, dbias | None, dprelu | None)
    with_cuda() -> bool
    dice_ce_forward(x, y) -> (stats, ce);  dice_ce_backward(x, y, a, b, e, grad_in) -> None
                                            (the fused Dice + CE ops, medseg.kernels.dice_ce)

Builds go to ``~/.cache/medseg/torch_extensions/<torch>-<cpXY>-<cpu|cuXY>`` (``MEDSEG_KERNEL_CACHE``
overrides the folder), under an exclusive file lock so that concurrent processes build once.
"""

from __future__ import annotations

import contextlib
import ctypes.util
import logging
import os
import platform
import shutil
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

from medseg.kernels.reference import ACTIVATIONS, NORMS

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
EXTENSION_NAME = "medseg_norm_act"
# The integer codes the C++/CUDA ops take: positions in reference.py's lists (one source).
NORM_CODES = {name: i for i, name in enumerate(NORMS)}
ACT_CODES = {name: i for i, name in enumerate(ACTIVATIONS)}
# -ffp-contract=off: the element-wise steps must round like the reference (no fused multiply-add),
# so that the y > 0 branch is decided identically. -fno-trapping-math lets the branch selects be
# vectorised (values are unchanged; only FP exception flags could differ). -fopenmp:
# at::parallel_for is inline OpenMP, and `#pragma omp simd` marks the vectorisable loops.
# -fno-math-errno: math calls (ELU) may be vectorised; errno is never read.
CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math", "-fno-math-errno", "-DNDEBUG"]
CUDA_CFLAGS = ["-O3", "-DMEDSEG_WITH_CUDA"]  # cpp_extension adds the -std and -gencode flags

_lock = threading.Lock()
_state: dict[str, object] = {}  # "module" (ModuleType | None) once load() has run


def _cuda_toolkit() -> str | None:
    """The CUDA toolkit to build with, when both a GPU and a matching toolkit are present."""
    if not torch.cuda.is_available() or torch.version.cuda is None:
        return None
    from torch.utils import cpp_extension

    home = cpp_extension.CUDA_HOME
    if home is None or not (Path(home) / "bin" / "nvcc").exists():
        return None
    return home


def cache_dir(with_cuda: bool | None = None) -> Path:
    """Where the extension is built: ``$MEDSEG_KERNEL_CACHE`` or the per-torch/python/backend folder."""
    override = os.environ.get("MEDSEG_KERNEL_CACHE")
    if override:
        return Path(override).expanduser()
    if with_cuda is None:
        with_cuda = _cuda_toolkit() is not None
    backend = f"cu{torch.version.cuda.replace('.', '')}" if with_cuda and torch.version.cuda else "cpu"
    tag = f"{torch.__version__}-cp{sys.version_info.major}{sys.version_info.minor}-{backend}"
    return Path.home() / ".cache" / "medseg" / "torch_extensions" / tag


@contextlib.contextmanager
def _file_lock(path: Path):
    """Exclusive lock across processes; released by the OS if the holder dies (unlike a lock file)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: cpp_extension's own lock file still serialises builds
        yield
        return
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _libmvec() -> bool:
    """glibc's vector math library (x86-64, glibc >= 2.35: expm1/log1p variants) is present."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return False
    lib, version = platform.libc_ver()
    try:
        major, minor = (int(v) for v in version.split(".")[:2])
    except ValueError:
        return False
    return lib == "glibc" and (major, minor) >= (2, 35) and ctypes.util.find_library("mvec") is not None


def _build() -> ModuleType:
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None and not cpp_extension.is_ninja_available():
        raise RuntimeError("ninja is not installed (pip install ninja)")
    with_cuda = _cuda_toolkit() is not None
    sources = [CSRC / "norm_act_cpu.cpp", CSRC / "dice_ce_cpu.cpp"]
    cflags = list(CFLAGS)
    ldflags = ["-fopenmp"]
    if _libmvec():
        cflags.append("-DMEDSEG_LIBMVEC")
        ldflags.append("-lmvec")
    if with_cuda:
        sources += [CSRC / "norm_act_cuda.cu", CSRC / "dice_ce_cuda.cu"]
        cflags.append("-DMEDSEG_WITH_CUDA")
    build_dir = cache_dir(with_cuda)
    build_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with _file_lock(build_dir / "medseg.lock"):
        module = cpp_extension.load(
            name=EXTENSION_NAME,
            sources=[str(s) for s in sources],
            extra_cflags=cflags,
            extra_cuda_cflags=CUDA_CFLAGS if with_cuda else None,
            extra_ldflags=ldflags,
            extra_include_paths=[str(CSRC)],
            build_directory=str(build_dir),
            with_cuda=with_cuda,
            verbose=False,
        )
    log.debug("native kernels ready in %.1f s (%s)", time.perf_counter() - start, build_dir)
    return module


def load() -> ModuleType | None:
    """The native kernel module, built on first use; None (with one warning) if unavailable."""
    with _lock:
        if "module" in _state:
            return _state["module"]  # type: ignore[return-value]
        module = None
        if os.environ.get("MEDSEG_NATIVE", "1").strip() == "0":
            log.warning("medseg kernels: MEDSEG_NATIVE=0, using the pure-PyTorch reference path")
        else:
            try:
                module = _build()
            except Exception as exc:  # any build/import failure falls back to the reference
                reason = " ".join(str(exc).split())[:300] or type(exc).__name__
                log.warning(
                    "medseg kernels: native build unavailable, using the pure-PyTorch reference path (%s: %s)",
                    type(exc).__name__,
                    reason,
                )
        _state["module"] = module
        return module


def backend_name(device: torch.device | str | None = None) -> str:
    """``"native-cuda"``, ``"native-cpu"`` or ``"reference"``: what runs tensors on ``device``.

    Without a device: the best backend this process has.
    """
    module = load()
    if module is None:
        return "reference"
    cuda = module.with_cuda()
    if device is None:
        return "native-cuda" if cuda else "native-cpu"
    kind = torch.device(device).type
    if kind == "cpu":
        return "native-cpu"
    if kind == "cuda" and cuda:
        return "native-cuda"
    return "reference"
