"""``python -m starsd_target`` and the console script: a daemon (``serve``) asks for huge pages first
(``common.hugepages``); other commands start as they are."""

import sys

from common.hugepages import with_huge_pages


def run() -> None:
    if sys.argv[1:2] == ["serve"]:
        with_huge_pages()
    from starsd_target.cli import main

    main()


if __name__ == "__main__":
    run()
