"""CUDA sources: every csrc/*.cu compiles for sm_90, defines every kernel cuda.py launches, and
ships inside the package (editable install and wheel alike)."""

from __future__ import annotations

import importlib.resources
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from moebalance.dispatch import cuda, resplit_cuda

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "csrc").glob("*.cu"))
nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")


def test_csrc_holds_cuda_sources():
    assert [p.name for p in SOURCES] == ["dispatch.cu", "resplit.cu"]


@nvcc
@pytest.mark.parametrize("source", SOURCES, ids=[p.name for p in SOURCES])
def test_cuda_source_compiles_for_sm90(source, tmp_path):
    cubin = tmp_path / (source.stem + ".cubin")
    run = subprocess.run(["nvcc", "-arch=sm_90", "-cubin", *cuda.COMPILE_OPTIONS, "-o", str(cubin),
                          str(source)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    if source.name == cuda.SOURCE_FILE:
        image = cubin.read_bytes()
        missing = [k for k in cuda.KERNEL_NAMES if k.encode() + b"\0" not in image]
        assert not missing, f"kernels launched by cuda.py but not defined: {missing}"
    if source.name == resplit_cuda.SOURCE_FILE:
        assert resplit_cuda.KERNEL_NAME.encode() + b"\0" in cubin.read_bytes()


@nvcc
def test_resplit_source_compiles_to_ptx_for_sm90(tmp_path):
    ptx = tmp_path / "resplit.ptx"
    run = subprocess.run(["nvcc", "-arch=sm_90", "-ptx", *resplit_cuda.COMPILE_OPTIONS, "-o",
                          str(ptx), str(ROOT / "csrc" / resplit_cuda.SOURCE_FILE)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert f".entry {resplit_cuda.KERNEL_NAME}(" in ptx.read_text()
    source = (ROOT / "csrc" / resplit_cuda.SOURCE_FILE).read_text()
    assert f"#define MAX_REPLICAS {resplit_cuda.MAX_REPLICAS}" in source


@nvcc
@pytest.mark.parametrize("ftz, fmad", [("true", "true"), ("false", "false")])
def test_float_math_ignores_ftz_and_fmad_options(ftz, fmad, tmp_path):
    # CuPy appends -ftz=true after our options and NVRTC takes the last one: the source must give
    # the reference's results under any -ftz/--fmad (no flushed subnormals, no fused w * y + acc).
    ptx = tmp_path / "dispatch.ptx"
    run = subprocess.run(["nvcc", "-arch=sm_90", "-ptx", *cuda.COMPILE_OPTIONS, f"-ftz={ftz}",
                          f"--fmad={fmad}", "-o", str(ptx), str(ROOT / "csrc" / cuda.SOURCE_FILE)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    text = ptx.read_text()
    assert ".ftz" not in text and "fma." not in text
    assert "mul.rn.f32" in text and "add.rn.f32" in text


@nvcc
def test_resplit_float_math_is_not_contracted_under_the_package_options(tmp_path):
    # Bitwise agreement with the Numba reference rests on --fmad=false (with fused multiply-adds
    # the kernel's sums round otherwise); -ftz=true, which CuPy appends, touches only float32.
    ptx, source = tmp_path / "resplit.ptx", ROOT / "csrc" / resplit_cuda.SOURCE_FILE
    run = subprocess.run(["nvcc", "-arch=sm_90", "-ptx", *resplit_cuda.COMPILE_OPTIONS,
                          "-ftz=true", "-o", str(ptx), str(source)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    text = ptx.read_text()
    assert "fma." not in text and "mul.rn.f64" in text and "add.rn.f64" in text


def _nvrtc_compiler():
    """CuPy's NVRTC wrapper when the NVRTC library loads (no GPU needed), else skip."""
    compiler = pytest.importorskip("cupy.cuda.compiler")
    if not hasattr(compiler, "_NVRTCProgram"):
        pytest.skip("this CuPy has no _NVRTCProgram")
    try:
        compiler._get_nvrtc_version()
    except Exception as exc:  # the library is missing: nothing to compile with
        pytest.skip(f"NVRTC does not load: {type(exc).__name__}")
    return compiler


def test_dispatch_source_compiles_with_nvrtc_as_cupy_does():
    # What cupy.RawModule does on an H100/H200, minus the device query: NVRTC, no include paths.
    compiler = _nvrtc_compiler()
    program = compiler._NVRTCProgram(cuda.source(), cuda.SOURCE_FILE, (), (), method="cubin")
    image, _ = program.compile((*cuda.COMPILE_OPTIONS, "-arch=sm_90",
                                "--device-as-default-execution-space"), None)
    missing = [k for k in cuda.KERNEL_NAMES if k.encode() + b"\0" not in image]
    assert not missing, f"kernels launched by cuda.py but not defined: {missing}"


def test_resplit_source_compiles_with_nvrtc_as_cupy_does():
    compiler = _nvrtc_compiler()
    program = compiler._NVRTCProgram(resplit_cuda.source(), resplit_cuda.SOURCE_FILE, (), (),
                                     method="cubin")
    image, _ = program.compile((*resplit_cuda.COMPILE_OPTIONS, "-arch=sm_90",
                                "--device-as-default-execution-space"), None)
    assert resplit_cuda.KERNEL_NAME.encode() + b"\0" in image


def test_package_resources_hold_the_cuda_sources():
    shipped = {p.name: p for p in importlib.resources.files(cuda.SOURCE_PACKAGE).iterdir()}
    for source in SOURCES:
        assert source.name in shipped
        assert shipped[source.name].read_text() == source.read_text()
    assert cuda.source() == (ROOT / "csrc" / cuda.SOURCE_FILE).read_text()
    assert resplit_cuda.source() == (ROOT / "csrc" / resplit_cuda.SOURCE_FILE).read_text()


def test_pyproject_lists_every_package_on_disk():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    on_disk = {".".join(p.parent.relative_to(ROOT).parts)
               for p in (ROOT / "moebalance").rglob("__init__.py")}
    assert on_disk <= listed, f"add {sorted(on_disk - listed)} to [tool.setuptools] packages"
    assert config["package-dir"][cuda.SOURCE_PACKAGE] == "csrc"


def test_wheel_ships_cuda_sources(tmp_path):
    # Build from a copy so the checkout gets no build/ or egg-info folders.
    tree = tmp_path / "tree"
    tree.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, tree / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.nbi", "*.nbc")
    shutil.copytree(ROOT / "moebalance", tree / "moebalance", ignore=ignore)
    shutil.copytree(ROOT / "csrc", tree / "csrc", ignore=ignore)
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                          "-q", "-w", str(tmp_path / "wheel"), str(tree)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    (wheel,) = (tmp_path / "wheel").glob("moebalance-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for source in SOURCES:
        assert f"moebalance/_csrc/{source.name}" in names
