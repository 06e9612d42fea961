"""deploy/check/invariants.py - the checks deploy/check.sh runs that no schema expresses.

  python invariants.py k8s RENDERED.yaml            the objects `kubectl kustomize` rendered
  python invariants.py containerfiles REPO FILE...  Containerfiles, with REPO as build context

Prints one line per problem and exits 1 when there is any. Needs PyYAML (the checker's
tool environment has it: kubernetes-validate depends on it).
"""

import re
import sys
from pathlib import Path

import yaml

problems = []


def problem(msg):
    problems.append(msg)


def key(obj):
    m = obj.get("metadata", {})
    return f"{obj.get('kind')}/{m.get('namespace', '-')}/{m.get('name')}"


def selects(selector, labels):
    return all(labels.get(k) == v for k, v in (selector or {}).items())


def containers(obj):
    return obj["spec"]["template"]["spec"].get("containers", [])


def check_k8s(path):
    objs = [o for o in yaml.safe_load_all(Path(path).read_text()) if o]
    by_kind = {}
    for o in objs:
        by_kind.setdefault(o["kind"], []).append(o)
    workloads = [
        o for o in objs if o["kind"] in ("Deployment", "StatefulSet", "DaemonSet")
    ]

    def pods_in(ns):
        return [
            (w, w["spec"]["template"]["metadata"].get("labels", {}))
            for w in workloads
            if w["metadata"].get("namespace") == ns
        ]

    namespaces = {o["metadata"]["name"] for o in by_kind.get("Namespace", [])}
    for o in objs:
        ns = o["metadata"].get("namespace")
        if o["kind"] != "Namespace" and ns not in namespaces:
            problem(f"{key(o)}: namespace {ns!r} is not created by these manifests")

    # Pod Security "restricted" where the namespace enforces it (the rules of that level
    # a manifest can show: no host namespaces or hostPath, non-root, no escalation, every
    # capability dropped, a seccomp profile).
    restricted = {
        o["metadata"]["name"]
        for o in by_kind.get("Namespace", [])
        if o["metadata"].get("labels", {}).get("pod-security.kubernetes.io/enforce")
        == "restricted"
    }
    for w in workloads:
        if w["metadata"].get("namespace") not in restricted:
            continue
        pod = w["spec"]["template"]["spec"]
        psc = pod.get("securityContext", {})
        if any(pod.get(k) for k in ("hostNetwork", "hostPID", "hostIPC")):
            problem(f"{key(w)}: host namespaces in a restricted namespace")
        if any("hostPath" in v for v in pod.get("volumes", [])):
            problem(f"{key(w)}: hostPath volume in a restricted namespace")
        for c in pod.get("containers", []) + pod.get("initContainers", []):
            sc = c.get("securityContext", {})
            where = f"{key(w)}: container {c['name']}"
            if not (sc.get("runAsNonRoot") or psc.get("runAsNonRoot")):
                problem(f"{where}: runAsNonRoot not set (restricted)")
            if sc.get("runAsUser", psc.get("runAsUser")) == 0:
                problem(f"{where}: runs as uid 0 (restricted)")
            if sc.get("allowPrivilegeEscalation") is not False:
                problem(f"{where}: allowPrivilegeEscalation not false (restricted)")
            if sc.get("capabilities", {}).get("drop") != ["ALL"]:
                problem(f"{where}: capabilities.drop is not [ALL] (restricted)")
            if set(sc.get("capabilities", {}).get("add", [])) - {"NET_BIND_SERVICE"}:
                problem(f"{where}: adds capabilities (restricted)")
            seccomp = sc.get("seccompProfile", psc.get("seccompProfile", {})).get("type")
            if seccomp not in ("RuntimeDefault", "Localhost"):
                problem(f"{where}: no RuntimeDefault seccomp profile (restricted)")
            if sc.get("privileged"):
                problem(f"{where}: privileged (restricted)")

    # Every workload's selector matches its own pod template.
    for w in workloads:
        sel = w["spec"]["selector"].get("matchLabels", {})
        if not selects(sel, w["spec"]["template"]["metadata"].get("labels", {})):
            problem(f"{key(w)}: spec.selector does not match the pod template labels")

    # Services, PDBs and NetworkPolicies select at least one workload's pods.
    for s in by_kind.get("Service", []):
        ns = s["metadata"]["namespace"]
        hits = [w for w, lbl in pods_in(ns) if selects(s["spec"].get("selector"), lbl)]
        if not hits:
            problem(f"{key(s)}: selector matches no pod template in {ns}")
        for port in s["spec"].get("ports", []):
            tp = port.get("targetPort")
            if isinstance(tp, str):
                names = {
                    p.get("name")
                    for w in hits
                    for c in containers(w)
                    for p in c.get("ports", [])
                }
                if tp not in names:
                    problem(f"{key(s)}: targetPort {tp!r} is no container port name")
    for p in by_kind.get("PodDisruptionBudget", []):
        ns = p["metadata"]["namespace"]
        sel = p["spec"]["selector"].get("matchLabels", {})
        if not any(selects(sel, lbl) for _, lbl in pods_in(ns)):
            problem(f"{key(p)}: selector matches no pod template in {ns}")
    for n in by_kind.get("NetworkPolicy", []):
        ns = n["metadata"]["namespace"]
        sel = n["spec"]["podSelector"].get("matchLabels", {})
        if not any(selects(sel, lbl) for _, lbl in pods_in(ns)):
            problem(f"{key(n)}: podSelector matches no pod template in {ns}")

    # Probes point at named container ports that exist.
    for w in workloads:
        for c in containers(w):
            names = {p.get("name") for p in c.get("ports", [])}
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                port = c.get(probe, {}).get("httpGet", {}).get("port")
                if isinstance(port, str) and port not in names:
                    problem(f"{key(w)}: {probe} port {port!r} is no container port name")

    # The PM: what issue 7 and design.md ask of it.
    pm = [d for d in by_kind.get("Deployment", []) if d["metadata"]["name"] == "cynode-pm"]
    if len(pm) != 1:
        problem("Deployment cynode-pm: missing")
    else:
        d = pm[0]
        if d["spec"].get("replicas", 1) < 2:
            problem(f"{key(d)}: fewer than 2 replicas")
        pod = d["spec"]["template"]["spec"]
        if not pod.get("securityContext", {}).get("runAsNonRoot"):
            problem(f"{key(d)}: pod securityContext.runAsNonRoot is not true")
        for c in pod["containers"]:
            sc = c.get("securityContext", {})
            if not sc.get("readOnlyRootFilesystem"):
                problem(f"{key(d)}: container {c['name']}: root filesystem not read-only")
            if sc.get("allowPrivilegeEscalation") is not False:
                problem(f"{key(d)}: container {c['name']}: privilege escalation allowed")
            if "ALL" not in sc.get("capabilities", {}).get("drop", []):
                problem(f"{key(d)}: container {c['name']}: capabilities not dropped")
            if c.get("readinessProbe", {}).get("httpGet", {}).get("path") != "/readyz":
                problem(f"{key(d)}: container {c['name']}: readiness probe is not /readyz")
            if c.get("livenessProbe", {}).get("httpGet", {}).get("path") != "/healthz":
                problem(f"{key(d)}: container {c['name']}: liveness probe is not /healthz")
            res = c.get("resources", {})
            if not res.get("requests") or not res.get("limits", {}).get("memory"):
                problem(f"{key(d)}: container {c['name']}: resources incomplete")
        pdbs = [
            p
            for p in by_kind.get("PodDisruptionBudget", [])
            if selects(
                p["spec"]["selector"].get("matchLabels"),
                d["spec"]["template"]["metadata"]["labels"],
            )
        ]
        if not pdbs:
            problem(f"{key(d)}: no PodDisruptionBudget covers it")
        elif any(p["spec"].get("minAvailable", 0) < 1 for p in pdbs):
            problem(f"{key(d)}: its PodDisruptionBudget allows zero available")

    # The worker: a DaemonSet with the runtime socket, reachable only through a policy.
    ds = [d for d in by_kind.get("DaemonSet", []) if d["metadata"]["name"] == "cynode-worker"]
    if len(ds) != 1:
        problem("DaemonSet cynode-worker: missing")
    else:
        d = ds[0]
        vols = d["spec"]["template"]["spec"].get("volumes", [])
        if not any(v.get("hostPath", {}).get("type") == "Socket" for v in vols):
            problem(f"{key(d)}: no hostPath Socket volume for the container runtime")
        state = [v for v in vols if v.get("hostPath", {}).get("path") == "/var/lib/cynode-worker"]
        mounts = {m["name"]: m["mountPath"] for c in containers(d) for m in c.get("volumeMounts", [])}
        if not state or mounts.get(state[0]["name"]) != "/var/lib/cynode-worker":
            problem(f"{key(d)}: the state directory is not mounted at its host path")
        labels = d["spec"]["template"]["metadata"]["labels"]
        pols = [
            n
            for n in by_kind.get("NetworkPolicy", [])
            if n["metadata"]["namespace"] == d["metadata"]["namespace"]
            and selects(n["spec"]["podSelector"].get("matchLabels"), labels)
        ]
        if not pols or not all("Ingress" in n["spec"].get("policyTypes", []) for n in pols):
            problem(f"{key(d)}: no NetworkPolicy limits who reaches the worker")
        # The config the ConfigMap carries must point at paths the pod really mounts.
        cms = [
            c
            for c in by_kind.get("ConfigMap", [])
            if c["metadata"]["name"] == "cynode-worker-config"
        ]
        if cms:
            cfg = yaml.safe_load(cms[0]["data"]["worker.yaml"])
            tf = cfg.get("token_file", "")
            if not any(tf.startswith(p.rstrip("/") + "/") for p in mounts.values()):
                problem(f"{key(d)}: worker.yaml token_file {tf!r} is under no volume mount")
            if cfg.get("state_dir") != "/var/lib/cynode-worker":
                problem(f"{key(d)}: worker.yaml state_dir is not /var/lib/cynode-worker")
            port = int(str(cfg.get("listen", ":0")).rsplit(":", 1)[1])
            cports = {p["containerPort"] for c in containers(d) for p in c.get("ports", [])}
            if port not in cports:
                problem(f"{key(d)}: worker.yaml listens on {port}, no container port")
        else:
            problem("ConfigMap cynode-worker-config: missing")


