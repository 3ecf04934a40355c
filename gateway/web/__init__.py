"""The HTTP edge's shared pieces, used by every API package: answers as responses (`answers`), request
parsing and state (`requests`), errors in the route's shape (`error_render`), Server-Sent Events (`sse`)."""
