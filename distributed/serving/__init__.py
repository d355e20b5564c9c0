"""Rank 0's network front ends around the runtime's scheduler.

`front_ends` starts them from `options` (addresses, auth, TLS, limits):
`grpc_service` (trinity.v1.Generation, health, reflection; messages in `proto/`)
and `http_api` (OpenAI-compatible: `openai_api` which fields, into which requests, and the
JSON back; `tools` chat messages and tool calls). Both turn a client's input into a validated
request with `chat_format`. `client` is the command-line gRPC client.
"""
