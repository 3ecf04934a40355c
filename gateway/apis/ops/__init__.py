"""The ops API."""
