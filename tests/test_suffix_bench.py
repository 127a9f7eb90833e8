"""The bench's suffix section, without daemons: the agentic workload's requests, the replay through
StarSD's index, the peer's failure reported rather than raised, and the section's table."""

import pytest

from starsd_draftd.bench import agentic, config
from starsd_draftd.bench import suffix as section


def _response(text: str, rounds: int = 3) -> dict:
    return {"choices": [{"message": {"role": "assistant", "content": text}}],
            "usage": {"completion_tokens": 10},
            "starsd": {"rounds": rounds, "drafted": 12, "accepted": 7, "fallback_rounds": 0}}


def test_the_workload_sends_edits_tool_calls_and_turns_that_carry_earlier_answers():
    sent = []

    def chat(req):
        sent.append(req)
        return _response(f"answer {len(sent)}")

    done = agentic.run_workload(chat, 32)
    kinds = [d["kind"] for d in done]
    assert kinds.count("edit") == len(agentic.EDITS) - 1 and kinds.count("tool") == len(agentic.TOOL_ASKS)
    assert kinds.count("turn") == sum(len(c) for c in agentic.CONVERSATIONS)
    edit = sent[0].messages
    assert "def seed_at(" in edit[2]["content"] or "def best_probs(" in edit[2]["content"]  # the worked example
    assert "```python\ndef position_seed(" in edit[-1]["content"]  # a real function of the package
    tools = [r for r in sent if r.kind == "tool"]
    assert all(r.messages[0]["content"] == agentic.TOOL_SYSTEM and len(r.messages) == 6 for r in tools)  # one schema
    turns = [r for r in sent if r.kind == "turn"]
    second = turns[1].messages
    assert [m["role"] for m in second] == ["user", "assistant", "user"]
    assert second[1]["content"] == f"answer {sent.index(turns[0]) + 1}"  # the first turn's answer, carried
    assert len(agentic.run_workload(chat, 32, quick=True)) < len(done)


def test_the_replay_through_starsd_keeps_what_repeats():
    out = list(range(300, 340))
    requests = [{"id": "a", "prompt": [1, 2, 3], "output": out},
                {"id": "b", "prompt": [4, 5, 6], "output": out},  # the same answer again
                {"id": "c", "prompt": [7, 8, 9], "output": [500 + i for i in range(20)]}]  # nothing seen
    r = section.replay_starsd(requests, budget=16)
    assert r["tokens"] == 100 and r["accepted"] <= r["drafted"]
    # the first and third take a step a token; the second far fewer (its drafts grow with its match)
    assert r["steps"] < 40 + 40 + 20 and r["steps"] >= 40 + 20 + 40 // 17
    assert r["tokens_per_step"] == pytest.approx(100 / r["steps"])
    alone = section.replay_starsd(requests[:1] + requests[2:], budget=16)
    assert alone["tokens_per_step"] == pytest.approx(1.0)


def test_a_peer_that_cannot_build_is_reported_not_raised(monkeypatch):
    from starsd_draftd.bench import suffix_peer

    def fail(*a, **k):
        raise RuntimeError("arctic-suffix peer build failed at step 'compiler'")

    monkeypatch.setattr(suffix_peer, "ensure_env", fail)
    r = section.replay_peer([{"id": "a", "prompt": [1], "output": [2]}])
    assert "compiler" in r["error"]


def test_the_section_table_and_its_config_checks():
    runs = {name: {"tps": tps, "speedup": tps / 10, "tokens_per_round": tpr, "rounds": 50, "fallback_rounds": 0,
                   "same_as_alone": True, "by_kind": {"edit": {"tokens_per_round": tpr}}}
            for name, tps, tpr in (("alone", 10.0, 1.0), ("model", 14.0, 1.9), ("model-paused", 9.8, 1.05),
                                   ("suffix", 25.0, 3.4))}
    runs["model-paused"]["plain_rounds"] = 30  # rounds on the target alone by choice (--pause-unpaid-drafts)
    s = {"budget": 16, "topology": "draft core 0, target core 1", "dtype": "fp16-weights", "configs": runs,
         "draftd": {"suffix": {"suffix": {"requests": 40, "tokens": 300, "kept": 250, "query_us": 30.0,
                                          "update_us_per_token": 4.0, "bytes": 48000, "tokens_indexed": 100}}},
         "replays": {"starsd": {"tokens_per_step": 3.1, "drafted": 300, "accepted": 200, "query_us": 25.0,
                                "update_us_per_token": 3.0},
                     "arcticinference": {"error": "no compiler"}},
         "workload": {"edit": 3, "tool": 8, "turn": 6}}
    text = "\n".join(section.format_suffix(s))
    assert "| suffix | 25.0 | 2.50 | 3.40 | 50 | 0 | yes |" in text
    assert "| model-paused | 9.8 | 0.98 | 1.05 | 50 | 0 (+30 by choice) | yes |" in text
    assert "| arcticinference | did not run: no compiler" in text and "| starsd | 3.10 |" in text
    assert "prefill" not in text  # a report from before the bench said where the time went
    runs["suffix"].update(wall_s=40.0, prefill_s=10.0, prompt_tokens=5000,
                          round_ms={"round": 60.0, "draft_wait": 5.0, "verify_forward": 53.0})
    assert ("suffix: prefill 10.0 s of 40.0 (5000 prompt tokens, 0 of them reused from earlier prompts); a round 60.0 ms: draft wait 5.0, verify "
            "forward 53.0, the rest 2.0") in "\n".join(section.format_suffix(s))
    s["replays"]["arcticinference"] = {"totals": {"tokens_per_step": 3.0, "drafted": 310, "accepted": 190},
                                       "timing": {"speculate_us_mean": 8.0, "add_us_per_token": 1.5}}
    assert "| arcticinference | 3.00 | 310 | 190 | speculate 8.0 us, add 1.5 us a token |" in "\n".join(
        section.format_suffix(s))
    assert "tokens per round by kind (star with suffix drafts): edit 3.40" in text  # no peer by kind: none shown
    s["replays"]["arcticinference"]["by_kind"] = {"edit": {"tokens_per_round": 3.5}}
    assert ("tokens per round by kind (star with suffix drafts, ArcticInference's replay in brackets): "
            "edit 3.40 (3.50)") in "\n".join(section.format_suffix(s))
    assert "idle feeds" not in text  # a report from before the daemon fed while idle
    s["draftd"]["suffix"]["catch_up"] = {"feeds": 12, "tokens": 340, "seconds": 0.25}
    assert ("idle feeds: 340 verified tokens the draft model missed while suffix drafts answered, fed in 12 "
            "forwards (0.2 s) with no request waiting") in "\n".join(section.format_suffix(s))
    assert "suffix" in config.SECTIONS and "suffix" not in config.BenchConfig.quick_config().sections
    with pytest.raises(ValueError, match="demo models"):
        config.BenchConfig(sections=("suffix",), models="tiny").check()


