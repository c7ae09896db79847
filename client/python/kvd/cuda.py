"""CUDA slab mapping for Python workers: cudaIpcOpenMemHandle called through ctypes.

kvd hands each attached worker a 64-byte cudaIpcMemHandle_t per slab (ListPools). Opening it maps
the daemon's device memory into this process once; the result is a plain device pointer and size,
usable from any framework (wrap it with torch/cupy/DLPack as you like), valid until close().

The CUDA runtime is found as $KVD_CUDART, else libcudart.so, libcudart.so.13, .12, .11.0. The
process must see the device (same CUDA_VISIBLE_DEVICES numbering as kvd, hostPID or the device
plugin in Kubernetes).
"""
import ctypes
import ctypes.util
import os

CUDA_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
_CANDIDATES = ("libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0")


class CudaError(RuntimeError):
    """A CUDA runtime call failed: `code` is the cudaError_t, `name` its cudaGetErrorName."""

    def __init__(self, call, code, name, text):
        super().__init__(f"{call}: {name} ({code}): {text}")
        self.code = code
        self.name = name


class IpcMemHandle(ctypes.Structure):
    """cudaIpcMemHandle_t: 64 opaque bytes, passed by value."""
    _fields_ = [("reserved", ctypes.c_char * 64)]


class CudaRuntime:
    """The few runtime entry points a worker needs, loaded once per process."""

    def __init__(self, path=None):
        explicit = path or os.environ.get("KVD_CUDART")
        names = [explicit] if explicit else []
        found = ctypes.util.find_library("cudart")
        names += ([found] if found else []) + list(_CANDIDATES)
        errors = []
        for name in names:
            try:
                self._lib = ctypes.CDLL(name)
                self.path = name
                break
            except OSError as e:
                errors.append(f"{name}: {e}")
        else:
            raise OSError("cannot load the CUDA runtime (set KVD_CUDART): " + "; ".join(errors))
        lib = self._lib
        lib.cudaSetDevice.argtypes = [ctypes.c_int]
        lib.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), IpcMemHandle, ctypes.c_uint]
        lib.cudaIpcCloseMemHandle.argtypes = [ctypes.c_void_p]
        lib.cudaGetErrorName.restype = ctypes.c_char_p
        lib.cudaGetErrorName.argtypes = [ctypes.c_int]
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        for fn in (lib.cudaSetDevice, lib.cudaIpcOpenMemHandle, lib.cudaIpcCloseMemHandle):
            fn.restype = ctypes.c_int
        self._memcpy = getattr(lib, "cudaMemcpy", None)  # optional: tests and simple tools
        if self._memcpy is not None:
            self._memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            self._memcpy.restype = ctypes.c_int

    def check(self, call, code):
        if code != 0:
            name = (self._lib.cudaGetErrorName(code) or b"?").decode()
            text = (self._lib.cudaGetErrorString(code) or b"").decode()
            raise CudaError(call, code, name, text)

    def open_ipc_handle(self, handle: bytes, device: int):
        """Maps a slab exported by kvd; returns a DeviceSlab (device pointer, size set by caller)."""
        if len(handle) != 64:
            raise ValueError(f"a CUDA IPC handle is 64 bytes, not {len(handle)}")
        self.check(f"cudaSetDevice({device})", self._lib.cudaSetDevice(device))
        ptr = ctypes.c_void_p()
        h = IpcMemHandle()
        ctypes.memmove(ctypes.addressof(h), handle, 64)
        self.check("cudaIpcOpenMemHandle", self._lib.cudaIpcOpenMemHandle(
            ctypes.byref(ptr), h, CUDA_IPC_MEM_LAZY_ENABLE_PEER_ACCESS))
        return ptr.value

    def copy_to_device(self, dst, data: bytes):
        """cudaMemcpy host -> device (synchronous): for tools and tests; engines use their kernels."""
        self._need_memcpy()
        buf = ctypes.create_string_buffer(bytes(data), len(data))
        self.check("cudaMemcpy(HostToDevice)", self._memcpy(ctypes.c_void_p(dst), buf, len(data), 1))

    def copy_from_device(self, src, n):
        """cudaMemcpy device -> host (synchronous): `n` bytes at device address `src`."""
        self._need_memcpy()
        buf = ctypes.create_string_buffer(n)
        self.check("cudaMemcpy(DeviceToHost)", self._memcpy(buf, ctypes.c_void_p(src), n, 2))
        return buf.raw

    def _need_memcpy(self):
        if self._memcpy is None:
            raise OSError(f"{self.path} has no cudaMemcpy")

    def close_ipc_handle(self, ptr):
        self.check("cudaIpcCloseMemHandle", self._lib.cudaIpcCloseMemHandle(ctypes.c_void_p(ptr)))


class DeviceSlab:
    """One mapped CUDA slab: `ptr` (int device address), `size` bytes, on `device`."""

    def __init__(self, runtime, ptr, size, device):
        self._runtime = runtime
        self.ptr = ptr
        self.size = size
        self.device = device

    def address(self, offset):
        if not 0 <= offset < self.size:
            raise IndexError(f"offset {offset} outside the {self.size}-byte slab")
        return self.ptr + offset

    def close(self):
        if self.ptr is not None:
            ptr, self.ptr = self.ptr, None
            self._runtime.close_ipc_handle(ptr)


def map_slab(runtime, slab_info):
    """Maps one SlabInfo of ListPools (CUDA backend, allocator ipc). VMM slabs (allocator vmm,
    imported from an fd with the driver's cuMemImportFromShareableHandle) are mapped by the C++
    client only for now: they are refused here with that reason."""
    if slab_info.allocator == "vmm":
        raise CudaError("map_slab", 801, "cudaErrorNotSupported",
                        "this pool uses allocator: vmm, which the Python client does not map yet "
                        "(the C++ client does); configure allocator: ipc for Python engines")
    ptr = runtime.open_ipc_handle(bytes(slab_info.cuda_ipc_handle), slab_info.device)
    return DeviceSlab(runtime, ptr, slab_info.size_bytes, slab_info.device)
