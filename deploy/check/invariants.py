"""deploy/check/invariants.py - the checks deploy/check.sh runs that no schema expresses.

  python invariants.py k8s RENDERED.yaml            the objects `kubectl kustomize` rendered
  python invariants.py containerfiles REPO FILE...  Containerfiles, with REPO as build context
  python invariants.py compose RENDERED.json        `docker-compose config --format json`
  python invariants.py systemd UNIT WORKERS.yaml    cynode-pm.service and its example registry

The PM's worker registry (--workers-file) is cross-checked in each: the flag names a file
the PM really gets (a key of a mounted ConfigMap, a read-only bind mount, the path the
unit's install steps put it at), every token_file is a secret the PM really has, every
endpoint is one worker's own address (never a Service in front of several), and each
image is one the worker allows. The file's own rules are the PM's parser's
(pm/tests/deploy.rs parses every shipped registry with it).

Prints one line per problem and exits 1 when there is any. Needs PyYAML (the checker's
tool environment has it: kubernetes-validate depends on it).
"""

import json
import re
import sys
from pathlib import Path
from urllib.parse import urlsplit

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


def flag(args, name):
    """The value of `--name=V` or `--name V` in an argument list, else None."""
    for i, a in enumerate(args):
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
        if a == name and i + 1 < len(args):
            return args[i + 1]
    return None


def under(path, dirs):
    """The longest of dirs that path lies beneath, else None."""
    hits = [d for d in dirs if path.startswith(d.rstrip("/") + "/")]
    return max(hits, key=len) if hits else None


def registry(where, text):
    """The worker registry's entries (the PM's parser checks the rest), or None."""
    try:
        reg = yaml.safe_load(text)
        workers = reg["workers"]
        assert isinstance(workers, list) and workers
    except Exception as e:  # noqa: BLE001 - any shape problem is reported the same way
        problem(f"{where}: not a workers file with a `workers` list ({e!r})")
        return None
    ids = [w.get("id") for w in workers]
    for dup in sorted({i for i in ids if ids.count(i) > 1}):
        problem(f"{where}: worker id {dup!r} is used twice")
    return workers


def check_images(where, worker, allowed):
    """Every image the registry names for worker is in the worker's allowlist."""
    if not allowed:  # empty: the worker allows any local image
        return
    for purpose, image in (worker.get("purposes") or {}).items():
        if image not in allowed:
            problem(
                f"{where}: worker {worker.get('id')!r} purpose {purpose!r}: image {image!r} "
                f"is not in the worker's images {allowed}"
            )


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
        if any(p.get("hostPort") for c in pod.get("containers", []) for p in c.get("ports", [])):
            problem(f"{key(w)}: hostPort in a restricted namespace")
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

    # The PM: what design.md asks of its Deployment.
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

    if len(pm) == 1 and len(ds) == 1:
        check_k8s_registry(pm[0], ds[0], by_kind)


def check_k8s_registry(d, ds, by_kind):
    """The PM's --workers-file: a key of a ConfigMap mounted read-only in its pod, whose
    workers are reached at the worker DaemonSet's hostPort on each node."""
    pod = d["spec"]["template"]["spec"]
    vols = {v["name"]: v for v in pod.get("volumes", [])}
    c = pod["containers"][0]
    args = c.get("command", []) + c.get("args", [])
    where = f"{key(d)}: container {c['name']}"
    if flag(args, "--worker-endpoint"):
        problem(
            f"{where}: --worker-endpoint: one address for node-local workers; "
            "list each node's worker in --workers-file"
        )
    wf = flag(args, "--workers-file")
    if not wf:
        problem(f"{where}: no --workers-file")
        return
    mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
    mp = under(wf, mounts)
    if mp is None:
        problem(f"{where}: --workers-file {wf} is under no volume mount")
        return
    m = mounts[mp]
    cmv = vols.get(m["name"], {}).get("configMap")
    if not cmv:
        problem(f"{where}: --workers-file {wf} is not on a ConfigMap volume")
        return
    if not m.get("readOnly"):
        problem(f"{where}: the workers file's volume is not mounted readOnly")
    rel = wf[len(mp.rstrip("/")) + 1 :]
    items = cmv.get("items")
    k = rel if not items else next((i["key"] for i in items if i["path"] == rel), None)
    cms = [
        o
        for o in by_kind.get("ConfigMap", [])
        if o["metadata"]["name"] == cmv["name"]
        and o["metadata"].get("namespace") == d["metadata"]["namespace"]
    ]
    if k is None:
        problem(f"{where}: --workers-file {wf}: volume {m['name']} projects no item at {rel!r}")
        return
    if not cms or k not in (cms[0].get("data") or {}):
        problem(f"{where}: --workers-file {wf}: ConfigMap {cmv['name']} has no key {k!r}")
        return
    workers = registry(f"{key(cms[0])} {k}", cms[0]["data"][k])
    if workers is None:
        return
    secret_dirs = [
        p for p, mm in mounts.items() if "secret" in vols.get(mm["name"], {})
    ]
    host_ports = {
        p.get("hostPort") for wc in containers(ds) for p in wc.get("ports", [])
    } - {None}
    services = {
        n
        for s in by_kind.get("Service", [])
        for n in (
            s["metadata"]["name"],
            f"{s['metadata']['name']}.{s['metadata']['namespace']}",
        )
    }
    wcm = [
        o for o in by_kind.get("ConfigMap", []) if o["metadata"]["name"] == "cynode-worker-config"
    ]
    allowed = yaml.safe_load(wcm[0]["data"]["worker.yaml"]).get("images", []) if wcm else []
    for w in workers:
        wid = w.get("id")
        tf = w.get("token_file")
        if tf and under(tf, secret_dirs) is None:
            problem(f"{where}: worker {wid!r}: token_file {tf} is on no Secret volume of the PM")
        u = urlsplit(str(w.get("endpoint", "")))
        host = u.hostname or ""
        if host in services or host.endswith(".svc") or ".svc." in host:
            problem(
                f"{where}: worker {wid!r}: endpoint {w.get('endpoint')} is a Service; "
                "a session's calls must all reach its node's worker"
            )
        if u.port not in host_ports:
            problem(
                f"{where}: worker {wid!r}: endpoint port {u.port} is no hostPort of "
                f"{key(ds)} ({sorted(host_ports)})"
            )
        check_images(where, w, allowed)