def test_a_summary_says_where_the_time_went():
    """Prefill and the rounds' profile, summed over the responses' own stats."""
    def response(prefill, rounds, wall, wait, verify):
        return {"kind": "edit", "response": {
            "usage": {"completion_tokens": 2 * rounds, "prompt_tokens": 100},
            "choices": [{"message": {"content": "x"}}],
            "starsd": {"rounds": rounds, "drafted": rounds, "accepted": rounds, "fallback_rounds": 0,
                       "prefill_s": prefill, "profile": {"rounds": rounds, "wall_s": wall,
                                                         "seconds": {"draft_wait": wait, "verify_forward": verify},
                                                         "counts": {}}}}}

    s = section._summary([response(1.0, 10, 0.6, 0.1, 0.5), response(2.0, 30, 1.8, 0.3, 1.5)], 6.0)
    assert s["prefill_s"] == 3.0 and s["prompt_tokens"] == 200 and s["tokens_per_round"] == 2.0
    assert s["round_ms"]["round"] == pytest.approx(60.0) and s["round_ms"]["draft_wait"] == pytest.approx(10.0)
    assert s["round_ms"]["verify_forward"] == pytest.approx(50.0)
    assert s["per_request"][1] == {"kind": "edit", "tokens": 60, "rounds": 30, "drafted": 30, "accepted": 30,
                                   "fallback_rounds": 0}
    assert s["by_kind"] == {"edit": {"requests": 2, "tokens": 80, "rounds": 40, "tokens_per_round": 2.0}}


def test_the_replays_outputs_end_on_the_stop_token_the_target_generated(tmp_path):
    """A reply that stopped on the end of turn had that token generated in a round: its replay
    keeps it; one cut at max_tokens has none."""
    from starsd_draftd.demo.byte_tokenizer import EOS_ID, make_byte_tokenizer

    tok = make_byte_tokenizer()
    tok.save_pretrained(tmp_path)

    def done(reason):
        return {"kind": "tool", "messages": [{"role": "user", "content": "hi"}],
                "response": {"choices": [{"message": {"content": "ok"}, "finish_reason": reason}]}}

    stopped, cut = section.token_requests([done("stop"), done("length")], tmp_path)
    body = tok.encode("ok", add_special_tokens=False)
    assert stopped["output"] == [*body, EOS_ID] and cut["output"] == body
    assert stopped["prompt"] == cut["prompt"] and stopped["kind"] == "tool"


def test_paired_sends_each_request_alone_then_to_the_star_and_answers_with_the_stars():
    """The workload's conversations go on from the star's answers; the target alone's responses
    are kept in order, and each configuration's time is its own requests' (an injected clock)."""
    sent = []

    def chat(name):
        def send(req):
            sent.append(name)
            return _response(f"{name}:{len(sent)}")
        return send

    ticks = iter(range(1000))
    paired = section.Paired(chat("alone"), chat("star"), clock=lambda: next(ticks))
    done = agentic.run_workload(paired, 8, quick=True)
    assert sent == ["alone", "star", "star", "alone"] * (len(done) // 2) + ["alone", "star"] * (len(done) % 2)
    assert [d["messages"] for d in paired.alone] == [d["messages"] for d in done]
    assert all(d["response"]["choices"][0]["message"]["content"].startswith("star:") for d in done)
    assert all(d["response"]["choices"][0]["message"]["content"].startswith("alone:") for d in paired.alone)
    later = [d for d in done if d["kind"] == "turn"][-1]  # a later turn carries the star's answer
    assert any(m["role"] == "assistant" and m["content"].startswith("star:") for m in later["messages"])
    assert paired.seconds == [len(done), len(done)]  # one tick per request each
