"""Layer-level benchmark."""