def check_compose(path):
    """Each PM service reads --workers-file from a read-only bind mount of a file in the
    repository, with its tokens from the PM's secrets and its endpoints at the compose
    worker services, whose own config allows the images."""
    cfg = json.loads(Path(path).read_text())
    services = cfg.get("services", {})
    pms = {n: s for n, s in services.items() if "cynode-pm" in str(s.get("image", ""))}
    if not pms:
        problem("compose: no cynode-pm service")
    for name, s in sorted(pms.items()):
        where = f"compose: service {name}"
        args = s.get("command") or []
        if flag(args, "--worker-endpoint"):
            problem(f"{where}: --worker-endpoint: use --workers-file (the worker registry)")
        wf = flag(args, "--workers-file")
        if not wf:
            problem(f"{where}: no --workers-file")
            continue
        vol = [v for v in s.get("volumes", []) if v.get("target") == wf]
        if not vol or vol[0].get("type") != "bind":
            problem(f"{where}: --workers-file {wf} is no bind-mounted file")
            continue
        if not vol[0].get("read_only"):
            problem(f"{where}: {wf} is not mounted read-only")
        src = Path(vol[0]["source"])
        if not src.is_file():
            problem(f"{where}: {wf} comes from {src}, which is not a file")
            continue
        workers = registry(f"{where}: {src.name}", src.read_text())
        if workers is None:
            continue
        secrets = {
            sec.get("target") or f"/run/secrets/{sec['source']}" for sec in s.get("secrets", [])
        }
        for w in workers:
            wid = w.get("id")
            tf = w.get("token_file")
            if tf and tf not in secrets:
                problem(f"{where}: worker {wid!r}: token_file {tf} is none of its secrets {sorted(secrets)}")
            u = urlsplit(str(w.get("endpoint", "")))
            target = services.get(u.hostname or "")
            if target is None:
                problem(f"{where}: worker {wid!r}: endpoint host {u.hostname!r} is no service")
                continue
            if not set(target.get("networks", {})) & set(s.get("networks", {})):
                problem(f"{where}: worker {wid!r}: shares no network with {u.hostname}")
            conf = [
                v for v in target.get("volumes", []) if v.get("target") == "/etc/cynode/worker.yaml"
            ]
            if conf and Path(conf[0]["source"]).is_file():
                wcfg = yaml.safe_load(Path(conf[0]["source"]).read_text()) or {}
                port = int(str(wcfg.get("listen", ":0")).rsplit(":", 1)[1])
                if u.port != port:
                    problem(f"{where}: worker {wid!r}: endpoint port {u.port}, the worker listens on {port}")
                check_images(where, w, wcfg.get("images", []))


def check_systemd_registry(unit_path, workers_path):
    """cynode-pm.service reads the registry its install steps put in place, and every
    token_file of that registry is a credential the unit loads."""
    unit = Path(unit_path)
    text = unit.read_text()
    where = f"{unit.name}"
    joined = re.sub(r"\\\n\s*", " ", text)
    exec_start = re.search(r"^ExecStart=(.*)$", joined, re.M)
    args = exec_start.group(1).split() if exec_start else []
    wf = flag(args, "--workers-file")
    if not wf:
        problem(f"{where}: ExecStart has no --workers-file")
        return
    example = Path(workers_path)
    install = re.search(
        rf"^#\s+install .*deploy/systemd/{re.escape(example.name)}\s+(\S+)", text, re.M
    )
    if not install or install.group(1) != wf:
        problem(
            f"{where}: --workers-file {wf}, but the install steps put "
            f"deploy/systemd/{example.name} at {install.group(1) if install else 'nowhere'}"
        )
    creds = set(re.findall(r"^LoadCredential=([^:\s]+)", text, re.M))
    workers = registry(str(example), example.read_text())
    for w in workers or []:
        tf = str(w.get("token_file", ""))
        prefix = f"/run/credentials/{unit.name}/"
        if not tf.startswith(prefix) or tf[len(prefix) :] not in creds:
            problem(
                f"{example.name}: worker {w.get('id')!r}: token_file {tf} is none of "
                f"{unit.name}'s credentials ({', '.join(prefix + c for c in sorted(creds))})"
            )


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
    elif len(sys.argv) == 3 and sys.argv[1] == "compose":
        check_compose(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "systemd":
        check_systemd_registry(sys.argv[2], sys.argv[3])
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
