"""The models API."""
