"""What the gateway keeps between requests: the response cache (`cache`) and the Responses API's
stored responses (`responses`), in memory or in Redis (`redis`: one connection pool shared)."""
