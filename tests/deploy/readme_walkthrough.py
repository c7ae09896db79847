"""README.md's "Start here", run as a newcomer would: every command of its walkthrough blocks as
written, in a checkout of their own (`build/` is the build under test, `client/python` a copy the
user may write to), with a HOME of their own and the system's PATH.

- The `daemon` block's command starts kvd in the background, once as written and once as its
  "# or:" alternative (with deploy/kvd.example.yaml); the test waits until `kvdctl health` (on
  the default target) answers, runs the `shell` blocks line by line, then stops kvd with SIGINT
  and expects exit 0.
- What the README promises is checked: the second example worker reused 96 tokens, kvdctl status
  answers, the second engine run reused the first's blocks and produced the same tokens and
  digest, the Python snippet (`<!-- python-snippet -->`) runs with the venv's python.
- As root, the whole walkthrough runs again as an unprivileged user (nobody, through setpriv),
  where kvd's default socket is under /tmp/kvd-<uid>/ instead of /run/kvd.
- `sudo apt-get install ...` lines are checked (every package named is installed), not run.
- /metrics goes to a free port (KVD_METRICS_LISTEN=127.0.0.1:0) so that the test does not need
  127.0.0.1:9464 to be free; nothing else differs from the README.

Usage: readme_walkthrough.py REPO_ROOT BUILD_DIR
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

failures = []
NOBODY = 65534


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        failures.append(what)
    return cond


def walkthrough(readme):
    """[(kind, [lines])] of the blocks marked <!-- walkthrough: KIND -->, and the Python snippet."""
    blocks = []
    for kind, body in re.findall(r"<!-- walkthrough: (\w+) -->\n```sh\n(.*?)```", readme, re.S):
        blocks.append((kind, [line for line in body.splitlines() if line.strip()]))
    snippet = re.search(r"<!-- python-snippet -->\n```python\n(.*?)```", readme, re.S)
    return blocks, snippet.group(1) if snippet else None


def make_checkout(root, build_dir, where, uid):
    """A checkout the user owns: links to the repository's files, `build` to the build under
    test, and a copy of client/python (pip writes beside its sources)."""
    os.makedirs(where)
    for name in os.listdir(root):
        if name.startswith("build") or name in ("client", ".git"):
            continue
        os.symlink(os.path.join(root, name), os.path.join(where, name))
    os.symlink(build_dir, os.path.join(where, "build"))
    os.makedirs(os.path.join(where, "client"))
    for name in os.listdir(os.path.join(root, "client")):
        src = os.path.join(root, "client", name)
        if name == "python":
            shutil.copytree(src, os.path.join(where, "client", name),
                            ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
        else:
            os.symlink(src, os.path.join(where, "client", name))
    if uid != os.geteuid():
        for d, dirs, files in os.walk(where):
            for n in [d] + [os.path.join(d, f) for f in dirs + files]:
                os.lchown(n, uid, uid)


def as_user(uid, argv):
    if uid == os.geteuid():
        return argv
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *argv]


def default_socket(uid):
    return "/run/kvd/kvd.sock" if uid == 0 else f"/tmp/kvd-{uid}/kvd.sock"


def run_shell_line(line, uid, cwd, env, timeout=300):
    return subprocess.run(as_user(uid, ["bash", "-c", line]), cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def last_json(text):
    for line in reversed(text.strip().splitlines()):
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            continue
    return None


def check_apt_line(line):
    packages = [w for w in line.split("#")[0].split()[3:] if not w.startswith("-")]
    missing = [p for p in packages if subprocess.run(
        ["dpkg-query", "-W", "-f=${Status}", p], capture_output=True, text=True).stdout != "install ok installed"]
    check(not missing, f"`{line.split('#')[0].strip()}`: every package is installed here (missing: {missing})")


def run_pass(user, uid, daemon_cmd, blocks, snippet, checkout, home):
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": home,
           "LANG": "C.UTF-8", "KVD_METRICS_LISTEN": "127.0.0.1:0", "USER": user}
    for keep in ("ASAN_OPTIONS", "UBSAN_OPTIONS", "KVD_JOBS"):
        if keep in os.environ:
            env[keep] = os.environ[keep]
    tag = f"[{user}, `{daemon_cmd}`]"
    log = open(os.path.join(home, "kvd.log"), "w")
    daemon = subprocess.Popen(as_user(uid, ["bash", "-c", daemon_cmd]), cwd=checkout, env=env, stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 600  # run.sh may have a build to bring up to date
        up = False
        while time.monotonic() < deadline and daemon.poll() is None:
            h = run_shell_line("build/server/kvdctl health", uid, checkout, env, timeout=30)
            if h.returncode == 0:
                up = True
                break
            time.sleep(0.5)
        if not check(up, f"{tag} kvd serves on its default socket ({default_socket(uid)})"):
            print(open(log.name).read()[-3000:])
            return
        outputs = {}
        for kind, lines in blocks:
            if kind != "shell":
                continue
            for line in lines:
                if line.startswith("sudo apt-get install"):
                    check_apt_line(line)
                    continue
                r = run_shell_line(line, uid, checkout, env)
                short = line.split("#")[0].strip()
                if not check(r.returncode == 0, f"{tag} `{short[:90]}` exits 0"):
                    print(r.stdout[-1500:], r.stderr[-1500:])
                outputs[short] = r.stdout
        worker = [o for c, o in outputs.items() if "kvd_example_worker --id=r2" in c]
        r2 = last_json(worker[0]) if worker else None
        check(r2 is not None and r2.get("cached_tokens") == 96 and r2.get("mismatches") == 0,
              f"{tag} the second example worker reused r1's 96 tokens, every byte verified ({r2})")
        status = [o for c, o in outputs.items() if c.endswith("kvdctl status")]
        check(bool(status) and "default" in status[0], f"{tag} kvdctl status lists the pools")
        engine = [last_json(o) for c, o in outputs.items() if "kvd.engine.worker" in c]
        check(len(engine) == 2 and all(engine) and engine[0]["cached_tokens"] == 0 and engine[1]["cached_tokens"] > 0
              and engine[0]["tokens"] == engine[1]["tokens"] and engine[0]["digest"] == engine[1]["digest"],
              f"{tag} the reference engine's second run reuses the first's KV, bit-exact ({engine})")
        if snippet is not None:
            path = os.path.join(home, "snippet.py")
            with open(path, "w") as f:
                f.write(snippet)
            if uid != os.geteuid():
                os.chown(path, uid, uid)
            r = run_shell_line(f"~/kvd-venv/bin/python {path}", uid, home, env, timeout=120)
            check(r.returncode == 0 and "prompt tokens already cached" in r.stdout,
                  f"{tag} the Python snippet runs with ~/kvd-venv/bin/python ({r.stdout.strip()} {r.stderr[-500:]})")
    finally:
        if daemon.poll() is None:
            os.killpg(daemon.pid, signal.SIGINT)
        try:
            rc = daemon.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(daemon.pid, signal.SIGKILL)
            rc = daemon.wait()
        log.close()
        check(rc == 0, f"{tag} Ctrl-C (SIGINT) drains kvd and it exits 0 (rc={rc})")
        if rc != 0:
            print(open(log.name).read()[-3000:])


def main():
    root, build_dir = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    blocks, snippet = walkthrough(open(os.path.join(root, "README.md")).read())
    daemon = [lines for kind, lines in blocks if kind == "daemon"]
    check(len(daemon) == 1 and len(daemon[0]) == 1, "README.md has one walkthrough daemon command")
    check(any(kind == "shell" for kind, _ in blocks), "README.md has walkthrough shell blocks")
    check(snippet is not None, "README.md has the Python snippet")
    if failures:
        return 1
    line = daemon[0][0]
    variants = [line.split("#")[0].strip()]
    alternative = re.search(r"#\s*or:\s*(.*)$", line)
    if alternative:
        variants.append(alternative.group(1).strip())
    check("--config deploy/kvd.example.yaml" in " ".join(variants), "the walkthrough offers the example config")

    users = [("root" if os.geteuid() == 0 else "you", os.geteuid())]
    if os.geteuid() == 0:
        probe = subprocess.run(as_user(NOBODY, ["test", "-x", os.path.join(build_dir, "server", "kvd")]))
        if probe.returncode == 0 and shutil.which("setpriv"):
            users.append(("nobody", NOBODY))
        else:
            print(f"skip: the unprivileged pass (nobody cannot reach {build_dir}, or no setpriv)")
    tmp = tempfile.mkdtemp(prefix="kvd-readme-")
    os.chmod(tmp, 0o755)
    try:
        for user, uid in users:
            home = os.path.join(tmp, f"home-{user}")
            os.makedirs(home)
            checkout = os.path.join(home, "kvd")
            make_checkout(root, build_dir, checkout, uid)
            if uid != os.geteuid():
                os.chown(home, uid, uid)
            for cmd in variants:
                run_pass(user, uid, cmd, blocks, snippet, checkout, home)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
