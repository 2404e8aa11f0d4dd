"""Native fused norm + activation kernels (kernels/csrc) against the pure-PyTorch reference."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from medseg.kernels import native
from medseg.kernels import reference as ref

CSRC = Path(native.__file__).parent / "csrc"
NORMS = ("instance", "group", "batch")
# (activation, number of PReLU slopes: 0 none, 1 shared, -1 one per channel)
ACTS = [("identity", 0), ("relu", 0), ("leaky_relu", 0), ("prelu", 1), ("prelu", -1), ("elu", 0)]
PARAM = {"leaky_relu": 0.1, "elu": 0.7}
SHAPE = (2, 4, 5, 3, 7)  # N=2, odd spatial sizes; group norm with 2 groups of 2 channels
TOL = {torch.float64: (1e-10, 1e-10), torch.float32: (1e-5, 1e-5)}  # (rtol, atol relative to max |ref|)


@pytest.fixture(scope="module")
def mod():
    module = native.load()
    if module is None:
        if os.environ.get("MEDSEG_NATIVE", "1") == "0" or shutil.which("c++") is None:
            pytest.skip("native kernels disabled (MEDSEG_NATIVE=0) or no C++ compiler")
        pytest.fail("the native kernels failed to build (see the warning logged by medseg.kernels.native)")
    return module


def close(actual: torch.Tensor | None, expected: torch.Tensor | None, what: str) -> None:
    if expected is None:
        assert actual is None, f"{what}: expected None"
        return
    assert actual is not None, f"{what}: missing"
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    rtol, atol = TOL[expected.dtype]
    scale = expected.abs().max().item() or 1.0
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol * scale, msg=lambda m: f"{what}: {m}")


def make_case(norm, act, slopes, dtype, device, affine, seed=0):
    g = torch.Generator().manual_seed(seed)
    c = SHAPE[1]
    x = (torch.randn(SHAPE, generator=g, dtype=torch.float64) * 2 + 0.5).to(dtype).to(device)
    dz = torch.randn(SHAPE, generator=g, dtype=torch.float64).to(dtype).to(device)
    weight = bias = prelu = None
    if affine:  # |γ| >= 0.5 with mixed signs, so that the output can be inverted
        sign = torch.tensor([1.0, -1.0] * (c // 2), dtype=torch.float64)
        weight = ((torch.rand(c, generator=g, dtype=torch.float64) + 0.5) * sign).to(dtype).to(device)
        bias = torch.randn(c, generator=g, dtype=torch.float64).to(dtype).to(device)
    if slopes:
        n = c if slopes < 0 else 1
        prelu = (torch.rand(n, generator=g, dtype=torch.float64) * 0.3 + 0.05).to(dtype).to(device)
    spec = ref.Spec(norm, act, num_groups=2 if norm == "group" else 1, param=PARAM.get(act, 0.0))
    return spec, x, dz, weight, bias, prelu


def codes(spec: ref.Spec) -> tuple[int, int, int, float]:
    return native.NORM_CODES[spec.norm], spec.num_groups, native.ACT_CODES[spec.act], spec.param


def check_case(mod, norm, act, slopes, dtype, device):
    for affine in (False, True):
        spec, x, dz, weight, bias, prelu = make_case(norm, act, slopes, dtype, device, affine)
        nc, groups, ac, param = codes(spec)
        label = f"{norm}/{act}/{slopes}/{dtype}/affine={affine}"

        mean, invstd = mod.norm_stats(x, nc, groups, spec.eps)
        rmean, rinvstd = ref.norm_stats(x, spec)
        close(mean, rmean, f"{label} mean")
        close(invstd, rinvstd, f"{label} invstd")

        z_ref = ref.forward(x, rmean, rinvstd, weight, bias, spec, prelu)
        z = torch.empty_like(x)
        mod.forward(x, rmean, rinvstd, weight, bias, nc, groups, ac, param, prelu, z)
        close(z, z_ref, f"{label} forward")
        z_inplace = x.clone()
        mod.forward(z_inplace, rmean, rinvstd, weight, bias, nc, groups, ac, param, prelu, z_inplace)
        close(z_inplace, z_ref, f"{label} forward in place")

        for from_output in (False, True) if act in ref.INVERTIBLE else (False,):
            saved = z_ref if from_output else x
            for stats_grad in (True, False):
                flags = {"from_output": from_output, "stats_grad": stats_grad}
                expected = ref.backward(saved, dz, rmean, rinvstd, weight, bias, spec, prelu, **flags)
                name = f"{label} from_output={from_output} stats_grad={stats_grad}"
                # grad_in: a new buffer, the saved tensor itself, grad_out itself
                for alias in ("new", "saved", "grad_out"):
                    s, g = saved.clone(), dz.clone()
                    grad_in = {"new": torch.empty_like(s), "saved": s, "grad_out": g}[alias]
                    common = (rmean, rinvstd, weight, bias, nc, groups, ac, param, prelu)
                    dw, db, da = mod.backward(s, g, *common, from_output, stats_grad, grad_in)
                    close(grad_in, expected[0], f"{name} dx (grad_in={alias})")
                    close(dw, expected[1], f"{name} dweight")
                    close(db, expected[2], f"{name} dbias")
                    close(da, expected[3], f"{name} dprelu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("act,slopes", ACTS, ids=[f"{a}{s or ''}" for a, s in ACTS])
@pytest.mark.parametrize("norm", NORMS)
def test_native_matches_reference_cpu(mod, norm, act, slopes, dtype):
    check_case(mod, norm, act, slopes, dtype, "cpu")


def test_stats_numerically_sound(mod):
    """A large offset must not cancel the variance (no E[x²] − E[x]² in float)."""
    x = torch.randn(2, 3, 4096, dtype=torch.float32) * 1e-3 + 1e4
    for norm, groups in ((0, 1), (1, 3), (2, 1)):
        spec = ref.Spec(ref.NORMS[norm], "identity", num_groups=groups, eps=0.0)
        mean, invstd = mod.norm_stats(x, norm, groups, 0.0)
        rmean, rinvstd = ref.norm_stats(x, spec)
        torch.testing.assert_close(mean, rmean)
        torch.testing.assert_close(invstd, rinvstd, rtol=1e-5, atol=0)


def test_large_slices_and_threads_are_deterministic(mod):
    """Slices longer than one reduction chunk; identical results with 1 and 2 threads."""
    spec = ref.Spec("batch", "prelu")
    x = torch.randn(3, 2, 40_000, dtype=torch.float64)
    dz = torch.randn_like(x)
    a = torch.tensor([0.2], dtype=torch.float64)
    w, b = torch.tensor([1.5, -0.7], dtype=torch.float64), torch.tensor([0.1, 0.2], dtype=torch.float64)

    def run():
        mean, invstd = mod.norm_stats(x, 2, 1, spec.eps)
        gi = torch.empty_like(x)
        grads = mod.backward(x, dz, mean, invstd, w, b, 2, 1, 3, 0.0, a, False, True, gi)
        return mean, invstd, gi, *grads

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(max(2, threads))
        two = run()
    finally:
        torch.set_num_threads(threads)
    for u, v in zip(one, two):
        assert torch.equal(u, v)
    rmean, rinvstd = ref.norm_stats(x, spec)
    expected = ref.backward(x, dz, rmean, rinvstd, w, b, spec, a, from_output=False)
    close(one[0], rmean, "mean")
    close(one[2], expected[0], "dx")
    close(one[5], expected[3], "dprelu")


def _args(x, **over):
    n, c = x.shape[:2]
    base = dict(
        input=x,
        mean=torch.zeros(n, c, dtype=x.dtype),
        invstd=torch.ones(n, c, dtype=x.dtype),
        weight=None,
        bias=None,
        norm=0,
        groups=1,
        act=2,
        param=0.1,
        prelu=None,
        out=torch.empty_like(x),
    )
    base.update(over)
    return base


@pytest.mark.parametrize(
    "over,message",
    [
        ({"input": torch.zeros(2, 4, 3, dtype=torch.float16)}, "float32 or float64"),
        ({"input": torch.zeros(2, 3, 4).transpose(1, 2)}, "contiguous"),
        ({"input": torch.zeros(4)}, r"\(N, C, \*spatial\)"),
        ({"norm": 1, "groups": 3}, "divide the number of channels"),
        ({"norm": 5}, "norm must be"),
        ({"act": 9}, "act must be"),
        ({"mean": torch.zeros(3)}, "mean must have 8 elements"),
        ({"invstd": torch.ones(2, 4, dtype=torch.float64)}, "invstd must have dtype"),
        ({"weight": torch.ones(3)}, "weight must have 4 elements"),
        ({"act": 3}, "needs the prelu slope"),
        ({"act": 3, "prelu": torch.ones(2)}, "prelu must have 1 or C"),
        ({"out": torch.empty(2, 4, 2)}, "out must have the shape"),
    ],
)
def test_forward_bad_arguments(mod, over, message):
    kw = _args(torch.zeros(2, 4, 3), **over)
    with pytest.raises(RuntimeError, match=message):
        mod.forward(*kw.values())


def test_partial_overlap_rejected(mod):
    buf = torch.zeros(2 * 4 * 3 + 1)
    x, out = buf[:-1].view(2, 4, 3), buf[1:].view(2, 4, 3)
    with pytest.raises(RuntimeError, match="out must be the input itself or not overlap it"):
        mod.forward(*_args(x, out=out).values())


def test_backward_argument_errors(mod):
    x = torch.randn(2, 4, 3)
    mean, invstd = mod.norm_stats(x, 0, 1, 1e-5)
    gi = torch.empty_like(x)
    with pytest.raises(RuntimeError, match="relu is not invertible"):
        mod.backward(x, x, mean, invstd, None, None, 0, 1, 1, 0.0, None, True, True, gi)
    with pytest.raises(RuntimeError, match="needs weight != 0"):
        w = torch.tensor([1.0, 0.0, 1.0, 1.0])
        mod.backward(x, x, mean, invstd, w, None, 0, 1, 2, 0.1, None, True, True, gi)
    with pytest.raises(RuntimeError, match="slope > 0"):
        mod.backward(x, x, mean, invstd, None, None, 0, 1, 2, 0.0, None, True, True, gi)
    with pytest.raises(RuntimeError, match="prelu slopes > 0"):
        mod.backward(x, x, mean, invstd, None, None, 0, 1, 3, 0.0, torch.tensor([-0.1]), True, True, gi)
    with pytest.raises(RuntimeError, match="grad_out must have the shape"):
        mod.backward(x, x[:1], mean, invstd, None, None, 0, 1, 2, 0.1, None, False, True, gi)
    # relu from the saved input is fine, and absent gradients come back as None
    grads = mod.backward(x, x, mean, invstd, None, None, 0, 1, 1, 0.0, None, False, True, gi)
    assert grads == (None, None, None)


def test_stats_bad_arguments(mod):
    with pytest.raises(RuntimeError, match="divide the number of channels"):
        mod.norm_stats(torch.zeros(2, 4, 3), 1, 3, 1e-5)
    with pytest.raises(RuntimeError, match="empty"):
        mod.norm_stats(torch.zeros(2, 4, 0), 0, 1, 1e-5)


def test_backend_name(mod):
    assert native.backend_name() in ("native-cpu", "native-cuda")
    assert native.backend_name("cpu") == "native-cpu"


def test_disabled_by_env(monkeypatch, caplog):
    monkeypatch.setenv("MEDSEG_NATIVE", "0")
    monkeypatch.setattr(native, "_state", {})
    with caplog.at_level("WARNING", logger=native.__name__):
        assert native.load() is None
        assert native.load() is None  # memoised: still one warning
    assert native.backend_name() == "reference"
    lines = [r for r in caplog.records if r.name == native.__name__]
    assert len(lines) == 1 and "reference path" in lines[0].getMessage()


def test_cache_dir_override(monkeypatch, tmp_path):
    monkeypatch.setenv("MEDSEG_KERNEL_CACHE", str(tmp_path))
    assert native.cache_dir() == tmp_path
    monkeypatch.delenv("MEDSEG_KERNEL_CACHE")
    assert native.cache_dir(False).name.endswith("-cpu")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("source", ["norm_act_cuda.cu", "dice_ce_cuda.cu"])
def test_cuda_source_compiles(tmp_path, source):
    cmd = ["nvcc", "-c", "-std=c++17", "-O2", "-arch=sm_80", "-I", str(CSRC), str(CSRC / source)]
    result = subprocess.run([*cmd, "-o", str(tmp_path / "k.o")], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / "k.o").stat().st_size > 0


def _cuda_include() -> Path | None:
    """The CUDA toolkit's include folder (cuda_runtime_api.h), whether or not torch is a CUDA build."""
    from torch.utils import cpp_extension

    homes = [cpp_extension.CUDA_HOME, os.environ.get("CUDA_HOME"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        homes.append(str(Path(nvcc).resolve().parent.parent))
    for home in homes:
        if home and (Path(home) / "include" / "cuda_runtime_api.h").exists():
            return Path(home) / "include"
    return None


@pytest.mark.skipif(
    shutil.which("c++") is None or _cuda_include() is None, reason="no C++ compiler or CUDA headers"
)
@pytest.mark.parametrize("source", ["norm_act_cpu.cpp", "dice_ce_cpu.cpp"])
def test_cuda_host_glue_compiles(source, tmp_path):
    """The ``#ifdef MEDSEG_WITH_CUDA`` host code (guards, streams, launcher calls) type-checks against
    torch's c10/cuda headers and the toolkit's: compile-only (-fsyntax-only), no GPU or CUDA torch needed."""
    import sysconfig

    from torch.utils import cpp_extension

    # A CPU build of torch ships c10/cuda's headers but not the one CMake generates for CUDA builds:
    # stand it in with what a shared-library CUDA build defines.
    shim = tmp_path / "shim" / "c10" / "cuda" / "impl"
    shim.mkdir(parents=True)
    (shim / "cuda_cmake_macros.h").write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    includes = [
        *cpp_extension.include_paths(),
        sysconfig.get_paths()["include"],
        str(_cuda_include()),
        str(CSRC),
        str(tmp_path / "shim"),
    ]
    cmd = [
        "c++",
        "-fsyntax-only",
        "-std=c++17",
        "-fopenmp",
        "-DMEDSEG_WITH_CUDA",
        "-DTORCH_EXTENSION_NAME=medseg_check",
    ]
    cmd += [f"-I{p}" for p in includes] + [str(CSRC / source)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
class TestCuda:
    @pytest.fixture(scope="class")
    def cmod(self, mod):
        if not mod.with_cuda():
            pytest.skip("native kernels were built without CUDA (no CUDA toolkit found)")
        return mod

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
    @pytest.mark.parametrize("act,slopes", ACTS, ids=[f"{a}{s or ''}" for a, s in ACTS])
    @pytest.mark.parametrize("norm", NORMS)
    def test_native_matches_reference_cuda(self, cmod, norm, act, slopes, dtype):
        check_case(cmod, norm, act, slopes, dtype, "cuda")

    def test_large_cuda_matches_cpu(self, cmod):
        x = torch.randn(2, 3, 40_000, dtype=torch.float64)
        dz = torch.randn_like(x)
        w, b = torch.tensor([1.5, -0.7, 0.3], dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
        results = []
        for dev in ("cpu", "cuda"):
            xs, dzs, ws, bs = (t.to(dev) for t in (x, dz, w, b))
            mean, invstd = cmod.norm_stats(xs, 2, 1, 1e-5)
            gi = torch.empty_like(xs)
            dw, db, _ = cmod.backward(xs, dzs, mean, invstd, ws, bs, 2, 1, 4, 0.5, None, False, True, gi)
            results.append([t.cpu() for t in (mean, invstd, gi, dw, db)])
        for u, v in zip(*results):
            close(v, u, "cuda vs cpu")

    def test_cuda_tensor_checks(self, cmod):
        x = torch.randn(2, 4, 3, device="cuda")
        mean, invstd = cmod.norm_stats(x, 0, 1, 1e-5)
        with pytest.raises(RuntimeError, match="is on cpu"):
            cmod.forward(x, mean.cpu(), invstd, None, None, 0, 1, 2, 0.1, None, torch.empty_like(x))
