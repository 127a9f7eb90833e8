"""The real-model section: real draft and target daemons on this machine, beside the target alone
and co-located assisted generation."""

from __future__ import annotations

import contextlib
import json
import logging
import statistics
import threading
import time
from pathlib import Path

import torch
import zmq

from common.control import ControlClient
from common.protocol import Message, MsgType
from starsd_draftd.bench import plan as plan_mod
from starsd_draftd.demo.prompts import DEMO_PROMPTS
from starsd_draftd.bench.trace import idle_gaps, services_between
from starsd_draftd.bench.config import BenchConfig, GAP_EDGES_MS
from starsd_draftd.bench.pool import Pool, _busy_fraction, _stats
from starsd_draftd.bench.stats import histogram, per_token_latencies, session_rounds, summarize

log = logging.getLogger("starsd.bench")


# ---------------------------------------------------------------- real models
@contextlib.contextmanager
def quiet_transformers():
    """No progress bars or deprecation chatter from transformers while the bench loads models in
    its own process (the bench draws its own progress bar)."""
    import transformers.utils.logging as tlog

    verbosity, bars = tlog.get_verbosity(), tlog.is_progress_bar_enabled()
    tlog.set_verbosity_error()
    tlog.disable_progress_bar()
    try:
        yield
    finally:
        tlog.set_verbosity(verbosity)
        if bars:
            tlog.enable_progress_bar()


