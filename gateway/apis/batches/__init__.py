"""The batches API."""
