"""Six completions one after another on a target whose draft daemon is SIGSTOPped, beside a
target with no draft daemon and one whose draft endpoint is unreachable (the demo pair, the draft
daemon on core 0, the targets on core 1; three runs each). Prints the times and their ratios.

Usage, from a checkout: .venv/bin/python tools/measure_hung.py .venv/bin (the daemons of that venv run)."""
import os, signal, subprocess, sys, time, json
sys.path.insert(0, os.getcwd())
from common.control import ControlClient
from common.protocol import Message, MsgType
from common.sockets import free_tcp_endpoint

BIN = sys.argv[1]
from starsd_draftd.demo.checkpoints import ensure_demo_checkpoints
TARGET, DRAFT = (str(p) for p in ensure_demo_checkpoints())
PROMPTS = ["def parse(line):\n    ", "import os\nimport sys\n", "class Point:\n", "for i in range(10):",
           "# Read a file\n", "def main():\n"]
N = 24

def start(args, core):
    return subprocess.Popen(["taskset", "-c", str(core), f"{BIN}/{args[0]}", *args[1:]],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

def wait_ready(ep, timeout=120):
    t = time.monotonic() + timeout
    while time.monotonic() < t:
        try:
            with ControlClient(ep) as cc:
                cc.call(Message(MsgType.STATS, {}), timeout_s=2)
                return
        except Exception:
            time.sleep(0.3)
    raise SystemExit(f"{ep} not ready")

def six(ep):
    out = []
    with ControlClient(ep) as cc:
        t0 = time.perf_counter()
        for p in PROMPTS:
            r = cc.call(Message(MsgType.GENERATE, {"id": 1, "prompt": p, "max_tokens": N}), timeout_s=120).header
            out.append(r["stats"])
        return time.perf_counter() - t0, out

def target(ep, draft=None):
    args = ["starsd-target", "serve", "--model", TARGET, "--listen", ep, "--depth", "4"]
    args += ["--draft", draft] if draft else ["--no-draft"]
    return start(args, 1)

res = {}
procs = []
try:
    d_ep = free_tcp_endpoint()
    d = start(["starsd-draftd", "serve", "--model", DRAFT, "--bind", d_ep], 0); procs.append(d)
    t_ep, a_ep, u_ep = free_tcp_endpoint(), free_tcp_endpoint(), free_tcp_endpoint()
    t = target(t_ep, d_ep); procs.append(t)
    a = target(a_ep); procs.append(a)
    u = target(u_ep, free_tcp_endpoint()); procs.append(u)
    for ep in (t_ep, a_ep, u_ep):
        wait_ready(ep)
    time.sleep(2)
    healthy = six(t_ep)  # warm, with drafts
    res["healthy_s"] = healthy[0]
    res["healthy_fallback"] = sum(s["fallback_rounds"] for s in healthy[1])
    for rep in range(3):
        res.setdefault("alone_s", []).append(six(a_ep)[0])
        res.setdefault("unreachable_s", []).append(six(u_ep)[0])
        os.kill(d.pid, signal.SIGSTOP)
        hs, st = six(t_ep)
        os.kill(d.pid, signal.SIGCONT)
        res.setdefault("stopped_s", []).append(hs)
        res.setdefault("stopped_fallback", []).append(sum(s["fallback_rounds"] for s in st))
        time.sleep(3)  # the link comes back
        h = six(t_ep)
        res.setdefault("resumed_s", []).append(h[0])
        res.setdefault("resumed_accepted", []).append(sum(s["accepted"] for s in h[1]))
finally:
    for p in procs:
        try: os.kill(p.pid, signal.SIGCONT)
        except Exception: pass
        p.terminate()
    for p in procs:
        p.wait(10)
print(json.dumps(res, indent=1))
a = sum(res["alone_s"]) / 3
print("stopped/alone %.2f  unreachable/alone %.2f" % (sum(res["stopped_s"]) / 3 / a, sum(res["unreachable_s"]) / 3 / a))
