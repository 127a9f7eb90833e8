"""StarSD's on/off environment switches (``STARSD_HUGE_PAGES``, ``STARSD_WIDE_PREFILL``): on
unless set to 0, off, false or no. Imports nothing heavy: the daemons read one before PyTorch."""

from __future__ import annotations

import os
from collections.abc import Mapping

OFF = ("0", "off", "false", "no")


def switched_off(name: str, env: Mapping[str, str] | None = None) -> bool:
    """Whether switch ``name`` is turned off in ``env`` (default: this process's environment)."""
    return (os.environ if env is None else env).get(name, "").strip().lower() in OFF
