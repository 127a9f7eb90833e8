from starsd_draftd.cli import main

main()
