"""The vLLM side of `starsd-draftd bench-peers`: one vLLM engine (target alone, or target with a
draft model) running the bench's token-id prompts greedily, printed as one JSON object.

Run by the vLLM venv's python as a file path, never imported by StarSD: it imports vLLM and the
standard library only (tests/test_bench_peers.py checks that), so the product never depends on
vLLM. The orchestrator (starsd_draftd/bench/peers/run.py) chooses the cores (process affinity and
VLLM_CPU_OMP_THREADS_BIND), the allocator preload and the KV cache size through the environment.

Progress lines go to stderr with the prefix ``[vllm-peer]``; vLLM's own logging goes wherever
vLLM sends it (the orchestrator keeps both in a log file). With ``--out`` the JSON object is
written to that file (vLLM's engine processes share stdout and may log into it), else printed.

With ``--serve`` the engine stays up after its warm-up for the alternated comparison: it writes
one ``[vllm-peer-result]`` line (JSON: the start costs) when ready, then runs the prompts, the
first streams count at a time, on each ``run`` line read from stdin and answers each with a
``[vllm-peer-result]`` line holding the case; ``quit`` or the end of stdin ends it. Result lines
go to ``--result-fd`` (a pipe of the orchestrator's own, which vLLM's processes never write to),
else to stderr.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
import time

SCHEMA = "starsd-vllm-peer/1"
PREFIX = "[vllm-peer]"
RESULT_PREFIX = "[vllm-peer-result]"
SPEC_COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens": "accepted_tokens"}


def progress(msg: str) -> None:
    print(f"{PREFIX} {msg}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="The target's checkpoint directory.")
    p.add_argument("--draft", default=None, help="The draft model's checkpoint directory (none: target alone).")
    p.add_argument("--depth", type=int, default=4, help="num_speculative_tokens.")
    p.add_argument("--dtype", default="bfloat16", help="vLLM's dtype (bfloat16, float32, ...).")
    p.add_argument("--prompts", required=True, help="JSON file: a list of prompts, each a list of token ids.")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--streams", default="1,4", help="Comma-separated: generations at once in each case.")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True,
                   help="vLLM's enforce_eager (--no-enforce-eager: vLLM's CPU default, torch.compile warm-up).")
    p.add_argument("--warmup-tokens", type=int, default=8, help="One untimed generation of this many tokens first.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="Write the JSON object here instead of stdout.")
    p.add_argument("--serve", action="store_true",
                   help="Stay up: run the prompts on each 'run' line from stdin and answer each (see above).")
    p.add_argument("--result-fd", type=int, default=None, help="With --serve: write result lines to this file "
                   "descriptor (inherited from the caller) instead of stderr.")
    return p.parse_args(argv)


def spec_counters(llm) -> dict:
    """vLLM's speculative-decoding counters, summed over engines (all zero without a draft)."""
    out = {v: 0 for v in SPEC_COUNTERS.values()}
    for m in llm.get_metrics():
        key = SPEC_COUNTERS.get(m.name)
        if key is not None:
            out[key] += int(m.value)
    return out


def run_case(llm, sampling, prompts: list[list[int]], streams: int) -> dict:
    """The prompts in groups of ``streams`` sent at once (one group after another); each group's
    wall time from the call to its last output. Prompts go as ``{"prompt_token_ids": ...}``, the
    dict vLLM's ``TokensPrompt`` (a TypedDict) describes."""
    c0 = spec_counters(llm)
    outputs, wall = [], 0.0
    for i in range(0, len(prompts), streams):
        group = [{"prompt_token_ids": list(p)} for p in prompts[i: i + streams]]
        t0 = time.perf_counter()
        res = llm.generate(group, sampling, use_tqdm=False)
        wall += time.perf_counter() - t0
        for r in res:
            o = r.outputs[0]
            outputs.append({"token_ids": list(o.token_ids), "finish_reason": o.finish_reason})
    c1 = spec_counters(llm)
    return {"streams": streams, "wall_s": wall, "tokens": sum(len(o["token_ids"]) for o in outputs),
            "outputs": outputs, "spec": {k: c1[k] - c0[k] for k in c0}}


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


RESULT_FD: int | None = None  # --result-fd


