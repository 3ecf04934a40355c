"""The chat API."""
