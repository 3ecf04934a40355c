"""The embeddings API."""
