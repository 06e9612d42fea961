#!/usr/bin/env python3
"""Inference proxy overhead: the same requests straight to the upstream (TCP) and through a
job's proxy socket. Each request opens its own connection (as the SBA does).

Usage: inference_proxy.py SOCKET [UPSTREAM_HOST:PORT]   (default 127.0.0.1:8097)
       inference_proxy.py SOCKET --loopback TOKEN
Setup (see docs/PERFORMANCE.md): a worker with `inference.base_url` set to the upstream,
and a running job with `use_inference: true` (e.g. `sleep 300`), whose socket is
<state>/jobs/<job_id>/job/inference.sock. With `--loopback`, the socket against the job's
loopback listener (127.0.0.1:11434, TOKEN its OPENAI_API_KEY): run it inside the job's
network namespace (`nsenter -t <pid in the sandbox> -n`).
CYNODE_BENCH_QUICK=1: one round of 5 + 2 requests per transport, for a test that checks the
path rather than measures it."""
import os, socket, time, json, statistics, sys
QUICK = os.environ.get("CYNODE_BENCH_QUICK") == "1"
SOCK = sys.argv[1]
LOOPBACK = len(sys.argv) > 3 and sys.argv[2] == "--loopback"
TOKEN = sys.argv[3] if LOOPBACK else ""
HOST, PORT = ("127.0.0.1:11434" if LOOPBACK else (sys.argv[2] if len(sys.argv) > 2 else "127.0.0.1:8097")).rsplit(":", 1)
def req(kind, method, path, body=b""):
    if kind=="unix":
        s=socket.socket(socket.AF_UNIX); s.connect(SOCK)
    else:
        s=socket.create_connection((HOST, int(PORT)))
    auth = f"Authorization: Bearer {TOKEN}\r\n" if TOKEN and kind != "unix" else ""
    s.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{auth}Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()+body)
    out=b""
    while True:
        d=s.recv(65536)
        if not d: break
        out+=d
    s.close()
    assert b" 200 " in out.split(b"\r\n")[0], out[:200]
def run(kind, method, path, body, n):
    ts=[]
    for _ in range(n):
        t=time.perf_counter(); req(kind, method, path, body); ts.append((time.perf_counter()-t)*1000)
    ts.sort()
    return statistics.median(ts), ts[int(len(ts)*0.9)]
chat=json.dumps({"model":"smollm2","messages":[{"role":"user","content":"hi"}],"max_tokens":1,"temperature":0}).encode()
for rnd in range(1 if QUICK else 2):
    for kind in ("loop","unix") if LOOPBACK else ("tcp","unix"):
        m=run(kind,"GET","/v1/models",b"",5 if QUICK else 300)
        c=run(kind,"POST","/v1/chat/completions",chat,2 if QUICK else 40)
        print(f"{kind:5} models p50 {m[0]:.2f} ms p90 {m[1]:.2f} ms | chat(max_tokens=1) p50 {c[0]:.2f} ms p90 {c[1]:.2f} ms")
