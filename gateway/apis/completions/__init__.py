"""The completions API."""
