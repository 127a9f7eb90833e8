"""Bench peer, never a product dependency: replays given greedy outputs through ArcticInference's suffix
decoding cache (``arctic_inference.suffix_decoding.SuffixDecodingCache`` over its C++ suffix tree) and
reports tokens per step at a fixed draft budget.

Run BY THE PEER ENV's python (built by ``starsd_draftd.bench.suffix_peer.ensure_env``) as a file path,
never imported by StarSD: it imports the standard library and the peer's ``arctic_inference`` only.

stdin: ``{"budget": 16, "requests": [{"id": "r0", "prompt": [ints], "output": [ints]}, ...]}`` plus
optional parameters (defaults: ArcticInference 0.3.0's vLLM plugin, ``ArcticSpeculativeConfig`` in
``arctic_inference/vllm/config.py``): ``max_tree_depth`` 64, ``max_spec_factor`` 1.0,
``max_spec_offset`` 0.0, ``min_token_prob`` 0.1, ``max_cached_requests`` 100000, ``tree`` false
(the plugin's ``propose_suffix_draft_token_ids`` in ``arctic_inference/vllm/model_runner.py`` never
passes ``use_tree_spec``, so vLLM gets chains), ``ask_tokens`` null (the draft length asked of the
cache; null: the budget; vLLM's runner asks for up to MAX_SPEC_LEN and cuts the draft to the budget).

Requests run one after another. Each is started with its prompt; then, until its output is used up:
speculate on prompt + output[:pos]; accepted = the longest root-down draft path equal to the output
from pos; the step yields accepted + 1 tokens (the target's own), capped at what is left; those go to
the cache as the request's response. The request is then stopped, its response staying in the global
tree for later requests (the loop of ``arctic_inference/suffix_decoding/simulator.py``).

stdout: one JSON object, per request ``{"id", "steps", "tokens", "drafted", "accepted"}``, totals
(``tokens_per_step`` = output tokens / steps), mean microseconds per speculate call and per token
added, the parameters used and the arctic-inference version.
"""

import os
import sys

# Run as a file path, this script's folder (the StarSD bench, with modules such as trace.py) would
# come first on sys.path and could shadow the standard library: drop it before any other import.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

SCHEMA = "starsd-arctic-replay/1"
DEFAULTS = {
    "max_tree_depth": 64,
    "max_spec_factor": 1.0,
    "max_spec_offset": 0.0,
    "min_token_prob": 0.1,
    "max_cached_requests": 100000,
    "tree": False,
    "ask_tokens": None,
}


def peer_version() -> str:
    """The arctic-inference version the peer was built from (BUILD_INFO.json beside the package)."""
    import arctic_inference

    info = Path(arctic_inference.__file__).resolve().parent / "BUILD_INFO.json"
    if info.is_file():
        return str(json.loads(info.read_text()).get("version", "unknown"))
    try:
        from importlib.metadata import version

        return version("arctic-inference")
    except Exception:  # noqa: BLE001 - any failure means we cannot tell
        return "unknown"


