#!/usr/bin/env python3
"""On a GPU, without kvd's gRPC stubs: a PyTorch process maps a kvd CUDA slab and reads, in place,
the KV the C++ example worker wrote.

The GPU machines the proof runs on have PyTorch but no grpcio, so this path needs no generated
stubs (docs/operations.md, "The GPU proof bundle"): `kvdctl --json pools` gives the slab's IPC
handle and device UUID, the example worker's JSON gives the blocks of its prompt, the driver API
(libcuda.so.1, present wherever the NVIDIA driver is) opens the handle, and the slab becomes a
torch tensor through __cuda_array_interface__ (no copy: the tensor's data_ptr is the mapping).
Every byte of every cached token is compared with the pattern of client/examples/kv_pattern.h.

Usage: torch_slab_check.py BIN_DIR   (kvd, kvd_example_worker, kvdctl in BIN_DIR)
Exit status: 0 all bytes matched; 1 a check failed; 4 skipped (no PyTorch or no usable GPU).
"""
import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kvd_testlib import Daemon, check, finish, run_worker, slot_bytes  # noqa: E402

POOL = ("pools:\n  - name: default\n    block_tokens: 16\n    num_layers: 4\n"
        "    bytes_per_token_per_layer: 256\n    capacity_blocks: 256\n    max_model_len: 2048\n")
BLOCK_TOKENS, LAYERS, TOKEN_BYTES, CAPACITY = 16, 4, 256, 256


class CuIpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


class SlabTensorSource:
    """A device range exposed through __cuda_array_interface__ (version 3), bytes."""

    def __init__(self, ptr, size):
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


def open_ipc(cuda, handle_bytes):
    handle = CuIpcMemHandle()
    ctypes.memmove(ctypes.byref(handle), handle_bytes, 64)
    ptr = ctypes.c_uint64(0)
    # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1; cuIpcOpenMemHandle is the _v2 symbol since CUDA 11.
    rc = cuda.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), handle, ctypes.c_uint(1))
    return rc, ptr.value


def main():
    bin_dir = sys.argv[1]
    try:
        import torch
    except ImportError as e:
        print(f"skipped: no PyTorch in {sys.executable} ({e})")
        return 4
    if not torch.cuda.is_available():
        print("skipped: PyTorch sees no CUDA device")
        return 4
    tmp = tempfile.mkdtemp(prefix="kvd-torch-")
    with open(os.path.join(tmp, "kvd.log"), "w") as log:
        daemon = Daemon(os.path.join(bin_dir, "kvd"), tmp, POOL, extra=["--backend=cuda"], stderr=log)
    try:
        if not daemon.started:
            print("FAIL kvd --backend=cuda did not start: " + open(os.path.join(tmp, "kvd.log")).read()[-2000:])
            return 1
        rc, res = run_worker(os.path.join(bin_dir, "kvd_example_worker"), daemon.target, "cpp-a", "500:40")
        check(rc == 0 and res.get("written_bytes") == 40 * LAYERS * TOKEN_BYTES, f"C++ worker wrote KV ({res})")
        blocks = res.get("blocks", [])
        listed = json.loads(subprocess.run([os.path.join(bin_dir, "kvdctl"), "--target=" + daemon.target,
                                            "--json", "pools"], capture_output=True, text=True,
                                           timeout=30).stdout)
        slab = listed["pools"][0]["slabs"][0]
        handle = bytes.fromhex(slab["cuda_ipc_handle"])  # kvdctl --json prints bytes as hex
        uuid = slab.get("device_uuid", "").lower().removeprefix("gpu-")
        ordinal = next((i for i in range(torch.cuda.device_count())
                        if str(torch.cuda.get_device_properties(i).uuid).lower().removeprefix("gpu-") == uuid), None)
        check(ordinal is not None, f"the slab's device {slab.get('device_uuid')} resolved by UUID to torch device {ordinal}")
        if ordinal is None:
            return finish()
        torch.cuda.set_device(ordinal)
        torch.zeros(1, device=f"cuda:{ordinal}")  # the primary context, current on this thread
        cuda = ctypes.CDLL("libcuda.so.1")
        rc, ptr = open_ipc(cuda, handle)
        check(rc == 0 and ptr != 0, f"cuIpcOpenMemHandle opened kvd's slab (rc {rc})")
        if rc != 0:
            return finish()
        size = int(slab["size_bytes"])
        tensor = torch.as_tensor(SlabTensorSource(ptr, size), device=f"cuda:{ordinal}")
        check(tensor.data_ptr() == ptr and tensor.numel() == size, "the tensor is the mapping itself (no copy)")
        layer_block = BLOCK_TOKENS * TOKEN_BYTES
        bad = 0
        for pos in range(32):  # the two full blocks the worker published
            for layer in range(LAYERS):
                at = (layer * CAPACITY + blocks[pos // BLOCK_TOKENS]) * layer_block + (pos % BLOCK_TOKENS) * TOKEN_BYTES
                got = bytes(tensor[at:at + TOKEN_BYTES].cpu().tolist())
                bad += got != slot_bytes(500 + pos, pos, layer, TOKEN_BYTES)
        check(bad == 0, f"PyTorch read the C++ worker's KV in place, byte for byte ({bad} bad slots of {32 * LAYERS})")
        del tensor
        torch.cuda.synchronize()
        cuda.cuIpcCloseMemHandle(ctypes.c_uint64(ptr))
    finally:
        daemon.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return finish()


if __name__ == "__main__":
    sys.exit(main())
