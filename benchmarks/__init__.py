"""Load generator, echo-engine gateway and the race against vLLM's own server (see README.md)."""
