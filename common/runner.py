"""One model runner for both daemons: in-place KV caches, and forwards eager or compiled.

The target engine and the draft backends run their models only through a ``ModelRunner``:

- caches are ``SlotCache``s (``common.slot_cache``): preallocated slots written in place, rolled
  back by moving a position;
- ``forward`` feeds new tokens after a cache and returns the logits rows asked for (all, the last,
  or none) and, if asked, the final hidden states;
- with ``compile=True`` the model's forward goes through ``torch.compile`` with symbolic
  lengths, so that a few graphs serve every step: dynamo specialises a length of 1 (decode, a
  one-token feed) apart from longer ones (verification, prefill chunks), a first feed apart from
  one after cached positions, and each kind of output asked for (all logits, the last only,
  hidden states). A one-token feed always asks for its row as the last (the same logits), so a
  decode step and a round without drafts share a graph: a target compiles four (a first prefill
  chunk, a later one, one row, a verification's rows), and five more with hidden states where
  an EAGLE head needs them. Each consumer's ``warm_up`` drives the kinds it serves with before
  serving; after that, a call no graph covers runs eagerly (``serving_stance``) instead of
  compiling for minutes mid-serving. On CPUs inductor's weight freezing folds and prepacks the
  weights (it keeps the original weights too: about twice the weight memory). Generated kernels are cached
  under StarSD's cache directory (``<cache>/inductor``); a restart traces the model and, on a CPU,
  compiles its graphs again (inductor's graph cache cannot hold prepacked oneDNN weights), so it
  takes about two thirds of the first start.
  Eager is the default and the fallback: a warm-up that fails (no C++ compiler, an operator
  inductor cannot lower) logs a warning and leaves the runner eager.
- eager forwards of Llama and Qwen2 models run through ``common.lean`` (the same arithmetic, bit
  for bit, with less overhead; ``lean=False`` or another architecture: transformers' forward).
  ``eager`` is that callable, for the callers that build their own masks (batches, trees).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from common.features import fused_features
from common.lean import LeanForward
from common.models import LoadedModel, cache_root, new_cache

log = logging.getLogger("starsd.runner")

COMPILE_HELP = ("Compile the model's forward with torch.compile (inductor; on CPUs with weight freezing). "
                "The daemon compiles before it serves (minutes on a CPU: the demo target takes about 10 on "
                "one core). Generated kernels are cached under StarSD's cache directory; on a CPU a restart "
                "still compiles the graphs again (their prepacked weights cannot be cached) and takes about "
                "two thirds as long. Off by default: see docs/architecture.md, 'The model runner', for what "
                "it costs and when it pays.")


LEAN_HELP = ("Run eager forwards of Llama and Qwen2 models through StarSD's lean forward: the model's own "
             "arithmetic, bit for bit, with less Python around it and, with fp16-weights, q/k/v and gate/up as "
             "one GEMM each (about 20% off a CPU decode step). On by default; --no-lean runs them through "
             "transformers.")


def inductor_cache_dir() -> Path:
    """Where inductor keeps compiled artifacts: ``$TORCHINDUCTOR_CACHE_DIR`` if the user set it,
    else ``<StarSD cache>/inductor``. Importing ``torch._dynamo`` (loading a model does) sets the
    variable to torch's default under the temporary directory, which a reboot, or systemd's
    PrivateTmp at every restart, empties: that value counts as unset."""
    explicit = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if explicit and not _torch_default_dir(explicit):
        return Path(explicit)
    return cache_root() / "inductor"


def _torch_default_dir(path: str) -> bool:
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # another torch: its default is not known, so the value is taken as set
        return False
    return os.path.abspath(path) == os.path.abspath(default_cache_dir())


def _configure_inductor(device: torch.device) -> Path:
    path = inductor_cache_dir()
    path.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    import torch._inductor.config as icfg

    icfg.fx_graph_cache = True
    import torch._dynamo

    # a forward's kinds (lengths 1 and more, first feed or not, outputs, batch) with and without
    # hidden states exceed dynamo's default of 8 graphs per code object
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    if device.type == "cpu":
        icfg.freezing = True  # fold and prepack weights (inference only: the runner never trains)
    return path


class ModelRunner:
    """Runs one loaded causal LM. ``compile``: compile the forward (see the module's docstring)."""

    HEARTBEAT_S = 60.0  # while the warm-up compiles: a log line and more start-up time from systemd

    def __init__(self, loaded: LoadedModel, compile: bool = False, lean: bool = True):
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device
        self.compiled = False
        self.compile_s = 0.0  # seconds the warm-up's compilation took (0: eager)
        self.warm = False  # warm_up() ran: serving shapes are compiled
        self.serving_stance = "eager_on_recompile"  # after the warm-up (tests make it fail_on_recompile)
        self.lean_wanted = lean
        self._asked: set[str] = set()  # the lean forward's modes asked for (enable_...), kept if it is rebuilt
        self.lean, self.lean_reason = None, "off (--no-lean)" if not lean else "off with --compile"
        if not compile:
            self._build_lean()
        self._call = self.eager
        if compile:
            from common.bf16_packed import unpack_bf16

            if unpack_bf16(self.model):  # graphs cannot trace oneDNN's packed tensors; freezing packs them
                log.info("bfloat16 linear layers unpacked for torch.compile, whose weight freezing packs them itself")
            path = _configure_inductor(self.device)
            self._call = torch.compile(self.model, dynamic=True)
            self.compiled = True
            log.info("model forward compiled with torch.compile (artifacts cached in %s)", path)

    def _build_lean(self) -> None:
        """The lean forward (common.lean), where asked for and the model allows."""
        if self.lean_wanted:
            self.lean, self.lean_reason = LeanForward.build(self.model)
            if self.lean is None:
                log.info("lean forward unavailable (%s): the model runs through transformers", self.lean_reason)
            elif self._asked:  # rebuilt after a failed compilation: what the runner's user turned on
                for ask in self._asked:
                    getattr(self.lean, ask)()

    @property
    def eager(self):
        """The eager forward: the lean one where built, else the model's own."""
        return self.lean if self.lean is not None else self.model

    @property
    def forward_kind(self) -> str:
        """How forwards run: "compiled", "lean" (``common.lean``) or "transformers" (with the lean
        forward built, while a hook is set on the model: see ``common.lean``)."""
        if self.compiled:
            return "compiled"
        if self.lean is None:
            return "transformers"
        return "transformers (forward hooks set)" if self.lean._hooked() else "lean"

    @property
    def wide_prefill_rows(self) -> int:
        """The chunk length from which a prefill multiplies in bfloat16 (``common.fp16_weights``,
        "Wide prefill"; 0: never here). A forward goes wide by its feed's length; a caller
        batching prefill chunks runs each such chunk alone (its rounding follows its row count)."""
        eager = not self.compiled and self.lean is not None
        return self.lean.wide_rows if eager and self.lean.wide_layers is not None else 0

    def enable_wide_prefill(self) -> bool:
        """A target's long prefill chunks go wide from now on, where the lean forward can
        (``LeanForward.enable_wide_prefill``); returns whether they do."""
        self._asked.add("enable_wide_prefill")
        return self.lean.enable_wide_prefill() if self.lean is not None else False

    def enable_row_exact(self) -> int:
        """A target's verifications of one sequence run row-exact from now on, where the lean
        forward can (``LeanForward.enable_row_exact``); returns up to how many rows (0: not here)."""
        self._asked.add("enable_row_exact")
        return self.lean.enable_row_exact() if self.lean is not None else 0

    def new_cache(self, capacity: int = 0):
        """An empty cache with ``capacity`` positions preallocated (0: grown as needed)."""
        return new_cache(self.model, capacity)

    def __call__(self, **kwargs):
        """The model's forward (compiled or eager), for callers that build their own inputs
        (batched drafting's masks and position ids)."""
        if self.compiled and self.warm:
            # after the warm-up, a shape no compiled graph covers runs eagerly instead of stalling
            # the daemon for a compilation (minutes on a CPU) in the middle of serving
            with torch.compiler.set_stance(self.serving_stance):
                return self._call(**kwargs)
        return self._call(**kwargs)

    @torch.inference_mode()
    def forward(self, cache, ids: list[int], logits: str = "all", hidden: bool = False,
                layers: tuple[int, ...] | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Feed ``ids`` after the positions ``cache`` holds. ``logits``: ``"all"`` rows
        [len(ids), V], ``"last"`` [V], or ``"none"`` (a prefill needs none: the LM head over a whole
        chunk costs more than the chunk's layers in a small model). Logits come back as float32
        on the model's device; ``hidden``: also the final hidden states [len(ids), H], or with
        ``layers`` the hidden states entering those layers, concatenated (``common.features``)."""
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        if self.compiled and hasattr(cache, "reserve"):
            cache.reserve(cache.get_seq_length() + len(ids))  # any growth outside the graph
        keep = {"all": 0, "last": 1, "none": 1}[logits]
        if self.compiled and len(ids) == 1:
            keep = 1  # one row either way: a decode step and a one-row round run one graph
        out = self(input_ids=x, cache=cache, use_cache=True, output_hidden_states=hidden, logits_to_keep=keep)
        h = fused_features(out.hidden_states, layers)[0] if hidden else None
        if logits == "none":
            return None, h
        rows = out.logits[0].float()
        return (rows if logits == "all" else rows[-1]), h

    def warm_up(self, exercise: Callable[[], object], what: str) -> float:
        """Compile (or load from the on-disk cache) the graphs that serving uses by running
        ``exercise`` once, which drives the shapes serving drives, before the daemon says it is
        ready; returns the seconds it took (0 when eager). Afterwards, shapes no graph covers run
        eagerly rather than compile mid-serving."""
        if not self.compiled:
            return 0.0
        log.info("compiling the %s's forwards (minutes on a CPU; generated kernels are cached in %s)", what,
                 inductor_cache_dir())
        from common.sdnotify import Heartbeat, notify

        notify(f"STATUS=compiling the {what}'s forwards")
        t0 = time.perf_counter()
        self.warm = False  # compile what the exercise needs (a second warm-up adds graphs)
        try:
            # a log line a minute, and more start-up time from systemd while it runs
            with torch.inference_mode(), Heartbeat(f"compiling the {what}'s forwards", self.HEARTBEAT_S):
                exercise()
        except Exception as exc:  # inductor failures are many and varied: eager always works
            log.warning("compiling the %s failed (%s: %s); it runs eagerly", what, type(exc).__name__, exc)
            self._build_lean()
            self._call, self.compiled = self.eager, False
            return 0.0
        self.compile_s += time.perf_counter() - t0
        self.warm = True
        log.info("%s's compiled forwards ready in %.1f s", what, self.compile_s)
        return self.compile_s
