"""What every API's translation shares: the Service protocol, per-choice generation state, chunk
encoding, structured output, tool calls, remote answers. No Starlette here (a test says so): this layer
works on validated protocol models and engines."""
