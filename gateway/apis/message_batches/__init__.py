"""The message_batches API."""
