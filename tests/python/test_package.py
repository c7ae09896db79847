"""The Python client as an engine team installs it: `pip install ./client/python` into a fresh
virtual environment (no PYTHONPATH, not run from the repository), then the README's snippet, run as
written against a real kvd, twice (the second run hits the first's prefix), and against a target
where nothing listens (KvdUnavailable, not a bare grpc timeout). Also: the committed gRPC stubs
equal what scripts/gen-python-stubs.sh generates from the proto now (else scripts/gen-python-stubs.sh), and the
package byte-compiles with Python 3.9 when one is installed (its requires-python floor).

Usage: test_package.py REPO_ROOT KVD_BINARY
"""
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

from kvd_testlib import Daemon, check, finish


def main():
    root, kvd = sys.argv[1], sys.argv[2]
    src = os.path.join(root, "client", "python")
    fresh_dir = tempfile.mkdtemp(prefix="kvd-stubs-")
    try:
        r = subprocess.run(["bash", os.path.join(root, "scripts", "gen-python-stubs.sh"), fresh_dir],
                           capture_output=True, text=True)
        check(r.returncode == 0, f"scripts/gen-python-stubs.sh runs ({r.stderr.strip()[-300:]})")
        for name in ("__init__.py", "kvd_pb2.py", "kvd_pb2_grpc.py"):
            committed = open(os.path.join(src, "kvd", "v1", name)).read()
            fresh_path = os.path.join(fresh_dir, "kvd", "v1", name)
            fresh = open(fresh_path).read() if os.path.exists(fresh_path) else None
            check(committed == fresh, f"client/python/kvd/v1/{name} is what the proto generates now "
                                      "(else run scripts/gen-python-stubs.sh)")
    finally:
        shutil.rmtree(fresh_dir, ignore_errors=True)

    readme = open(os.path.join(root, "README.md")).read()
    m = re.search(r"<!-- python-snippet -->\n```python\n(.*?)```", readme, re.S)
    check(m is not None, "README.md has the Python snippet")
    if m is None:
        return finish()
    tmp = tempfile.mkdtemp(prefix="kvd-pypkg-")
    try:
        # Install from a copy: setuptools writes build/ and *.egg-info beside the sources.
        pkg = os.path.join(tmp, "src")
        shutil.copytree(src, pkg, ignore=shutil.ignore_patterns("__pycache__", "CMakeLists.txt"))
        venv = os.path.join(tmp, "venv")
        subprocess.run(["/usr/bin/python3", "-m", "venv", "--system-site-packages", venv], check=True)
        py = os.path.join(venv, "bin", "python")
        r = subprocess.run([py, "-m", "pip", "install", "--quiet", "--no-index", "--no-build-isolation", pkg],
                           capture_output=True, text=True)
        check(r.returncode == 0, f"pip install ./client/python ({r.stderr.strip()[-500:]})")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        where = subprocess.run([py, "-c", "import kvd, kvd.v1.kvd_pb2; print(kvd.__file__)"],
                               capture_output=True, text=True, cwd=tmp, env=env)
        check(where.returncode == 0 and where.stdout.startswith(venv),
              f"kvd imports from the virtual environment ({where.stdout.strip()} {where.stderr.strip()[-300:]})")
        r = subprocess.run([py, "-m", "pip", "show", "kvd-client"], capture_output=True, text=True, env=env)
        check("Requires: grpcio, protobuf" in r.stdout, f"the package declares grpcio and protobuf ({r.stdout.strip()})")
        snippet = os.path.join(tmp, "snippet.py")
        open(snippet, "w").write(m.group(1))

        d = Daemon(kvd, tmp, "budget_bytes: 0\n")  # the default pool, as scripts/run.sh starts it
        try:
            env["KVD_TARGET"] = d.target
            first = subprocess.run([py, snippet], capture_output=True, text=True, cwd=tmp, env=env, timeout=60)
            check(first.returncode == 0 and "pool default: 0 of 100 prompt tokens already cached" in first.stdout,
                  f"the README snippet runs as written ({first.stdout.strip()} {first.stderr.strip()[-500:]})")
            second = subprocess.run([py, snippet], capture_output=True, text=True, cwd=tmp, env=env, timeout=60)
            check(second.returncode == 0 and "pool default: 96 of 100 prompt tokens already cached" in second.stdout,
                  f"run again, it reuses the first run's published blocks ({second.stdout.strip()})")
        finally:
            d.stop()
        env["KVD_TARGET"] = "unix://" + os.path.join(tmp, "nobody.sock")
        gone = subprocess.run([py, snippet], capture_output=True, text=True, cwd=tmp, env=env, timeout=60)
        check(gone.returncode == 1 and "UNAVAILABLE: cannot reach kvd at unix://" in gone.stderr
              and "Traceback" not in gone.stderr,
              f"no kvd: KvdUnavailable names the target ({gone.stderr.strip()[-400:]})")

        # A real 3.9 (a pyenv shim on PATH may only say which versions have one).
        candidates = sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.9*/bin/python3.9")))
        candidates += [p for p in ("/usr/bin/python3.9", "/usr/local/bin/python3.9") if os.path.exists(p)]
        py39 = next((c for c in candidates
                     if subprocess.run([c, "-c", "pass"], capture_output=True).returncode == 0), None)
        if py39:
            r = subprocess.run([py39, "-m", "compileall", "-q", "-d", "kvd", os.path.join(pkg, "kvd")],
                               capture_output=True, text=True)
            check(r.returncode == 0, f"the package byte-compiles with Python 3.9 ({r.stdout.strip()[-500:]})")
        else:
            print("skip: no Python 3.9 here to byte-compile the package with")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return finish()


if __name__ == "__main__":
    sys.exit(main())
