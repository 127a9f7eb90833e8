"""The pool section: emulated targets drafting from one, two and four draft daemons through the
target's own pool (``starsd_target.pool``: placement, failover), and a failover run.

Each draft daemon is the emulated one (service S(d) a timed sleep; sockets, protocol and loop
real); each target is ``PooledTarget``: a session placed by the pool and driven as the scheduler
drives one (send, wait for the reply or the link's deadline, resolve), verifying by sleeping V + R.
The sweep runs, for D daemons, 2 N_full D targets (N_full: the targets one daemon carries at full
speed, from the analytic model), so that each D is saturated: D daemons should carry D times the
tokens of one. The failover run kills one of two daemons (SIGKILL) mid-run and counts each
target's rounds without drafts and the time until every target drafts again."""

from __future__ import annotations

import logging
import random
import signal
import threading
import time

import zmq

from common.verify import SamplingParams
from starsd_draftd.bench.config import BenchConfig
from starsd_draftd.bench.emulated_target import Round, TargetModel, acceptance_chain, run_window
from starsd_draftd.bench.emulation import EMU_FINGERPRINT, EMU_VOCAB, PacedSleep
from starsd_draftd.bench.pool import Pool, _draftd_emulation_args

log = logging.getLogger("starsd.bench")

DAEMONS = (1, 2, 4)
QUICK_DAEMONS = (1, 2)


def pool_daemons(cfg: BenchConfig) -> tuple[int, ...]:
    return QUICK_DAEMONS if cfg.quick else DAEMONS


class PooledTarget:
    """One target's rounds against a pool of draft daemons: the target's DraftPool and
    RemoteDraftSession, with verification emulated by a timed sleep."""

    def __init__(self, endpoints: list[str], model: TargetModel, seed: int, ctx: zmq.Context,
                 draft_timeout_s: float = 2.0, prompt_len: int = 16):
        self.endpoints = endpoints
        self.model = model
        self.seed = seed
        self.name = f"pooled-{seed}"
        self.ctx = ctx
        self.prompt = [3 + (seed * 7 + i) % 200 for i in range(prompt_len)]
        self.draft_timeout_s = draft_timeout_s
        self.rounds: list[Round] = []
        self.placed: list[str] = []  # the endpoint each round asked (empty: none)
        self.error: BaseException | None = None
        self.drafting = threading.Event()  # set at its first round with drafts
        self._sleep = PacedSleep()

    def run(self, stop: threading.Event) -> None:
        from starsd_target.client import DraftReply
        from starsd_target.drafts import RemoteDraftSession
        from starsd_target.pool import DraftPool

        pool = DraftPool(self.endpoints, EMU_VOCAB, EMU_FINGERPRINT, self.name, self.ctx)
        rng = random.Random(self.seed)
        try:
            pool.handshake(30.0)
            deadline = time.monotonic() + 10
            while not all(link.up for link in pool.links.values()) and time.monotonic() < deadline:
                pool.poll(0.01)  # every daemon known before the first placement
            d = RemoteDraftSession(pool, pool.next_session(), SamplingParams(), self.draft_timeout_s)
            verified = list(self.prompt)
            while not stop.is_set():
                t_send = time.monotonic()
                seq = d.send(verified, self.model.depth)
                proposal = None
                if seq is not None:
                    link = d.client
                    while (reply := link.take(d.session, seq)) is None and not d.expired() and link.up:
                        pool.poll(max(0.0, min(d.wake_at - time.monotonic(), 0.05)))
                    proposal = d.resolve(reply)
                self.placed.append(d.client.endpoint if seq is not None else "")
                t_reply = time.monotonic()
                own = 3 + rng.randrange(EMU_VOCAB - 3)
                if isinstance(proposal, DraftReply):
                    n = acceptance_chain(rng, self.model.acceptance, len(proposal.tokens))
                    self._sleep((self.model.verify_ms + self.model.rtt_ms) / 1000.0)
                    self.rounds.append(Round(t_send, t_reply, time.monotonic(), len(verified), len(proposal.tokens),
                                             n, False))
                    verified += list(proposal.tokens[:n]) + [own]
                    d.kept(n)
                    self.drafting.set()
                else:
                    self._sleep((self.model.fallback_ms + self.model.rtt_ms) / 1000.0)
                    self.rounds.append(Round(t_send, t_reply, time.monotonic(), len(verified), 0, 0, True))
                    verified.append(own)
                if len(verified) > 900:  # bounded contexts: start over
                    d.close()
                    d = RemoteDraftSession(pool, pool.next_session(), SamplingParams(), self.draft_timeout_s)
                    verified = list(self.prompt)
            d.close()
        except BaseException as exc:  # handed to whoever joins this target
            self.error = exc
            log.exception("pooled target %s failed", self.name)
        finally:
            pool.close()


