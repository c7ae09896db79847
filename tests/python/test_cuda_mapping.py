#!/usr/bin/env python3
"""kvd.cuda's ctypes marshalling against a stand-in CUDA runtime (fake_cudart.c): the 64-byte
handle reaches cudaIpcOpenMemHandle by value and intact, with the device set first and the lazy
peer-access flag; addresses are slab base + Pool.offset; errors carry cudaGetErrorName; close
unmaps. (tests/gpu covers the real runtime on a GPU.)

VMM slabs (allocator vmm) against a stand-in driver (fake_cuda_driver.c) that maps the fd kvd
would pass: the allocation properties and access flags reach the driver as cuda.h lays them out,
the slab's bytes are read and written through the returned pointer, and close releases it.

Usage: test_cuda_mapping.py LIBFAKECUDART LIBFAKECUDADRIVER   (PYTHONPATH=<build>/python)
"""
import ctypes
import os
import sys

from kvd import cuda
from kvd.client import Pool
from kvd.v1 import kvd_pb2
from kvd_testlib import check, finish


def main():
    lib_path = sys.argv[1]
    fake = ctypes.CDLL(lib_path)
    fake.fake_handle.restype = ctypes.POINTER(ctypes.c_ubyte * 64)
    fake.fake_flags.restype = ctypes.c_uint
    rt = cuda.CudaRuntime(path=lib_path)
    check(rt.path == lib_path, "the runtime named by path is loaded")

    handle = bytes((i * 7 + 3) % 251 for i in range(64))
    info = kvd_pb2.SlabInfo(shard=0, device=3, size_bytes=4 << 20, cuda_ipc_handle=handle)
    slab = cuda.map_slab(rt, info)
    base = int.from_bytes(handle[:8], "little")
    check(slab.ptr == 0x7f0000000000 | (base & 0xffffff000), f"device pointer returned ({slab.ptr:#x})")
    check(fake.fake_device() == 3, "cudaSetDevice got the slab's device")
    check(bytes(fake.fake_handle().contents) == handle, "cudaIpcOpenMemHandle got all 64 handle bytes by value")
    check(fake.fake_flags() == cuda.CUDA_IPC_MEM_LAZY_ENABLE_PEER_ACCESS, "lazy peer-access flag")
    check(slab.size == 4 << 20 and slab.device == 3, "size and device kept")

    pool = Pool(kvd_pb2.PoolInfo(pool_id=0, name="m", block_tokens=16, num_layers=4,
                                 bytes_per_token_per_layer=256, capacity_blocks=64,
                                 layout=kvd_pb2.LAYOUT_LAYER_MAJOR, layer_block_bytes=4096, slabs=[info]))
    check(slab.address(pool.offset(5, 2)) == slab.ptr + (2 * 64 + 5) * 4096, "layer address = base + offset")
    try:
        slab.address(4 << 20)
        check(False, "an address past the slab is refused")
    except IndexError:
        check(True, "an address past the slab is refused")

    slab.close()
    check(fake.fake_open() == 0 and slab.ptr is None, "close unmaps the handle")
    slab.close()  # idempotent

    bad = kvd_pb2.SlabInfo(shard=0, device=0, size_bytes=2 << 20, cuda_ipc_handle=b"\xff" + bytes(63))
    try:
        cuda.map_slab(rt, bad)
        check(False, "a foreign handle fails")
    except cuda.CudaError as e:
        check(e.name == "cudaErrorInvalidResourceHandle" and e.code == 400 and "cudaIpcOpenMemHandle" in str(e),
              f"a foreign handle fails naming the CUDA error ({e})")
    try:
        rt.open_ipc_handle(b"short", 0)
        check(False, "a short handle is refused")
    except ValueError:
        check(True, "a short handle is refused")
    try:
        rt.copy_to_device(0x1000, b"x")
        check(False, "copies need cudaMemcpy")
    except OSError as e:
        check("cudaMemcpy" in str(e), "a runtime without cudaMemcpy says so")
    try:
        cuda.CudaRuntime(path="/nonexistent/libcudart.so")
        check(True, "a bad path falls back to the system runtime when there is one")
    except OSError as e:
        check("KVD_CUDART" in str(e), "no runtime: the error says how to name one")

    vmm(rt, sys.argv[2])
    return finish()


def vmm(rt, driver_path):
    fake = ctypes.CDLL(driver_path)
    drv = cuda.CudaDriver(path=driver_path)
    size = 4 << 20
    fd = os.memfd_create("kvd-test-vmm")
    os.ftruncate(fd, size)
    os.pwrite(fd, bytes(range(256)) * 4, 4096)
    info = kvd_pb2.SlabInfo(shard=0, device=2, size_bytes=size, allocator="vmm", memory_id="m-1")
    slab = cuda.map_slab(rt, info, fd=fd, driver=drv)
    check(fake.fake_prop_type() == cuda.CU_MEM_ALLOCATION_TYPE_PINNED and
          fake.fake_prop_handle_types() == cuda.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR and
          fake.fake_prop_location() == 100 + 2, "vmm: CUmemAllocationProp reaches the driver laid out as cuda.h's")
    check(fake.fake_access() == 10000 + 200 + cuda.CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
          "vmm: read-write access on the slab's device")
    check(ctypes.string_at(slab.ptr + 4096, 1024) == bytes(range(256)) * 4, "vmm: the slab's bytes, through the pointer")
    ctypes.memmove(slab.ptr + 8192, b"written by python", 17)
    check(os.pread(fd, 17, 8192) == b"written by python", "vmm: writes land in the allocation kvd shares")
    check(slab.size == size and slab.device == 2, "vmm: size and device kept")
    os.close(fd)  # the mapping holds its own reference, as an imported CUDA allocation does
    slab.close()
    check(fake.fake_live() == 0 and slab.ptr is None, "vmm: close unmaps and releases the allocation")
    try:
        cuda.map_slab(rt, info, driver=drv)
        check(False, "vmm: without the side socket's fd it is refused")
    except cuda.CudaError as e:
        check("side socket" in str(e), f"vmm: without the side socket's fd it is refused, saying why ({e})")
    try:
        cuda.CudaDriver(path="/nonexistent/libcuda.so.1")
        check(False, "vmm: a missing driver is named")
    except OSError as e:
        check("KVD_LIBCUDA" in str(e), "vmm: a missing driver says how to name one")


if __name__ == "__main__":
    sys.exit(main())
