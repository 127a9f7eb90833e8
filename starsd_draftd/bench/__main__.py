"""`python -m starsd_draftd.bench wire-server`: the bench's helper processes."""

from __future__ import annotations

import json
import sys

import click

from starsd_draftd.bench.wire import run_wire_server


# ---------------------------------------------------------------- helper process entry
@click.group()
def main() -> None:
    """Helper processes for `starsd-draftd bench`."""


@main.command("wire-server")
@click.option("--spec", required=True, help="JSON list of {mode: raw|torch, case, endpoint}.")
@click.option("--q-topk", type=int, default=32)
@click.option("--feature-size", type=int, default=4096)
@click.option("--feature-rows", type=int, default=3)
def wire_server(spec, q_topk, feature_size, feature_rows) -> None:
    """The raw pyzmq and torch.save counterparts of the draft daemon, for the wire-cost section."""
    run_wire_server(json.loads(spec), q_topk, feature_size, feature_rows)


if __name__ == "__main__":
    sys.exit(main())
