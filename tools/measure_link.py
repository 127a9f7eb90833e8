"""A target's completions when its draft daemon is not there for it (the demo pair; the draft
daemon on core 0, the targets and any other clients on core 1). One of:

- stopped: six completions (24 tokens) on a target whose draft daemon is SIGSTOPped, beside a
  target with no draft daemon and one whose draft endpoint is unreachable, three runs each;
- backlog: six completions (32 tokens) alone, then while another host (127.0.0.2) keeps seven
  sessions re-opened with fresh 2,000-token prompts, so the draft daemon always has long
  prefills queued;
- neighbours: the same, while sixteen connections from the target's own address (127.0.0.1)
  open 64 sessions each and keep every one they got warm with cheap DRAFTs.

Logs one JSON line: the wall times, rounds, rounds without drafts and drafts kept of each run
(and what the other clients were served and refused, or the times' ratios).

Usage, from a checkout: .venv/bin/python tools/measure_link.py .venv/bin stopped|backlog|neighbours [starsd-draftd serve options]"""
import json, logging, os, random, signal, subprocess, sys, tempfile, threading, time
sys.path.insert(0, os.getcwd())
import zmq
from common import protocol as P
from common.control import ControlClient
from common.protocol import Message, MsgType
from common.sockets import free_tcp_endpoint
from starsd_draftd.demo.checkpoints import ensure_demo_checkpoints

BIN, SCENARIO, extra = sys.argv[1], sys.argv[2], sys.argv[3:]
if SCENARIO not in ("stopped", "backlog", "neighbours"):
    raise SystemExit(f"unknown scenario {SCENARIO!r}: stopped, backlog or neighbours")
TARGET, DRAFT = (str(p) for p in ensure_demo_checkpoints())
PROMPTS = ["def parse(line):\n    ", "import os\nimport sys\n", "class Point:\n", "for i in range(10):",
           "# Read a file\n", "def main():\n"]
counts = {"served": 0, "refused": 0}
stop = threading.Event()
log = logging.getLogger("measure_link")


