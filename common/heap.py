"""Python's cyclic garbage collector and a serving daemon.

A loaded daemon holds a few hundred thousand Python objects (torch, transformers, the model's
modules), none of which will ever be garbage. Python's oldest-generation collection walks all of
them: on the demo target's daemon, 115-130 ms on one core, run whenever enough new long-lived
objects have piled up, which first happened in the middle of the first burst of requests (one
verification forward took 163 ms where its neighbours took 14). ``freeze_startup_objects``
collects once at the end of start-up and moves what is alive into the collector's permanent
generation (``gc.freeze``), so that later collections walk only what serving itself made; the C
heap's free pages go back to the system at the same moment."""

from __future__ import annotations

import gc
import logging
import time

from common.memory import give_back_freed_memory

log = logging.getLogger("starsd.heap")


def freeze_startup_objects(what: str) -> int:
    """Collect, then freeze every object alive now (see the module docstring); returns how many
    are frozen. Call once, when the daemon is loaded and about to serve."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    give_back_freed_memory()  # what loading and the warm-up freed, out of resident memory
    frozen = gc.get_freeze_count()
    log.info("%s: %d start-up objects moved out of the garbage collector's reach (%.2f s)", what, frozen,
             time.perf_counter() - t0)
    return frozen
