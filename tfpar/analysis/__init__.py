"""Read-only analyses of a captured graph (no mutation, no TF patching)."""
