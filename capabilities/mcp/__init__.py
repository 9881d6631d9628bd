"""Sigil over MCP (Model Context Protocol): `/_mcp`, where an agent's model sees the
capabilities it may call as tools, calls them, and (with a deploy token) writes new ones.

`endpoint` speaks the Streamable HTTP transport and JSON-RPC; `tools` turns capabilities into
tools and tool calls into the engine's calls and service calls.
"""