def make_tiny_pair(root: Path, seed: int = 0) -> tuple[Path, Path]:
    """Tiny random checkpoints for quick runs: a 2-layer target and, as its draft, the same weights
    (so drafts are mostly accepted and rounds carry several tokens)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from starsd_draftd.demo.byte_tokenizer import BOS_ID, BYTE_VOCAB_SIZE, EOS_ID, PAD_ID, make_byte_tokenizer

    target = root / "tiny-target"
    if not (target / "config.json").is_file():
        config = LlamaConfig(vocab_size=BYTE_VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                             bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, initializer_range=0.3,
                             tie_word_embeddings=False)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = LlamaForCausalLM(config)
        with torch.no_grad():
            head = model.get_output_embeddings().weight
            head.mul_(4.0)  # sharp logits: no near-ties for chunked and step-by-step forwards to break apart
            head[EOS_ID].zero_()  # rare EOS: generations run their length
        target.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(target)
        make_byte_tokenizer().save_pretrained(target)
    return target, target


def measure_target_forward(target_dir: Path, depth: int, reps: int = 30, dtype: str = "auto") -> dict:
    """V: the target's forward over [last token, x_1..x_d] after a 64-token prefix, and V1: its
    single-token forward (one thread, median of ``reps``)."""
    from common.models import crop_cache, load_causal_lm
    from common.runner import ModelRunner

    runner = ModelRunner(load_causal_lm(str(target_dir), dtype=dtype))  # as the daemons run it
    prefix = [3 + (7 * i) % 200 for i in range(64)]
    out = {}
    with torch.inference_mode():
        cache = runner.new_cache(64 + depth + 2)
        runner.forward(cache, prefix, "none")
        for name, width in (("verify_ms", depth + 1), ("single_ms", 1)):
            times = []
            for _ in range(reps + 3):
                t0 = time.perf_counter()
                runner.forward(cache, [5] * width, "all")
                times.append(time.perf_counter() - t0)
                crop_cache(cache, 64)
            out[name] = 1000.0 * statistics.median(times[3:])
    return out


def _run_jobs(endpoints: list[str], prompts: list[list[str]], max_tokens: int, no_draft: bool, ctx: zmq.Context,
              timeout_s: float, extra: dict | None = None) -> dict:
    """Each target runs its prompts one after another, all targets at once, through GENERATE
    (``extra``: more of its fields, e.g. ``max_draft_tokens``)."""
    results: list[list[dict]] = [[] for _ in endpoints]
    failures: list[BaseException] = []

    def worker(i: int, ep: str) -> None:
        try:
            with ControlClient(ep, ctx) as cc:
                for j, prompt in enumerate(prompts[i]):
                    msg = Message(MsgType.GENERATE, {"id": j + 1, "prompt": prompt, "max_tokens": max_tokens,
                                                     "temperature": 0.0, "no_draft": no_draft, **(extra or {})})
                    h = cc.call(msg, timeout_s).header
                    results[i].append({"stats": h["stats"], "token_ids": h["token_ids"]})
        except Exception as exc:  # re-raised below, in the caller's thread
            failures.append(exc)

    threads = [threading.Thread(target=worker, args=(i, ep)) for i, ep in enumerate(endpoints)]
    t0, w0 = time.perf_counter(), time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall, w1 = time.perf_counter() - t0, time.monotonic()
    if failures:
        raise RuntimeError(f"a bench job failed: {failures[0]}") from failures[0]
    return {"wall_s": wall, "w0": w0, "w1": w1, "results": results}


def _run_streams(endpoint: str, prompts: list[str], max_tokens: int, no_draft: bool, ctx: zmq.Context,
                 timeout_s: float) -> dict:
    """All ``prompts`` sent to one target at once, one client each: the target's scheduler
    interleaves them (while one generation waits for drafts, another is verified)."""
    return _run_jobs([endpoint] * len(prompts), [[p] for p in prompts], max_tokens, no_draft, ctx, timeout_s)


INTERLEAVE_STREAMS = (1, 2, 4)


def _phase_summary(phase: dict) -> dict:
    res = phase["results"]
    per_target = []
    tokens = rounds = fallback = plain = 0
    for jobs in res:
        t = sum(j["stats"]["generated"] for j in jobs)
        w = sum(j["stats"]["wall_s"] for j in jobs)
        per_target.append(t / w if w else 0.0)
        tokens += t
        rounds += sum(j["stats"]["rounds"] for j in jobs)
        fallback += sum(j["stats"]["fallback_rounds"] for j in jobs)
        plain += sum(j["stats"].get("plain_rounds", 0) for j in jobs)  # without drafts by choice (crowded, adaptive)
    job_tpot = [(j["stats"]["wall_s"] - j["stats"]["prefill_s"]) / j["stats"]["generated"]
                for jobs in res for j in jobs if j["stats"]["generated"]]
    return {"system_tps": tokens / phase["wall_s"], "per_target_tps": statistics.fmean(per_target),
            "per_target_tps_min": min(per_target), "per_target_tps_max": max(per_target),
            "tokens": tokens, "rounds": rounds, "mean_accepted_length": tokens / rounds if rounds else 0.0,
            "fallback_rounds": fallback, "plain_rounds": plain, "wall_s": phase["wall_s"],
            "per_job_time_per_token_ms": summarize(job_tpot, 1e3)}


def colocated_baseline(target_dir: Path, draft_dir: Path, prompts: list[str], max_tokens: int,
                       dtype: str = "auto") -> dict:
    """transformers on the same checkpoints, in this process, one thread, greedy, in the daemons'
    ``dtype``: co-located speculative decoding (``generate(assistant_model=...)``) and the target's
    own ``generate``, one prompt at a time; and the target's ``generate`` over all the prompts as
    one left-padded batch (what one process serving them together gets without speculation)."""
    from common.models import load_causal_lm

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        target = load_causal_lm(str(target_dir), dtype=dtype)
        draft = load_causal_lm(str(draft_dir), dtype=dtype).model
        tok = target.tokenizer
        eos = sorted(target.eos_token_ids)
        pad = tok.pad_token_id if tok.pad_token_id is not None else (eos[0] if eos else 0)
        gen_kw = dict(do_sample=False, max_new_tokens=max_tokens, pad_token_id=pad, eos_token_id=eos or None)
        out: dict = {}
        for name, extra in (("assisted", {"assistant_model": draft}), ("target_generate", {})):
            jobs = []
            for i, prompt in enumerate([prompts[0], *prompts]):  # the first run warms up and is not counted
                ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
                t0 = time.perf_counter()
                with torch.inference_mode():
                    seq = target.model.generate(ids, attention_mask=torch.ones_like(ids), **gen_kw, **extra)
                wall = time.perf_counter() - t0
                if i:
                    jobs.append({"tokens": seq.shape[1] - ids.shape[1], "wall_s": wall,
                                 "token_ids": seq[0, ids.shape[1]:].tolist()})
            tokens, wall = sum(j["tokens"] for j in jobs), sum(j["wall_s"] for j in jobs)
            out[name] = {"tokens_per_s": tokens / wall, "tokens": tokens, "wall_s": wall,
                         "per_job_time_per_token_ms": summarize(
                             [j["wall_s"] / j["tokens"] for j in jobs if j["tokens"]], 1e3),
                         "token_ids": [j["token_ids"] for j in jobs]}
        out["target_batched"] = _batched_generate(target, prompts, gen_kw)
        gc = draft.generation_config
        out["assistant_settings"] = {k: getattr(gc, k, None) or "transformers default"
                                     for k in ("num_assistant_tokens", "num_assistant_tokens_schedule")}
        out["dtype"] = dtype
        return out
    finally:
        torch.set_num_threads(threads)


def _batched_generate(target, prompts: list[str], gen_kw: dict) -> dict:
    """The target's ``generate`` over ``prompts`` as one left-padded batch; tokens counted up to
    each row's end of sequence."""
    tok = target.tokenizer
    rows = [tok.encode(p, add_special_tokens=False) for p in prompts]
    width = max(map(len, rows))
    pad = gen_kw["pad_token_id"]
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    t0 = time.perf_counter()
    with torch.inference_mode():
        seq = target.model.generate(ids, attention_mask=mask, **gen_kw)
    wall = time.perf_counter() - t0
    tokens = 0
    for row in seq[:, width:].tolist():
        ends = [i for i, t in enumerate(row) if t in target.eos_token_ids]
        tokens += ends[0] + 1 if ends else len(row)
    return {"tokens_per_s": tokens / wall, "tokens": tokens, "wall_s": wall, "batch": len(prompts)}


