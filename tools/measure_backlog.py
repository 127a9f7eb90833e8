"""A legitimate target's rounds behind another host's backlog of 2,000-token prefills: six
completions (32 tokens) while a client on 127.0.0.2 keeps seven sessions re-opened with fresh
2,000-token prompts (the demo pair; the draft daemon on core 0, the target and the other host on
core 1). Prints the rounds, those without drafts, the drafts kept and the wall time.

Usage, from a checkout: .venv/bin/python tools/measure_backlog.py .venv/bin [starsd-draftd serve options]"""
import json, os, random, subprocess, sys, threading, time
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
sent = [0]

def other_host():
    os.sched_setaffinity(0, {1})
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    port = d_ep.rsplit(":", 1)[1]
    s.connect(f"tcp://127.0.0.2:0;127.0.0.1:{port}")
    vocab = json.load(open(TARGET + "/config.json"))["vocab_size"]
    from transformers import AutoTokenizer
    from common.models import tokenizer_fingerprint
    tok = AutoTokenizer.from_pretrained(TARGET)
    s.send_multipart(P.encode(Message(MsgType.HELLO, {"vocab_size": vocab, "tokenizer": tokenizer_fingerprint(tok, len(tok))})))
    assert P.decode(s.recv_multipart()).type is MsgType.WELCOME
    rng = random.Random(0)
    def go(sid):
        prompt = [rng.randrange(100, vocab - 1) for _ in range(2000)]
        s.send_multipart(P.encode(Message(MsgType.OPEN, {"session": sid, "prompt": prompt, "sampling": {"temperature": 0.0}})))
        s.send_multipart(P.encode(Message(MsgType.DRAFT, {"session": sid, "seq": 1, "accepted": 0, "new": [], "pos": 2000, "depth": 4})))
        sent[0] += 1
    for sid in range(1, 8):
        go(sid)
    while not stop.is_set():
        if s.poll(100):
            m = P.decode(s.recv_multipart())
            if m.type in (MsgType.DRAFTED, MsgType.ERROR) and m.header.get("session"):
                go(m.header["session"])
    s.close(0); ctx.term()

try:
    wait_ready(t_ep)
    time.sleep(2)
    with ControlClient(t_ep) as cc:  # warm, healthy
        for p in PROMPTS[:2]:
            cc.call(Message(MsgType.GENERATE, {"id": 1, "prompt": p, "max_tokens": 32}), timeout_s=120)
    th = threading.Thread(target=other_host, daemon=True); th.start()
    time.sleep(3)
    rounds = fallback = accepted = 0
    t0 = time.perf_counter()
    with ControlClient(t_ep) as cc:
        for p in PROMPTS:
            st = cc.call(Message(MsgType.GENERATE, {"id": 1, "prompt": p, "max_tokens": 32}), timeout_s=300).header["stats"]
            rounds += st["rounds"]; fallback += st["fallback_rounds"]; accepted += st["accepted"]
    wall = time.perf_counter() - t0
    stop.set(); th.join(5)
    print(json.dumps({"args": extra, "rounds": rounds, "fallback_rounds": fallback, "accepted": accepted,
                      "wall_s": round(wall, 2), "other_host_prefills": sent[0]}))
finally:
    stop.set()
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(10)
