"""Who is asking and what they may spend: the keys file and each key's policy (`tenants`), token
buckets (`limits`), rate limits and token budgets per key (`quota`)."""