def bench_dtype(cfg: BenchConfig) -> str:
    """The daemons' dtype: the one asked for (``--dtype``), else the demo's for the demo pair and
    float32 for the tiny random pair, whose 16-bit logits hold top-2 ties one rounding step apart,
    which a forward of another shape (a batch of generations, a longer feed) can break either way:
    float32 keeps the exactness checks meaningful."""
    from starsd_draftd.demo.run import DemoConfig, demo_dtype

    if cfg.dtype != "auto":
        return cfg.dtype
    return "float32" if cfg.models == "tiny" else demo_dtype(DemoConfig())


def start_real(cfg: BenchConfig, pool: Pool, models: tuple[Path, Path]) -> tuple[list[str], list[str]]:
    """The real section's draft daemon (real draft model, traced, one session at a time) and its
    target daemons; returns the targets' endpoints and names."""
    from starsd_draftd.demo.run import DemoConfig, topology

    target_dir, draft_dir = models
    names = [f"real-target{i + 1}" for i in range(min(cfg.real_n_max, cfg.n_max))]
    topo = topology(DemoConfig(targets=len(names), pin=cfg.real_pin))
    dtype = bench_dtype(cfg)
    pool.state["real_topology"], pool.state["real_dtype"] = topo.describe(), dtype
    draft_ep = pool.start("real-draftd", lambda ep: [
        "starsd_draftd.bench.emulation_serve", "serve", "--backend", "model", "--model", str(draft_dir), "--bind", ep,
        "--depth", str(cfg.depth), "--batch-max", str(cfg.real_batch_max), "--q-topk", str(cfg.q_topk),
        "--threads", "1", "--dtype", dtype, "--log-level", "warning"], traced=True, cpus=topo.draft)
    target_eps = [pool.start(name, lambda ep, i=i: [
        "starsd_target", "serve", "--model", str(target_dir), "--draft", draft_ep, "--listen", ep,
        "--depth", str(cfg.depth), "--threads", "1", "--dtype", dtype, "--name", f"target{i + 1}",
        # every round drafts, however many generations (this section measures speculation interleaved)
        "--draft-max-active", "0",
        "--connect-timeout", str(cfg.startup_timeout_s), "--draft-timeout", "30", "--heartbeat", "0.5",
        "--log-level", "warning"], cpus=topo.targets[i], jobs=True)
        for i, name in enumerate(names)]
    return target_eps, names


