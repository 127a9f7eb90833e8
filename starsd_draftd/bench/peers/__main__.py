"""`python -m starsd_draftd.bench.peers`: StarSD beside vLLM's CPU build."""

import sys

from starsd_draftd.bench.peers.cli import main

sys.exit(main())
