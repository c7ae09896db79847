#!/usr/bin/env python3
"""The GPU bundle's hybrid_model step: the reference hybrid model (TinyHybrid) in the
continuous-batching engine with every KV group in a kvd CUDA slab (kv_tensor on the cuda
backend), its tokens and float32 logits bit-identical to a run with no cache on the same device,
and the negative controls (a wrong window, a stale state) changing them — tests/python/
test_hybrid_engine.py run with --backend=cuda, deterministic algorithms on.

Unlike torch_slab_check.py this drives kvd through the Python client, so the python3 running it
needs grpcio and protobuf besides PyTorch (KVD_PYTHON picks the interpreter); without them the
step is skipped, saying so.

Usage: hybrid_gpu_check.py BIN_DIR   (kvd in BIN_DIR; the kvd package and the tests beside this file)
Exit status: 0 every check passed; 1 a check failed; 4 skipped (no PyTorch, no usable GPU, or no
grpcio/protobuf).
"""
import os
import sys

SKIPPED = 4


def main():
    bin_dir = sys.argv[1]
    here = os.path.dirname(os.path.abspath(__file__))
    # cuBLAS is deterministic only with a fixed workspace; set before CUDA initializes.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    try:
        import torch
    except ImportError as e:
        print(f"skipped: no PyTorch in {sys.executable} ({e})")
        return SKIPPED
    if not torch.cuda.is_available():
        print("skipped: PyTorch sees no CUDA device")
        return SKIPPED
    try:
        import grpc  # noqa: F401
        import google.protobuf  # noqa: F401
    except ImportError as e:
        print(f"skipped: {sys.executable} has PyTorch but not grpcio and protobuf, which the Python client "
              f"needs ({e}); set KVD_PYTHON to an interpreter with all three")
        return SKIPPED
    torch.use_deterministic_algorithms(True)
    torch.zeros(1, device="cuda")  # loads PyTorch's CUDA runtime
    if "KVD_CUDART" not in os.environ:  # the client maps the slab with the runtime PyTorch loaded
        with open("/proc/self/maps") as maps:
            cudart = next((line.split()[-1] for line in maps if "libcudart" in line.split()[-1]), None)
        if cudart:
            os.environ["KVD_CUDART"] = cudart
    sys.path.insert(0, here)  # the bundle's python/: the kvd package and the tests
    import test_hybrid_engine
    return test_hybrid_engine.main([sys.argv[0], os.path.join(bin_dir, "kvd"), "--backend=cuda"])


if __name__ == "__main__":
    sys.exit(main())
