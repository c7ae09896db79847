"""The Kubernetes half of check_deploy.py: deploy/kubernetes is a kustomize base with overlays
(host, gpu, monitoring). Each overlay is rendered with `kubectl kustomize`, every rendered object
is validated against the Kubernetes API schemas offline (kubernetes-models and its Prometheus
Operator models from npm, installed once into the build tree), and the objects are checked for
what matters on a node: namespace first, the socket and disk hostPaths handed to kvd's user by the
init container (run for real: its command as root on a directory made the way the kubelet makes
one, then the real kvd as uid 10001 binding there), critical priority, gRPC-health probes, a grace
period covering drain and flush, the workers' group, the example worker in no overlay, and the
monitoring objects (the PrometheusRule's groups are deploy/prometheus/kvd-rules.yaml)."""
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time

import yaml

OVERLAYS = ("host", "gpu", "monitoring")
# Pinned: what the schema validation was written against.
NPM_PACKAGES = ("kubernetes-models@5.1.0", "@kubernetes-models/prometheus-operator@6.0.0")
KVD_UID = 10001

VALIDATE_JS = r"""
const objs = JSON.parse(require("fs").readFileSync(0, "utf8"));
const groups = { "v1": "kubernetes-models/v1", "apps/v1": "kubernetes-models/apps/v1",
                 "scheduling.k8s.io/v1": "kubernetes-models/scheduling.k8s.io/v1",
                 "monitoring.coreos.com/v1": "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1" };
(async () => {
  let bad = 0;
  for (const o of objs) {
    const mod = groups[o.apiVersion];
    if (!mod) { console.log(`FAIL ${o.kind}/${o.metadata.name}: no schema for ${o.apiVersion}`); bad++; continue; }
    const Model = (await import(mod))[o.kind];
    if (!Model) { console.log(`FAIL ${o.kind}/${o.metadata.name}: unknown kind in ${o.apiVersion}`); bad++; continue; }
    try { new Model(o).validate(); console.log(`ok ${o.apiVersion} ${o.kind}/${o.metadata.name}`); }
    catch (e) { console.log(`FAIL ${o.kind}/${o.metadata.name}: ${e.message}`); bad++; }
  }
  process.exit(bad ? 1 : 0);
})();
"""


