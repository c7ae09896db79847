"""CUDA slab mapping for Python workers, through ctypes.

kvd hands each attached worker, per slab, either a 64-byte cudaIpcMemHandle_t (allocator ipc, in
ListPools), opened with cudaIpcOpenMemHandle, or a POSIX fd of a VMM allocation (allocator vmm,
through the side socket), imported with the driver's cuMemImportFromShareableHandle and mapped
with cuMemAddressReserve / cuMemMap / cuMemSetAccess. Either maps the daemon's device memory into
this process once; the result is a plain device pointer and size, usable from any framework (wrap
it with torch/cupy/DLPack as you like), valid until close().

The CUDA runtime is found as $KVD_CUDART, else libcudart.so, libcudart.so.13, .12, .11.0; the
driver (VMM slabs only) as $KVD_LIBCUDA, else libcuda.so.1. The
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


# The driver's virtual-memory API (cuda.h, CUDA 11.2 and later), for VMM slabs.
CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class MemAllocationProp(ctypes.Structure):
    """CUmemAllocationProp (cuda.h), as kvd's allocator creates VMM slabs."""
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _MemLocation),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class MemAccessDesc(ctypes.Structure):
    """CUmemAccessDesc (cuda.h)."""
    _fields_ = [("location", _MemLocation), ("flags", ctypes.c_int)]


class CudaDriver:
    """The driver entry points that import a VMM slab from its fd, loaded once per process."""

    def __init__(self, path=None):
        names = [path or os.environ.get("KVD_LIBCUDA") or "libcuda.so.1"]
        try:
            self._lib = ctypes.CDLL(names[0])
            self.path = names[0]
        except OSError as e:
            raise OSError(f"cannot load the CUDA driver (set KVD_LIBCUDA): {e}") from None
        lib, u64, size_t = self._lib, ctypes.c_ulonglong, ctypes.c_size_t
        sigs = {
            "cuMemGetAllocationGranularity": [ctypes.POINTER(size_t), ctypes.POINTER(MemAllocationProp), ctypes.c_int],
            "cuMemImportFromShareableHandle": [ctypes.POINTER(u64), ctypes.c_void_p, ctypes.c_int],
            "cuMemAddressReserve": [ctypes.POINTER(u64), size_t, size_t, u64, u64],
            "cuMemMap": [u64, size_t, size_t, u64, u64],
            "cuMemSetAccess": [u64, size_t, ctypes.POINTER(MemAccessDesc), size_t],
            "cuMemUnmap": [u64, size_t],
            "cuMemAddressFree": [u64, size_t],
            "cuMemRelease": [u64],
        }
        for name, args in sigs.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
        lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.cuGetErrorString.restype = ctypes.c_int

    def check(self, call, code):
        if code != 0:
            text = ctypes.c_char_p()
            self._lib.cuGetErrorString(code, ctypes.byref(text))
            raise CudaError(call, code, "CUresult", (text.value or b"unknown").decode())

    def import_fd(self, fd, size, device):
        """Maps the VMM allocation behind `fd` (kvd's, `size` bytes on `device`, whose context the
        runtime made current): returns (device pointer, mapped size, allocation handle)."""
        lib = self._lib
        prop = MemAllocationProp(type=CU_MEM_ALLOCATION_TYPE_PINNED,
                                 requestedHandleTypes=CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                                 location=_MemLocation(CU_MEM_LOCATION_TYPE_DEVICE, device))
        gran = ctypes.c_size_t()
        self.check("cuMemGetAllocationGranularity",
                   lib.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(prop),
                                                     CU_MEM_ALLOC_GRANULARITY_MINIMUM))
        g = gran.value or 1
        mapped = (size + g - 1) // g * g  # as kvd's cuMemCreate rounded it
        handle = ctypes.c_ulonglong()
        self.check("cuMemImportFromShareableHandle",
                   lib.cuMemImportFromShareableHandle(ctypes.byref(handle), ctypes.c_void_p(fd),
                                                      CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
        ptr = ctypes.c_ulonglong()
        try:
            self.check("cuMemAddressReserve", lib.cuMemAddressReserve(ctypes.byref(ptr), mapped, g, 0, 0))
            try:
                self.check("cuMemMap", lib.cuMemMap(ptr.value, mapped, 0, handle.value, 0))
                access = MemAccessDesc(location=_MemLocation(CU_MEM_LOCATION_TYPE_DEVICE, device),
                                       flags=CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
                try:
                    self.check("cuMemSetAccess", lib.cuMemSetAccess(ptr.value, mapped, ctypes.byref(access), 1))
                except CudaError:
                    lib.cuMemUnmap(ptr.value, mapped)
                    raise
            except CudaError:
                lib.cuMemAddressFree(ptr.value, mapped)
                raise
        except CudaError:
            lib.cuMemRelease(handle.value)
            raise
        return ptr.value, mapped, handle.value

    def release(self, ptr, mapped, handle):
        self.check("cuMemUnmap", self._lib.cuMemUnmap(ptr, mapped))
        self.check("cuMemAddressFree", self._lib.cuMemAddressFree(ptr, mapped))
        self.check("cuMemRelease", self._lib.cuMemRelease(handle))


class VmmSlab(DeviceSlab):
    """A VMM slab imported from kvd's fd: unmapped and released by close()."""

    def __init__(self, driver, ptr, size, device, mapped, handle):
        super().__init__(None, ptr, size, device)
        self._driver, self._mapped, self._handle = driver, mapped, handle

    def close(self):
        if self.ptr is not None:
            ptr, self.ptr = self.ptr, None
            self._driver.release(ptr, self._mapped, self._handle)


def map_slab(runtime, slab_info, fd=None, driver=None):
    """Maps one SlabInfo of ListPools (CUDA backend). allocator ipc: its IPC handle. allocator vmm:
    `fd`, the slab's fd from the side socket (kept open by the caller until this returns), through
    `driver` (a CudaDriver; loaded when not given)."""
    if slab_info.allocator == "vmm":
        if fd is None:
            raise CudaError("map_slab", 801, "cudaErrorNotSupported",
                            "a VMM slab (allocator: vmm) maps from its fd, which the side socket passes: none was given")
        runtime.check(f"cudaSetDevice({slab_info.device})", runtime._lib.cudaSetDevice(slab_info.device))
        driver = driver or CudaDriver()
        ptr, mapped, handle = driver.import_fd(fd, slab_info.size_bytes, slab_info.device)
        return VmmSlab(driver, ptr, slab_info.size_bytes, slab_info.device, mapped, handle)
    ptr = runtime.open_ipc_handle(bytes(slab_info.cuda_ipc_handle), slab_info.device)
    return DeviceSlab(runtime, ptr, slab_info.size_bytes, slab_info.device)
