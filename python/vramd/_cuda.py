"""GPU memory the daemon exports (CUDA's virtual memory API, one POSIX file descriptor per
allocation), imported and mapped into this process through the CUDA driver with ctypes, in
the device's primary context (PyTorch's). The C++ side is lib/util/cuda_vmm.cpp."""
from __future__ import annotations

import ctypes
import functools
import threading

import torch

from ._errors import ProtocolError

_SUCCESS = 0
_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
_LOCATION_TYPE_DEVICE = 1
_PROT_READ, _PROT_READWRITE = 1, 3

# cuda.h maps these names to their _v2 symbols.
_SIGNATURES = {
    "cuInit": [ctypes.c_uint],
    "cuGetErrorName": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
    "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
    "cuDevicePrimaryCtxRetain": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int],
    "cuDevicePrimaryCtxRelease_v2": [ctypes.c_int],
    "cuCtxPushCurrent_v2": [ctypes.c_void_p],
    "cuCtxPopCurrent_v2": [ctypes.POINTER(ctypes.c_void_p)],
    "cuMemImportFromShareableHandle": [ctypes.POINTER(ctypes.c_ulonglong), ctypes.c_void_p, ctypes.c_int],
    "cuMemAddressReserve": [ctypes.POINTER(ctypes.c_ulonglong), ctypes.c_size_t, ctypes.c_size_t,
                            ctypes.c_ulonglong, ctypes.c_ulonglong],
    "cuMemMap": [ctypes.c_ulonglong, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_ulonglong, ctypes.c_ulonglong],
    "cuMemSetAccess": [ctypes.c_ulonglong, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t],
    "cuMemUnmap": [ctypes.c_ulonglong, ctypes.c_size_t],
    "cuMemAddressFree": [ctypes.c_ulonglong, ctypes.c_size_t],
    "cuMemRelease": [ctypes.c_ulonglong],
}


def host_register(address: int, size: int, flags: int):
    """cudaHostRegister through torch's binding; returns its error (0: page-locked). CUDA keeps a
    refused call's error as the thread's last one, which torch's next kernel launch check
    (cudaGetLastError) would raise as that kernel's own: a refusal's is taken here."""
    error = torch.cuda.cudart().cudaHostRegister(address, size, flags)
    if error != 0:
        _clear_runtime_error()
    return error


def host_unregister(address: int) -> None:
    """cudaHostUnregister, a refusal's error taken as host_register's is."""
    if torch.cuda.cudart().cudaHostUnregister(address) != 0:
        _clear_runtime_error()


def _clear_runtime_error() -> None:
    """cudaGetLastError of the CUDA runtime torch loaded (torch binds no such call)."""
    for runtime in _runtimes():
        runtime.cudaGetLastError()


@functools.cache
def _runtimes() -> list:
    """The libcudart libraries this process has loaded (torch's; none where torch links it in)."""
    with open("/proc/self/maps") as maps:
        paths = {line.split(maxsplit=5)[-1].strip() for line in maps if "/libcudart.so" in line}
    return [ctypes.CDLL(path) for path in sorted(paths)]


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_driver = None
_driver_lock = threading.Lock()


def _load():
    global _driver
    with _driver_lock:
        if _driver is None:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError as e:
                raise ProtocolError(f"sent CUDA memory, but there is no CUDA driver here ({e})") from None
            for name, args in _SIGNATURES.items():
                function = getattr(lib, name)
                function.argtypes, function.restype = args, ctypes.c_int
            _driver = lib
            _check(lib.cuInit(0), "cuInit", 0)
    return _driver


def _check(result: int, what: str, device: int) -> None:
    if result != _SUCCESS:
        name = ctypes.c_char_p()
        known = _driver is not None and _driver.cuGetErrorName(result, ctypes.byref(name)) == _SUCCESS
        raise ProtocolError(f"sent CUDA memory that cuda:{device} cannot map: {what} failed: "
                            f"{name.value.decode() if known and name.value else f'CUresult {result}'}")


