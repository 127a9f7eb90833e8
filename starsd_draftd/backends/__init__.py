"""Draft backends: what the draft daemon drafts with (a standalone model, an EAGLE head)."""