def real_measure(cfg: BenchConfig, pool: Pool, step, models: tuple[Path, Path]) -> dict:
    """Start the draft daemon (traced, one session at a time) and N_real target daemons, then for
    N = 1..N_real run the same jobs with speculation and by the targets alone. The draft daemon
    stays up (the batched section measures its one-at-a-time capacity); ``real_finish`` stops it."""
    ctx = pool.ctx
    n_real = min(cfg.real_n_max, cfg.n_max)
    target_eps, names = start_real(cfg, pool, models)
    draft_ep = pool.endpoints["real-draftd"]
    pool.ready("real-draftd", *names)
    pool.procs.wait_draft_link(target_eps, cfg.startup_timeout_s)
    warm = [[DEMO_PROMPTS[i % len(DEMO_PROMPTS)]] for i in range(n_real)]
    _run_jobs(target_eps, warm, 8, False, ctx, cfg.startup_timeout_s)
    _run_jobs(target_eps, warm, 8, True, ctx, cfg.startup_timeout_s)
    step("real warm-up")
    phases = []
    for n in range(1, n_real + 1):
        prompts = [[DEMO_PROMPTS[(i * cfg.jobs_per_target + j) % len(DEMO_PROMPTS)]
                    for j in range(cfg.jobs_per_target)] for i in range(n)]
        s0 = _stats(draft_ep, ctx)
        spec = _run_jobs(target_eps[:n], prompts, cfg.max_tokens, False, ctx, cfg.startup_timeout_s)
        s1 = _stats(draft_ep, ctx)
        alone = _run_jobs(target_eps[:n], prompts, cfg.max_tokens, True, ctx, cfg.startup_timeout_s)
        phases.append({"n": n, "spec": spec, "alone": alone, "busy": _busy_fraction(s0, s1),
                       "requests": s1["requests"] - s0["requests"], "busy_s": s1["busy_s"] - s0["busy_s"],
                       "draftd_profile": _request_profile_delta(s0, s1)})
        step(f"real N={n}")
    streams = []
    for g in INTERLEAVE_STREAMS:  # one target, g generations at once
        prompts = [DEMO_PROMPTS[j % len(DEMO_PROMPTS)] for j in range(g)]
        s0 = _stats(draft_ep, ctx)
        spec = _run_streams(target_eps[0], prompts, cfg.max_tokens, False, ctx, cfg.startup_timeout_s)
        s1 = _stats(draft_ep, ctx)
        alone = _run_streams(target_eps[0], prompts, cfg.max_tokens, True, ctx, cfg.startup_timeout_s)
        streams.append({"streams": g, "spec": spec, "alone": alone, "draftd_profile": _request_profile_delta(s0, s1)})
        step(f"real {g} streams")
    return {"phases": phases, "streams": streams, "targets": names, "models": models}


def _request_profile_delta(s0: dict, s1: dict) -> dict | None:
    """The draft daemon's request profile between two STATS (None from a daemon without one)."""
    p0, p1 = s0.get("request_profile"), s1.get("request_profile")
    if p0 is None or p1 is None:
        return None
    return {"requests": p1["requests"] - p0["requests"],
            "seconds": {k: v - p0["seconds"].get(k, 0.0) for k, v in p1["seconds"].items()}}


def round_profile(spec: dict, draftd: dict | None, label: str) -> dict:
    """Where the rounds of a run's StarSD jobs went: ms per round by part (starsd_target.profile,
    summed over the jobs' own profiles, so the parts add up to the round) and ms per draft
    request in the draft daemon over the same run."""
    from starsd_target.profile import merge, ms_per_round

    total = merge([j["stats"].get("profile", {}) for jobs in spec["results"] for j in jobs])
    out = {"run": label, "rounds": total["rounds"], "ms_per_round": ms_per_round(total), "profile": total}
    if draftd is not None and draftd["requests"]:
        out["draftd_ms_per_request"] = {k: 1000.0 * v / draftd["requests"] for k, v in draftd["seconds"].items()}
    return out


def _train_summary(path: Path) -> dict | None:
    """What the demo checkpoints' build report says about them (None for other checkpoints)."""
    try:
        rep = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    draft = rep.get("draft", {})
    return {"target_params": rep.get("target", {}).get("params"), "draft_params": draft.get("params"),
            "draft_layers": draft.get("layers"), "draft_training_steps": draft.get("steps"),
            "heldout_top1_agreement": draft.get("heldout_top1_agreement"), "build_s": rep.get("wall_s")}


