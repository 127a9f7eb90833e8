"""`starsd-draftd bench-peers` (``python -m starsd_draftd.bench.peers``): StarSD measured beside vLLM's CPU build."""
