"""The responses API."""
