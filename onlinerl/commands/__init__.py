"""CLI command groups."""
