"""A 24-token draft tree against the chain, the demo pair in its default format: the draft daemon
(`--backend model` unless BACKEND says, `--tree-topk 8`, no suffix drafts, no lookahead) on
core 0 and three target daemons on core 1, one thread each, depth 4:

- chain: `--draft-tokens 4`;
- tree24-pruned: `--draft-tokens 24` with adaptive depth (the default): the tree keeps the nodes
  that pay their verified row by the target's measured costs;
- tree24-full: `--draft-tokens 24 --no-adaptive-depth`: every tree fills its budget.

Four greedy prompts of 64 tokens per configuration, four passes in alternating order, the first
a warm-up. Logs each configuration's tokens per second, rounds, tokens kept and drafts sent per
round, tree rounds and rounds without drafts, and whether every output equals the chain's; writes
trees.json to OUT.

BACKEND (default model): eagle or eagle3 serves the demo target's EAGLE head instead of the
draft model (`--eagle-head demo-eagle`, trained once and cached by `starsd-draftd demo --backend
eagle`).

Usage, from a checkout: .venv/bin/python tools/measure_trees.py OUT [BACKEND]"""
import json, logging, os, sys, time
from pathlib import Path
sys.path.insert(0, os.getcwd())
from common.control import ControlClient
from common.protocol import Message, MsgType
from common.sockets import free_tcp_endpoint
from starsd_draftd.bench.procs import ProcessSet
from starsd_draftd.demo.prompts import DEMO_PROMPTS

CONFIGS = {"chain": ["--draft-tokens", "4"], "tree24-pruned": ["--draft-tokens", "24"],
           "tree24-full": ["--draft-tokens", "24", "--no-adaptive-depth"]}
PASSES = 4  # the first a warm-up
log = logging.getLogger("measure_trees")
logging.basicConfig(level=logging.INFO, format="%(message)s")
out = Path(sys.argv[1])
backend = sys.argv[2] if len(sys.argv) > 2 else "model"
drafter = (["--model", "demo-draft"] if backend == "model" else
           ["--backend", backend, "--eagle-head", f"demo-{backend}", "--base-model", "demo"])
out.mkdir(parents=True, exist_ok=True)
procs = ProcessSet(out)
try:
    draft_ep = free_tcp_endpoint()
    procs.start("draftd", "starsd_draftd", "serve", *drafter, "--bind", draft_ep, "--depth", "4",
                "--threads", "1", "--tree-topk", "8", "--max-tree-tokens", "24", "--no-suffix", "--no-lookahead",
                "--log-level", "warning", cpus=[0])
    procs.wait_ready("draftd", draft_ep, 300)
    eps = {}
    for name, extra in CONFIGS.items():
        eps[name] = procs.job_endpoint(name)
        procs.start(name, "starsd_target", "serve", "--model", "demo", "--draft", draft_ep, "--listen", eps[name],
                    "--depth", "4", "--threads", "1", "--name", name, "--connect-timeout", "300",
                    "--log-level", "warning", *extra, cpus=[1])
        procs.wait_ready(name, eps[name], 300)
    keys = ("s", "tokens", "rounds", "accepted", "drafted", "tree_rounds", "fallback_rounds")
    res = {name: dict.fromkeys(keys, 0) | {"outputs": []} for name in CONFIGS}
    job = 0
    for p in range(PASSES):
        for name in (list(CONFIGS) if p % 2 == 0 else list(CONFIGS)[::-1]):
            with ControlClient(eps[name]) as cc:
                for prompt in DEMO_PROMPTS[:4]:
                    job += 1
                    t0 = time.perf_counter()
                    r = cc.call(Message(MsgType.GENERATE, {"id": job, "prompt": prompt, "max_tokens": 64}),
                                timeout_s=300).header
                    if p == 0:
                        continue
                    d, s = res[name], r["stats"]
                    d["s"] += time.perf_counter() - t0
                    d["tokens"] += len(r["token_ids"])
                    for k in ("rounds", "accepted", "drafted", "tree_rounds", "fallback_rounds"):
                        d[k] += s[k]
                    if p == 1:
                        d["outputs"].append(r["token_ids"])
finally:
    for proc in procs.procs.values():
        proc.terminate()
same = all(d["outputs"] == res["chain"]["outputs"] for d in res.values())
for name, d in res.items():
    rounds = max(d["rounds"], 1)
    log.info("%-14s %6.2f tok/s, %d rounds, %.2f tokens kept and %.2f drafts a round, %d tree rounds, "
             "%d fallback rounds", name, d["tokens"] / d["s"], d["rounds"], (d["accepted"] + d["rounds"]) / rounds,
             d["drafted"] / rounds, d["tree_rounds"], d["fallback_rounds"])
log.info("outputs equal the chain's: %s", same)
(out / "trees.json").write_text(json.dumps({n: {k: v for k, v in d.items() if k != "outputs"} for n, d in res.items()}
                                           | {"outputs_equal": same}))
