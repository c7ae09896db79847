"""Shared pieces of the Python tests: a check() that records failures, a real kvd on a temporary
Unix socket, the example worker, and the KV byte pattern of client/examples/kv_pattern.h
(re-implemented here, so that each side verifies the other's writes byte for byte)."""
import json
import os
import signal
import subprocess
import tempfile
import time

M = (1 << 64) - 1
failures = []

# A small pool: 4-token blocks, 2 layers, 16 bytes per token per layer.
SMALL_POOL = ("pools:\n  - name: default\n    block_tokens: 4\n    num_layers: 2\n"
              "    bytes_per_token_per_layer: 16\n    capacity_blocks: 64\n    max_model_len: 200\n")


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        failures.append(what)


def finish():
    """Prints the count and returns the exit code."""
    print(f"{len(failures)} failed")
    return 1 if failures else 0


def kv_byte(token, pos, layer, j):
    x = ((token << 32) ^ (pos << 12) ^ layer ^ ((j >> 3) << 48)) & M
    x = (x + 0x9E3779B97F4A7C15) & M
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M
    x ^= x >> 31
    return (x >> (8 * (j & 7))) & 0xFF


def slot_bytes(token, pos, layer, n):
    return bytes(kv_byte(token, pos, layer, j) for j in range(n))


class Daemon:
    """kvd with `config_yaml` on <tmp>/<name>.sock, started and waited for; stop() sends SIGTERM.
    `started` is False when it exited before serving (e.g. --backend=cuda without a GPU)."""

    def __init__(self, kvd, tmp, config_yaml, name="kvd", extra=(), stderr=None):
        config = os.path.join(tmp, f"{name}.yaml")
        with open(config, "w") as f:
            f.write(config_yaml)
        sock = os.path.join(tmp, f"{name}.sock")
        ready = os.path.join(tmp, f"{name}.ready")
        self.target = "unix://" + sock
        self.proc = subprocess.Popen([kvd, "--config=" + config, "--listen=" + self.target, "--metrics-listen=off",
                                      "--ready-file=" + ready, "--log-level=warn", *extra], stderr=stderr)
        for _ in range(500):
            if os.path.exists(ready) or self.proc.poll() is not None:
                break
            time.sleep(0.02)
        self.started = self.proc.poll() is None

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=15)


def stop_process(pid, timeout=5.0):
    """SIGSTOPs `pid` and returns once every one of its threads is stopped (/proc says T): kill()
    only queues the signal, and a thread running on another CPU may still answer a call sent
    right after it."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except OSError:
                pass
        if states and all(s in ("T", "t") for s in states):
            return
        time.sleep(0.001)
    raise RuntimeError(f"process {pid} did not stop within {timeout} s")


def serve_and_run(kvd, config_yaml, run, what="kvd serves a hybrid pool"):
    """Starts kvd with `config_yaml` in a temporary directory, checks it serves (`what`), calls
    run(target) and stops it; returns finish()'s exit code (main()'s return)."""
    with tempfile.TemporaryDirectory() as tmp:
        d = Daemon(kvd, tmp, config_yaml)
        check(d.started, what)
        if not d.started:
            return finish()
        try:
            run(d.target)
        finally:
            d.stop()
    return finish()


def run_worker(worker, target, request_id, prompt_range, timeout=60):
    """Runs the C++ example worker; returns (exit code, its JSON result or {})."""
    out = subprocess.run([worker, "--target=" + target, "--id=" + request_id, "--prompt-range=" + prompt_range],
                         capture_output=True, text=True, timeout=timeout)
    lines = out.stdout.strip().splitlines()
    try:
        return out.returncode, json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        return out.returncode, {}


# A hybrid pool of four layers: full attention in 1 and 3, a 6-token window in 0, recurrent state in
# 2 (checkpointed every 2 blocks), and the expectation a worker attaching to it names.
HYBRID_POOL = ("pools:\n  - name: hy\n    block_tokens: 4\n    num_layers: 4\n    bytes_per_token_per_layer: 16\n"
               "    max_model_len: 64\n    dtype: float32\n    kv_heads: 2\n    head_dim: 1\n"
               "    kv_arrangement: token_kv_head_dim\n    step_tokens: 8\n    groups:\n"
               "      - {name: full, kind: full, layers: [\"1-3/2\"], capacity_blocks: 40}\n"
               "      - {name: swa, kind: sliding_window, layers: [0], window: 6, capacity_blocks: 24}\n"
               "      - {name: rec, kind: state, layers: [2], bytes_per_state: 96, checkpoint_every_blocks: 2, "
               "capacity_slots: 6}\n")
HYBRID_GROUPS = [{"name": "full", "kind": "full", "layers": [1, 3]},
                 {"name": "swa", "kind": "sliding_window", "window": 6},
                 {"name": "rec", "kind": "state", "checkpoint_every_blocks": 2, "bytes_per_state": 96}]
