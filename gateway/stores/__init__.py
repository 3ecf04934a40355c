"""What the gateway keeps between requests: the response cache (`cache`) and the Responses API's
stored responses (`responses`), in memory or in Redis (`redis`: one connection pool shared), and
the Files API's uploads (`files`), on disk. Each stored object is reached through its owner's view."""
