"""``python -m starsd_target`` and the console script: huge pages asked for first (``common.hugepages``)."""

from common.hugepages import with_huge_pages


def run() -> None:
    with_huge_pages()
    from starsd_target.cli import main

    main()


if __name__ == "__main__":
    run()