def start(args, core):
    return subprocess.Popen(["taskset", "-c", str(core), *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_ready(ep):
    for _ in range(400):
        try:
            with ControlClient(ep) as cc:
                cc.call(Message(MsgType.STATS, {}), timeout_s=2)
                return
        except Exception:
            time.sleep(0.3)
    raise SystemExit("not ready")


def greeted(ctx, endpoint):
    """A DEALER that completed the handshake, as a target of the demo pair."""
    from transformers import AutoTokenizer
    from common.models import tokenizer_fingerprint
    tok = AutoTokenizer.from_pretrained(TARGET)
    vocab = json.load(open(TARGET + "/config.json"))["vocab_size"]
    s = ctx.socket(zmq.DEALER)
    s.connect(endpoint)
    s.send_multipart(P.encode(Message(MsgType.HELLO, {"vocab_size": vocab, "tokenizer": tokenizer_fingerprint(tok, len(tok))})))
    assert P.decode(s.recv_multipart()).type is MsgType.WELCOME
    return s, vocab


def send(s, mtype, header):
    s.send_multipart(P.encode(Message(mtype, header)))


def backlog(ctx, d_ep):
    s, vocab = greeted(ctx, f"tcp://127.0.0.2:0;127.0.0.1:{d_ep.rsplit(':', 1)[1]}")
    rng = random.Random(0)

    def go(sid):
        send(s, MsgType.OPEN, {"session": sid, "prompt": [rng.randrange(100, vocab - 1) for _ in range(2000)],
                               "sampling": {"temperature": 0.0}})
        send(s, MsgType.DRAFT, {"session": sid, "seq": 1, "accepted": 0, "new": [], "pos": 2000, "depth": 4})
    for sid in range(1, 8):
        go(sid)
    while not stop.is_set():
        if s.poll(100):
            m = P.decode(s.recv_multipart())
            if m.type in (MsgType.DRAFTED, MsgType.ERROR) and m.header.get("session"):
                counts["served" if m.type is MsgType.DRAFTED else "refused"] += 1
                go(m.header["session"])
    return [s]


def neighbours(ctx, d_ep):
    socks, seq = [greeted(ctx, d_ep)[0] for _ in range(16)], {}
    for s in socks:
        for sid in range(1, 65):
            send(s, MsgType.OPEN, {"session": sid, "prompt": [5, 6, 7], "sampling": {"temperature": 0.0}})
            send(s, MsgType.DRAFT, {"session": sid, "seq": 1, "accepted": 0, "new": [], "pos": 3, "depth": 1})
            seq[(s, sid)] = 1
    poller = zmq.Poller()
    for s in socks:
        poller.register(s, zmq.POLLIN)
    while not stop.is_set():
        for s, _ in poller.poll(100):
            m = P.decode(s.recv_multipart())
            sid = m.header.get("session")
            if m.type is MsgType.DRAFTED:  # warm: the same position again, nothing verified
                counts["served"] += 1
                seq[(s, sid)] += 1
                send(s, MsgType.DRAFT, {"session": sid, "seq": seq[(s, sid)], "accepted": 0, "new": [], "pos": 3,
                                        "depth": 1})
            elif m.type is MsgType.ERROR:
                counts["refused"] += 1
    return socks


def others(d_ep):
    os.sched_setaffinity(0, {1})
    ctx = zmq.Context()
    for s in {"backlog": backlog, "neighbours": neighbours}[SCENARIO](ctx, d_ep):
        s.close(0)
    ctx.term()


def six(t_ep, max_tokens=32):
    out = {"rounds": 0, "fallback_rounds": 0, "accepted": 0}
    t0 = time.perf_counter()
    with ControlClient(t_ep) as cc:
        for p in PROMPTS:
            st = cc.call(Message(MsgType.GENERATE, {"id": 1, "prompt": p, "max_tokens": max_tokens}),
                         timeout_s=600).header["stats"]
            for k in out:
                out[k] += st[k]
    out["wall_s"] = round(time.perf_counter() - t0, 2)
    return out


JOBS = tempfile.mkdtemp(prefix="starsd-jobs-")  # the targets' job sockets: ipc, this user's alone


def job_endpoint(name):
    return f"ipc://{JOBS}/{name}.sock"


def target(ep, draft=None):
    """A target daemon on core 1: drafting from ``draft``, or with none (--no-draft)."""
    return start([f"{BIN}/starsd-target", "serve", "--model", TARGET, "--listen", ep, "--depth", "4",
                  *(["--draft", draft] if draft else ["--no-draft"])], 1)


def crowd(procs, d_ep):
    t_ep = job_endpoint("crowd")
    procs.append(target(t_ep, d_ep))
    wait_ready(t_ep)
    time.sleep(2)
    six(t_ep)  # warm
    alone = six(t_ep)
    th = threading.Thread(target=others, args=(d_ep,), daemon=True)
    th.start()
    time.sleep(5)
    crowded = six(t_ep)
    stop.set()
    th.join(5)
    return {"alone": alone, "crowded": crowded, "others": counts}


def stopped(procs, d_ep):
    eps = {name: job_endpoint(name) for name in ("drafted", "alone", "unreachable")}
    drafts = {"drafted": d_ep, "alone": None, "unreachable": free_tcp_endpoint()}
    procs += [target(eps[k], drafts[k]) for k in eps]
    for ep in eps.values():
        wait_ready(ep)
    time.sleep(2)
    runs = {"healthy": [six(eps["drafted"], 24)]}  # warm, with drafts
    for _ in range(3):
        runs.setdefault("alone", []).append(six(eps["alone"], 24))
        runs.setdefault("unreachable", []).append(six(eps["unreachable"], 24))
        os.kill(procs[0].pid, signal.SIGSTOP)
        try:
            runs.setdefault("stopped", []).append(six(eps["drafted"], 24))
        finally:
            os.kill(procs[0].pid, signal.SIGCONT)
        time.sleep(3)  # the link comes back
        runs.setdefault("resumed", []).append(six(eps["drafted"], 24))
    wall = {k: sum(r["wall_s"] for r in v) for k, v in runs.items()}
    return {"runs": runs, "stopped/alone": round(wall["stopped"] / wall["alone"], 3),
            "unreachable/alone": round(wall["unreachable"] / wall["alone"], 3)}


def main():
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    d_ep = free_tcp_endpoint()
    procs = [start([f"{BIN}/starsd-draftd", "serve", "--model", DRAFT, "--bind", d_ep, *extra], 0)]
    try:
        res = (stopped if SCENARIO == "stopped" else crowd)(procs, d_ep)
        log.info("%s", json.dumps({"scenario": SCENARIO, "args": extra, **res}))
    finally:
        stop.set()
        for p in procs:
            p.send_signal(signal.SIGCONT)
            p.terminate()
        for p in procs:
            p.wait(10)


if __name__ == "__main__":
    main()
