"""Guardrails on prompts and outputs, configured as named profiles (`config`: the guards file, the
models file's `guards:`), picked per request by API key, model or default (`pipeline`).

    config      the guards file, validated at start
    patterns    detectors, the scanner, redaction placeholders
    pii         emails, phone numbers, card numbers (Luhn), IBANs (mod 97), IP addresses
    injection   the shipped prompt-injection list (injection.yaml)
    moderation  the optional /v1/moderations upstream (httpx)
    pipeline    Guards (profiles, profile_for) and RequestGuard (input checks, moderation)
    stream      the output guard: a sliding window per choice, cuts with finish_reason content_filter
    requests    the texts of chat and completion requests, checked and rewritten
"""
