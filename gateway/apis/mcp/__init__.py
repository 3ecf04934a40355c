"""The MCP gateway: /mcp, the servers file's servers as one MCP server, per key."""
