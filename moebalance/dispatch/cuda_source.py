"""CUDA sources shipped with the package: their text, and one compiled CuPy module per device.

The sources live in the top-level ``csrc/`` and ship as the package ``moebalance._csrc``. A
:class:`CudaSource` compiles its file once per device, at first use and under a lock, with the
options every kernel of the package is built with (tests compile the same files with nvcc).
"""

from __future__ import annotations

import importlib.resources
import threading

__all__ = ["SOURCE_PACKAGE", "COMPILE_OPTIONS", "CudaSource"]

SOURCE_PACKAGE = "moebalance._csrc"
# --fmad=false: products and sums round as the CPU reference's do, so results compare exactly.
COMPILE_OPTIONS = ("--std=c++17", "--fmad=false")


class CudaSource:
    """One ``.cu`` file of ``csrc/``: its text, its module on each device, its kernels.

    Args:
        file: the file name inside ``csrc/``.
        probe: a kernel of the file, looked up when a module is built so that compile errors
            surface there (as a RuntimeError naming the file) and not at the first launch.
    """

    def __init__(self, file: str, probe: str) -> None:
        self.file, self.probe = file, probe
        self._modules: dict[int, object] = {}
        self._functions: dict[tuple[int, str], object] = {}
        self._lock = threading.Lock()

    def text(self) -> str:
        """The CUDA C++ source, as shipped with the package."""
        return importlib.resources.files(SOURCE_PACKAGE).joinpath(self.file).read_text()

    def module(self, device_index: int):
        """The compiled ``cupy.RawModule`` for one device (compiled once, at first use)."""
        with self._lock:
            module = self._modules.get(device_index)
            if module is None:
                import cupy

                with cupy.cuda.Device(device_index):
                    module = cupy.RawModule(code=self.text(), options=COMPILE_OPTIONS)
                    try:
                        module.get_function(self.probe)
                    except cupy.cuda.compiler.CompileException as exc:
                        raise RuntimeError(f"compiling {self.file} failed:\n{exc}") from exc
                self._modules[device_index] = module
            return module

    def function(self, device_index: int, name: str):
        """The kernel ``name`` of one device's module (looked up once)."""
        function = self._functions.get((device_index, name))
        if function is None:
            function = self.module(device_index).get_function(name)
            self._functions[device_index, name] = function
        return function
