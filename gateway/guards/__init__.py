"""Guardrails on prompts and outputs, configured as named profiles (`config`: the guards file, the
models file's `guards:`), picked per request by API key, model or default (`guarding`).

    config      the guards file, validated at start
    normalize   text as every guard reads it (NFKC, invisibles out, confusables, spaces, dashes,
                digits), with the map back to the original for redaction
    patterns    detectors, the scanner (on normalized text), redaction placeholders
    pii         emails, phone numbers, card numbers (Luhn), IBANs (mod 97), IP addresses
    injection   the shipped prompt-injection list (injection.yaml)
    moderation  the optional /v1/moderations upstream (httpx)
    guarding    Guards (profiles, profile_for) and RequestGuard (input checks, moderation)
    stream      the output guard: a sliding window per choice, cuts with finish_reason content_filter
    logprobs    a choice's logprobs, passed on with the text they belong to
    inbound     every text of a request that the model reads, checked and rewritten
"""
