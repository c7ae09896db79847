"""Two kvd nodes in two network namespaces joined by a veth pair, for the peer-transfer test and
benchmark (root only). Each namespace gets its own kvd with a `transfer:` section pulling from
the other; the daemons' gRPC sockets are Unix sockets in a shared temporary directory, so workers
run in the test's own namespace while the daemons reach each other only over the veth pair.
Certificates: node-a and node-b (each the other's peer) and a CA-signed `stranger` nobody allows."""
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request

CERTS = r"""set -e
openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=kvd-peer-ca -keyout ca.key -out ca.pem 2>/dev/null
for who in node-a node-b stranger; do
  openssl req -newkey rsa:2048 -nodes -subj /CN=$who -keyout $who.key -out $who.csr 2>/dev/null
  printf 'subjectAltName=DNS:%s\n' $who > $who.ext
  openssl x509 -req -in $who.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 -extfile $who.ext -out $who.pem 2>/dev/null
done
"""


def why_not():
    """None when the namespaces can be made here, else why not (the test is skipped)."""
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    for tool in ("ip", "openssl"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    # Everything the setup needs, tried once: a chroot can create namespaces but not enter them.
    probe = f"kvdprobe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"ip netns add failed: {r.stderr.strip()}"
    try:
        r = subprocess.run(["ip", "netns", "exec", probe, "ip", "link", "set", "lo", "up"], capture_output=True, text=True)
        if r.returncode != 0:
            return f"ip netns exec failed: {r.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def sh(*cmd, ns=None, check=True, **kw):
    full = (["ip", "netns", "exec", ns] if ns else []) + list(cmd)
    r = subprocess.run(full, capture_output=True, text=True, **kw)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(full)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


class Node:
    def __init__(self, name, ns, ip, proc, dir_):
        self.name, self.ns, self.ip, self.proc, self.dir = name, ns, ip, proc, dir_
        self.target = f"unix://{dir_}/{name}.sock"
        ready = json.load(open(f"{dir_}/{name}.ready"))
        self.metrics_port = ready["metrics_port"]

    def metrics(self):
        """/metrics, scraped from inside the node's namespace."""
        code = f"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{self.metrics_port}/metrics').read().decode())"
        return sh("python3", "-c", code, ns=self.ns).stdout

    def metric(self, series):
        for line in self.metrics().splitlines():
            if line.startswith(series + " "):
                return float(line.split()[-1])
        return -1

    def log(self):
        return open(f"{self.dir}/{self.name}.log").read()

    def listening(self):
        """(protocol, local address) of every socket listening in the node's namespace that is
        not a Unix socket: TCP listeners and bound UDP sockets."""
        out = []
        for proto, flag in (("tcp", "-ltnH"), ("udp", "-lunH")):
            for line in sh("ss", flag, ns=self.ns).stdout.splitlines():
                fields = line.split()
                if len(fields) >= 4:  # an IPv4 address on a dual-stack socket reads [::ffff:A.B.C.D]:P
                    out.append((proto, fields[3].replace("[::ffff:", "").replace("]:", ":")))
        return out


class Pair:
    """Namespaces, veth pair, certificates and two serving kvds: `a` and `b`. `pools` (YAML,
    optional) replaces the default pools."""

    def __init__(self, kvd, pools="", extra=""):
        self.kvd, self.pools, self.extra = kvd, pools, extra
        tag = f"{os.getpid() % 100000}"
        self.ns = {"a": f"kvdA{tag}", "b": f"kvdB{tag}"}
        self.veth = {"a": f"kva{tag}", "b": f"kvb{tag}"}
        octet = 1 + os.getpid() % 250
        self.ip = {"a": f"10.231.{octet}.1", "b": f"10.231.{octet}.2"}
        self.dir = tempfile.mkdtemp(prefix="kvd-netns-")
        self.procs = []

    def __enter__(self):
        try:
            self._setup()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _setup(self):
        for side in "ab":
            sh("ip", "netns", "add", self.ns[side])
        sh("ip", "link", "add", self.veth["a"], "type", "veth", "peer", "name", self.veth["b"])
        for side in "ab":
            sh("ip", "link", "set", self.veth[side], "netns", self.ns[side])
            sh("ip", "addr", "add", f"{self.ip[side]}/24", "dev", self.veth[side], ns=self.ns[side])
            sh("ip", "link", "set", self.veth[side], "up", ns=self.ns[side])
            sh("ip", "link", "set", "lo", "up", ns=self.ns[side])
        subprocess.run(["/bin/sh", "-c", CERTS], cwd=self.dir, check=True)
        self.a = self._start("a", "b")
        self.b = self._start("b", "a")

    def _start(self, side, other):
        name, peer = f"node-{side}", f"node-{other}"
        d = self.dir
        config = f"""{self.pools}
transfer:
  listen: "{self.ip[side]}:7070"
  tls_cert_file: {d}/{name}.pem
  tls_key_file: {d}/{name}.key
  tls_ca_file: {d}/ca.pem
  peers:
    - {{name: {peer}, address: "{self.ip[other]}:7070"}}
{self.extra}"""
        open(f"{d}/{name}.yaml", "w").write(config)
        env = dict(os.environ)
        log = open(f"{d}/{name}.log", "w")
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.ns[side], self.kvd, f"--config={d}/{name}.yaml",
             f"--listen=unix://{d}/{name}.sock", "--metrics-listen=127.0.0.1:0",
             f"--ready-file={d}/{name}.ready"], stdout=log, stderr=subprocess.STDOUT, env=env)
        self.procs.append(proc)
        deadline = time.monotonic() + 30
        while not os.path.exists(f"{d}/{name}.ready"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start:\n" + open(f"{d}/{name}.log").read())
            time.sleep(0.05)
        return Node(name, self.ns[side], self.ip[side], proc, d)

    def __exit__(self, *exc):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for side in "ab":
            subprocess.run(["ip", "netns", "del", self.ns[side]], capture_output=True)
        shutil.rmtree(self.dir, ignore_errors=True)
        return False