FROM_RE = re.compile(r"^FROM\s+(?:--\S+\s+)*(\S+)(?:\s+AS\s+(\S+))?", re.I)


def check_containerfile(repo, path):
    text = Path(path).read_text()
    # Join continuation lines; drop comments.
    lines = []
    cur = ""
    for raw in text.splitlines():
        if raw.lstrip().startswith("#") and not cur:
            continue
        if raw.rstrip().endswith("\\"):
            cur += raw.rstrip()[:-1] + " "
            continue
        lines.append(cur + raw)
        cur = ""
    stages = []
    for line in lines:
        m = FROM_RE.match(line.strip())
        if m:
            stages.append({"image": m.group(1), "name": m.group(2), "lines": []})
        elif stages:
            stages[-1]["lines"].append(line.strip())
    if not stages:
        problem(f"{path}: no FROM")
        return
    names = {s["name"] for s in stages if s["name"]}
    for s in stages:
        img = s["image"]
        if img not in names and "/" not in img.split(":")[0]:
            problem(f"{path}: FROM {img}: not fully qualified (podman needs registry/name)")
    final = stages[-1]["lines"]
    # A service (it EXPOSEs a port) carries a HEALTHCHECK; a one-shot runner (the SBA)
    # has nothing to probe.
    exposes = any(l.upper().startswith("EXPOSE ") for l in final)
    if exposes and not any(l.upper().startswith("HEALTHCHECK ") for l in final):
        problem(f"{path}: the final stage EXPOSEs a port but has no HEALTHCHECK")
    users = [l.split(None, 1)[1] for l in final if l.upper().startswith("USER ")]
    if not users:
        problem(f"{path}: final stage sets no USER")
    # Build-context sources must exist (images cannot be built here, so catch a renamed
    # or missing file now). Sources with a build ARG in them are artifacts made first.
    for s in stages:
        for l in s["lines"]:
            if not l.upper().startswith(("COPY ", "ADD ")):
                continue
            words = [w for w in l.split()[1:] if not w.startswith("--")]
            if "--from=" in l or len(words) < 2:
                continue
            for src in words[:-1]:
                if "$" in src:
                    continue
                if not list(Path(repo).glob(src)):
                    problem(f"{path}: COPY source {src!r} does not exist in the build context")


def main():
    if len(sys.argv) >= 3 and sys.argv[1] == "k8s":
        check_k8s(sys.argv[2])
    elif len(sys.argv) >= 4 and sys.argv[1] == "containerfiles":
        for f in sys.argv[3:]:
            check_containerfile(sys.argv[2], f)
    else:
        print(__doc__, file=sys.stderr)
        return 2
    for p in problems:
        print(f"invariant: {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
