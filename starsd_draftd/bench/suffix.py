"""The suffix section: the agentic workload (``bench.agentic``) through the target's chat API, one
stream, greedy, with a draft budget of BUDGET tokens a round: each request through the target
alone and through the star with suffix drafts, back to back, the first of the two alternating
(``Paired``: the ratio of the two holds out the machine's drift), then the star drafting with the
model alone (``--no-suffix``), without and with ``--pause-unpaid-drafts`` on its target; then
the same greedy outputs replayed, in the same order, through StarSD's suffix index alone and
through ArcticInference's suffix cache (``bench.suffix_peer``, built in an environment of its
own), to compare tokens per step at the same budget.

The draft daemons run on the draft core and the target on the target core (pinned with 2+ cores);
each configuration gets fresh daemons, so no index holds an earlier run's text."""

from __future__ import annotations

import json
import logging
import time
import urllib.request
from pathlib import Path
from typing import Callable

from common.sockets import free_tcp_port
from starsd_draftd.bench.agentic import Request, run_workload
from starsd_draftd.bench.config import BenchConfig
from starsd_draftd.bench.pool import Pool, _stats
from starsd_draftd.bench.real import bench_dtype
from starsd_draftd.suffix import SuffixIndex

log = logging.getLogger("starsd.bench")

BUDGET = 16  # draft tokens a round at most: the target's --depth and the replays' budget
# the star's configurations, run in this order (the first paired with the target alone): with suffix
# drafts; with model drafts only; the same with --pause-unpaid-drafts
STARS = ("suffix", "model", "model-paused")


def start_suffix(cfg: BenchConfig, pool: Pool, models: tuple[Path, Path], config: str) -> str:
    """Fresh daemons for one configuration ("model", "model-paused" or "suffix"): a draft daemon
    and a target with its chat API (for "model-paused", one that pauses drafting while it does
    not pay); returns the API's base URL. "alone": a target with no draft daemon, on
    the same core as the star's target (a daemon of its own, so that each keeps the prompt
    prefixes of its own requests only)."""
    from starsd_draftd.demo.run import DemoConfig, topology

    target_dir, draft_dir = models
    topo = topology(DemoConfig(targets=1, pin=cfg.real_pin))
    dtype = bench_dtype(cfg)
    pool.state["suffix_topology"], pool.state["suffix_dtype"] = topo.describe(), dtype
    draft = None
    if config != "alone":
        draft = pool.start(f"sfx-draftd-{config}", lambda ep: [
            "starsd_draftd", "serve", "--backend", "model", "--model", str(draft_dir), "--bind", ep,
            "--depth", str(BUDGET), "--threads", "1", "--dtype", dtype,
            "--suffix" if config == "suffix" else "--no-suffix", "--log-level", "warning"], cpus=topo.draft)
    port = free_tcp_port("127.0.0.1")
    link = ["--draft", draft, "--connect-timeout", str(cfg.startup_timeout_s), "--draft-timeout", "30"] if draft \
        else ["--no-draft"]
    if config == "model-paused":
        link.append("--pause-unpaid-drafts")
    pool.start(f"sfx-target-{config}", lambda ep: [
        "starsd_target", "serve", "--model", str(target_dir), *link, "--listen", ep,
        "--http", f"127.0.0.1:{port}", "--depth", str(BUDGET), "--threads", "1", "--dtype", dtype,
        "--name", f"sfx-{config}", "--log-level", "warning"], cpus=topo.targets[0], jobs=True)
    if draft:
        pool.ready(f"sfx-draftd-{config}", f"sfx-target-{config}")
        pool.procs.wait_draft_link([pool.endpoints[f"sfx-target-{config}"]], cfg.startup_timeout_s)
    else:
        pool.ready(f"sfx-target-{config}")
    return f"http://127.0.0.1:{port}"