def result(obj: dict) -> None:
    """One result line, written with as few writes as the pipe allows (one, up to its buffer)."""
    data = f"{RESULT_PREFIX} {json.dumps(obj)}\n".encode()
    fd = RESULT_FD if RESULT_FD is not None else sys.stderr.fileno()
    if RESULT_FD is None:
        sys.stderr.flush()
    while data:
        data = data[os.write(fd, data):]


def serve(llm, sampling, prompts: list[list[int]], streams: int, lines, emit=result) -> int:
    """The ``--serve`` loop: one case per ``run`` line, emitted as it ends; the number of cases.
    Any other line is refused with an ``error`` result, and the loop goes on."""
    done = 0
    for line in lines:
        cmd = line.strip()
        if cmd in ("quit", "exit"):
            break
        if cmd != "run":
            emit({"error": f"unknown command {cmd!r} (run, quit)"})
            continue
        emit(run_case(llm, sampling, prompts, streams))
        done += 1
    return done


def main(argv: list[str] | None = None) -> int:
    global RESULT_FD
    args = parse_args(argv)
    RESULT_FD = args.result_fd
    with open(args.prompts) as f:
        prompts = json.load(f)
    streams = [int(s) for s in args.streams.split(",") if s.strip()]
    t_import = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams

    import_s = time.perf_counter() - t_import
    progress(f"vllm {vllm.__version__} imported in {import_s:.1f}s; starting the engine "
             f"({'target + draft' if args.draft else 'target alone'}, {args.dtype}, "
             f"cores {os.environ.get('VLLM_CPU_OMP_THREADS_BIND', 'auto')}, "
             f"{'eager' if args.enforce_eager else 'torch.compile'})")
    spec = None
    if args.draft:
        spec = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.depth}
    t0 = time.perf_counter()
    # a checkpoint without a tokenizer (a random-init one of a real model's shape): token ids in and out
    no_tokenizer = not any(os.path.exists(os.path.join(args.target, f)) for f in ("tokenizer.json", "tokenizer_config.json"))
    llm = LLM(model=args.target, dtype=args.dtype, max_model_len=args.max_model_len, enforce_eager=args.enforce_eager,
              speculative_config=spec, disable_log_stats=False, seed=args.seed, max_num_seqs=max(streams),
              skip_tokenizer_init=no_tokenizer)
    init_s = time.perf_counter() - t0
    progress(f"engine up in {init_s:.1f}s; warm-up generation")
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": list(prompts[0])}],
                 SamplingParams(temperature=0.0, max_tokens=args.warmup_tokens, detokenize=False), use_tqdm=False)
    warmup_s = time.perf_counter() - t0
    sampling = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, detokenize=False, seed=args.seed)
    start = {"import_s": import_s, "engine_init_s": init_s, "first_generation_s": warmup_s,
             "warmup_tokens": args.warmup_tokens}
    if args.serve:
        result({"ready": True, "vllm_version": vllm.__version__, "torch_version": _version("torch"),
                "dtype": args.dtype, "start": start,
                "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
                "affinity": sorted(os.sched_getaffinity(0)), "enforce_eager": args.enforce_eager})
        progress(f"serving: {len(prompts)} prompts x {args.max_tokens} tokens, {streams[0]} at once, per 'run' line")
        serve(llm, sampling, prompts, streams[0], sys.stdin)
        return 0
    cases = []
    for s in streams:
        progress(f"{len(prompts)} prompts x {args.max_tokens} tokens, {s} at once")
        cases.append(run_case(llm, sampling, prompts, s))
        c = cases[-1]
        progress(f"  {c['tokens']} tokens in {c['wall_s']:.1f}s: {c['tokens'] / c['wall_s']:.1f} tok/s")
    report = {"schema": SCHEMA, "vllm_version": vllm.__version__,
              "torch_version": _version("torch"), "dtype": args.dtype, "speculative": spec,
              "enforce_eager": args.enforce_eager, "max_model_len": args.max_model_len,
              "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
              "kvcache_space_gib": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
              "ld_preload": os.environ.get("LD_PRELOAD", ""),
              "affinity": sorted(os.sched_getaffinity(0)),
              "start": start,
              "max_tokens": args.max_tokens, "cases": cases}
    text = json.dumps(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        print(text, flush=True)
    return 0


if __name__ == "__main__":  # vLLM spawns its engine processes: nothing may run at import
    sys.exit(main())