class _PrimaryContext:
    """The device's primary context current on this thread while inside."""

    def __init__(self, device: int):
        self.device, self.driver = device, _load()

    def __enter__(self):
        d, self.handle = self.driver, ctypes.c_int()
        _check(d.cuDeviceGet(ctypes.byref(self.handle), self.device), "cuDeviceGet", self.device)
        context = ctypes.c_void_p()
        _check(d.cuDevicePrimaryCtxRetain(ctypes.byref(context), self.handle), "cuDevicePrimaryCtxRetain", self.device)
        result = d.cuCtxPushCurrent_v2(context)
        if result != _SUCCESS:
            d.cuDevicePrimaryCtxRelease_v2(self.handle)
            _check(result, "cuCtxPushCurrent", self.device)
        return d

    def __exit__(self, *exc):
        self.driver.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
        self.driver.cuDevicePrimaryCtxRelease_v2(self.handle)


class Region:
    """One allocation the daemon exported, mapped here read-only where the driver allows
    (`read_only` tells); unmapped when the last tensor viewing it is freed."""

    def __init__(self, fd: int, size: int, device: int):
        self.device, self.size, self.address, self.read_only = device, size, 0, False
        self._handle, self._mapped = 0, False
        _load()
        torch.cuda.init()  # PyTorch's primary context exists before ours is retained
        with _PrimaryContext(device) as d:
            try:
                handle = ctypes.c_ulonglong()
                _check(d.cuMemImportFromShareableHandle(ctypes.byref(handle), ctypes.c_void_p(fd),
                                                        _HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                       "cuMemImportFromShareableHandle", device)
                self._handle = handle.value
                address = ctypes.c_ulonglong()
                _check(d.cuMemAddressReserve(ctypes.byref(address), size, 0, 0, 0), "cuMemAddressReserve", device)
                self.address = address.value
                _check(d.cuMemMap(self.address, size, 0, self._handle, 0), "cuMemMap", device)
                self._mapped = True
                access = _AccessDesc(_Location(_LOCATION_TYPE_DEVICE, device), _PROT_READ)
                if d.cuMemSetAccess(self.address, size, ctypes.byref(access), 1) == _SUCCESS:
                    self.read_only = True
                else:  # the driver allows no read-only mapping here
                    access.flags = _PROT_READWRITE
                    _check(d.cuMemSetAccess(self.address, size, ctypes.byref(access), 1), "cuMemSetAccess", device)
            except BaseException:
                self._free(d)
                raise

    def _free(self, d) -> None:
        if self._mapped:
            d.cuMemUnmap(self.address, self.size)
        if self.address:
            d.cuMemAddressFree(self.address, self.size)
        if self._handle:
            d.cuMemRelease(self._handle)
        self._mapped, self.address, self._handle = False, 0, 0

    def __del__(self):
        if self._handle or self.address:
            try:
                torch.cuda.synchronize(self.device)  # no kernel still reads what is unmapped
                with _PrimaryContext(self.device) as d:
                    self._free(d)
            except Exception:
                pass  # at interpreter exit the driver may be gone, and with it the mapping

    def view(self, dtype: torch.dtype, shape: list[int], strides: list[int], offset: int) -> torch.Tensor:
        """A zero-copy tensor over this region's bytes from `offset` (bounds checked by the caller);
        it keeps the region mapped."""
        return torch.as_tensor(_Interface(self, dtype, shape, strides, offset), device=f"cuda:{self.device}").view(dtype)


# A same-sized type torch knows from a __cuda_array_interface__ typestr, viewed as the real dtype.
_CARRIER = {1: "|i1", 2: "<i2", 4: "<i4", 8: "<i8", 16: "<c16"}


class _Interface:
    """What torch.as_tensor reads (the CUDA array interface, version 3). torch keeps this object,
    and with it the region, alive as long as the tensor."""

    def __init__(self, region: Region, dtype: torch.dtype, shape, strides, offset: int):
        self.region = region
        self.__cuda_array_interface__ = {
            "shape": tuple(shape), "typestr": _CARRIER[dtype.itemsize], "version": 3, "stream": None,
            "data": (region.address + offset, False),  # torch takes no read-only flag; the mapping is
            "strides": tuple(s * dtype.itemsize for s in strides),
        }
