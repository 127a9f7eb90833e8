"""A legitimate target beside a misbehaving process on its own host: six completions (32 tokens),
first alone, then while sixteen connections from the same address (127.0.0.1) open 64 sessions
each and keep every one they got warm with cheap DRAFTs (the demo pair; the draft daemon on core
0, the target and the other process on core 1). Prints, for both, the rounds, those without
drafts, the drafts kept and the wall time, and the other process's sessions and refusals.

Usage, from a checkout: .venv/bin/python tools/measure_neighbours.py .venv/bin [starsd-draftd serve options]"""
import json, os, subprocess, sys, threading, time
sys.path.insert(0, os.getcwd())
import zmq
from common import protocol as P
from common.control import ControlClient
from common.protocol import Message, MsgType
from common.sockets import free_tcp_endpoint

BIN = sys.argv[1]; extra = sys.argv[2:]
from starsd_draftd.demo.checkpoints import ensure_demo_checkpoints
TARGET, DRAFT = (str(p) for p in ensure_demo_checkpoints())
PROMPTS = ["def parse(line):\n    ", "import os\nimport sys\n", "class Point:\n", "for i in range(10):",
           "# Read a file\n", "def main():\n"]

def start(args, core):
    return subprocess.Popen(["taskset", "-c", str(core), *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

def wait_ready(ep):
    for _ in range(400):
        try:
            with ControlClient(ep) as cc:
                cc.call(Message(MsgType.STATS, {}), timeout_s=2); return
        except Exception:
            time.sleep(0.3)
    raise SystemExit("not ready")

d_ep, t_ep = free_tcp_endpoint(), free_tcp_endpoint()
procs = [start([f"{BIN}/starsd-draftd", "serve", "--model", DRAFT, "--bind", d_ep, *extra], 0)]
procs.append(start([f"{BIN}/starsd-target", "serve", "--model", TARGET, "--listen", t_ep, "--draft", d_ep,
                    "--depth", "4"], 1))
stop = threading.Event()

held = [0]
refused = [0]


def neighbour():
    os.sched_setaffinity(0, {1})
    ctx = zmq.Context()
    vocab = json.load(open(TARGET + "/config.json"))["vocab_size"]
    from transformers import AutoTokenizer
    from common.models import tokenizer_fingerprint
    tok = AutoTokenizer.from_pretrained(TARGET)
    fp = tokenizer_fingerprint(tok, len(tok))
    socks = []
    for _ in range(16):
        s = ctx.socket(zmq.DEALER)
        s.connect(d_ep)
        s.send_multipart(P.encode(Message(MsgType.HELLO, {"vocab_size": vocab, "tokenizer": fp})))
        assert P.decode(s.recv_multipart()).type is MsgType.WELCOME
        socks.append(s)
    seq = {}
    for s in socks:
        for sid in range(1, 65):
            s.send_multipart(P.encode(Message(MsgType.OPEN, {"session": sid, "prompt": [5, 6, 7], "sampling": {"temperature": 0.0}})))
            s.send_multipart(P.encode(Message(MsgType.DRAFT, {"session": sid, "seq": 1, "accepted": 0, "new": [], "pos": 3, "depth": 1})))
            seq[(s, sid)] = 1
    poller = zmq.Poller()
    for s in socks:
        poller.register(s, zmq.POLLIN)
    while not stop.is_set():
        for s, _ in poller.poll(100):
            m = P.decode(s.recv_multipart())
            sid = m.header.get("session")
            if m.type is MsgType.DRAFTED:
                held[0] += seq[(s, sid)] == 1
                seq[(s, sid)] += 1  # warm: the same position again, nothing verified
                s.send_multipart(P.encode(Message(MsgType.DRAFT, {"session": sid, "seq": seq[(s, sid)], "accepted": 0,
                                                                  "new": [], "pos": 3, "depth": 1})))
            elif m.type is MsgType.ERROR:
                refused[0] += 1
    for s in socks:
        s.close(0)
    ctx.term()


def six():
    rounds = fallback = accepted = 0
    t0 = time.perf_counter()
    with ControlClient(t_ep) as cc:
        for p in PROMPTS:
            st = cc.call(Message(MsgType.GENERATE, {"id": 1, "prompt": p, "max_tokens": 32}), timeout_s=300).header["stats"]
            rounds += st["rounds"]; fallback += st["fallback_rounds"]; accepted += st["accepted"]
    return {"rounds": rounds, "fallback_rounds": fallback, "accepted": accepted, "wall_s": round(time.perf_counter() - t0, 2)}


try:
    wait_ready(t_ep)
    time.sleep(2)
    with ControlClient(t_ep) as cc:  # warm, healthy
        for p in PROMPTS[:2]:
            cc.call(Message(MsgType.GENERATE, {"id": 1, "prompt": p, "max_tokens": 32}), timeout_s=120)
    before = six()
    th = threading.Thread(target=neighbour, daemon=True); th.start()
    time.sleep(5)
    during = six()
    stop.set(); th.join(5)
    print(json.dumps({"args": extra, "alone": before, "beside_the_neighbour": during,
                      "neighbour_sessions_served": held[0], "neighbour_refusals": refused[0]}))
finally:
    stop.set()
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(10)
