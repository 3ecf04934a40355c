"""What answers a model name: the registry (aliases, A/B splits, fallbacks), the models file,
remote upstreams, per-model admission, and starting and stopping them. No Starlette here."""
