"""The Model Context Protocol: the servers file, who may reach which server and tool (access), and the one client
that talks to a server; the Responses API's `mcp` tool and the /mcp gateway both use them."""
