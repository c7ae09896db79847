"""kvd: the Python worker library for the kvd KV-cache daemon.

    from kvd import Client
    with Client() as c:   # kvd's default socket ($KVD_TARGET overrides; or Client("unix:///..."))
        with c.request("req-1", pool="default", prompt=tokens, max_new_tokens=64) as r:
            view = c.layer_view(r.pool, r.blocks[0], layer=0)   # memoryview into the shared slab
            ...
            r.publish(tokens)

Host slabs arrive as file descriptors over the side socket (SCM_RIGHTS) and are mapped with mmap
(memoryviews; numpy arrays with slab_array/block_array when numpy is installed). CUDA slabs are
opened with cudaIpcOpenMemHandle through ctypes (kvd.cuda): pools[i].devices[shard] holds the
device pointer and size, and layer_address() gives a block layer's device address.
"""
from .client import Client, KvdError, KvdRestarted, KvdUnavailable, Request, default_target  # noqa: F401
from .cuda import CudaError, CudaRuntime, DeviceSlab  # noqa: F401
from .step import GroupTable, InFlight, StepBatch, StepRequest, StepResult  # noqa: F401
