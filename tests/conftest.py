import atexit
import os
import sys
import threading
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The daemons' --dtype auto serves fp16-weights on an x86 CPU, and the suite's references are the
# float32 checkpoint's own generate: daemons started here serve float32 unless a test says otherwise
# (tests/test_dtype_auto.py runs auto itself, against an fp16-weights reference).
os.environ.setdefault("STARSD_TARGET_DTYPE", "float32")
os.environ.setdefault("STARSD_DRAFTD_DTYPE", "float32")
# Tiny models gain nothing from huge pages, and their daemons would start slower and wait on the
# kernel's huge-page faults inside millisecond rounds (tests/test_hugepages.py tests the switch)
os.environ.setdefault("STARSD_HUGE_PAGES", "0")
# the daemons take every core by default; the suite's share two, one torch thread each
os.environ.setdefault("STARSD_TARGET_THREADS", "1")
os.environ.setdefault("STARSD_DRAFTD_THREADS", "1")
# The suite runs two workers, each with several daemons, on two cores: a daemon's socket thread
# waits for a core longer than the product's 50 ms acknowledgement floor at times, and a round then
# runs without drafts, which end-to-end tests count as a failure. Targets started here wait 250 ms
# (tests/test_link.py tests the floor itself; fakes.IN_PROCESS_ACK_FLOOR_S does the same in process).
os.environ.setdefault("STARSD_TARGET_ACK_TIMEOUT", "0.25")
sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(1)

from common.sockets import free_tcp_endpoint  # noqa: E402
from starsd_draftd.bench.procs import ProcessSet  # noqa: E402
from tiny_models import make_tiny_checkpoint  # noqa: E402

# Daemons started through ProcessSet (the Star below, the bench's and the demo's) are forked from a
# server that imported torch and the daemons' modules once (tests/forkserver.py): a new
# interpreter spends 2-3 s of CPU on those imports, and the suite starts about 110 daemons on two
# cores. STARSD_TEST_FORK_SERVER=0 starts each as a new interpreter, as the product does.
_fork_server = None
_fork_lock = threading.Lock()


def _fork_launch(args, env, log, cpus):
    global _fork_server
    with _fork_lock:
        if _fork_server is None or not _fork_server.alive():  # the first daemon, or the server died: a new one
            from forkserver import ForkServer

            _fork_server = ForkServer()
            atexit.register(_fork_server.close)
        server = _fork_server
    return server.spawn(args, env, log, cpus)


if os.environ.get("STARSD_TEST_FORK_SERVER", "1") != "0":
    ProcessSet.launcher = staticmethod(_fork_launch)


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("target"), "llama", seed=1, hidden=48, layers=2)


