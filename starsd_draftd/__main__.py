"""``python -m starsd_draftd`` and the console script (``common.hugepages.run_cli``)."""

from common.hugepages import run_cli


def run() -> None:
    run_cli("starsd_draftd.cli")


if __name__ == "__main__":
    run()
