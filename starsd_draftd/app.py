"""The draft daemon's application wiring: its configuration, the backend it names, and run(config)."""

from __future__ import annotations

from dataclasses import dataclass, field

import zmq

from common.heap import freeze_startup_objects
from common.models import load_causal_lm, resolve_model_path, set_torch_threads
from starsd_draftd.server import DraftServer, ServerConfig


@dataclass
class ServeConfig:
    """Every `serve` option's default, stated here once (the command line reads them from here)."""

    server: ServerConfig = field(default_factory=ServerConfig)  # the serving loop's own options
    model: str = "demo-draft"
    backend: str = "model"
    eagle_head: str | None = None
    base_model: str | None = None
    device: str = "cpu"
    dtype: str = "auto"
    q_topk: int = 32
    tree_topk: int = 8  # most children a draft tree's node gets (1: chains only)
    threads: int = 0  # torch CPU threads (0: one per core this process may run on)
    compile: bool = False  # --backend model: compile the draft model's forward (common.runner)
    lean: bool = True  # --backend model: eager forwards through common.lean where the model allows
    draft_vocab: str = "auto"  # --backend model: auto, off or a vocabulary file (common.draft_vocab)


def build_backend(cfg: ServeConfig):
    """The draft backend named by the configuration; EAGLE code is imported only when asked for."""
    if cfg.backend == "model":
        from starsd_draftd.backends.model import ModelBackend

        from common.runner import ModelRunner
        from common.draft_vocab import resolve_vocab

        vocab = resolve_vocab(cfg.draft_vocab, resolve_model_path(cfg.model))
        loaded = load_causal_lm(cfg.model, cfg.device, cfg.dtype, draft_vocab=vocab)
        backend = ModelBackend(loaded, q_topk=cfg.q_topk, runner=ModelRunner(loaded, compile=cfg.compile, lean=cfg.lean),
                               tree_topk=cfg.tree_topk)
        backend.warm_up(cfg.server.batch_max)
        return backend
    if cfg.draft_vocab not in ("auto", "off"):
        raise ValueError("--draft-vocab applies to --backend model: an EAGLE-1 head drafts with the target's LM "
                         "head, and an EAGLE-3 head brings its own draft vocabulary")
    if cfg.backend == "eagle":
        if cfg.compile:
            raise ValueError("--compile applies to --backend model; the EAGLE head runs eagerly")
        if not cfg.eagle_head or not cfg.base_model:
            raise ValueError("--backend eagle needs --eagle-head DIR and --base-model DIR (the target's checkpoint)")
        from starsd_draftd.backends.eagle import EagleBackend

        try:
            return EagleBackend.from_dirs(resolve_model_path(cfg.eagle_head), resolve_model_path(cfg.base_model),
                                          cfg.device, cfg.dtype, q_topk=cfg.q_topk, tree_topk=cfg.tree_topk)
        except ImportError as exc:  # the EAGLE-1 head class comes from eagle-llm
            raise ValueError(f"the EAGLE backend needs the eagle-llm package ({exc}); install it with "
                             "`pip install --no-deps eagle-llm==1.2.1`") from None
    if cfg.backend == "eagle3":
        if cfg.compile:
            raise ValueError("--compile applies to --backend model; the EAGLE-3 head runs eagerly")
        if not cfg.eagle_head or not cfg.base_model:
            raise ValueError("--backend eagle3 needs --eagle-head DIR (an EAGLE-3 head) and --base-model DIR "
                             "(the target's checkpoint)")
        from starsd_draftd.backends.eagle3 import Eagle3Backend

        return Eagle3Backend.from_dirs(resolve_model_path(cfg.eagle_head), resolve_model_path(cfg.base_model),
                                       cfg.device, cfg.dtype, q_topk=cfg.q_topk, tree_topk=cfg.tree_topk)
    raise ValueError(f"unknown backend {cfg.backend!r}")


def run(cfg: ServeConfig) -> None:
    """Load the backend and serve until SIGTERM (then drain and return)."""
    set_torch_threads(cfg.threads)
    backend = build_backend(cfg)
    ctx = zmq.Context()
    server = DraftServer(backend, cfg.server, ctx)
    server.install_signal_handlers()
    freeze_startup_objects("draft daemon")
    server.serve_forever()
    ctx.term()  # returns once the last messages (GOODBYEs) have left, within the sockets' linger
