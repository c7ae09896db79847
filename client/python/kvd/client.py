"""A small pythonic layer over the generated kvd.v1 stubs (see __init__.py)."""
import mmap
import os
import sys
import queue
import socket
import struct
import threading
import time

import grpc

from . import cuda
from .errors import KvdError, KvdRestarted, KvdUnavailable  # noqa: F401 (also kvd.client's)
from .step import IN_FLIGHT_WAITS, GroupTable, InFlight, StepBatch, StepRequest, Stepper, _state_checkpoints, _swap_kept_slots
from .v1 import kvd_pb2, kvd_pb2_grpc

try:  # optional: numpy views of the slabs
    import numpy
except ImportError:  # pragma: no cover - numpy is optional
    numpy = None




def default_target():
    """Where kvd listens when nothing says otherwise (the daemon and kvdctl agree): $KVD_TARGET,
    else unix:///run/kvd/kvd.sock as root, else $XDG_RUNTIME_DIR/kvd/kvd.sock, else
    /tmp/kvd-<uid>/kvd.sock."""
    if os.environ.get("KVD_TARGET"):
        return os.environ["KVD_TARGET"]
    if os.geteuid() == 0:
        return "unix:///run/kvd/kvd.sock"
    if os.environ.get("XDG_RUNTIME_DIR"):
        return f"unix://{os.environ['XDG_RUNTIME_DIR']}/kvd/kvd.sock"
    return f"unix:///tmp/kvd-{os.geteuid()}/kvd.sock"


def _call(fn, req, timeout=30):
    try:
        return fn(req, timeout=timeout)
    except grpc.RpcError as e:  # pylint: disable=no-member
        raise KvdError(e.code(), e.details()) from None


def _send_frame(sock, payload: bytes):
    sock.sendall(struct.pack("=I", len(payload)) + payload)


def _recv_exact(sock, n):
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise KvdError(grpc.StatusCode.UNAVAILABLE, "side socket closed")
        out += chunk
    return out


def _recv_frame(sock, max_fds):
    head, fds, _, _ = socket.recv_fds(sock, 4, max(max_fds, 1))
    head += _recv_exact(sock, 4 - len(head))
    (length,) = struct.unpack("=I", head)
    return _recv_exact(sock, length), fds


class _CudaArray:
    """The first `nbytes` of a mapped CUDA slab as __cuda_array_interface__ (version 3, bytes), for
    torch.as_tensor. kvd synchronizes nothing here: stream ordering across processes is the
    publisher events' job (docs/api.md)."""

    def __init__(self, slab, nbytes):
        if nbytes > slab.size:
            raise ValueError(f"{nbytes} bytes do not fit the {slab.size}-byte slab")
        self.slab = slab  # keeps the mapping referenced while the tensor is built
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (slab.ptr, False),
                                         "version": 3, "strides": None}


class Pool:
    """A pool's geometry and, per shard, its slab: an mmap (host backend) or a DeviceSlab (CUDA)."""

    def __init__(self, info):
        self.id = info.pool_id
        self.name = info.name
        self.block_tokens = info.block_tokens
        self.num_layers = info.num_layers
        self.bytes_per_token_per_layer = info.bytes_per_token_per_layer
        self.capacity_blocks = info.capacity_blocks
        self.max_model_len = info.max_model_len
        self.layer_major = info.layout == kvd_pb2.LAYOUT_LAYER_MAJOR
        self.layer_block_bytes = info.layer_block_bytes
        # The declared format (empty / 0 when the operator declared none): see PoolInfo.
        self.dtype = info.dtype
        self.kv_heads = info.kv_heads
        self.head_dim = info.head_dim
        self.kv_arrangement = info.kv_arrangement
        # KV groups of a hybrid pool (docs/hybrid.md), in order; empty for a pool without groups.
        # Tables carry pool-wide indices: group g owns [first_block, first_block + capacity).
        self.groups = list(info.groups)
        self.step_tokens = info.step_tokens  # hybrid pools: most tokens computed between two reports
        self.slab_sizes = [s.size_bytes for s in info.slabs]
        self.slabs = list(info.slabs)
        self.maps = [None] * len(info.slabs)     # host: mmap per shard
        self.devices = [None] * len(info.slabs)  # cuda: DeviceSlab per shard

    def geometry_key(self):
        """What an engine's kernels assume of this pool; equal across a kvd restart or the pool
        changed under the engine."""
        return (self.name, self.block_tokens, self.num_layers, self.bytes_per_token_per_layer,
                self.capacity_blocks, self.layer_major, tuple(self.slab_sizes))

    def token_shape(self):
        """What one token of one layer holds under the declared arrangement, e.g. (2, heads, dim)
        for token_kv_head_dim; None when the pool declares no arrangement."""
        if self.kv_arrangement == "token_kv_head_dim":
            return (2, self.kv_heads, self.head_dim)
        if self.kv_arrangement == "token_latent":
            return (self.kv_heads, self.head_dim)
        return None

    def group(self, name):
        """The GroupInfo of KV group `name` (KeyError when the pool has none of that name)."""
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(f"pool {self.name} has no KV group '{name}'")

    def group_index(self, group, index):
        """The group-local index of pool-wide `index` (what kv_tensor(pool, group=...) is indexed
        by): index - first_block. IndexError when the index is not the group's."""
        g = self.group(group)
        if not g.first_block <= index < g.first_block + g.capacity:
            raise IndexError(f"index {index} is not in group {group} [{g.first_block}, {g.first_block + g.capacity})")
        return index - g.first_block

    def offset(self, block, layer):
        """Byte offset of `layer` of `block` in a slab (gpu/slab_layout.h)."""
        if not (0 <= block < self.capacity_blocks and 0 <= layer < self.num_layers):
            raise IndexError(f"block {block} / layer {layer} out of range")
        for g in self.groups:  # a hybrid pool: the block's group's region, layer-major in it
            if g.first_block <= block < g.first_block + g.capacity:
                if layer not in g.layers:
                    raise IndexError(f"layer {layer} is not in group {g.name} of block {block}")
                j = list(g.layers).index(layer)
                return g.region_offset_bytes + (j * g.capacity + block - g.first_block) * g.layer_unit_bytes
        if self.layer_major:
            return (layer * self.capacity_blocks + block) * self.layer_block_bytes
        return (block * self.num_layers + layer) * self.layer_block_bytes


