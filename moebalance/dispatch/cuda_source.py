"""CUDA sources shipped with the package: their text, one compiled CuPy module per device, and
checked launches of their kernels.

The sources live in the top-level ``csrc/`` and ship as the package ``moebalance._csrc``. A
:class:`CudaSource` compiles its file once per device, at first use and under a lock, with the
options every kernel of the package is built with (tests compile the same files with nvcc), and
launches its kernels on torch's current stream with their arguments checked against the source.
"""

from __future__ import annotations

import importlib.resources
import threading

import numpy as np

from .kernel_signatures import Param, kernel_signatures

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
        self._signatures: dict[str, tuple[Param, ...]] | None = None
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
            import cupy

            with cupy.cuda.Device(device_index):  # CuPy loads a module on its current device
                function = self.module(device_index).get_function(name)
            self._functions[device_index, name] = function
        return function

    def signatures(self) -> dict[str, tuple[Param, ...]]:
        """``{kernel: its parameters}`` read from :meth:`text` once (a parse costs milliseconds,
        too much for every launch)."""
        if self._signatures is None:
            self._signatures = kernel_signatures(self.text())
        return self._signatures

    def launch(self, device, name: str, grid: int, block: int, args) -> None:
        """Launch kernel ``name`` with ``grid`` blocks of ``block`` threads on torch's current
        stream of ``device`` (a CUDA ``torch.device``).

        Tensors travel as raw device pointers (``data_ptr()``: no DLPack, no CuPy array), None
        as a null pointer and Python ints as int64. Neither CuPy nor the driver checks a
        launch's arguments, so each launch is checked here against the kernel's parameters as
        read from the source: a missing argument would make the kernel read past its argument
        vector. The tensors are used on the stream the caching allocator knows them on, so no
        record_stream is needed.
        """
        import torch

        params = self.signatures()[name]
        assert len(args) == len(params), (
            f"{name} takes {len(params)} arguments ({', '.join(p.name for p in params)}), "
            f"launched with {len(args)}")
        packed = []
        for a, param in zip(args, params):
            if isinstance(a, torch.Tensor) or a is None:
                assert param.kind == "ptr", f"{name}: {param.name} is a {param.kind}, got a pointer"
                packed.append(np.uint64(0 if a is None else a.data_ptr()))
            else:
                assert param.kind == "i64", f"{name}: {param.name} is a {param.kind}, got an int"
                packed.append(np.int64(a))
        import cupy

        index = device.index if device.index is not None else torch.cuda.current_device()
        kernel = self.function(index, name)
        stream = _stream(index, torch.cuda.current_stream(index).cuda_stream)
        with cupy.cuda.Device(index), stream:
            kernel((max(1, grid),), (block,), tuple(packed))


_streams: dict[tuple[int, int], object] = {}


def _stream(device_index: int, handle: int):
    """CuPy's view of torch's stream ``handle`` (one object per stream)."""
    import cupy

    stream = _streams.get((device_index, handle))
    if stream is None:
        stream = _streams[device_index, handle] = cupy.cuda.ExternalStream(handle, device_index)
    return stream
