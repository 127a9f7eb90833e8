"""``python -m starsd_target`` and the console script (``common.hugepages.run_cli``)."""

from common.hugepages import run_cli


def run() -> None:
    run_cli("starsd_target.cli")


if __name__ == "__main__":
    run()
