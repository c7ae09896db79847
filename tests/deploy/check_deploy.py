#!/usr/bin/env python3
"""Checks the files in deploy/ against what they must say, and against a running kvd.

Usage: check_deploy.py REPO_ROOT KVD_BINARY KVDCTL_BINARY [EXAMPLE_WORKER_BINARY]

- every kustomize overlay renders and validates, and carries what matters (kubernetes_checks.py);
- deploy/kvd.example.yaml is accepted by `kvd --print-config`;
- the systemd unit passes `systemd-analyze verify`, scores <= 3.0 in `systemd-analyze security`,
  and its SystemCallFilter= allows every system call a real kvd makes (traced with strace through
  start-up, two workers mapping slabs, a hit, a flush to the disk tier, metrics, drain and exit)
  (when systemd-analyze and strace exist);
- the alert rules pass `promtool check rules` (when promtool exists);
- every kvd_* metric named by the alert rules and the Grafana dashboard is one a running kvd
  actually exports (scraped from a real daemon on a temporary socket and port 0);
- the Containerfile is multi-stage and runs as a non-root user.
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
import urllib.request

import yaml

from kubernetes_checks import check_kubernetes

failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what)


def load_all(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def main():
    root, kvd, kvdctl = sys.argv[1], os.path.abspath(sys.argv[2]), os.path.abspath(sys.argv[3])
    worker_bin = os.path.abspath(sys.argv[4]) if len(sys.argv) > 4 else None
    deploy = os.path.join(root, "deploy")
    # The build tree (kvd is <build>/server/kvd): where the schema validator is installed once.
    check_kubernetes(check, root, kvd, os.path.dirname(os.path.dirname(kvd)))

    tmp = tempfile.mkdtemp(prefix="kvd-deploy-")
    try:
        configs = [("kvd.example.yaml", open(os.path.join(deploy, "kvd.example.yaml")).read())]
        bench = os.path.join(root, "tests", "bench", "configs")
        configs += [(f"tests/bench/configs/{n}", open(os.path.join(bench, n)).read())
                    for n in sorted(os.listdir(bench)) if n.endswith(".yaml")]
        for label, text in configs:
            path = os.path.join(tmp, "cfg.yaml")
            open(path, "w").write(text)
            r = subprocess.run([kvd, "--config=" + path, "--print-config"], capture_output=True, text=True)
            check(r.returncode == 0, f"{label} is accepted by kvd ({r.stderr.strip()})")

        if shutil.which("systemd-analyze"):
            unit = open(os.path.join(deploy, "systemd", "kvd.service")).read().replace("/usr/local/bin/kvd", kvd)
            upath = os.path.join(tmp, "kvd.service")
            open(upath, "w").write(unit)
            r = subprocess.run(["systemd-analyze", "verify", upath], capture_output=True, text=True, cwd=tmp)
            check(r.returncode == 0 and "kvd.service" not in r.stderr, f"systemd-analyze verify ({r.stderr.strip()})")
            check("Type=notify" in unit and "RuntimeDirectory=kvd" in unit and "User=kvd" in unit, "unit is notify, runtime dir, own user")
            # Hardening: systemd's own exposure score (0 best, 10 worst), 3.0 at most.
            r = subprocess.run(["systemd-analyze", "security", "--offline=true", "--threshold=30", upath],
                               capture_output=True, text=True, cwd=tmp)
            score = re.search(r"Overall exposure level for kvd.service: (\S+)", r.stdout)
            check(r.returncode == 0 and score is not None,
                  f"systemd-analyze security scores the unit <= 3.0 ({score.group(1) if score else r.stdout[-300:]})")
            if score:
                print("systemd-analyze security: exposure", score.group(1))
            if shutil.which("strace") and worker_bin:
                check_syscalls(unit, kvd, kvdctl, worker_bin, tmp)
            else:
                print("skip: strace not installed (or no example worker): the syscall filter is not exercised")
        else:
            print("skip: systemd-analyze not installed")

        rules = os.path.join(deploy, "prometheus", "kvd-rules.yaml")
        if shutil.which("promtool"):
            r = subprocess.run(["promtool", "check", "rules", rules], capture_output=True, text=True)
            check(r.returncode == 0, f"promtool check rules ({r.stdout.strip()} {r.stderr.strip()})")
            # Every alert fires in its unit test and stays quiet in one (an empty exp_alerts).
            tests = os.path.join(deploy, "prometheus", "kvd-rules.test.yaml")
            r = subprocess.run(["promtool", "test", "rules", tests], capture_output=True, text=True)
            check(r.returncode == 0, f"promtool test rules kvd-rules.test.yaml ({r.stdout.strip()[-1500:]} {r.stderr.strip()})")
            fired, quiet = set(), set()
            for t in yaml.safe_load(open(tests))["tests"]:
                for a in t.get("alert_rule_test", []):
                    (fired if a.get("exp_alerts") else quiet).add(a["alertname"])
            for group in yaml.safe_load(open(rules))["groups"]:
                for rule in group["rules"]:
                    check(rule["alert"] in fired and rule["alert"] in quiet,
                          f"alert {rule['alert']} has a unit test that fires it and one where it stays quiet")
        else:
            print("skip: promtool not installed")

        exported = scrape_metric_names(kvd, kvdctl, worker_bin, tmp)
        check("kvd_hit_tokens_total" in exported, "a live kvd exports kvd_hit_tokens_total")
        referenced = set()
        for group in yaml.safe_load(open(rules))["groups"]:
            for rule in group["rules"]:
                referenced |= set(re.findall(r"\bkvd_[a-z_]+", rule["expr"]))
        dash = json.load(open(os.path.join(deploy, "grafana", "kvd-dashboard.json")))
        variables = {v["name"] for v in dash.get("templating", {}).get("list", [])}
        check("instance" in variables, "the dashboard has a node (instance) variable")
        # Under Kubernetes `instance` would be the pod's IP: the PodMonitor sets it to the node's name.
        pm = yaml.safe_load(open(os.path.join(deploy, "kubernetes", "overlays", "monitoring", "podmonitor.yaml")))
        relabel = [r for e in pm["spec"]["podMetricsEndpoints"] for r in e.get("relabelings", [])]
        check(any(r.get("sourceLabels") == ["__meta_kubernetes_pod_node_name"] and r.get("targetLabel") == "instance"
                  for r in relabel), "the PodMonitor labels each kvd target with its node's name (instance)")
        rows = {p["title"] for p in dash["panels"] if p["type"] == "row"}
        for row in ("Tiers (host, disk)", "Redis tier", "Router events", "Requests", "Device memory"):
            check(row in rows, f"the dashboard has a row '{row}'")
        for p in dash["panels"]:
            for t in p.get("targets", []):
                referenced |= set(re.findall(r"\bkvd_[a-z_]+", t["expr"]))
                for m in re.findall(r"\bkvd_[a-z_]+(\{[^}]*\})?", t["expr"]):
                    check('instance=~"$instance"' in m, f"panel '{p['title']}' filters by the node variable ({t['expr'][:80]})")
                if "kvd_bytes" in t["expr"]:
                    check('state!="total"' in t["expr"], f"panel '{p['title']}' stacks kvd_bytes without the total")
        headings = {h.lower() for h in re.findall(r"^### (\S+)\s*$", open(os.path.join(root, "docs", "operations.md")).read(), re.M)}
        for rule_group in yaml.safe_load(open(rules))["groups"]:
            for rule in rule_group["rules"]:
                url = rule.get("annotations", {}).get("runbook_url", "")
                anchor = url.rsplit("#", 1)[-1] if "#" in url else ""
                check(url.startswith("https://") and "docs/operations.md#" in url and anchor in headings,
                      f"alert {rule['alert']} has a runbook_url to its section of docs/operations.md ({url})")
        for name in sorted(referenced):
            base = re.sub(r"_(bucket|count|sum)$", "", name)
            check(name in exported or base in exported, f"metric {name} used by rules/dashboard is exported")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    cf = open(os.path.join(deploy, "Containerfile")).read()
    check(len(re.findall(r"^FROM ", cf, re.M)) >= 2, "Containerfile is multi-stage")
    user = re.findall(r"^USER (\S+)", cf, re.M)
    check(bool(user) and not user[-1].startswith(("0", "root")), "Containerfile runs as non-root")
    check("runtime-packages.txt" in cf, "the runtime stage installs deploy/runtime-packages.txt "
          "(image_root_check.sh holds that list to what the binaries link)")
    check(re.search(r"^FROM nvidia/cuda:\S+-devel-\S+ AS cuda-toolkit", cf, re.M) is not None and "--target kvd-cuda" in cf,
          "a CUDA build from NVIDIA's official image, with its tag documented")
    ignore = open(os.path.join(root, ".dockerignore")).read().split() if os.path.exists(os.path.join(root, ".dockerignore")) else []
    check("build*/" in ignore and ".git/" in ignore, ".dockerignore keeps build trees and .git out of the context")

    print(f"{len(failures)} failed")
    return 1 if failures else 0


def start_kvd_all_tiers(command, d, ready, tries=500):
    """`command` (kvd, possibly under a tracer) on d/k.sock with every tier on, so that every
    family (flush, demotion...) is exported and every code path is reachable: host and disk tiers,
    a Redis tier where nothing listens (merely unavailable) and router events; waits for `ready`."""
    proc = subprocess.Popen(command + ["--listen=unix://" + os.path.join(d, "k.sock"), "--metrics-listen=127.0.0.1:0",
                                       "--ready-file=" + ready, "--log-level=warn",
                                       "--disk-dir=" + os.path.join(d, "disk"), "--host-tier-bytes=4MiB",
                                       "--redis-url=redis://127.0.0.1:1",
                                       "--router-events=ipc://" + os.path.join(d, "events")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(tries):
        if os.path.exists(ready):
            break
        time.sleep(0.02)
    return proc


def syscall_set(name):
    """The system calls of a systemd syscall set, nested sets expanded."""
    out = subprocess.run(["systemd-analyze", "syscall-filter", name], capture_output=True, text=True).stdout
    calls = set()
    for line in out.splitlines()[1:]:
        item = line.split("#")[0].strip()
        if item.startswith("@"):
            calls |= syscall_set(item)
        elif item:
            calls.add(item)
    return calls


def check_syscalls(unit, kvd, kvdctl, worker, tmp):
    """Runs kvd under strace through a workload and checks every call against the unit's filter."""
    allowed = None
    for line in unit.splitlines():
        m = re.match(r"^SystemCallFilter=(~?)(.*)$", line.strip())
        if not m:
            continue
        names = set()
        for item in m.group(2).split():
            names |= syscall_set(item) if item.startswith("@") else {item}
        if allowed is None:
            allowed = set() if m.group(1) else set(names)
            if m.group(1):
                check(False, "the unit's first SystemCallFilter= is an allow-list")
                return
        elif m.group(1):
            allowed -= names
        else:
            allowed |= names
    check(allowed is not None, "the unit sets SystemCallFilter=")
    if allowed is None:
        return
    d = os.path.join(tmp, "strace")
    os.makedirs(d)
    sock = os.path.join(d, "k.sock")
    ready = os.path.join(d, "ready.json")
    trace = os.path.join(d, "trace")
    proc = start_kvd_all_tiers(["strace", "-f", "-qq", "-o", trace, kvd], d, ready, tries=1500)
    try:
        check(os.path.exists(ready), "kvd started under strace")
        if not os.path.exists(ready):
            return
        for wid in ("a", "b"):  # b hits a's prefix in the slabs it mapped
            r = subprocess.run([worker, "--target=unix://" + sock, "--id=" + wid, "--prompt-range=0:40"],
                               capture_output=True, text=True, timeout=60)
            check(r.returncode == 0 and '"mismatches": 0' in r.stdout, f"worker {wid} under the traced kvd ({r.stdout[-200:]})")
        subprocess.run([kvdctl, "--target=unix://" + sock, "flush"], stdout=subprocess.DEVNULL, timeout=60)
        port = json.load(open(ready))["metrics_port"]
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    finally:
        # SIGTERM to kvd itself (strace would detach and leave it running); strace exits with it.
        try:
            os.kill(json.load(open(ready))["pid"], signal.SIGTERM)
        except (OSError, ValueError, KeyError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    used = set()
    for line in open(trace):
        m = re.match(r"^\d+\s+([a-z0-9_]+)\(", line)
        if m:
            used.add(m.group(1))
    check(len(used) > 20, f"strace saw kvd's system calls ({len(used)})")
    outside = sorted(used - allowed)
    check(not outside, f"every system call kvd made is allowed by the unit's SystemCallFilter= (not: {outside})")
    print(f"syscall filter: kvd made {len(used)} distinct system calls, all within the unit's filter"
          if not outside else f"syscall filter: outside: {outside}")


def scrape_metric_names(kvd, kvdctl, worker_bin, tmp):
    ready = os.path.join(tmp, "ready.json")
    proc = start_kvd_all_tiers([kvd], tmp, ready)
    try:
        port = json.load(open(ready))["metrics_port"]
        # One RPC, so that the per-RPC latency histogram has a series to show, and one request
        # (a Start), so that the admission-wait histogram has one too.
        subprocess.run([kvdctl, "--target=unix://" + os.path.join(tmp, "k.sock"), "status"],
                       stdout=subprocess.DEVNULL, check=True)
        if worker_bin:
            subprocess.run([worker_bin, "--target=unix://" + os.path.join(tmp, "k.sock"), "--id=scrape",
                            "--prompt-range=0:40"], stdout=subprocess.DEVNULL, timeout=60)
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        return {m.group(1) for m in re.finditer(r"^# TYPE (\S+)", body, re.M)}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)


if __name__ == "__main__":
    sys.exit(main())
