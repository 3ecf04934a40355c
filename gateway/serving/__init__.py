"""From an API request to engine calls and back: chat, completions, tool calls, chunk encoding.
No Starlette here (a test says so): this layer works on validated protocol models and engines."""
