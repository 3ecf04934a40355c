"""What the gateway keeps between requests: the response cache, stored responses, files and batches."""