def _chat(base: str, alone: bool, timeout_s: float):
    with urllib.request.urlopen(f"{base}/v1/models", timeout=timeout_s) as resp:
        model = json.loads(resp.read())["data"][0]["id"]

    def chat(req: Request) -> dict:
        body = {"model": model, "messages": req.messages, "max_tokens": req.max_tokens, "temperature": 0.0}
        if alone:
            body["starsd"] = {"max_draft_tokens": 0}
        r = urllib.request.Request(f"{base}/v1/chat/completions", data=json.dumps(body).encode(),
                                   headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(r, timeout=timeout_s) as resp:
            return json.loads(resp.read())
    return chat


class Paired:
    """A chat that sends each request to the target alone and to the star, back to back, and
    answers with the star's response: the two configurations share every minute of the machine's
    drift (a shared host's speed wanders by 10-30% over minutes), so their ratio holds it out.
    Which goes first alternates, so neither is always the one that follows the other (warm
    caches, the prompt's weights just read). ``alone``: the target alone's requests and
    responses, in order; ``seconds``: each one's time in total."""

    def __init__(self, chat_alone: Callable[[Request], dict], chat_star: Callable[[Request], dict],
                 clock: Callable[[], float] = time.perf_counter):
        self.chats, self.clock = (chat_alone, chat_star), clock
        self.alone: list[dict] = []
        self.seconds = [0.0, 0.0]
        self.sent = 0

    def __call__(self, req: Request) -> dict:
        responses: list[dict | None] = [None, None]
        order = (0, 1) if self.sent % 2 == 0 else (1, 0)
        self.sent += 1
        for i in order:
            t0 = self.clock()
            responses[i] = self.chats[i](req)
            self.seconds[i] += self.clock() - t0
        self.alone.append({"kind": req.kind, "messages": req.messages, "response": responses[0]})
        return responses[1]


def _summary(done: list[dict], wall_s: float) -> dict:
    from starsd_target.profile import merge, ms_per_round

    stats = [d["response"]["starsd"] for d in done]
    tokens = sum(d["response"]["usage"]["completion_tokens"] for d in done)
    rounds = sum(s["rounds"] for s in stats)
    by_kind = _by_kind([(d["kind"], d["response"]["usage"]["completion_tokens"], s["rounds"])
                        for d, s in zip(done, stats)])
    return {"requests": len(done), "tokens": tokens, "wall_s": wall_s, "tps": tokens / wall_s, "rounds": rounds,
            "tokens_per_round": tokens / rounds if rounds else 0.0,
            "drafted": sum(s["drafted"] for s in stats), "accepted": sum(s["accepted"] for s in stats),
            "fallback_rounds": sum(s["fallback_rounds"] for s in stats),
            "plain_rounds": sum(s.get("plain_rounds", 0) for s in stats), "by_kind": by_kind,
            # where the time went: the prompts' prefill (both configurations pay it alike) and the rounds
            "prompt_tokens": sum(d["response"]["usage"]["prompt_tokens"] for d in done),
            "prefill_s": sum(s.get("prefill_s", 0.0) for s in stats),
            "cached_prompt_tokens": sum(s.get("cached_prompt_tokens", 0) for s in stats),
            "round_ms": ms_per_round(merge([s["profile"] for s in stats if "profile" in s])),
            # per request, in order, to read beside the replays' steps
            "per_request": [{"kind": d["kind"], "tokens": d["response"]["usage"]["completion_tokens"],
                             "rounds": s["rounds"], "drafted": s["drafted"], "accepted": s["accepted"],
                             "fallback_rounds": s["fallback_rounds"]}
                            for d, s in zip(done, stats)],
            "texts": [d["response"]["choices"][0]["message"]["content"] for d in done]}


def _by_kind(rows: list[tuple[str, int, int]]) -> dict[str, dict]:
    """Requests, tokens, rounds and tokens a round per kind, from (kind, tokens, rounds) rows."""
    by_kind: dict[str, dict] = {}
    for kind, tokens, rounds in rows:
        k = by_kind.setdefault(kind, {"requests": 0, "tokens": 0, "rounds": 0})
        k["requests"] += 1
        k["tokens"] += tokens
        k["rounds"] += rounds
    for k in by_kind.values():
        k["tokens_per_round"] = k["tokens"] / k["rounds"] if k["rounds"] else 0.0
    return by_kind


def token_requests(done: list[dict], target_dir: Path) -> list[dict]:
    """The run's requests as token ids for the replays: the prompt as the chat API encodes it,
    the output as its text re-encoded, and, where the reply stopped (finish_reason "stop": the
    workload sets no stop strings), the tokenizer's end-of-sequence token, the chat template's
    end of turn: the target generated its stop token in a round as any other, and a replay
    without it would have a round fewer to take."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    out = []
    for i, d in enumerate(done):
        text = tok.apply_chat_template(d["messages"], tokenize=False, add_generation_prompt=True)
        choice = d["response"]["choices"][0]
        output = list(tok.encode(choice["message"]["content"], add_special_tokens=False))
        if choice.get("finish_reason") == "stop" and tok.eos_token_id is not None:
            output.append(int(tok.eos_token_id))
        out.append({"id": f"r{i}", "kind": d["kind"], "prompt": list(tok.encode(text, add_special_tokens=False)),
                    "output": output})
    return out


def replay_starsd(requests: list[dict], budget: int = BUDGET) -> dict:
    """The outputs replayed through a suffix index alone, in order, as ArcticInference's are
    (``bench.arctic_replay``): each step drafts a chain of at most ``budget`` tokens after the
    verified text, keeps the drafts up to the first that differs from the output, plus the
    target's own token."""
    index = SuffixIndex(share="all")
    steps = tokens = drafted = accepted = 0
    t0 = time.perf_counter()
    for r in requests:
        text = index.open(b"", r["prompt"])
        out, pos = r["output"], 0
        while pos < len(out):
            d = index.propose(text, budget)
            kept = 0
            if d is not None:
                drafted += len(d.tokens)
                while kept < len(d.tokens) and pos + kept < len(out) and d.tokens[kept] == out[pos + kept]:
                    kept += 1
                text.drafted(d)
            take = min(kept + 1, len(out) - pos)
            index.extend(text, out[pos: pos + take])
            text.learn(kept)
            accepted += kept
            pos += take
            steps += 1
        tokens += len(out)
    snap = index.snapshot()
    return {"steps": steps, "tokens": tokens, "drafted": drafted, "accepted": accepted,
            "tokens_per_step": tokens / steps if steps else 0.0, "seconds": time.perf_counter() - t0,
            "query_us": snap["query_us"], "update_us_per_token": snap["update_us_per_token"],
            "bytes_per_token": snap["bytes"] / max(snap["tokens_indexed"], 1)}


def replay_peer(requests: list[dict], budget: int = BUDGET) -> dict:
    """ArcticInference's replay of the same outputs, or why it could not run."""
    from starsd_draftd.bench import suffix_peer

    try:
        python = suffix_peer.ensure_env()
        return suffix_peer.replay([{k: r[k] for k in ("id", "prompt", "output")} for r in requests], budget,
                                  python=python)
    except Exception as exc:  # the peer is optional: the section reports StarSD's figures without it
        log.warning("the ArcticInference peer did not run: %s", exc)
        return {"error": str(exc)}


def suffix_section(cfg: BenchConfig, pool: Pool, step, models: tuple[Path, Path]) -> dict:
    runs: dict[str, dict] = {}
    draftd: dict[str, dict] = {}
    texts_alone = None
    done_alone: list[dict] = []
    for config in STARS:
        base = start_suffix(cfg, pool, models, config)
        chat_star = _chat(base, False, 600)
        chat_alone = _chat(start_suffix(cfg, pool, models, "alone"), True, 600) if config == "suffix" else None
        warm = Request("warm", [{"role": "user", "content": "Say hello."}], 8)
        for chat in (chat_alone, chat_star):
            if chat is not None:
                chat(warm)
        d0 = _stats(pool.endpoints[f"sfx-draftd-{config}"], pool.ctx)
        if config == "suffix":  # each request through the target alone and the star, back to back
            paired = Paired(chat_alone, chat_star)
            done = run_workload(paired, cfg.max_tokens, cfg.quick)
            done_alone = paired.alone
            runs["alone"] = _summary(done_alone, paired.seconds[0])
            texts_alone = runs["alone"]["texts"]
            runs[config] = _summary(done, paired.seconds[1])
            step("suffix: target alone and star, suffix drafts")
        else:
            t0 = time.perf_counter()
            done = run_workload(chat_star, cfg.max_tokens, cfg.quick)
            runs[config] = _summary(done, time.perf_counter() - t0)
        d1 = _stats(pool.endpoints[f"sfx-draftd-{config}"], pool.ctx)
        draftd[config] = {"suffix": {k: d1.get("suffix", {}).get(k) for k in
                                     ("requests", "tokens", "kept", "query_us", "update_us_per_token", "bytes",
                                      "tokens_indexed")},
                          "requests": d1["requests"] - d0["requests"],
                          "catch_up": {k: v - d0.get("catch_up", {}).get(k, 0)
                                       for k, v in d1.get("catch_up", {}).items()}}
        pool.stop(f"sfx-target-{config}")
        pool.stop(f"sfx-draftd-{config}")
        if config == "suffix":
            pool.stop("sfx-target-alone")
        if config != "suffix":
            step(f"suffix: star, {config} drafts")
    for name, r in runs.items():
        r["speedup"] = r["tps"] / runs["alone"]["tps"]
        r["same_as_alone"] = r.pop("texts") == texts_alone
    requests = token_requests(done_alone, models[0])
    saved = pool.workdir / "suffix_replay.json"  # the replays' input, to replay again elsewhere
    saved.write_text(json.dumps(requests))
    replays = {"starsd": replay_starsd(requests), "arcticinference": replay_peer(requests)}
    step("suffix: replays")
    peer = replays["arcticinference"]
    if "requests" in peer:  # its steps by kind, beside the star's rounds by kind
        kinds = {r["id"]: r["kind"] for r in requests}
        peer["by_kind"] = _by_kind([(kinds[p["id"]], p["tokens"], p["steps"]) for p in peer["requests"]])
    return {"budget": BUDGET, "topology": pool.state.get("suffix_topology"), "dtype": pool.state.get("suffix_dtype"),
            "configs": runs, "draftd": draftd, "replays": replays, "replay_requests": str(saved),
            "workload": {k: sum(1 for r in requests if r["kind"] == k) for k in ("edit", "tool", "turn")}}


def format_suffix(s: dict) -> list[str]:
    lines = [f"### Suffix drafts: the agentic workload ({s['workload']}), greedy, budget {s['budget']} tokens a round",
             f"({s['topology']}, {s['dtype']})", "",
             "| configuration | tok/s | x alone | tokens/round | rounds | rounds without drafts | same as alone |",
             "|---|---|---|---|---|---|---|"]
    for name, r in s["configs"].items():
        plain = f" (+{r['plain_rounds']} by choice)" if r.get("plain_rounds") else ""
        lines.append(f"| {name} | {r['tps']:.1f} | {r['speedup']:.2f} | {r['tokens_per_round']:.2f} | {r['rounds']} | "
                     f"{r['fallback_rounds']}{plain} | {'yes' if r['same_as_alone'] else 'NO'} |")
    sd = s["draftd"].get("suffix", {}).get("suffix") or {}
    if sd.get("requests") is not None:
        lines += ["", f"suffix drafts: {sd['requests']} requests, {sd['tokens']} tokens drafted, {sd['kept']} kept; "
                      f"query {sd['query_us']:.0f} us, update {sd['update_us_per_token']:.1f} us a token, "
                      f"{sd['bytes'] / max(sd['tokens_indexed'] or 1, 1):.0f} bytes a token indexed"]
    cu = s["draftd"].get("suffix", {}).get("catch_up") or {}
    if cu.get("feeds"):
        lines.append(f"idle feeds: {cu['tokens']} verified tokens the draft model missed while suffix drafts "
                     f"answered, fed in {cu['feeds']} forwards ({cu['seconds']:.1f} s) with no request waiting")
    for name, r in s["configs"].items():
        ms = r.get("round_ms") or {}
        if "prefill_s" in r:
            lines.append(f"{name}: prefill {r['prefill_s']:.1f} s of {r['wall_s']:.1f} ({r['prompt_tokens']} prompt tokens, "
                         f"{r.get('cached_prompt_tokens', 0)} of them reused from earlier prompts)"
                         + (f"; a round {ms['round']:.1f} ms: draft wait {ms['draft_wait']:.1f}, verify forward "
                            f"{ms['verify_forward']:.1f}, the rest {ms['round'] - ms['draft_wait'] - ms['verify_forward']:.1f}"
                            if ms else ""))
    kinds = s["configs"].get("suffix", {}).get("by_kind", {})
    if kinds:
        peer = s["replays"].get("arcticinference", {}).get("by_kind", {})
        lines.append("tokens per round by kind (star with suffix drafts"
                     + (", ArcticInference's replay in brackets): " if peer else "): ")
                     + ", ".join(f"{k} {v['tokens_per_round']:.2f}"
                                 + (f" ({peer[k]['tokens_per_round']:.2f})" if k in peer else "")
                                 for k, v in kinds.items()))
    lines += ["", "| replay, same outputs, same order | tokens/step | drafted | accepted | cost |",
              "|---|---|---|---|---|"]
    for name, r in s["replays"].items():
        if "error" in r:
            lines.append(f"| {name} | did not run: {r['error'][:80]} | | | |")
            continue
        t = r.get("totals", r)  # the peer's report keeps its totals and timing apart
        cost = (f"query {r['query_us']:.0f} us, update {r['update_us_per_token']:.1f} us a token" if "query_us" in r
                else f"speculate {r['timing']['speculate_us_mean']:.1f} us, add {r['timing']['add_us_per_token']:.1f} "
                     "us a token")
        lines.append(f"| {name} | {t['tokens_per_step']:.2f} | {t['drafted']} | {t['accepted']} | {cost} |")
    return lines
