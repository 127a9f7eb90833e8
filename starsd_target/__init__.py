"""StarSD target daemon: runs the target model and verifies drafts from a remote draft daemon.

Ships alone to small machines: imports only ``common`` and never draft-side code."""