def _run(endpoints: list[str], n: int, model: TargetModel, ctx: zmq.Context, seed: int, warmup_s: float,
         window_s: float, during=None) -> dict:
    """``n`` pooled targets, each drafting, for ``warmup_s`` then a window of ``window_s``
    (``during()`` is called as it opens); their rounds in the window."""
    targets = [PooledTarget(endpoints, model, seed + i, ctx) for i in range(n)]

    def drafting() -> None:  # every target drafting before the window opens (start-ups stay out of it)
        deadline = time.monotonic() + 120
        for t in targets:
            while not t.drafting.wait(0.1) and t.error is None:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"pooled target {t.name} drafted nothing within 120 s")

    w0, w1 = run_window(targets, warmup_s, window_s, "pooled", ready=drafting, at_open=during)
    rounds = [[r for r in t.rounds if w0 <= r.t_done <= w1] for t in targets]
    tokens = sum(r.tokens for rs in rounds for r in rs)
    used = {ep for t in targets for ep in t.placed if ep}
    return {"n": n, "targets": targets, "w0": w0, "w1": w1, "tok_s": tokens / (w1 - w0),
            "per_target_tok_s": tokens / (w1 - w0) / n, "fallback_rounds": sum(r.fallback for rs in rounds for r in rs),
            "rounds": sum(len(rs) for rs in rounds), "daemons_used": len(used)}


def pool_section(cfg: BenchConfig, pool: Pool, step) -> dict:
    ctx = pool.ctx
    nominal = cfg.emulation_plan()
    n_full = max(1, nominal.n_full)
    model = TargetModel(verify_ms=cfg.verify_ms, rtt_ms=cfg.rtt_ms, depth=cfg.depth, acceptance=cfg.acceptance,
                        single_ms=cfg.single_ms)
    most = max(pool_daemons(cfg))
    names = [f"pool-draftd-{i}" for i in range(most)]
    eps = [pool.start(name, lambda e: _draftd_emulation_args(e, base_ms=cfg.draft_base_ms,
                                                              per_token_ms=cfg.draft_per_token_ms, depth=cfg.depth,
                                                              q_topk=cfg.q_topk)) for name in names]
    pool.ready(*names)
    round_s = nominal.round_ms(2 * n_full) / 1000.0
    warmup_s, window_s = (2 * round_s, max(1.0, 15 * round_s)) if cfg.quick else (5 * round_s, max(4.0, 60 * round_s))
    sweep = []
    for k in pool_daemons(cfg):
        n = 2 * n_full * k
        run = _run(eps[:k], n, model, ctx, cfg.seed + 50_000 + 100 * k, warmup_s, window_s)
        sweep.append({"daemons": k, "targets": n, "tok_s": run["tok_s"], "per_target_tok_s": run["per_target_tok_s"],
                      "fallback_rounds": run["fallback_rounds"], "rounds": run["rounds"],
                      "daemons_used": run["daemons_used"]})
        step(f"pool D={k}")
    one = sweep[0]["tok_s"]
    for row in sweep:
        row["x_one"] = row["tok_s"] / one if one else None

    # failover: two daemons, 2 N_full targets; one daemon killed at the window's start
    killed = {}

    def kill() -> None:
        killed["at"] = time.monotonic()
        pool.procs.procs[names[0]].send_signal(signal.SIGKILL)

    n = 2 * n_full
    try:
        run = _run(eps[:2], n, model, ctx, cfg.seed + 60_000, warmup_s, max(window_s, 2.0), during=kill)
        pool.procs.procs[names[0]].wait(10)
    finally:
        for name in names:  # their cores are the later sections'
            pool.stop(name)
    # rounds without drafts from the round in flight at the kill to the window's end; recovery: from
    # the kill to each target's first drafts that came after it
    per_target, recover = [], []
    for t in run["targets"]:
        after = [r for r in t.rounds if r.t_done >= killed["at"] and r.t_send <= run["w1"]]
        per_target.append(sum(r.fallback for r in after))
        drafted = [r.t_reply for r in after if not r.fallback and r.t_send >= killed["at"]]
        recover.append((drafted[0] - killed["at"]) if drafted else None)
    step("pool failover")
    return {"n_full": n_full, "sweep": sweep,
            "failover": {"targets": n, "daemons": 2, "fallback_rounds_per_target": per_target,
                         "max_fallback_rounds": max(per_target),
                         "recovered_s": None if None in recover else max(recover),
                         "tok_s_after": run["tok_s"]}}


def format_pool(p: dict) -> list[str]:
    lines = ["## A pool of draft daemons", "",
             f"Emulated targets drafting through the target's own pool (placement and failover), 2 N_full D "
             f"targets against D emulated draft daemons (N_full = {p['n_full']} per daemon):", "",
             "| daemons | targets | system tok/s | x one daemon | per target tok/s | daemons used | rounds without "
             "drafts |", "|---|---|---|---|---|---|---|"]
    for r in p["sweep"]:
        lines.append(f"| {r['daemons']} | {r['targets']} | {r['tok_s']:.1f} | {r['x_one']:.2f} | "
                     f"{r['per_target_tok_s']:.1f} | {r['daemons_used']} | {r['fallback_rounds']} of {r['rounds']} |")
    f = p["failover"]
    rec = "-" if f["recovered_s"] is None else f"{1000 * f['recovered_s']:.0f} ms"
    lines += ["", f"Failover: {f['targets']} targets on {f['daemons']} daemons, one killed (SIGKILL) mid-run: rounds "
                  f"without drafts per target {f['fallback_rounds_per_target']} (at most {f['max_fallback_rounds']}); "
                  f"every target drafting again {rec} after the kill.", ""]
    return lines