def accepted_length(token_ids: list, parents: list, truth: list) -> int:
    """Tokens of ``truth`` matched by the longest root-down path of the draft (a chain or a tree;
    ``parents[i]`` is the index of token i's parent, -1 for the root's children)."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        children.setdefault(p, []).append(i)
    node, n = -1, 0
    for tok in truth:
        nxt = next((c for c in children.get(node, ()) if token_ids[c] == tok), None)
        if nxt is None:
            break
        node, n = nxt, n + 1
    return n


def cut_draft(token_ids: list, parents: list, budget: int) -> tuple[list, list]:
    """The first ``budget`` draft tokens (parents always precede children, so a prefix stays a tree)."""
    return list(token_ids[:budget]), list(parents[:budget])


def _us(total_ns: float, n: int) -> float:
    return total_ns / n / 1e3 if n else 0.0


def replay(spec: dict) -> dict:
    """Replay ``spec["requests"]`` through one SuffixDecodingCache; see the module docstring."""
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    unknown = set(spec) - set(DEFAULTS) - {"budget", "requests"}
    if unknown:
        raise ValueError(f"unknown parameters: {sorted(unknown)}")
    params = {k: v if spec.get(k) is None else spec[k] for k, v in DEFAULTS.items()}
    budget = int(spec.get("budget", 16))
    if budget < 0:
        raise ValueError("budget must be >= 0")
    ask = budget if params["ask_tokens"] is None else int(params["ask_tokens"])
    cache = SuffixDecodingCache(max_tree_depth=int(params["max_tree_depth"]),
                                max_cached_requests=int(params["max_cached_requests"]))
    depth = int(params["max_tree_depth"])
    per_request = []
    spec_ns: list[int] = []
    add_ns: list[int] = []
    added_tokens = 0
    for index, req in enumerate(spec["requests"]):
        prompt = [int(t) for t in req["prompt"]]
        output = [int(t) for t in req["output"]]
        seq = prompt + output
        key = f"replay-{index}"  # the cache's id; the caller's ids need not be unique
        cache.start_request(key, prompt)
        pos = steps = drafted = accepted = 0
        while pos < len(output):
            end = len(prompt) + pos  # the context is prompt + output[:pos], cut as vLLM's runner cuts it
            context = seq[max(0, end - depth): end]
            t0 = time.perf_counter_ns()
            draft = cache.speculate(key, context, max_spec_tokens=ask,
                                    max_spec_factor=float(params["max_spec_factor"]),
                                    max_spec_offset=float(params["max_spec_offset"]),
                                    min_token_prob=float(params["min_token_prob"]),
                                    use_tree_spec=bool(params["tree"]))
            spec_ns.append(time.perf_counter_ns() - t0)
            token_ids, parents = cut_draft(draft.token_ids, draft.parents, budget)
            left = len(output) - pos
            acc = min(accepted_length(token_ids, parents, output[pos:]), left)
            new = output[pos: pos + min(acc + 1, left)]
            t0 = time.perf_counter_ns()
            cache.add_active_response(key, new)
            add_ns.append(time.perf_counter_ns() - t0)
            added_tokens += len(new)
            drafted += len(token_ids)
            accepted += acc
            steps += 1
            pos += len(new)
        cache.stop_request(key)
        per_request.append({"id": req.get("id", index), "steps": steps, "tokens": len(output),
                            "drafted": drafted, "accepted": accepted})
    steps = sum(r["steps"] for r in per_request)
    tokens = sum(r["tokens"] for r in per_request)
    drafted = sum(r["drafted"] for r in per_request)
    accepted = sum(r["accepted"] for r in per_request)
    return {
        "schema": SCHEMA,
        "peer": "arctic-inference suffix decoding (SuffixDecodingCache)",
        "version": peer_version(),
        "params": {"budget": budget, **params, "ask_tokens": ask,
                   "draft_shape": "tree" if params["tree"] else "chain"},
        "requests": per_request,
        "totals": {"requests": len(per_request), "steps": steps, "tokens": tokens, "drafted": drafted,
                   "accepted": accepted, "tokens_per_step": tokens / steps if steps else 0.0,
                   "acceptance_rate": accepted / drafted if drafted else 0.0},
        "timing": {"speculate_calls": len(spec_ns), "speculate_us_mean": _us(sum(spec_ns), len(spec_ns)),
                   "speculate_us_p50": _us(statistics.median(spec_ns), 1) if spec_ns else 0.0,
                   "add_calls": len(add_ns), "tokens_added": added_tokens,
                   "add_us_per_call": _us(sum(add_ns), len(add_ns)),
                   "add_us_per_token": _us(sum(add_ns), added_tokens)},
    }


def main() -> int:
    try:
        spec = json.load(sys.stdin)
        result = replay(spec)
    except Exception as exc:  # noqa: BLE001 - reported to the caller on stderr with a nonzero exit
        print(f"[arctic-replay] error: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