@pytest.fixture(scope="session")
def tiny_draft(tmp_path_factory) -> Path:
    """An independent, smaller model: most drafts are rejected, which exercises rollback."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("draft"), "llama", seed=2, hidden=32, layers=1)


@pytest.fixture(scope="session")
def loaded_target(tiny_target):
    from common.models import load_causal_lm

    return load_causal_lm(str(tiny_target))


@pytest.fixture(scope="session")
def eagle_head(tiny_target, tmp_path_factory) -> Path:
    """An EAGLE-1 head for the tiny target, briefly trained (a few seconds). A random-init head keeps
    the outputs exact as well, but its drafts are almost never kept (2 to 17 of some 1050 in a
    sampled test), and the tests that use this one need both verification branches to run."""
    from starsd_draftd.demo.eagle_train import train_eagle_head

    out = tmp_path_factory.mktemp("eagle")
    train_eagle_head(tiny_target, out, steps=40, time_budget_s=None, progress=False, batch_size=4, seq_len=64,
                     corpus_bytes=200_000, num_threads=1, eval_windows=2, eval_prompts=1, eval_tokens=8)
    return out


@pytest.fixture(scope="session")
def near_draft(tiny_target, tmp_path_factory) -> Path:
    """A draft close to the tiny target (its weights plus a little noise): most drafts are kept."""
    from tiny_models import make_near_copy

    return make_near_copy(tiny_target, tmp_path_factory.mktemp("near"), noise=0.02)


# The suite runs two workers on two cores, each test's daemons beside the other worker's compiles:
# a batch the draft daemon estimated at 10 ms can take 100 ms there, and a round that stops waiting
# for it runs without drafts. The tests that count those rounds give the daemons' own estimates
# this much room; a daemon that does not acknowledge is still given up after a round trip.
TEST_PATIENCE = 10.0

# what a target's and a draft daemon's logs say when a round went without drafts
NO_DRAFT_SIGNS = ("acknowledgement", "later than the daemon", "re-open", "refused", "ERROR", "WARNING")


class Star(ProcessSet):
    """Draft and target daemons as real processes on free loopback ports, built on the process set
    the demo and the bench use."""

    def __init__(self, logdir, ctx=None):
        super().__init__(logdir, ctx)
        self.starting: list[tuple[str, str]] = []  # (name, endpoint) of draft daemons not yet waited for

    def draftd(self, model, *extra: str, name: str = "draftd", endpoint: str | None = None, depth: int = 4,
               ready: bool = True) -> str:
        """Start a draft daemon serving ``model``; its endpoint, once it answers. With ``ready``
        false, at once: the next ``targets`` starts its targets while it loads, and waits for it
        before them (give those targets a --connect-timeout that covers its loading)."""
        return self.serve_drafts(["--model", str(model), "--depth", str(depth), *extra], name, endpoint, ready)

    def serve_drafts(self, args: list[str], name: str = "draftd", endpoint: str | None = None,
                     ready: bool = True) -> str:
        """``starsd_draftd serve`` with ``args`` (a backend and its options) as ``name``, as ``draftd`` starts it."""
        endpoint = endpoint or free_tcp_endpoint()
        self.start(name, "starsd_draftd", "serve", *args, "--bind", endpoint)
        if ready:
            self.wait_ready(name, endpoint)
        else:
            self.starting.append((name, endpoint))
        return endpoint

    def targets(self, model, draft_ep: str, n: int, *extra: str, depth: int = 4, prefix: str = "t",
                patience: float = TEST_PATIENCE) -> list[str]:
        """Start ``n`` target daemons (named t0, t1, ...) linked to ``draft_ep``; their job endpoints,
        once they answer (and any draft daemon started without waiting, before them). ``patience``:
        their --draft-patience."""
        eps = [self.job_endpoint(f"{prefix}{i}") for i in range(n)]
        for i, ep in enumerate(eps):
            self.start(f"{prefix}{i}", "starsd_target", "serve", "--model", str(model), "--draft", draft_ep,
                       "--listen", ep, "--depth", str(depth), "--name", f"{prefix}{i}",
                       "--draft-patience", str(patience), *extra)
        while self.starting:
            self.wait_ready(*self.starting.pop(0))
        for i, ep in enumerate(eps):
            self.wait_ready(f"{prefix}{i}", ep)
        return eps

    def assert_speculated(self, results: list[dict], prefix: str = "t", draftd: str = "draftd") -> None:
        """Each result (of target ``prefix``0, 1, ...) kept drafts and had no round without them;
        if not, the daemons' log lines that say why."""
        for i, res in enumerate(results):
            s = res["stats"]
            if s["fallback_rounds"] == 0 and s["accepted"] > 0:
                continue
            notes = [f"{name}: {line}" for name in (f"{prefix}{i}", draftd) if name in self.procs
                     for line in self.log(name).splitlines() if any(sign in line for sign in NO_DRAFT_SIGNS)]
            raise AssertionError(f"{prefix}{i}: {s['fallback_rounds']} fallback rounds, {s['accepted']} drafts kept, "
                                 f"{s['invalid_drafts']} invalid, {s['rounds']} rounds; the logs say:\n"
                                 + "\n".join(notes[-20:]))


@pytest.fixture
def star(tmp_path):
    """A Star for one test, stopped after it."""
    with Star(tmp_path) as s:
        yield s


@pytest.fixture(scope="module")
def module_star(tmp_path_factory):
    """A Star shared by one module's tests, stopped after them."""
    with Star(tmp_path_factory.mktemp("daemons")) as s:
        yield s