def render(root, overlay):
    r = subprocess.run(["kubectl", "kustomize", os.path.join(root, "deploy", "kubernetes", "overlays", overlay)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        return None, r.stderr.strip()
    return [d for d in yaml.safe_load_all(r.stdout) if d], ""


def install_validator(cache):
    """node + the pinned npm packages under `cache`; None (and why) when that cannot be had."""
    if not shutil.which("node") or not shutil.which("npm"):
        return None, "node/npm not installed"
    marker = os.path.join(cache, "installed-" + "+".join(NPM_PACKAGES).replace("/", "_"))
    if not os.path.exists(marker):
        os.makedirs(cache, exist_ok=True)
        r = subprocess.run(["npm", "install", "--silent", "--no-audit", "--no-fund", "--prefix", cache, *NPM_PACKAGES],
                           capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            return None, "npm install failed: " + (r.stderr.strip()[-300:] or r.stdout.strip()[-300:])
        open(marker, "w").close()
    script = os.path.join(cache, "validate.cjs")
    open(script, "w").write(VALIDATE_JS)
    return script, ""


# How long kvd may take to become ready with the shipped configuration (see start_kvd below).
READY_DEADLINE_S = 180


def check_init_every_start(check, init_command, caps):
    """The init container's command under exactly its capability set (root, bounding set = the
    rendered `add` list, no new privileges), on fresh, already-owned and half-owned directories,
    twice each: every pod start succeeds, not only the first on a node."""
    tmp = tempfile.mkdtemp(prefix="kvd-init-")
    try:
        run, disk = os.path.join(tmp, "run-kvd"), os.path.join(tmp, "var-lib-kvd")
        cmd = init_command.replace("/run/kvd", run).replace("/var/lib/kvd", disk)
        capset = ",".join(["-all"] + ["+" + c.lower() for c in caps])
        states = {"fresh": (0, 0), "already kvd's": (KVD_UID, KVD_UID), "half kvd's": (KVD_UID, 0)}
        for name, (run_owner, disk_owner) in states.items():
            for d, owner in ((run, run_owner), (disk, disk_owner)):
                shutil.rmtree(d, ignore_errors=True)
                os.mkdir(d)
                os.chown(d, owner, owner)
                os.chmod(d, 0o750 if owner else 0o755)
            for attempt in (1, 2):
                r = subprocess.run(["setpriv", "--bounding-set=" + capset, "--inh-caps=-all", "--no-new-privs",
                                    "/bin/sh", "-c", cmd], capture_output=True, text=True)
                ok = r.returncode == 0 and all(os.stat(d).st_uid == KVD_UID for d in (run, disk)) and \
                    (os.stat(run).st_mode & 0o777, os.stat(disk).st_mode & 0o777) == (0o750, 0o700)
                check(ok, f"the init container's command under capabilities {caps} on {name} directories, "
                          f"start {attempt} ({r.stderr.strip()})")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_socket_dir(check, init_command, config_text, kvd):
    """The init container's command, then kvd as uid 10001, on hostPath-like directories."""
    tmp = tempfile.mkdtemp(prefix="kvd-hostpath-")
    try:
        os.chmod(tmp, 0o755)
        run, disk = os.path.join(tmp, "run-kvd"), os.path.join(tmp, "var-lib-kvd")

        def kubelet_dirs():  # DirectoryOrCreate: root-owned, 0755
            for d in (run, disk):
                shutil.rmtree(d, ignore_errors=True)
                os.mkdir(d)
                os.chown(d, 0, 0)
                os.chmod(d, 0o755)

        config = os.path.join(tmp, "kvd.yaml")
        open(config, "w").write(config_text.replace("/var/lib/kvd", disk))
        os.chmod(config, 0o644)

        def start_kvd():
            ready = os.path.join(run, "ready.json")
            if os.path.exists(ready):
                os.remove(ready)
            p = subprocess.Popen(["setpriv", f"--reuid={KVD_UID}", f"--regid={KVD_UID}", "--clear-groups",
                                  kvd, "--config=" + config, "--listen=unix://" + os.path.join(run, "kvd.sock"),
                                  "--metrics-listen=off", "--ready-file=" + os.path.join(run, "ready.json")],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            # The shipped config pre-faults 4 GiB of pool and 1 GiB of host tier before kvd binds:
            # ~5 s on an idle 2-core machine, over 10 s beside the integration tests under ASan.
            # So wait on a deadline for the ready file (or an exit), not a count of short sleeps.
            deadline = time.monotonic() + READY_DEADLINE_S
            while time.monotonic() < deadline:
                if os.path.exists(ready) or p.poll() is not None:
                    break
                time.sleep(0.05)
            served = p.poll() is None and os.path.exists(ready) and os.path.exists(os.path.join(run, "kvd.sock"))
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
            out = p.communicate(timeout=60)[0]
            return served, out

        # Without the init container kvd cannot bind: the check below would catch its loss.
        kubelet_dirs()
        served, out = start_kvd()
        check(not served and "ermission denied" in out,
              f"as the kubelet leaves it, the socket directory refuses kvd ({out.strip()[-200:]})")
        kubelet_dirs()
        r = subprocess.run(["/bin/sh", "-c", init_command.replace("/run/kvd", run).replace("/var/lib/kvd", disk)],
                           capture_output=True, text=True)
        check(r.returncode == 0, f"the init container's command runs ({r.stderr.strip()})")
        served, out = start_kvd()
        check(served, f"after it, kvd as uid {KVD_UID} binds the socket and serves ({out.strip()[-300:]})")
        if served:
            print(f"hostPath: kvd as uid {KVD_UID} could not bind in a kubelet-made directory, and could after the "
                  "init container's command")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_kubernetes(check, root, kvd, build_dir):
    if not shutil.which("kubectl"):
        check(False, "kubectl is installed (it renders the kustomize overlays)")
        return
    rendered = {}
    for overlay in OVERLAYS:
        objs, err = render(root, overlay)
        check(objs is not None, f"kubectl kustomize overlays/{overlay} renders ({err})")
        rendered[overlay] = objs or []

    script, why = install_validator(os.path.join(build_dir, "k8s-schema-validator"))
    if script is None:
        print(f"skip: schema validation ({why})")
    else:
        for overlay, objs in rendered.items():
            r = subprocess.run(["node", script], input=json.dumps(objs), capture_output=True, text=True,
                               cwd=os.path.dirname(script), timeout=120)
            print(f"overlays/{overlay}:", r.stdout.strip().replace("\n", "; "))
            check(r.returncode == 0, f"every object of overlays/{overlay} is valid against the API schemas")

    rules = yaml.safe_load(open(os.path.join(root, "deploy", "prometheus", "kvd-rules.yaml")))
    for overlay in ("host", "gpu"):
        objs = rendered[overlay]
        if not objs:
            continue
        kinds = [o["kind"] for o in objs]
        check(kinds[0] == "Namespace", f"{overlay}: the Namespace comes first ({kinds})")
        check("Pod" not in kinds, f"{overlay}: the example worker is not part of the overlay")
        by = {(o["kind"], o["metadata"]["name"]): o for o in objs}
        check(all(o["metadata"].get("namespace") == "kvd" for o in objs if o["kind"] not in ("Namespace", "PriorityClass")),
              f"{overlay}: every namespaced object is in namespace kvd")
        ds = by.get(("DaemonSet", f"kvd-{overlay}"))
        cms = [o for (k, n), o in by.items() if k == "ConfigMap" and n.startswith(f"kvd-config-{overlay}-")]
        cm = cms[0] if len(cms) == 1 else None
        check(ds is not None and cm is not None,
              f"{overlay}: DaemonSet kvd-{overlay} and a generated ConfigMap kvd-config-{overlay}-<hash>")
        if ds is None or cm is None:
            continue
        pod = ds["spec"]["template"]["spec"]
        cm_refs = [v["configMap"]["name"] for v in pod["volumes"] if "configMap" in v]
        check(cm_refs == [cm["metadata"]["name"]],
              f"{overlay}: the DaemonSet mounts that ConfigMap by its hashed name: a config change rolls it ({cm_refs})")
        sel = ds["spec"]["selector"]["matchLabels"]
        check(sel.get("kvd.dev/flavor") == overlay and
              ds["spec"]["template"]["metadata"]["labels"].get("kvd.dev/flavor") == overlay,
              f"{overlay}: a selector of its own (kvd.dev/flavor={overlay}): the other overlay's pods are not its")
        c = pod["containers"][0]
        check(pod.get("hostPID") is True and pod.get("hostIPC") is True, f"{overlay}: host PID and IPC namespaces")
        pc = by.get(("PriorityClass", pod.get("priorityClassName", "")))
        check(pc is not None and pc.get("preemptionPolicy") == "Never" and pc.get("value", 0) >= 1_000_000,
              f"{overlay}: kvd's PriorityClass is rendered with it, high, and preemptionPolicy Never: a surge pod "
              f"that does not fit never evicts an engine ({pod.get('priorityClassName')})")
        vols = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        check(vols.get("socket-dir", {}).get("hostPath", {}).get("path") == "/run/kvd" and
              mounts.get("socket-dir") == "/run/kvd", f"{overlay}: the socket directory is hostPath /run/kvd")
        check(vols.get("disk", {}).get("hostPath", {}).get("path") == "/var/lib/kvd" and
              mounts.get("disk") == "/var/lib/kvd", f"{overlay}: the disk tier is hostPath /var/lib/kvd")
        check("--listen=unix:///run/kvd/kvd.sock" in c["args"], f"{overlay}: kvd listens on the shared socket")
        # Upgrades (docs/operations.md, "Upgrading kvd"): host nodes roll by hot handoff — the
        # surge pod takes over, the old one waits for its deletion, and every probe goes through the
        # shared socket (so the waiting old pod is neither restarted nor reported unready); CUDA
        # pools are not handed over, so GPU nodes are replaced pod by pod (OnDelete).
        strategy = ds["spec"].get("updateStrategy", {})
        if overlay == "host":
            ru = strategy.get("rollingUpdate", {})
            check(strategy.get("type") == "RollingUpdate" and ru.get("maxSurge") == 1 and ru.get("maxUnavailable") == 0,
                  f"host: rollouts surge one pod and never leave a node without kvd ({strategy})")
            check("--takeover" in c["args"] and "--after-handoff=wait" in c["args"],
                  "host: the new kvd takes over; the old one waits for its pod's deletion")
            check(all(c[p]["exec"]["command"][1] == "--target=unix:///run/kvd/kvd.sock"
                      for p in ("startupProbe", "readinessProbe", "livenessProbe")),
                  "host: every probe reaches kvd through the shared socket")
        else:
            check(strategy.get("type") == "OnDelete" and "rollingUpdate" not in strategy,
                  f"gpu: nodes are upgraded pod by pod (OnDelete: {strategy})")
            check("--takeover" not in c["args"],
                  "gpu: no --takeover (a replacement started while the deleted pod drains would be refused and "
                  f"crash-loop) ({c['args']})")
        ns = next(o for o in objs if o["kind"] == "Namespace")
        check(ns["metadata"].get("labels", {}).get("pod-security.kubernetes.io/enforce") == "privileged",
              f"{overlay}: kvd's namespace admits the privileged Pod Security level (hostPID, hostIPC, hostPath)")
        for probe in ("startupProbe", "readinessProbe"):
            check(probe in c and c[probe]["exec"]["command"][-1] == "health",
                  f"{overlay}: {probe} asks gRPC health over the socket")
        check("livenessProbe" in c, f"{overlay}: liveness probe set")
        check(c.get("securityContext", {}).get("runAsNonRoot") is True and
              pod["securityContext"].get("runAsUser") == KVD_UID, f"{overlay}: kvd runs as uid {KVD_UID}")
        check("nvidia.com/gpu" not in str(c.get("resources", {})), f"{overlay}: kvd reserves no GPU from the scheduler")
        port_names = {p["name"] for p in c["ports"]}
        pm = next((o for o in rendered["monitoring"] if o["kind"] == "PodMonitor"), None)
        check(pm is not None and pm["spec"]["podMetricsEndpoints"][0]["port"] in port_names,
              f"{overlay}: the PodMonitor scrapes a port the DaemonSet declares")

        # The configuration: accepted by this kvd, and the pod sized and timed for it.
        tmp = tempfile.mkdtemp(prefix="kvd-cm-")
        try:
            path = os.path.join(tmp, "kvd.yaml")
            open(path, "w").write(cm["data"]["kvd.yaml"])
            r = subprocess.run([kvd, "--config=" + path, "--print-config"], capture_output=True, text=True)
            check(r.returncode == 0, f"{overlay}: its kvd.yaml is accepted by kvd ({r.stderr.strip()})")
            eff = yaml.safe_load(r.stdout) if r.returncode == 0 else {}
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if not eff:
            continue
        check(str(eff.get("socket_group")) == "10001", f"{overlay}: the sockets belong to the workers' group 10001")
        check(eff.get("handoff_socket") != "off", f"{overlay}: the handoff socket is on")
        check(eff["tiers"].get("disk_dir", "").startswith("/var/lib/kvd/") and eff["tiers"].get("flush_on_drain"),
              f"{overlay}: the disk tier is on the hostPath and a drain flushes it")
        drain = float(eff["drain_timeout_s"])
        check(pod.get("terminationGracePeriodSeconds", 30) >= drain + 60,
              f"{overlay}: the grace period covers the drain ({drain:g} s) and a flush budget of 60 s")
        limit = c["resources"]["limits"]["memory"]
        units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
        m = re.match(r"^(\d+)(Ki|Mi|Gi|Ti)?$", limit)
        limit_bytes = int(m.group(1)) * units.get(m.group(2), 1) if m else 0
        host_pool = 0 if eff["backend"] == "cuda" else sum(
            p["capacity_blocks"] * p["block_tokens"] * p["num_layers"] * p["bytes_per_token_per_layer"] * p.get("shards", 1)
            for p in eff["pools"])
        need = host_pool + int(eff["tiers"]["host_bytes"])
        check(limit_bytes > need, f"{overlay}: the memory limit {limit} holds the host pools and host tier ({need} bytes)")
        if overlay == "gpu":
            check(eff["backend"] == "cuda", "gpu: backend cuda (no silent fall-back to host memory)")
            check(pod.get("runtimeClassName") == "nvidia", "gpu: the NVIDIA runtime class")
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            check(env.get("NVIDIA_VISIBLE_DEVICES") == "all", "gpu: every device visible to kvd")
            check("kvd-cuda" in c["image"], f"gpu: the CUDA image ({c['image']})")
        else:
            check(eff["backend"] == "host" and "runtimeClassName" not in pod, "host: host backend, no GPU runtime")
        init = pod.get("initContainers", [])
        check(len(init) == 1 and init[0]["securityContext"].get("runAsUser") == 0,
              f"{overlay}: an init container (as root) prepares the host directories")
        if overlay == "host" and init and os.geteuid() == 0 and shutil.which("setpriv"):
            check_init_every_start(check, init[0]["command"][-1],
                                   init[0]["securityContext"].get("capabilities", {}).get("add", []))
            check_socket_dir(check, init[0]["command"][-1], cm["data"]["kvd.yaml"], kvd)
        elif overlay == "host":
            print("skip: the hostPath ownership run needs root and setpriv")

    # host and gpu side by side in one cluster: no namespaced object of one is the other's, shared
    # objects (the Namespace) are identical, and no node runs both.
    host = {(o["kind"], o["metadata"]["name"]): o for o in rendered["host"]}
    gpu = {(o["kind"], o["metadata"]["name"]): o for o in rendered["gpu"]}
    shared = set(host) & set(gpu)
    check(shared == {("Namespace", "kvd"), ("PriorityClass", "kvd-node")} and all(host[k] == gpu[k] for k in shared),
          f"host and gpu apply side by side: they share only the Namespace and the PriorityClass, identical "
          f"({sorted(shared)})")

    def node_terms(objs):
        pod = next(o for o in objs if o["kind"] == "DaemonSet")["spec"]["template"]["spec"]
        exprs = [e for t in pod.get("affinity", {}).get("nodeAffinity", {}).get(
            "requiredDuringSchedulingIgnoredDuringExecution", {}).get("nodeSelectorTerms", [])
                 for e in t.get("matchExpressions", [])]
        return pod.get("nodeSelector", {}), exprs
    gsel, _ = node_terms(rendered["gpu"])
    _, hexprs = node_terms(rendered["host"])
    check(gsel.get("nvidia.com/gpu.present") == "true" and
          {"key": "nvidia.com/gpu.present", "operator": "NotIn", "values": ["true"]} in hexprs,
          "host and gpu select disjoint nodes: gpu those labelled nvidia.com/gpu.present=true, host every other")

    mon = {o["kind"]: o for o in rendered["monitoring"]}
    check(set(mon) == {"PodMonitor", "PrometheusRule"}, f"monitoring: a PodMonitor and a PrometheusRule ({sorted(mon)})")
    for kind, o in mon.items():
        check(o["metadata"].get("labels", {}).get("release"), f"monitoring: the {kind} carries the release label "
              "kube-prometheus-stack selects on")
    if "PrometheusRule" in mon:
        check(mon["PrometheusRule"]["spec"] == rules,
              "monitoring: the PrometheusRule's groups are deploy/prometheus/kvd-rules.yaml (promtool checks those)")

    # One example worker per overlay, that works with it: its image, a pool its config has, its nodes.
    for overlay in ("host", "gpu"):
        worker = yaml.safe_load(open(os.path.join(root, "deploy", "kubernetes", "examples", f"{overlay}-worker.yaml")))
        spec = worker["spec"]
        c = spec["containers"][0]
        check(spec.get("hostPID") is True and spec.get("hostIPC") is True, f"{overlay} example worker shares PID and IPC")
        check("/run/kvd" in {m["mountPath"] for m in c["volumeMounts"]}, f"{overlay} example worker mounts the socket dir")
        check(KVD_UID in spec["securityContext"].get("supplementalGroups", []), f"{overlay} example worker joins kvd's group")
        objs = rendered[overlay]
        ds = next((o for o in objs if o["kind"] == "DaemonSet"), None)
        cm = next((o for o in objs if o["kind"] == "ConfigMap"), None)
        if ds is None or cm is None:
            continue
        kvd_image = ds["spec"]["template"]["spec"]["containers"][0]["image"]
        check(c["image"] == kvd_image, f"{overlay} example worker runs the overlay's image ({c['image']} vs {kvd_image})")
        pools = {p["name"] for p in yaml.safe_load(cm["data"]["kvd.yaml"])["pools"]}
        pool = next((a.split("=", 1)[1] for a in c["args"] if a.startswith("--pool=")), "default")
        check(pool in pools, f"{overlay} example worker's pool {pool} is one of the overlay's ({sorted(pools)})")
        gpu_limit = c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
        if overlay == "gpu":
            check(gpu_limit == 1 and spec.get("nodeSelector", {}).get("nvidia.com/gpu.present") == "true",
                  "gpu example worker takes one GPU on a GPU node")
        else:
            check(gpu_limit is None and "nvidia.com/gpu.present" not in spec.get("nodeSelector", {}),
                  "host example worker takes no GPU (the host image has no CUDA)")
