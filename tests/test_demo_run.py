"""The demo's topology (disjoint cores for draft and targets) and its report formatting."""

from starsd_draftd.demo.run import DemoConfig, Topology, format_texts, topology


def test_two_or_more_cores_pin_the_draft_and_the_targets_apart():
    topo = topology(DemoConfig(targets=3), cpus=[0, 1, 2])
    assert topo.draft == (0,)
    assert topo.targets == [(1,), (2,), (1,)]
    assert all(set(t).isdisjoint(topo.draft) for t in topo.targets)
    assert "core 0" in topo.describe() and "cores 1,2" in topo.describe()


def test_one_core_or_no_pin_leaves_everything_unpinned():
    assert topology(DemoConfig(targets=2), cpus=[5]) == Topology(None, [None, None])
    assert topology(DemoConfig(targets=2, pin=False), cpus=[0, 1]) == Topology(None, [None, None])
    assert "unpinned" in Topology(None, [None]).describe()


def test_texts_show_each_targets_first_completion_after_its_prompt():
    report = {"config": {"backends": ["model"], "prompts_per_target": 2},
              "prompts": ["p1 ", "p2 ", "q1 ", "q2 "],
              "targets": [{"target": "target1", "backends": {"model": {"texts": ["one\ntwo\nthree\nfour", "x"]}}},
                          {"target": "target2", "backends": {"model": {"texts": ["alpha", "y"]}}}]}
    out = format_texts(report).splitlines()
    assert out == ["--- target1: p1 one", "    two", "    three", "--- target2: q1 alpha"]


def test_the_draft_daemon_gets_the_demo_vocabulary_unless_the_full_head_is_asked_for():
    from starsd_draftd.demo.run import _draftd_args

    cut = _draftd_args(DemoConfig(), "model", "tcp://127.0.0.1:1")
    full = _draftd_args(DemoConfig(draft_vocab=False, suffix=False), "model", "tcp://127.0.0.1:1")
    assert cut[-2:] == ["--draft-vocab", "auto"]  # the demo draft's own file, whatever the environment says
    assert full[-3:] == ["--no-suffix", "--draft-vocab", "off"]