class Request:
    """An acquired request; as a context manager it releases itself (interrupted on exception)."""

    def __init__(self, client, request_id, resp):
        self._client = client
        self.id = request_id
        self.pool_id = resp.pool_id
        self.pool = client.pool(resp.pool_id).name  # the name, like the argument request() took
        self.blocks = list(resp.blocks)
        self.num_tokens = resp.num_tokens
        self.cached_tokens = resp.cached_tokens
        self.resumed = resp.resumed
        self.resumed_tokens = list(resp.resumed_tokens)
        self.engine_state = resp.engine_state
        # Hybrid pools (docs/hybrid.md §2.4): one GroupTable per KV group, in the pool's group order,
        # with pool-wide indices (Pool.group_index gives the group's tensor index); a window group's
        # blocks[i] holds block position first_block_position + i. Empty for pools without groups.
        # A hit on a hybrid pool: a state group's table has checkpoint_slot (the state at
        # cached_tokens); full_hit_tokens and limited_by say what shortened the hit.
        self.group_tables = [GroupTable.from_proto(t) for t in resp.group_tables]
        self.full_hit_tokens = resp.full_hit_tokens
        self.limited_by = resp.limited_by or None
        # Blocks in flight (kvd.step.InFlight, or None): what the lookup stopped at, blocks another
        # live request of the namespace computes now (this one computes them too). Client.request
        # also sets in_flight_seen (what it found before waiting), in_flight_wait and
        # in_flight_waited_s when it asked to wait for them (wait_in_flight_s).
        self.in_flight = InFlight.from_proto(resp)
        self.in_flight_seen = None
        self.in_flight_wait = "not_waited"
        self.in_flight_waited_s = 0.0
        self._released = False
        self._epoch = client.epoch

    def group_table(self, name):
        """The GroupTable of group `name`; None when the pool has no such group."""
        return next((t for t in self.group_tables if t.name == name), None)

    def may_write(self):
        """Whether this request's blocks may be written now: its attachment is the client's current
        one and the lease is held. Never True again once the client re-attached since it started."""
        return self._client.may_write(self._epoch)

    def _call(self, method, req):
        """One RPC for this request; KvdRestarted once kvd has restarted since it started."""
        if self._client.epoch != self._epoch:
            raise KvdRestarted(self.id)
        try:
            return self._client._rpc(method, req)
        except KvdError as e:
            if self._client._lost(e, self._epoch):
                raise KvdRestarted(self.id) from None
            raise

    def extend(self, n, computed_tokens=0):
        """`n` more positions. Hybrid pools: a grow step that also reports `computed_tokens`, the
        engine's computed tokens after the step that just ran (0: unchanged); kvd releases each
        window group's blocks wholly below computed - (W - 1), and group_tables drop them and gain
        the new ones. KvdError INVALID_ARGUMENT, changing nothing, when it goes back below the last
        report or past num_tokens + n. Ignored on pools without groups."""
        if self.group_tables:
            return self._extend_groups(n, computed_tokens)
        resp = self._call("Extend", kvd_pb2.ExtendRequest(
            worker_id=self._client.worker_id, request_id=self.id, additional_tokens=n))
        self.blocks += list(resp.new_blocks)
        self.num_tokens += n

    def _extend_groups(self, n, computed_tokens):
        # The Extend RPC answers the flat table only: the per-group tables come with a step.
        if self._client.epoch != self._epoch:
            raise KvdRestarted(self.id)
        s = StepRequest(self.id)
        s.pool_id, s.blocks, s.num_tokens, s.group_tables = self.pool_id, self.blocks, self.num_tokens, self.group_tables
        s.live, s.epoch = True, self._epoch
        batch = StepBatch().grow(s, n, computed_tokens=computed_tokens)
        batch.ask_credit = False  # a Request places nothing from credit: it asks for none
        try:
            result = self._client.step(batch)[0]
        except KvdError as e:
            if self._client._lost(e, self._epoch):
                raise KvdRestarted(self.id) from None
            raise
        if not result.ok:
            raise KvdError(result.code, result.message)
        self.blocks, self.num_tokens, self.group_tables = s.blocks, s.num_tokens, s.group_tables

    def publish(self, tokens, state_checkpoints=()):
        """Publishes every full block `tokens` cover. Hybrid pools: `state_checkpoints`, tuples
        (group index, position_tokens, slot) of this request's state slots (docs/hybrid.md §2.7);
        the response has one checkpoint_outcomes entry each, and a kept slot is replaced in its
        table by the fresh spare kvd handed out (fresh_slots)."""
        self._client._await_writes()
        bt = self._client.pool(self.pool_id).block_tokens
        full = min(len(tokens) // bt, len(self.blocks))
        resp = self._call("Publish", kvd_pb2.PublishRequest(
            worker_id=self._client.worker_id, request_id=self.id, tokens=tokens, blocks=self.blocks[:full],
            state_checkpoints=_state_checkpoints(state_checkpoints)))
        _swap_kept_slots(self.group_tables, list(state_checkpoints), resp.checkpoint_outcomes, resp.fresh_slots)
        return resp

    def checkpoint(self, tokens, engine_state=b"", state_checkpoints=()):
        """A generation checkpoint of `tokens`. Hybrid pools with a state group:
        `state_checkpoints`, (group index, len(tokens), slot) per state group; the record keeps
        the slot and the fresh spare kvd hands out takes its place in the state table."""
        self._client._await_writes()
        resp = self._call("Checkpoint", kvd_pb2.CheckpointRequest(
            worker_id=self._client.worker_id, request_id=self.id, tokens=tokens, engine_state=engine_state,
            state_checkpoints=_state_checkpoints(state_checkpoints)))
        _swap_kept_slots(self.group_tables, list(state_checkpoints), [kvd_pb2.CHECKPOINT_KEPT] * len(state_checkpoints),
                         resp.fresh_slots)
        return resp

    def end(self, publish_blocks=0, more_tokens=(), completed=True, state_checkpoints=()):
        """Publishes the first `publish_blocks` blocks and releases, in one round trip (the daemon
        has the prompt; `more_tokens` are generated tokens past what it knows). Returns the
        EndResponse (kept, already_cached, duplicates, no_parent)."""
        if publish_blocks or state_checkpoints:
            self._client._await_writes()
        resp = self._call("End", kvd_pb2.EndRequest(
            worker_id=self._client.worker_id, request_id=self.id, publish_blocks=publish_blocks,
            more_tokens=list(more_tokens), completed=completed,
            state_checkpoints=_state_checkpoints(state_checkpoints)))
        self._released = True
        return resp

    def release(self, completed=True):
        if not self._released:
            self._released = True
            self._call("Release", kvd_pb2.ReleaseRequest(
                worker_id=self._client.worker_id, request_id=self.id, completed=completed))

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            self.release(completed=exc_type is None)
        except KvdRestarted:
            if exc_type is None:
                raise  # the body finished, but kvd lost the request: the engine must know


class Client:
    """Attaches to kvd (with a background heartbeat), lists pools and maps host slabs once."""

    # A step that needs no round trip is placed while a submitted one is in flight (kvd.step).
    steps_while_in_flight = True

    def __init__(self, target=None, worker_name="python", map_slabs=True, heartbeat_s=1.0, cuda_runtime=None,
                 expect=(), on_remap=None, connect_timeout_s=5.0, step_credit_blocks=128, on_lease_lost=None,
                 no_async_writes=False, step_lane=True):
        """`target`: kvd's address; None means default_target() ($KVD_TARGET, else kvd's default
        socket for this user).

        `expect`: dicts of kvd_pb2.PoolExpectation fields ({"pool": "llama", "dtype": "bfloat16",
        "kv_heads": 8, ...}); the daemon refuses to attach (FAILED_PRECONDITION, KvdError) when a
        pool differs, so the worker never reads KV laid out for another model. A hybrid pool's
        expectation lists its KV groups, in order: "groups": [{"name": "full", "kind": "full"},
        {"name": "swa", "kind": "sliding_window", "window": 128}, ...] (GroupInfo fields); such a
        pool refuses a worker declaring none or other groups.

        Riding through kvd restarts: when the attach stream ends, a background thread re-attaches
        under the same worker name (back-off 50 ms doubling to 2 s) and compares the slabs kvd
        lists with its mappings: the same memfd inodes keep every mapping; new memory is mapped,
        `on_remap()` is called (the engine's KV arrays moved), then the old maps are closed.
        Requests live at the restart raise KvdRestarted; request() waits for the re-attachment
        within its wait_s. `epoch` counts attachments from 1; `attached` is an Event.

        KvdUnavailable (a KvdError) when nothing answers at `target` within connect_timeout_s.

        `step_credit_blocks`: block credit asked for per pool used in steps (kvd.step; 0: none).
        `step_lane`: steps go over a lane on kvd's side socket (docs/api.md, "The step lane"), by
        gRPC where kvd opens none; False: always by gRPC.

        Leases (docs/security.md, "Leases and fencing"): every heartbeat carries a sequence number
        and kvd acknowledges it once it renewed the lease; `may_write()` is True until half a lease
        past the sending of the last acknowledged heartbeat. An engine checks it before writing
        into kvd's memory. When the attach stream ends, the client quiesces before it re-attaches:
        may_write() turns False, the write fences run (add_write_fence) and then `on_lease_lost()`,
        the engine's hook that stops its writes and waits for those in flight. The re-attach names
        the lost attachment and says `quiesced` only when the engine vouched for its writes: it
        passed `on_lease_lost`, or `no_async_writes=True` (it never writes kvd's memory from
        another thread or stream). kvd then hands on at once what it fenced for that attachment;
        otherwise it keeps it fenced for a lease TTL. `may_write(epoch)` (and Request.may_write())
        is never True again for a request of an earlier attachment."""
        self.target = target = target or default_target()
        self.rpc_seconds = 0.0  # wall time spent in unary RPCs, for the engine benchmark
        self.rpc_calls = 0
        # A first attach lifts nothing: fences belong to the attachment that held the blocks.
        self._hello = kvd_pb2.AttachRequest(hello=kvd_pb2.Hello(
            worker_name=worker_name, pid=os.getpid(), quiesced=False,
            expect_pools=[kvd_pb2.PoolExpectation(**e) for e in expect]))
        self._on_lease_lost = on_lease_lost
        self._vouches = on_lease_lost is not None or no_async_writes
        self._lease_lock = threading.Lock()
        self._lease_ttl_s = 10.0
        self._may_write_until = 0.0   # time.monotonic(); 0: the lease is lost
        self._write_epoch = 1         # the attachment that lease is for (set with it, under the lock)
        # (_write_epoch, _may_write_until) as one tuple, replaced under the lock at every change of
        # either: may_write() reads it without the lock (one attribute read is atomic), since an
        # engine asks before every write.
        self._lease = (1, 0.0)
        self._beats = {}              # heartbeat seq -> monotonic time sent
        self._next_seq = 1
        self._map = map_slabs
        self._stepper = Stepper(self, step_credit_blocks)
        self.step_lane = step_lane
        self.side_socket = ""  # this attachment's side socket (slab fds, the step lane)
        self._step_lock = threading.Lock()
        self._cuda_runtime = cuda_runtime
        self._on_remap = on_remap
        self._fences = []
        self._fences_lock = threading.Lock()
        self._closed = threading.Event()
        self.attached = threading.Event()
        self.epoch = 1
        self.detached_reason = ""
        self._channel = grpc.insecure_channel(target)
        try:
            grpc.channel_ready_future(self._channel).result(timeout=connect_timeout_s)
        except grpc.FutureTimeoutError:
            self._channel.close()
            raise KvdUnavailable(target, connect_timeout_s) from None
        self._stub = kvd_pb2_grpc.KvdStub(self._channel)
        try:
            heartbeat_s = self._attach_first(heartbeat_s, map_slabs, cuda_runtime)
        except BaseException:
            # A refused or failed attach leaves no channel behind: an unclosed gRPC channel with an
            # ended stream can hang the interpreter's exit (grpc/grpc#6666, #17214).
            self._closed.set()
            self._channel.close()
            raise
        self._beat = threading.Thread(target=self._heartbeat, args=(heartbeat_s,), daemon=True)
        self._beat.start()
        self._supervisor = threading.Thread(target=self._supervise, daemon=True)
        self._supervisor.start()

    def _attach_first(self, heartbeat_s, map_slabs, cuda_runtime):
        """The first attach: worker id, pools and slab mappings (KvdError if kvd refuses); returns the
        heartbeat period, shortened to a third of kvd's lease."""
        attached = self._open_stream()
        self.worker_id = attached.worker_id
        self.backend = attached.backend
        if attached.lease_ttl_ms > 0:  # beat at least four times per lease (writes stop at half)
            heartbeat_s = min(heartbeat_s, attached.lease_ttl_ms / 4000.0)
        self.pools = [Pool(p) for p in self._rpc("ListPools", kvd_pb2.ListPoolsRequest()).pools]
        self._identities = []
        self._side = (attached.side_socket, attached.slab_token)  # for VMM slab fds (CUDA)
        self.side_socket = attached.side_socket
        if map_slabs and self.backend == "host":
            self._identities = self._map_slabs(self.pools, attached.side_socket, attached.slab_token)
        elif map_slabs and self.backend == "cuda":
            self.map_cuda_slabs(cuda_runtime)
        self.attached.set()
        return heartbeat_s

    def may_write(self, epoch=None):
        """Whether this process may write into kvd's memory now: it holds a lease kvd acknowledged
        less than half a lease ago. With `epoch` (a request's attachment), only for writes of that
        attachment: False for good once the client has re-attached since."""
        write_epoch, until = self._lease
        if epoch is not None and epoch != write_epoch:
            return False
        return until != 0.0 and time.monotonic() < until

    def _lease_proven_at(self, sent):
        with self._lease_lock:
            until = sent + self._lease_ttl_s / 2
            if self._may_write_until != 0.0 and until > self._may_write_until:
                self._may_write_until = until
                self._lease = (self._write_epoch, until)

    def _on_ack(self, seq):
        with self._lease_lock:
            sent = self._beats.get(seq)
            if sent is None:
                return
            self._beats = {k: v for k, v in self._beats.items() if k > seq}
        self._lease_proven_at(sent)

    def _quiesce(self):
        """Stops every write into kvd's memory and waits for those in flight (fences, then the
        engine's hook) before the client may re-attach."""
        with self._lease_lock:
            self._may_write_until = 0.0
            self._lease = (self._write_epoch, 0.0)
            self._beats = {}
        try:
            self._await_writes()
        except Exception:  # a failed wait still ends what it waited for
            pass
        if self._on_lease_lost is not None:
            self._on_lease_lost()

    def _open_stream(self, epoch=1):
        """A new attach stream on the current channel; the Attached reply (KvdError if refused).
        Its lease is for attachment `epoch`: writes of earlier ones stay refused."""
        self._outbox = queue.Queue()
        self._outbox.put(self._hello)
        sent = time.monotonic()
        self._stream = self._stub.Attach(self._requests(self._outbox))
        try:
            attached = next(self._stream).attached
            if attached.lease_ttl_ms > 0:
                self._lease_ttl_s = attached.lease_ttl_ms / 1000.0
            with self._lease_lock:  # kvd renewed the lease no earlier than the hello's sending
                self._write_epoch = epoch
                self._may_write_until = sent + self._lease_ttl_s / 2
                self._lease = (epoch, self._may_write_until)
            return attached
        except (grpc.RpcError, StopIteration) as e:
            self._outbox.put(None)
            code = e.code() if isinstance(e, grpc.RpcError) else grpc.StatusCode.UNAVAILABLE
            raise KvdError(code, e.details() if isinstance(e, grpc.RpcError) else "attach stream closed") from None

    def _supervise(self):
        while not self._closed.is_set():
            try:
                for resp in self._stream:  # heartbeat acks, until kvd goes away
                    if resp.HasField("heartbeat_ack"):
                        self._on_ack(resp.heartbeat_ack.seq)
            except grpc.RpcError:
                pass
            if self._closed.is_set():
                return
            self.attached.clear()
            self._quiesce()
            # The re-attach names the lost attachment; `quiesced` only when the engine vouched.
            self._hello.hello.previous_worker_id = self.worker_id
            self._hello.hello.quiesced = self._vouches
            self.detached_reason = "kvd went away; reconnecting"
            backoff = 0.05
            while not self._closed.is_set():
                try:
                    self._reattach()
                    break
                except (KvdError, grpc.FutureTimeoutError, OSError) as e:
                    self.detached_reason = f"kvd restarting; re-attaching failed: {e}"
                    self._closed.wait(backoff)
                    backoff = min(backoff * 2, 2.0)

    def _reattach(self):
        self._outbox.put(None)  # ends the old stream's request iterator
        # A fresh channel: one that saw kvd go away fails fast for its own back-off after kvd is back.
        # Its stub replaces the old one before the old channel closes, so a call racing this sees
        # one or the other (a closed one's ValueError becomes UNAVAILABLE in _rpc).
        channel = grpc.insecure_channel(self.target)
        try:
            grpc.channel_ready_future(channel).result(timeout=1)
        except grpc.FutureTimeoutError:
            channel.close()
            raise
        old_channel = self._channel
        self._channel, self._stub = channel, kvd_pb2_grpc.KvdStub(channel)
        old_channel.close()
        attached = self._open_stream(self.epoch + 1)
        pools = [Pool(p) for p in self._rpc("ListPools", kvd_pb2.ListPoolsRequest()).pools]
        if attached.backend != self.backend or [p.geometry_key() for p in pools] != [p.geometry_key() for p in self.pools]:
            self._outbox.put(None)
            with self._lease_lock:
                self._may_write_until = 0.0
                self._lease = (self._write_epoch, 0.0)
            raise KvdError(grpc.StatusCode.FAILED_PRECONDITION,
                           "kvd came back with different pools or backend; connect anew")
        self.side_socket = attached.side_socket
        moved = False
        if self._map and self.backend == "host":
            identities = self._map_slabs(pools, attached.side_socket, attached.slab_token)
            if identities != self._identities:
                old = [(p, list(p.maps)) for p in self.pools]
                for mine, fresh in zip(self.pools, pools):
                    mine.maps = fresh.maps
                self._identities = identities
                moved = True
            else:
                for p in pools:
                    for m in p.maps:
                        if m is not None:
                            m.close()
        elif self._map and self.backend == "cuda":
            self._side = (attached.side_socket, attached.slab_token)
            # The same memory: the same IPC handles, or (VMM) the same allocations by memory_id.
            ident = lambda ps: [(s.allocator, s.memory_id if s.allocator == "vmm" else s.cuda_ipc_handle)  # noqa: E731
                                for p in ps for s in p.slabs]
            if ident(pools) != ident(self.pools):
                old = [(p, list(p.devices)) for p in self.pools]
                for mine, fresh in zip(self.pools, pools):
                    mine.slabs, mine.devices = fresh.slabs, [None] * len(fresh.slabs)
                self.map_cuda_slabs(self._cuda_runtime)
                moved = True
        if moved and self._on_remap is not None:
            self._on_remap()
        if moved:
            for _, maps in old:
                for m in maps:
                    if m is not None:
                        try:
                            m.close()
                        except BufferError:  # a caller still holds a view; unmapped at exit
                            pass
        self.worker_id = attached.worker_id
        self.epoch += 1
        self.detached_reason = ""
        self.attached.set()

    def _lost(self, error, epoch):
        """Whether `error`, from a call of a request of attachment `epoch`, means kvd restarted."""
        maybe_gone = error.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED) or (
            error.code == grpc.StatusCode.FAILED_PRECONDITION and "not attached" in error.details)
        if maybe_gone and self.epoch == epoch and self.attached.is_set():
            deadline = time.monotonic() + 0.5  # the supervisor sees the stream end a moment later
            while self.attached.is_set() and self.epoch == epoch and time.monotonic() < deadline:
                time.sleep(0.01)
        return self.epoch != epoch or not self.attached.is_set()

    def wait_attached(self, timeout):
        """Blocks until attached; KvdError UNAVAILABLE with the last reason after `timeout` s."""
        if not self.attached.wait(timeout):
            raise KvdError(grpc.StatusCode.UNAVAILABLE,
                           f"not attached to kvd at {self.target}: {self.detached_reason}")

    def add_write_fence(self, wait):
        """Publish is host-synchronized (docs/api.md): kvd may copy a block as soon as its publish
        arrives. `wait()` is called, once, before the next publish, checkpoint or end that
        publishes, and must return when the engine's writes issued so far are complete (e.g.
        `torch.cuda.current_stream().synchronize`). On the CUDA backend, with no fence added,
        the client synchronizes the current PyTorch device if torch is loaded."""
        with self._fences_lock:
            self._fences.append(wait)

    def _await_writes(self):
        with self._fences_lock:
            pending, self._fences = self._fences, []
        for wait in pending:
            wait()
        if not pending and self.backend == "cuda" and "torch" in sys.modules:
            torch = sys.modules["torch"]
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()

    def map_cuda_slabs(self, runtime=None, ranks=None, driver=None):
        """Maps each slab (of shards `ranks`, default all) once: pools[i].devices[shard] becomes a
        DeviceSlab (device pointer + size). allocator ipc: its IPC handle; allocator vmm: its fd,
        fetched through the side socket (the attachment's one-time token: the first call that
        needs fds takes them all)."""
        runtime = runtime or cuda.CudaRuntime()
        wanted = [(p, shard, info) for p in self.pools for shard, info in enumerate(p.slabs)
                  if (ranks is None or shard in ranks) and p.devices[shard] is None]
        fds = {}
        if any(info.allocator == "vmm" for _, _, info in wanted) and self._side is not None:
            side, self._side = self._side, None  # the token redeems once
            fds = {(pool, shard): fd for pool, shard, _, fd in self._receive_slab_fds(*side)}
        try:
            for p, shard, info in wanted:
                p.devices[shard] = cuda.map_slab(runtime, info, fd=fds.get((p.id, shard)), driver=driver)
        finally:
            for fd in fds.values():
                os.close(fd)

    @staticmethod
    def _requests(outbox):
        while True:
            msg = outbox.get()
            if msg is None:
                return
            yield msg

    def _heartbeat(self, period):
        while not self._closed.wait(period):
            with self._lease_lock:
                seq = self._next_seq
                self._next_seq += 1
                self._beats[seq] = time.monotonic()
                if len(self._beats) > 64:  # unanswered ones prove nothing anyway
                    self._beats.pop(min(self._beats))
            self._outbox.put(kvd_pb2.AttachRequest(heartbeat=kvd_pb2.Heartbeat(seq=seq)))

    @staticmethod
    def _receive_slab_fds(path, token):
        """Every slab fd the side socket passes for the one-time `token`: (pool, shard, size, fd)."""
        out = []
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(path)
            _send_frame(sock, token.encode())
            greeting, _ = _recv_frame(sock, 0)
            if not greeting.startswith(b"OK "):
                raise KvdError(grpc.StatusCode.PERMISSION_DENIED, greeting.decode(errors="replace"))
            for _ in range(int(greeting[3:])):
                payload, fds = _recv_frame(sock, 1)
                pool, shard, size = (int(x) for x in payload.split())
                out.append((pool, shard, size, fds[0]))
        return out

    @staticmethod
    def _map_slabs(pools, path, token):
        """Maps every slab the side socket passes into pools[i].maps; returns their identities
        ((st_dev, st_ino) of each memfd, in order)."""
        identities = []
        for pool, shard, size, fd in Client._receive_slab_fds(path, token):
            st = os.fstat(fd)
            identities.append((pool, shard, st.st_dev, st.st_ino))
            pools[pool].maps[shard] = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            os.close(fd)
        return identities

    def _rpc(self, method, req, timeout=30):
        start = time.perf_counter()
        try:
            return _call(getattr(self._stub, method), req, timeout)
        except ValueError as e:  # a stub whose channel a re-attach closed under the call
            if "closed channel" not in str(e):
                raise
            raise KvdError(grpc.StatusCode.UNAVAILABLE, "kvd's channel closed by a re-attach") from None
        finally:
            self.rpc_seconds += time.perf_counter() - start
            self.rpc_calls += 1

    def pool(self, pool):
        """The Pool named `pool` (or with that id)."""
        if isinstance(pool, str):
            for p in self.pools:
                if p.name == pool:
                    return p
            raise KvdError(grpc.StatusCode.NOT_FOUND, f"no pool '{pool}'")
        return self.pools[pool]

    def layer_view(self, pool, block, layer, shard=0):
        """A writable memoryview of `layer` of `block`: block_tokens * bytes_per_token_per_layer bytes
        (in a hybrid pool: the block's group's unit; `block` is pool-wide, `layer` a model layer)."""
        p = self.pool(pool)
        if p.maps[shard] is None:
            raise KvdError(grpc.StatusCode.FAILED_PRECONDITION, f"shard {shard} of pool {pool} is not mapped")
        start = p.offset(block, layer)
        size = next((g.layer_unit_bytes for g in p.groups if g.first_block <= block < g.first_block + g.capacity),
                    p.layer_block_bytes)
        return memoryview(p.maps[shard])[start:start + size]

    def layer_address(self, pool, block, layer, shard=0):
        """Device address of `layer` of `block` in a mapped CUDA slab."""
        p = self.pool(pool)
        if p.devices[shard] is None:
            raise KvdError(grpc.StatusCode.FAILED_PRECONDITION, f"shard {shard} of pool {pool} is not mapped on a GPU")
        return p.devices[shard].address(p.offset(block, layer))

    def slab_array(self, pool, shard=0):
        """The whole host slab as a numpy uint8 array shaped (layers, blocks, bytes) for layer-major
        pools or (blocks, layers, bytes) for block-major ones. Needs numpy; no copy."""
        if numpy is None:
            raise ImportError("numpy is not installed (apt-get install python3-numpy)")
        p = self.pool(pool)
        if p.maps[shard] is None:
            raise KvdError(grpc.StatusCode.FAILED_PRECONDITION, f"shard {shard} of pool {pool} is not mapped")
        used = p.capacity_blocks * p.num_layers * p.layer_block_bytes
        flat = numpy.frombuffer(p.maps[shard], dtype=numpy.uint8, count=used)
        if p.layer_major:
            return flat.reshape(p.num_layers, p.capacity_blocks, p.layer_block_bytes)
        return flat.reshape(p.capacity_blocks, p.num_layers, p.layer_block_bytes)

    def kv_tensor(self, pool, dtype=None, inner_shape=None, shard=0, group=None):
        """The whole host slab as a torch tensor view [layers][blocks][block_tokens][*inner_shape]
        of `dtype`, whatever the pool's layout (a block-major slab comes back permuted, still a
        view). `inner_shape` is what one token of one layer holds, e.g. (2, kv_heads, head_dim)
        for K and V: its bytes must equal the pool's bytes_per_token_per_layer, else ValueError.
        Both default to the pool's declared format (ValueError when it declares none).
        On the CUDA backend the view is a CUDA tensor over the mapped slab (__cuda_array_interface__).
        No copy: writes land in kvd's memory. Needs torch.
        A hybrid pool needs `group` (a KV group's name): the view is that group's region,
        [group layers][capacity][block_tokens][*inner_shape] for attention groups and
        [group layers][slots][*inner_shape] for a state group (inner_shape default: the state's
        bytes in `dtype`), indexed by the group-local index (Pool.group_index)."""
        import torch
        p = self.pool(pool)
        if group is not None or p.groups:
            return self._group_tensor(p, group, dtype, inner_shape, shard)
        if dtype is None:
            if not p.dtype:
                raise ValueError(f"pool {p.name} declares no dtype: pass one")
            dtype = getattr(torch, p.dtype)
        if inner_shape is None:
            inner_shape = p.token_shape()
            if inner_shape is None:
                raise ValueError(f"pool {p.name} declares no token-major arrangement: pass inner_shape")
        if p.maps[shard] is None and p.devices[shard] is None:
            raise KvdError(grpc.StatusCode.FAILED_PRECONDITION, f"shard {shard} of pool {p.name} is not mapped")
        itemsize = torch.empty((), dtype=dtype).element_size()
        per_token = itemsize
        for d in inner_shape:
            per_token *= d
        if per_token != p.bytes_per_token_per_layer:
            raise ValueError(f"pool {p.name} holds {p.bytes_per_token_per_layer} bytes per token and layer; "
                             f"{tuple(inner_shape)} of {dtype} is {per_token}")
        count = p.capacity_blocks * p.num_layers * p.layer_block_bytes // itemsize
        if p.maps[shard] is not None:
            # Through numpy, which holds an export of the mmap: while the tensor (or a view of it)
            # lives, the mapping cannot be closed under it (a remap or close() leaves it mapped).
            # torch.frombuffer holds no export.
            if numpy is None:
                raise ValueError("kv_tensor over host slabs needs numpy (it keeps the mapping alive)")
            held = numpy.frombuffer(p.maps[shard], dtype=numpy.uint8, count=count * itemsize)
            flat = torch.from_numpy(held).view(dtype)
        else:
            raw = torch.as_tensor(_CudaArray(p.devices[shard], count * itemsize),
                                  device=f"cuda:{p.devices[shard].device}")
            flat = raw.view(dtype)  # bytes reinterpreted: bfloat16 has no array-interface type string
        if p.layer_major:
            return flat.view(p.num_layers, p.capacity_blocks, p.block_tokens, *inner_shape)
        return flat.view(p.capacity_blocks, p.num_layers, p.block_tokens, *inner_shape).transpose(0, 1)

    def _group_tensor(self, p, group, dtype, inner_shape, shard):
        import torch
        if group is None:
            raise ValueError(f"pool {p.name} has KV groups ({', '.join(g.name for g in p.groups)}): pass group=")
        g = p.group(group)
        state = g.kind == "state"
        if dtype is None:
            if not p.dtype and not state:
                raise ValueError(f"pool {p.name} declares no dtype: pass one")
            dtype = getattr(torch, p.dtype) if p.dtype and not state else torch.uint8
        itemsize = torch.empty((), dtype=dtype).element_size()
        unit = g.bytes_per_state if state else g.bytes_per_token
        if inner_shape is None:
            inner_shape = (unit // itemsize,) if state else p.token_shape()
            if inner_shape is None:
                raise ValueError(f"pool {p.name} declares no token-major arrangement: pass inner_shape")
        per = itemsize
        for d in inner_shape:
            per *= d
        if per != unit:
            what = "bytes per state" if state else "bytes per token and layer"
            raise ValueError(f"group {group} of pool {p.name} holds {unit} {what}; {tuple(inner_shape)} of {dtype} is {per}")
        if p.maps[shard] is None and p.devices[shard] is None:
            raise KvdError(grpc.StatusCode.FAILED_PRECONDITION, f"shard {shard} of pool {p.name} is not mapped")
        nbytes = len(g.layers) * g.capacity * g.layer_unit_bytes
        if p.maps[shard] is not None:
            if numpy is None:
                raise ValueError("kv_tensor over host slabs needs numpy (it keeps the mapping alive)")
            held = numpy.frombuffer(p.maps[shard], dtype=numpy.uint8, count=nbytes, offset=g.region_offset_bytes)
            flat = torch.from_numpy(held).view(dtype)
        else:
            raw = torch.as_tensor(_CudaArray(p.devices[shard], g.region_offset_bytes + nbytes),
                                  device=f"cuda:{p.devices[shard].device}")
            flat = raw[g.region_offset_bytes:].view(dtype)
        if state:
            return flat.view(len(g.layers), g.capacity, *inner_shape)
        return flat.view(len(g.layers), g.capacity, p.block_tokens, *inner_shape)

    def block_array(self, pool, block, shard=0):
        """One block's KV as a numpy array (layers, block_tokens, bytes_per_token_per_layer): a view."""
        p = self.pool(pool)
        slab = self.slab_array(pool, shard)
        per_layer = slab[:, block, :] if p.layer_major else slab[block]
        return per_layer.reshape(p.num_layers, p.block_tokens, -1)

    def request(self, request_id, pool, prompt, max_new_tokens=0, session="", resume_from="", cache_salt="",
                adapter="", media_keys=(), media=(), wait_s=10.0, peer="", wait_in_flight_s=0.0):
        """Admit (the daemon waits while the budget is full, up to wait_s) and acquire, in one
        round trip (Start): a Request context manager. `media`: (identifier, offset, length) of each
        multimodal item, in prompt order (router events key only the blocks an item overlaps, as
        vLLM does); `media_keys`: identifiers without positions (every block). `peer`: a peer kvd
        (a name in kvd's transfer.peers) whose cached blocks of the prompt kvd pulls first.
        `wait_in_flight_s` > 0: when another live request of the namespace is computing the prompt's
        next blocks, kvd waits up to that long (at most 30 s) for it to publish them (then they are
        a hit), holding nothing meanwhile; it answers early when that request ends without them."""
        ns = kvd_pb2.Namespace(pool=pool, cache_salt=cache_salt, adapter=adapter, media_keys=list(media_keys),
                               media=[kvd_pb2.MediaItem(identifier=i, offset=o, length=n) for i, o, n in media])
        deadline = time.monotonic() + wait_s
        while True:
            # While kvd restarts, a new request waits (within wait_s) for the re-attachment.
            self.wait_attached(max(0.0, deadline - time.monotonic()))
            epoch = self.epoch
            admit = kvd_pb2.AdmitRequest(
                worker_id=self.worker_id, request_id=request_id, namespace=ns,
                prompt=prompt, max_new_tokens=max_new_tokens, session_id=session, resume_from=resume_from)
            left = max(0.001, deadline - time.monotonic())
            # One round trip: the daemon waits for room (first come, first served) up to wait_s, and
            # gives the admission back itself if the Acquire after it fails.
            try:
                start = self._rpc("Start", kvd_pb2.StartRequest(admit=admit, max_wait_ms=max(1, int(left * 1000)), peer=peer,
                                                                wait_for_in_flight_ms=int(wait_in_flight_s * 1000)),
                                  timeout=left + 30 + wait_in_flight_s)
                resp = start.acquired
            except KvdError as e:
                if self._lost(e, epoch) and time.monotonic() < deadline:
                    continue  # kvd went away during the call: start again on the new one
                if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "not admitted within" in e.details:
                    raise KvdError(grpc.StatusCode.DEADLINE_EXCEEDED, f"{request_id} was not admitted in {wait_s}s") from None
                raise
            req = Request(self, request_id, resp)
            req._epoch = epoch
            req.in_flight_seen = InFlight.from_proto(start)
            req.in_flight_wait = IN_FLIGHT_WAITS.get(start.in_flight_wait, "not_waited")
            req.in_flight_waited_s = start.in_flight_waited_us / 1e6
            return req

    def step(self, batch):
        """Applies a StepBatch (kvd.step): a list of StepResult, one per item, in order. One round
        trip, or none when every item is growth the block credit covers. KvdError when the step
        fails as a whole; KvdRestarted when kvd restarted under it."""
        with self._step_lock:
            return self._stepper.step(batch)

    def step_submit(self, batch):
        """Client.step with the round trip left in flight: a kvd.step.StepFuture whose result() is
        the list Client.step returns. What needs no round trip is placed before it returns (growth
        on credit: req.blocks has its blocks), so the engine may compute into blocks it owns while
        kvd answers; the rest (starts, growth past the credit) is known once result() returns. A
        later step that needs no round trip is placed at once, this one still in flight; the first
        that must go out waits for this one's answer first."""
        with self._step_lock:
            return self._stepper.submit(batch)

    def step_flush(self):
        """Sends what steps hold back (growth on credit, publishes and ends given hold_s), if
        anything, after the step in flight; their StepResults get their outcomes. KvdError when
        that step fails as a whole."""
        with self._step_lock:
            f = self._stepper.submit(StepBatch(), overlap=False, force=True)
        if f._error is not None:
            raise f._error

    def step_warm_up(self, pools):
        """Readies this attachment for steps before the first request: opens the step lane and
        takes the block credit of `pools` (names or ids) in one empty step, so the engine's first
        step pays for neither (a fresh lane and credit cost the first step 1-3 ms). KvdError (no
        change) for a pool kvd does not have."""
        batch = StepBatch()
        batch.credit_pools = [self.pool(p).name for p in pools]  # NOT_FOUND names the pool
        self.step(batch)

    def step_credit(self, pool, group=None):
        """Credit blocks held now in `pool` (name or id); on a hybrid pool, in KV group `group` (name
        or index), or in all of them."""
        p = self.pool(pool)
        if isinstance(group, str):
            group = [g.name for g in p.groups].index(p.group(group).name)
        return self._stepper.credit_of(p, group)

    # --- the rest of the contract, typed ---------------------------------------------------------

    @staticmethod
    def namespace(pool, cache_salt="", adapter="", media_keys=(), media=()):
        return kvd_pb2.Namespace(pool=pool, cache_salt=cache_salt, adapter=adapter, media_keys=list(media_keys),
                                 media=[kvd_pb2.MediaItem(identifier=i, offset=o, length=n) for i, o, n in media])

    def admit(self, request_id, pool, prompt, max_new_tokens=0, session="", resume_from="", cache_salt="",
              adapter=""):
        """Reserves the request's KV (Admit): True when admitted, False when the budget is full now."""
        return self._rpc("Admit", kvd_pb2.AdmitRequest(
            worker_id=self.worker_id, request_id=request_id, namespace=self.namespace(pool, cache_salt, adapter),
            prompt=list(prompt), max_new_tokens=max_new_tokens, session_id=session,
            resume_from=resume_from)).admitted

    def acquire(self, request_id):
        """The block table of an admitted request (Acquire): a Request."""
        epoch = self.epoch
        resp = self._rpc("Acquire", kvd_pb2.AcquireRequest(worker_id=self.worker_id, request_id=request_id))
        req = Request(self, request_id, resp)
        req._epoch = epoch
        return req

    def peek_prefix_len(self, pool, tokens, cache_salt="", adapter=""):
        """Tokens a request with this prompt would reuse now; holds nothing."""
        return self._rpc("PeekPrefixLen", kvd_pb2.PeekPrefixLenRequest(
            namespace=self.namespace(pool, cache_salt, adapter), tokens=list(tokens))).cached_tokens

    def prefetch(self, pool, tokens, cache_salt="", adapter=""):
        """Starts reading a prompt's saved blocks up to host memory: the PrefetchResponse (handle)."""
        return self._rpc("Prefetch", kvd_pb2.PrefetchRequest(
            worker_id=self.worker_id, namespace=self.namespace(pool, cache_salt, adapter), tokens=list(tokens)))

    def release_prefetch(self, handle):
        self._rpc("ReleasePrefetch", kvd_pb2.ReleasePrefetchRequest(worker_id=self.worker_id, handle=handle))

    def put_object(self, pool, key, data, cache_salt=""):
        self._rpc("PutObject", kvd_pb2.PutObjectRequest(namespace=self.namespace(pool, cache_salt), key=key, data=data))

    def get_object(self, pool, key, cache_salt=""):
        return self._rpc("GetObject", kvd_pb2.GetObjectRequest(namespace=self.namespace(pool, cache_salt), key=key)).data

    def delete_object(self, pool, key, cache_salt=""):
        self._rpc("DeleteObject", kvd_pb2.DeleteObjectRequest(namespace=self.namespace(pool, cache_salt), key=key))

    def close_session(self, session):
        self._rpc("CloseSession", kvd_pb2.CloseSessionRequest(session_id=session))

    def get_session(self, session):
        return self._rpc("GetSession", kvd_pb2.GetSessionRequest(session_id=session))

    def list_sessions(self):
        return list(self._rpc("ListSessions", kvd_pb2.ListSessionsRequest()).sessions)

    def report(self):
        return self._rpc("Report", kvd_pb2.ReportRequest())

    def flush(self):
        """Makes every cached prefix durable on the disk tier; returns the FlushResponse."""
        return self._rpc("Flush", kvd_pb2.FlushRequest())

    def close(self):
        if not self._closed.is_set() and (self._stepper.ops or self._stepper.inflight is not None):
            try:  # publishes and ends held back go out before the stream ends (best effort)
                self.step_flush()
            except KvdError:
                pass
        with self._step_lock:
            self._stepper.close_lane()
        if not self._closed.is_set():
            self._closed.set()
            self._outbox.put(None)
            # A half-close, which kvd tells from a broken stream (that one it fences): let kvd end
            # the stream before the channel goes.
            if threading.current_thread() is not self._supervisor:
                self._supervisor.join(timeout=2)
            for p in self.pools:
                for m in p.maps:
                    if m is not None:
                        try:
                            m.close()
                        except BufferError:  # a caller still holds a view; the OS unmaps at exit
                            pass
                for d in p.devices:
                    if d is not None:
                        d.close()
            self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
