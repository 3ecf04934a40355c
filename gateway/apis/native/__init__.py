"""The native API."""
