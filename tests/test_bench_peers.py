"""`starsd-draftd bench-peers` without vLLM: the vLLM script's imports and its case logic on a fake
engine, the side-by-side report on synthetic cases, and the command line's plan."""

import ast
import importlib.util
import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from starsd_draftd.bench.peers import report as rep
from starsd_draftd.bench.peers import run
from starsd_draftd.bench.peers.cli import main
from starsd_draftd.bench.peers.run import VLLM_PEER, PeersConfig, daemon_args, plan, run_order, vllm_blocks, vllm_command
from tiny_models import make_tiny_checkpoint


def _load_peer():
    spec = importlib.util.spec_from_file_location("vllm_peer_under_test", VLLM_PEER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---------------------------------------------------------------- the vLLM script
def test_the_vllm_script_imports_only_vllm_and_the_standard_library():
    tree = ast.parse(VLLM_PEER.read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            roots.add(".")  # a relative import would need the starsd package
    assert "vllm" in roots  # it does drive vLLM
    foreign = {r for r in roots - {"vllm", "__future__"} if r not in sys.stdlib_module_names}
    assert foreign == set()
    assert not roots & {"common", "starsd_draftd", "starsd_target", "torch", "."}


def test_the_vllm_script_runs_nothing_at_import_and_reads_its_arguments():
    peer = _load_peer()  # vLLM itself is imported inside main only
    args = peer.parse_args(["--target", "/t", "--prompts", "p.json", "--draft", "/d", "--streams", "1,4",
                            "--dtype", "float32", "--no-enforce-eager"])
    assert (args.target, args.draft, args.dtype, args.streams, args.enforce_eager) == ("/t", "/d", "float32", "1,4",
                                                                                       False)
    assert peer.parse_args(["--target", "/t", "--prompts", "p"]).enforce_eager is True


class _Metric:
    def __init__(self, name, value):
        self.name, self.value = name, value


class _FakeLLM:
    """generate() answers each prompt with its own ids reversed; each call adds one draft per
    output token to the spec counters, two of them accepted."""

    def __init__(self):
        self.calls, self.counts = [], {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}

    def get_metrics(self):
        names = {v: k for k, v in _load_peer().SPEC_COUNTERS.items()}
        return [_Metric(names[k], v) for k, v in self.counts.items()] + [_Metric("vllm:other", 99)]

    def generate(self, prompts, sampling, use_tqdm=False):
        self.calls.append(len(prompts))
        outs = []
        for p in prompts:
            ids = list(reversed(p["prompt_token_ids"]))
            self.counts["drafts"] += 1
            self.counts["draft_tokens"] += 4
            self.counts["accepted_tokens"] += 2
            outs.append(type("R", (), {"outputs": [type("O", (), {"token_ids": ids, "finish_reason": "length"})]}))
        return outs


def test_a_case_sends_the_prompts_streams_at_a_time_and_diffs_the_spec_counters():
    peer = _load_peer()
    llm = _FakeLLM()
    llm.counts["drafts"] = 10  # counters from earlier cases do not count
    case = peer.run_case(llm, None, [[1, 2], [3, 4, 5], [6]], streams=2)
    assert llm.calls == [2, 1]
    assert case["tokens"] == 6 and case["streams"] == 2
    assert [o["token_ids"] for o in case["outputs"]] == [[2, 1], [5, 4, 3], [6]]
    assert case["spec"] == {"drafts": 3, "draft_tokens": 12, "accepted_tokens": 6}


# ---------------------------------------------------------------- the report
def _starsd_phase(jobs):
    return {"wall_s": 2.0, "results": [[{"token_ids": ids, "stats": {"rounds": r, "fallback_rounds": f,
                                                                   "plain_rounds": p, "finish_reason": "length"}}]
                                       for ids, r, f, p in jobs]}


def _vllm_case(streams, outputs, drafts, accepted, wall):
    return {"streams": streams, "wall_s": wall, "tokens": sum(map(len, outputs)),
            "outputs": [{"token_ids": o, "finish_reason": "length"} for o in outputs],
            "spec": {"drafts": drafts, "draft_tokens": 4 * drafts, "accepted_tokens": accepted}}


@pytest.fixture
def blocks():
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    alone = rep.starsd_case(1, [_starsd_phase([(a, 4, 0, 0)]), _starsd_phase([(b, 4, 0, 0)])])
    spec = rep.starsd_case(1, [_starsd_phase([(a, 2, 0, 1)]), _starsd_phase([(b, 3, 1, 1)])])
    return [
        {"system": "vllm", "mode": "spec", "cores": [0, 1], "dtype": "float32", "label": "v-spec2",
         "start": {"import_s": 9.0, "engine_init_s": 40.0, "first_generation_s": 1.0, "warmup_tokens": 8,
                   "process_s": 60.0},
         "cases": [_vllm_case(1, [a, [5, 6, 9, 9]], drafts=3, accepted=3, wall=1.0)]},
        {"system": "starsd", "mode": "spec", "cores": [0, 1], "dtype": "fp16-weights", "label": "s-spec",
         "start": {"ready_s": 10.0, "link_s": 10.5, "first_generation_s": 2.0, "warmup_tokens": 8}, "cases": [spec]},
        {"system": "vllm", "mode": "alone", "cores": [1], "dtype": "float32", "label": "v-alone",
         "start": {"import_s": 9.0, "engine_init_s": 30.0, "first_generation_s": 1.0, "warmup_tokens": 8,
                   "process_s": 50.0},
         "cases": [_vllm_case(1, [a, b], drafts=0, accepted=0, wall=2.0)]},
        {"system": "starsd", "mode": "alone", "cores": [1], "dtype": "fp16-weights", "label": "s-alone",
         "start": {"ready_s": 10.0, "link_s": 10.5, "first_generation_s": 2.0, "warmup_tokens": 8}, "cases": [alone]},
    ]


def test_rows_put_the_reference_first_and_count_rounds_the_same_way_for_both(blocks):
    rows = rep.build_rows(blocks, max_tokens=4)
    assert [(r["system"], r["mode"]) for r in rows] == [("starsd", "alone"), ("vllm", "alone"), ("starsd", "spec"),
                                                        ("vllm", "spec")]
    s_alone, v_alone, s_spec, v_spec = rows
    assert s_alone["vs_starsd_alone"] is None and s_alone["fallback_rounds"] is None
    assert s_alone["total_tps"] == pytest.approx(8 / 4.0)
    assert s_spec["kept_per_round"] == pytest.approx(8 / 5) and s_spec["fallback_rounds"] == 1
    assert s_spec["plain_rounds"] == 2 and s_alone["plain_rounds"] is None and v_spec["plain_rounds"] is None
    assert s_spec["vs_starsd_alone"] == {"identical": 2, "of": 2, "mean_common_prefix": 4.0}
    assert v_alone["kept_per_round"] == 1.0 and v_alone["vllm_mean_acceptance_length"] is None
    # vLLM with drafts: 3 draft rounds + 2 prefill steps for 8 tokens; its own metric 1 + 3/3
    assert v_spec["rounds"] == 5 and v_spec["kept_per_round"] == pytest.approx(8 / 5)
    assert v_spec["vllm_mean_acceptance_length"] == pytest.approx(2.0)
    assert v_spec["fallback_rounds"] is None
    assert v_spec["vs_starsd_alone"] == {"identical": 1, "of": 2, "mean_common_prefix": 3.0}
    assert v_spec["per_stream_tps"] == v_spec["total_tps"] == 8.0


def test_the_summary_and_markdown_state_identity_fallbacks_and_first_starts(blocks):
    rows = rep.build_rows(blocks, max_tokens=4)
    s = rep.summary(rows)
    assert s["starsd_spec_equals_starsd_alone"] == {"identical": 2, "of": 2}
    assert s["vllm_equals_starsd_alone"] == {"identical": 3, "of": 4}
    assert s["starsd_fallback_rounds"] == 1 and s["starsd_plain_rounds"] == 2
    report = {"created": "now", "machine": {"cpu": "X", "usable_cores": 2, "memory_gib": 8, "torch": "2"},
              "vllm_version": "0.32.0", "vllm_torch": "2", "config": {"prompts": 2, "max_tokens": 4, "depth": 4},
              "rows": rows, "summary": s, "blocks": blocks, "notes": ["a note"]}
    md = rep.format_markdown(report)
    table = [ln for ln in md.splitlines() if ln.startswith("|")]
    assert len(table) == 2 + 4 and all(ln.count("|") == table[0].count("|") for ln in table)
    assert "1 of 5" in md and "2 of 5" in md and "n/a (co-located)" in md and "(reference)" in md
    assert "vLLM's metric 2.00" in md and "1/2 (common prefix 3)" in md
    assert "identical to its target alone: 2/2" in md and "StarSD fallback rounds (drafts wanted, none in time): 1" in md
    assert "rounds run on the target alone by choice (more generations active than --draft-max-active): 2" in md
    assert "engine start 40.0 s" in md and "ready 10.0 s" in md and "- a note" in md


def test_a_divergent_starsd_output_is_called_out(blocks):
    blocks[1]["cases"][0]["outputs"][0]["token_ids"] = [1, 2, 0, 0]
    rows = rep.build_rows(blocks, max_tokens=4)
    s = rep.summary(rows)
    md = rep.format_markdown({"created": "now", "machine": {}, "config": {"prompts": 2, "max_tokens": 4, "depth": 4},
                              "rows": rows, "summary": s, "blocks": blocks})
    assert s["starsd_spec_equals_starsd_alone"] == {"identical": 1, "of": 2}
    assert "(NOT all)" in md


def test_each_starsd_dtype_is_compared_with_its_own_target_alone(blocks):
    """Two StarSD dtypes are two roundings of the model: speculative rows answer to their own
    dtype's target alone; the second dtype's target alone and vLLM to the first's (reported)."""
    a = [1, 2, 3, 4]
    other = [dict(b, dtype="bf16-weights", label=b["label"] + "-bf16") for b in blocks if b["system"] == "starsd"]
    other[0] = dict(other[0], cases=[rep.starsd_case(1, [_starsd_phase([(a, 2, 0, 0)]), _starsd_phase([([5, 6, 0, 0], 2, 0, 0)])])])
    other[1] = dict(other[1], cases=[rep.starsd_case(1, [_starsd_phase([(a, 4, 0, 0)]), _starsd_phase([([5, 6, 0, 0], 4, 0, 0)])])])
    rows = rep.build_rows(blocks + other, max_tokens=4)
    by = {(r["system"], r["mode"], r["dtype"]): r for r in rows}
    assert by[("starsd", "alone", "fp16-weights")]["vs_starsd_alone"] is None  # the first run's: the reference
    assert by[("starsd", "alone", "bf16-weights")]["vs_starsd_alone"]["identical"] == 1  # against fp16-weights'
    assert by[("starsd", "spec", "bf16-weights")]["vs_starsd_alone"]["identical"] == 2  # against its own
    assert by[("vllm", "alone", "float32")]["vs_starsd_alone"]["identical"] == 2
    assert rep.summary(rows)["starsd_spec_equals_starsd_alone"] == {"identical": 4, "of": 4}
    md = rep.format_markdown({"created": "now", "machine": {}, "config": {"prompts": 2, "max_tokens": 4, "depth": 4},
                              "rows": rows, "summary": rep.summary(rows), "blocks": blocks + other})
    assert md.count("(reference)") == 1


def test_starsd_dtypes_run_fresh_daemons_each_and_bad_ones_are_refused(tmp_path):
    cfg = PeersConfig(cpus=(0, 1), vllm_python=None, starsd_dtypes=("fp16-weights", "float32"))
    steps = plan(cfg)
    assert [s["draftd"][s["draftd"].index("--dtype") + 1] for s in steps] == ["fp16-weights", "float32"]
    with pytest.raises(ValueError, match="unknown StarSD dtype"):
        PeersConfig(cpus=(0, 1), vllm_python=None, starsd_dtypes=("fp8",)).check()


# ---------------------------------------------------------------- the plan and the command line
def test_vllm_gets_the_cores_starsd_uses_and_starsd_sits_between_vllm_engines():
    cfg = PeersConfig(cpus=(2, 3), vllm_dtypes=("bfloat16",))
    blocks = vllm_blocks(cfg)
    assert [(b["mode"], b["cores"]) for b in blocks] == [("alone", [3]), ("spec", [3]), ("spec", [2, 3])]
    assert run_order(blocks)[1] == "starsd" and len(run_order(blocks)) == 4
    two = vllm_blocks(PeersConfig(cpus=(0, 1), vllm_dtypes=("bfloat16", "float32")))
    order = run_order(two)
    assert len(two) == 6 and order[3] == "starsd"
    assert run_order([]) == ["starsd"]
    cmd, env = vllm_command(cfg, blocks[2], Path("/t"), Path("/d"), Path("/p.json"), Path("/o.json"))
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "2-3" and cmd[cmd.index("--draft") + 1] == "/d"
    cmd, env = vllm_command(cfg, blocks[0], Path("/t"), Path("/d"), Path("/p.json"), Path("/o.json"))
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "3" and "--draft" not in cmd


def test_extra_daemon_arguments_reach_both_daemons():
    cfg = PeersConfig(starsd_args=("--compile",), target_args=("--max-active", "8"))
    d, t = daemon_args(cfg, "fp16-weights", "tcp://a", "tcp://b")
    assert d[:2] == ["starsd_draftd", "serve"] and t[:2] == ["starsd_target", "serve"]
    assert d[-1] == "--compile" and t[-3:] == ["--compile", "--max-active", "8"]
    assert d[d.index("--threads") + 1] == "1" and d[d.index("--dtype") + 1] == "fp16-weights"
    assert t[t.index("--draft") + 1] == "tcp://a" and t[t.index("--depth") + 1] == "4"


def test_the_command_line_plans_without_vllm_installed(tmp_path):
    args = ["--plan", "--starsd-args=--compile --foo 1", "--streams", "1,2", "--cpus", "0,1", "--vllm-dtypes",
            "float32", "--vllm-python", str(tmp_path / "missing" / "python")]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    steps = json.loads(res.output)
    assert [s["system"] for s in steps] == ["vllm", "starsd", "vllm", "vllm", "alternated"]
    starsd = steps[1]
    assert starsd["draftd"][-3:] == ["--compile", "--foo", "1"] and starsd["target_cores"] == [1]
    assert starsd["cases"] == ["target alone, 1 stream(s)", "speculative, 1 stream(s)",
                               "target alone, 2 stream(s)", "speculative, 2 stream(s)"]
    assert all(s["command"][s["command"].index("--streams") + 1] == "1,2" for s in steps if s["system"] == "vllm")
    alt = steps[-1]
    assert alt["rounds"] == 6 and alt["cores"] == [1] and alt["vllm_env"]["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    cmd = alt["vllm_command"]
    assert cmd[-1] == "--serve" and cmd[cmd.index("--streams") + 1] == "1" and "--draft" not in cmd
    assert alt["starsd_target"][:2] == ["starsd_target", "serve"] and "--draft" not in alt["starsd_target"]
    assert "--no-draft" in alt["starsd_target"]  # no link to dial, no retries on the measured core
    assert alt["starsd_target"][-3:] == ["--compile", "--foo", "1"]


def test_the_alternated_comparison_is_planned_alone_or_not_at_all(tmp_path):
    base = ["--plan", "--cpus", "0,1", "--vllm-python", str(tmp_path / "python")]
    only = json.loads(CliRunner().invoke(main, base + ["--alternated-only", "--alternate", "3"]).output)
    assert [(s["system"], s["rounds"]) for s in only] == [("alternated", 3)]
    none = json.loads(CliRunner().invoke(main, base + ["--alternate", "0"]).output)
    assert "alternated" not in [s["system"] for s in none]
    assert "alternated" not in [s["system"] for s in json.loads(CliRunner().invoke(main, ["--plan", "--no-vllm"]).output)]


def test_the_alternated_comparison_can_send_the_prompts_together(tmp_path):
    """--alternate-streams N: vLLM's engine kept up batches N prompts per call, the plan and the
    report say so, and 0 is refused."""
    from starsd_draftd.bench.peers.run import alternated_block, serve_command

    base = ["--plan", "--cpus", "0,1", "--vllm-python", str(tmp_path / "python"), "--alternated-only"]
    (step,) = json.loads(CliRunner().invoke(main, base + ["--alternate-streams", "4"]).output)
    assert step["streams"] == 4 and step["vllm_command"][step["vllm_command"].index("--streams") + 1] == "4"
    (one,) = json.loads(CliRunner().invoke(main, base).output)
    assert one["streams"] == 1 and one["vllm_command"][one["vllm_command"].index("--streams") + 1] == "1"
    res = CliRunner().invoke(main, base + ["--alternate-streams", "0"])
    assert res.exit_code != 0 and "--alternate-streams" in res.output
    with pytest.raises(ValueError, match=r"alternated streams must lie in 1\.\.4"):
        PeersConfig(cpus=(0, 1), alternate_streams=5).check()  # more than the 4 prompts
    (wide,) = json.loads(CliRunner().invoke(main, base + ["--prompts", "8", "--alternate-streams", "8"]).output)
    t = wide["starsd_target"]  # the daemon takes as many at once as vLLM's engine batches
    assert t[t.index("--max-active") + 1] == "8" and t[t.index("--max-batch") + 1] == "8"
    assert "--max-batch" not in step["starsd_target"]  # 4 at once: the daemon's defaults
    cfg = PeersConfig(cpus=(0, 1), alternate_streams=4)
    cmd, _ = serve_command(cfg, alternated_block(cfg), tmp_path, tmp_path / "p.json", tmp_path / "o.json")
    assert cmd[cmd.index("--streams") + 1] == "4" and cmd[-1] == "--serve"
    alt = {"summary": {"rounds": 0}, "rounds": [], "pause_s": 1.0, "streams": 4, "starsd": {"dtype": "fp16-weights"},
           "vllm": {"cores": [1], "dtype": "bfloat16"}}
    assert "the prompts sent 4 at once" in rep.format_alternated(alt)
    assert "the prompts one at a time" in rep.format_alternated(dict(alt, streams=1))


def test_the_make_variable_reaches_the_daemons_through_the_environment():
    res = CliRunner().invoke(main, ["--plan", "--no-vllm"], env={"STARSD_ARGS": "--compile"})
    assert res.exit_code == 0, res.output
    (step,) = json.loads(res.output)
    assert step["draftd"][-1] == "--compile" and step["target"][-1] == "--compile"


@pytest.mark.parametrize("args, message", [
    (["--streams", "1,x"], "comma-separated list of integers"),
    (["--vllm-python", "/nonexistent/python"], "make bench-peers"),
    (["--no-vllm", "--no-starsd"], "nothing to run"),
    (["--no-vllm", "--cpus", "0"], "needs two cores"),
    (["--no-vllm", "--alternated-only"], "the alternated comparison only"),
    (["--alternated-only", "--alternate", "0", "--vllm-python", sys.executable], "the alternated comparison only"),
])
def test_bad_arguments_fail_with_a_message_before_any_work(args, message):
    res = CliRunner().invoke(main, args)
    assert res.exit_code != 0
    assert message in res.output


# ---------------------------------------------------------------- the alternated comparison
def test_the_serve_loop_answers_each_run_and_refuses_other_lines():
    peer = _load_peer()
    llm, emitted = _FakeLLM(), []
    done = peer.serve(llm, None, [[1, 2], [3]], 1, ["run\n", "bogus\n", "run\n", "quit\n", "run\n"], emitted.append)
    assert done == 2 and llm.calls == [1, 1, 1, 1]
    assert [sorted(e)[0] for e in emitted] == ["outputs", "error", "outputs"]
    assert "unknown command 'bogus'" in emitted[1]["error"]
    assert [o["token_ids"] for o in emitted[2]["outputs"]] == [[2, 1], [3]]


FAKE_VLLM = """
import os, subprocess, sys
__version__ = "0.0-fake"
class SamplingParams:
    def __init__(self, **kw):
        self.kw = kw
class _O:
    def __init__(self, ids):
        self.token_ids, self.finish_reason = ids, "length"
class _R:
    def __init__(self, ids):
        self.outputs = [_O(ids)]
class LLM:
    def __init__(self, **kw):
        if os.environ.get("FAKE_VLLM_FAIL"):
            raise SystemExit("fake engine failed to start")
    def get_metrics(self):
        return []
    def generate(self, prompts, sampling, use_tqdm=False):
        if os.environ.get("FAKE_VLLM_NOISE"):  # engine chatter, half lines and bytes that are not UTF-8
            sys.stderr.buffer.write(b"[vllm-peer-result] {broken\\xff\\xfe" + b"x" * 70000)
            sys.stderr.flush()
        self.calls = getattr(self, "calls", 0) + 1
        if os.environ.get("FAKE_VLLM_DIE") and self.calls > 1:  # after the warm-up: a child keeps the pipes
            # open and the front end dies
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], close_fds=False)
            os._exit(3)
        return [_R(list(reversed(p["prompt_token_ids"]))[: sampling.kw["max_tokens"]]) for p in prompts]
"""


def _fake_server(tmp_path, timeout_s=60, **env_flags):
    import os

    from starsd_draftd.bench.peers.run import VllmServer, alternated_block, serve_command

    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([[1, 2, 3], [4, 5]]))
    cfg = PeersConfig(cpus=(0, 1), vllm_python=Path(sys.executable), preload=(), max_tokens=2)
    block = alternated_block(cfg)
    cmd, env = serve_command(cfg, block, tmp_path, prompts, tmp_path / "out.json")
    env = dict(env, PYTHONPATH=str(tmp_path), **{k: "1" for k in env_flags})
    core = sorted(os.sched_getaffinity(0))[:1]
    return VllmServer(cmd, env, core, tmp_path / "vllm.log", timeout_s, timeout_s)


def _group_gone(pgid, wait_s=5.0):
    """No live process is left in the process group (zombies waiting for init to reap them do not
    count), within ``wait_s``."""
    import glob
    import time

    deadline = time.monotonic() + wait_s
    while True:
        alive = []
        for path in glob.glob("/proc/[0-9]*/stat"):
            try:
                with open(path) as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                alive.append(path)
        if not alive or time.monotonic() > deadline:
            return not alive
        time.sleep(0.05)


def test_a_kept_up_engine_runs_the_prompts_on_each_request_and_stops(tmp_path):
    server = _fake_server(tmp_path)
    with server:
        assert server.ready["ready"] is True and server.ready["vllm_version"] == "0.0-fake"
        first, second = server.run(), server.run()
        assert [o["token_ids"] for o in first["outputs"]] == [[3, 2], [5, 4]] and first["tokens"] == 4
        assert second["outputs"] == first["outputs"] and first["streams"] == 1
        assert server.cpu_s() > 0  # the process group's CPU time, read from /proc
        pid = server.proc.pid
    assert server.proc.returncode == 0  # "quit" ends it cleanly
    assert _group_gone(pid)  # nothing of its process group is left


def test_engine_chatter_on_stderr_cannot_split_or_fake_a_result(tmp_path):
    server = _fake_server(tmp_path, FAKE_VLLM_NOISE=1)
    with server:
        case = server.run()
        assert [o["token_ids"] for o in case["outputs"]] == [[3, 2], [5, 4]]
    assert "[vllm-peer-result] {broken" in (tmp_path / "vllm.log").read_text(errors="replace")  # in the log only


def test_an_engine_that_dies_mid_run_is_reported_at_once_though_a_child_holds_its_pipes(tmp_path):
    server = _fake_server(tmp_path, timeout_s=120, FAKE_VLLM_DIE=1)
    pid = server.proc.pid
    # the exit is what the server reports, not the 120 s timeout it would otherwise reach waiting on
    # the pipes the child holds (that raises TimeoutError)
    with pytest.raises(RuntimeError, match="exited with status 3"):
        server.run()
    server.close()
    assert _group_gone(pid)  # the orphaned child went with its group


def test_an_engine_that_fails_to_start_is_reported_with_its_log(tmp_path):
    with pytest.raises(RuntimeError, match="exited with status 1(.|\\n)*fake engine failed to start"):
        _fake_server(tmp_path, FAKE_VLLM_FAIL=1)


def test_alternation_lets_each_system_lead_in_turn_and_counts_the_others_cpu():
    from starsd_draftd.bench.peers.run import alternate

    calls, clock = [], {"a": 0.0, "b": 0.0}

    def pass_of(name):
        def run():
            calls.append(name)
            other = "b" if name == "a" else "a"
            clock[other] += 0.25  # the other system's idle processes use a little CPU meanwhile
            return {"name": name}
        return run

    pauses = []
    rounds = alternate(3, 1.5, {"a": pass_of("a"), "b": pass_of("b")},
                       cpu={"a": lambda: clock["a"], "b": lambda: clock["b"]}, sleep=pauses.append)
    assert calls == ["a", "b", "b", "a", "a", "b"]
    assert pauses == [1.5] * 6
    assert [r["order"] for r in rounds] == [["a", "b"], ["b", "a"], ["a", "b"]]
    assert all(p["others_cpu_s"] == pytest.approx(0.25) for r in rounds for p in r["passes"].values())
    assert alternate(2, 0, {"a": pass_of("a")}, sleep=pauses.append)[0]["passes"]["a"]["others_cpu_s"] is None


def _alt_round(i, starsd, vllm, starsd_ids=(1, 2), vllm_ids=(1, 2)):
    def case(tps, ids):
        return {"streams": 1, "wall_s": 64 / tps, "tokens": 64, "outputs": [{"token_ids": list(ids)}]}
    return {"round": i, "order": ["starsd", "vllm"] if i % 2 else ["vllm", "starsd"],
            "passes": {"starsd": {"case": case(starsd, starsd_ids), "others_cpu_s": 0.02},
                       "vllm": {"case": case(vllm, vllm_ids), "others_cpu_s": 0.01}}}


def test_the_alternated_summary_gives_median_ratio_spread_and_stability():
    rounds = [_alt_round(1, 50, 40), _alt_round(2, 45, 50), _alt_round(3, 60, 50, vllm_ids=(1, 3))]
    s = rep.alternated_summary(rounds)
    assert s["ratio_median"] == pytest.approx(1.2) and s["ratio_min"] == pytest.approx(0.9)
    assert s["ratio_max"] == pytest.approx(1.25) and (s["starsd_ahead"], s["of"]) == (2, 3)
    assert s["starsd_median_tps"] == pytest.approx(50) and s["vllm_median_tps"] == pytest.approx(50)
    assert s["starsd_outputs_stable"] and not s["vllm_outputs_stable"]
    assert s["vllm_equals_starsd"]["identical"] == 1
    assert s["vllm_cpu_during_starsd_s"] == pytest.approx(0.02)
    alt = {"summary": s, "rounds": rounds, "pause_s": 1.0, "starsd": {"dtype": "fp16-weights", "up_s": 3.0},
           "vllm": {"cores": [1], "dtype": "bfloat16", "enforce_eager": False, "start": {"engine_init_s": 40.0}}}
    md = rep.format_alternated(alt)
    assert "median ratio 1.200 (range 0.900 to 1.250)" in md and "StarSD at least as fast in 2 of 3" in md
    assert "| 2 | vLLM | 45.0 | 50.0 | 0.900 |" in md and "compiled" in md and "vLLM no" in md
    unstable = rep.alternated_summary([_alt_round(1, 50, 40), _alt_round(2, 50, 40, starsd_ids=(9,))])
    assert not unstable["starsd_outputs_stable"]
    assert "StarSD NO" in rep.format_alternated(dict(alt, summary=unstable))


def test_vllm_meets_starsd_compiled_in_its_faster_dtype_by_default(monkeypatch):
    import starsd_draftd.demo.run as demo_run

    cfg = PeersConfig(cpus=(0, 1))
    assert cfg.vllm_eager is False and cfg.vllm_dtypes == ("auto",)
    for native, dtype in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(demo_run, "cpu_has_native_bf16", lambda native=native: native)
        assert {b["dtype"] for b in vllm_blocks(cfg)} == {dtype}
        cmd, _ = vllm_command(cfg, vllm_blocks(cfg)[0], Path("/t"), Path("/d"), Path("/p"), Path("/o"))
        assert cmd[cmd.index("--dtype") + 1] == dtype and "--no-enforce-eager" in cmd
    both = PeersConfig(cpus=(0, 1), vllm_dtypes=("auto", "float32", "bfloat16"))
    assert both.vllm_dtype_list() == ("float32", "bfloat16")  # auto is float32 here (patched), counted once


def test_the_alternated_run_keeps_its_engines_on_the_target_core_and_restores_its_own_affinity(monkeypatch,
                                                                                               tmp_path):
    import os

    import starsd_draftd.bench.peers.run as run
    import starsd_draftd.bench.procs as procs_mod

    events, mine = [], os.sched_getaffinity(0)

    class FakeServer:
        def __init__(self, cmd, env, cores, log_path, ready_timeout_s, run_timeout_s):
            events.append(("vllm", cores, cmd[-1]))
            self.ready, self.n = {"start": {"engine_init_s": 1.0}, "vllm_version": "x", "torch_version": "y"}, 0

        def run(self):
            self.n += 1
            if self.n == 3 and fail:
                raise RuntimeError("engine gone")
            events.append(("vllm-pass", os.sched_getaffinity(0)))
            return {"streams": 1, "wall_s": 1.0, "tokens": 10, "outputs": [{"token_ids": [1]}]}

        def cpu_s(self):
            return 0.0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            events.append(("vllm-closed",))

    class FakeProcs:
        def __init__(self, workdir, ctx):
            pass

        def start(self, name, *args, cpus=None):
            events.append(("starsd", list(args), cpus))
            return type("P", (), {"pid": os.getpid()})

        def wait_ready(self, *a):
            pass

        def job_endpoint(self, name):
            return f"ipc:///nonexistent/{name}.sock"

        def close(self):
            events.append(("starsd-closed",))

    sizes = []

    def fake_generate(ep, prompts, max_tokens, no_draft, ctx, timeout_s):
        assert no_draft
        events.append(("starsd-pass", max_tokens))
        sizes.append(len(prompts))
        return {"wall_s": 1.0, "results": [[{"token_ids": [1] * 5, "stats": {"rounds": 5, "fallback_rounds": 0}}]]}

    monkeypatch.setattr(run, "VllmServer", FakeServer)
    monkeypatch.setattr(procs_mod, "ProcessSet", FakeProcs)
    monkeypatch.setattr(run, "generate_at_once", fake_generate)
    cores = sorted(mine)
    cfg = PeersConfig(cpus=(cores[0], cores[-1]), vllm_python=Path(sys.executable), alternate=2, alternate_pause_s=0,
                      max_tokens=7, warmup_tokens=3, starsd_dtypes=("float32",), vllm_dtypes=("float32",))
    fail = False
    res = run.run_alternated(cfg, [[1, 2]], "float32", tmp_path, tmp_path / "p.json", tmp_path, lambda m: None)
    assert os.sched_getaffinity(0) == mine
    (vllm,), (starsd,) = [e for e in events if e[0] == "vllm"], [e for e in events if e[0] == "starsd"]
    assert vllm[1] == [cores[-1]] and vllm[2] == "--serve" and starsd[2] == [cores[-1]]
    assert "--no-draft" in starsd[1] and "--draft" not in starsd[1]
    passes = [e[0] for e in events if e[0].endswith("-pass")]
    assert passes == ["starsd-pass"] + ["starsd-pass", "vllm-pass", "vllm-pass", "starsd-pass"]  # warm-up, then turns
    if len(cores) > 1:  # the client threads were off the measured core during vLLM's passes
        assert all(cores[-1] not in e[1] for e in events if e[0] == "vllm-pass")
    assert [r["order"] for r in res["rounds"]] == [["starsd", "vllm"], ["vllm", "starsd"]]
    assert res["streams"] == 1 and set(sizes) == {1}
    sizes.clear()
    cfg.alternate, cfg.alternate_streams = 1, 2  # --alternate-streams 2: StarSD's pass sends groups of two
    res = run.run_alternated(cfg, [[1, 2], [3, 4], [5]], "float32", tmp_path, tmp_path / "p.json", tmp_path,
                             lambda m: None)
    assert sizes == [1, 2, 1] and res["streams"] == 2  # the warm-up's one prompt, then the pass: 2 and the rest
    events.clear()
    fail = True
    cfg.alternate = 3
    with pytest.raises(RuntimeError, match="engine gone"):
        run.run_alternated(cfg, [[1, 2]], "float32", tmp_path, tmp_path / "p.json", tmp_path, lambda m: None)
    assert os.sched_getaffinity(0) == mine
    assert ("vllm-closed",) in events and ("starsd-closed",) in events


def test_the_real_size_models_are_planned_from_the_cache_and_prompted_with_seeded_ids(tmp_path, monkeypatch):
    """--models qwen2.5-1.5b: both daemons serve the random-init checkpoints of the real shapes
    (where a run builds them), and a checkpoint without a tokenizer is prompted with seeded ids
    inside its vocabulary."""
    monkeypatch.setenv("STARSD_CACHE_DIR", str(tmp_path / "cache"))
    res = CliRunner().invoke(main, ["--plan", "--models", "qwen2.5-1.5b", "--cpus", "0,1", "--no-vllm"])
    assert res.exit_code == 0, res.output
    (starsd,) = [s for s in json.loads(res.output) if s["system"] == "starsd"]
    shapes = tmp_path / "cache" / "bench"
    assert starsd["draftd"][starsd["draftd"].index("--model") + 1] == str(shapes / "shape-qwen2.5-0.5b")
    assert starsd["target"][starsd["target"].index("--model") + 1] == str(shapes / "shape-qwen2.5-1.5b")
    assert not shapes.exists()  # planning builds nothing
    bare = make_tiny_checkpoint(tmp_path / "bare", "qwen2", seed=0, hidden=32, layers=1)
    for f in bare.iterdir():  # a tokenizer-less checkpoint, as the shapes are
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            f.unlink()
    cfg = run.PeersConfig(prompts=3)
    texts, ids = run._prompt_ids(cfg, bare)
    vocab = json.loads((bare / "config.json").read_text())["vocab_size"]
    assert len(texts) == len(ids) == 3 and all(len(p) == run.SHAPE_PROMPT_TOKENS for p in ids)
    assert all(0 <= t < vocab for p in ids for t in p) and len({tuple(p) for p in ids}) == 3
    assert run._prompt_ids(cfg, bare) == (texts, ids)  # the same prompts every run
