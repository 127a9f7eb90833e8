from starsd_target.cli import main

main()