def real_finish(cfg: BenchConfig, pool: Pool, raw: dict, step) -> dict:
    """Stop the real daemons, read the draft daemon's trace, then run the co-located baseline and
    time the target's forwards on the now idle machine."""
    trace = pool.stop("real-draftd")
    for name in raw["targets"]:
        pool.stop(name)
    target_dir, draft_dir = raw["models"]
    rows = []
    profiles = []
    same_all = True
    for ph in raw["phases"]:
        spec, alone = ph["spec"], ph["alone"]
        profiles.append(round_profile(spec, ph.get("draftd_profile"), f"{ph['n']} target(s), 1 stream each"))
        sp, al = _phase_summary(spec), _phase_summary(alone)
        same = all(a["token_ids"] == b["token_ids"] for ja, jb in zip(spec["results"], alone["results"])
                   for a, b in zip(ja, jb))
        same_all = same_all and same
        reqs = [r for r in trace.requests if spec["w0"] <= r[1] <= spec["w1"]]
        gaps = idle_gaps(services_between(trace.services, spec["w0"], spec["w1"]))
        rows.append({
            "n": ph["n"],
            "starsd": dict(sp, draft_busy_fraction=ph["busy"],
                           draft_service_ms_per_request=(1000.0 * ph["busy_s"] / ph["requests"]
                                                         if ph["requests"] else None),
                           idle_gaps_ms=dict(summarize(gaps, 1e3), histogram=histogram([g * 1e3 for g in gaps],
                                                                                       GAP_EDGES_MS)),
                           per_token_latency_ms=summarize(per_token_latencies(session_rounds(reqs)), 1e3)),
            "alone": al,
            "speedup_system": sp["system_tps"] / al["system_tps"] if al["system_tps"] else None,
            "greedy_same_tokens_as_alone": same,
        })
    interleaving = []
    for st in raw.get("streams", []):
        profiles.append(round_profile(st["spec"], st.get("draftd_profile"), f"1 target, {st['streams']} stream(s)"))
        sp, al = _phase_summary(st["spec"]), _phase_summary(st["alone"])
        interleaving.append({
            "streams": st["streams"], "starsd_system_tps": sp["system_tps"], "alone_system_tps": al["system_tps"],
            "speedup_system": sp["system_tps"] / al["system_tps"] if al["system_tps"] else None,
            "mean_accepted_length": sp["mean_accepted_length"], "rounds": sp["rounds"],
            "fallback_rounds": sp["fallback_rounds"], "plain_rounds": sp["plain_rounds"],
            "greedy_same_tokens_as_alone": all(a["token_ids"] == b["token_ids"] for ja, jb in
                                               zip(st["spec"]["results"], st["alone"]["results"])
                                               for a, b in zip(ja, jb))})
    flat_prompts = [DEMO_PROMPTS[j % len(DEMO_PROMPTS)] for j in range(cfg.jobs_per_target)]
    with quiet_transformers():
        colocated = colocated_baseline(target_dir, draft_dir, flat_prompts, cfg.max_tokens,
                                       pool.state.get("real_dtype", "auto"))
    alone1 = raw["phases"][0]["alone"]["results"][0]
    colocated["assisted_same_tokens_as_starsd_alone"] = colocated["assisted"]["token_ids"] == [
        j["token_ids"] for j in alone1]
    for k in ("assisted", "target_generate"):
        colocated[k].pop("token_ids")
    step("real co-located")
    with quiet_transformers():
        forward = measure_target_forward(target_dir, cfg.depth, dtype=pool.state.get("real_dtype", "auto"))
    step("real forward timing")
    return {
        "label": f"real models on this machine's CPU ({pool.state.get('real_topology', 'unpinned')}, "
                 f"{pool.state.get('real_dtype', 'auto')})",
        "models": {"target": str(target_dir), "draft": str(draft_dir), "kind": cfg.models,
                   "training": _train_summary(Path(target_dir).parent / "build_report.json")},
        "config": {"jobs_per_target": cfg.jobs_per_target, "max_tokens": cfg.max_tokens, "depth": cfg.depth,
                   "temperature": 0.0, "draft_batch_max": cfg.real_batch_max, "threads_per_process": 1,
                   "draft_suffix": True},
        "rows": rows,
        "interleaving": interleaving,
        "round_profile": profiles,
        "greedy_outputs_identical": same_all,
        "colocated": colocated,
        "target_forward_ms": forward,
        "notes": ["per-token latency of StarSD rounds is measured on the draft side (successive requests of a "
                  "session are one round apart); the target alone and transformers report whole jobs only, so "
                  "their per-token figures are per-job means",
                  "co-located and batched runs are in the bench's process, one thread, on an otherwise idle machine",
                  "interleaving: one target, 1, 2 and 4 generations sent at once, with drafts and alone"],
    }


def _real_plan(real: dict, wire_rtt_ms: float, depth: int, n_max: int, service_ms: float) -> dict:
    """The analytic model for these real models if each target had its own device: S from the
    draft daemon, V and V1 timed in-process, R the loopback framework round trip, and the
    acceptance whose i.i.d. E matches the mean accepted length measured at N = 1."""
    e = min(max(real["rows"][0]["starsd"]["mean_accepted_length"], 1.0), depth + 1.0)
    fwd = real["target_forward_ms"]
    p = plan_mod.Plan(verify_ms=fwd["verify_ms"], rtt_ms=wire_rtt_ms, depth=depth,
                      acceptance=plan_mod.acceptance_for_tokens_per_round(e, depth), draft_ms=service_ms,
                      single_ms=fwd["single_ms"])
    return dict(p.summary(), table=p.table(n_max),
                note="sizing estimate for one accelerator per target; on this CPU the processes share cores")


