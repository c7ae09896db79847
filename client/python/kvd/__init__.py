"""kvd: the Python worker library for the kvd KV-cache daemon.

    from kvd import Client
    with Client("unix:///run/kvd/kvd.sock") as c:
        with c.request("req-1", pool="default", prompt=tokens, max_new_tokens=64) as r:
            view = c.layer_view(r.pool, r.blocks[0], layer=0)   # memoryview into the shared slab
            ...
            r.publish(tokens)

Host slabs arrive as file descriptors over the side socket (SCM_RIGHTS) and are mapped with mmap;
CUDA slabs are not mapped by this module yet (use the C++ client).
"""
from .client import Client, KvdError, Request  # noqa: F401
