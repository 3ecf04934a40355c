"""The messages API."""
