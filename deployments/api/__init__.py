"""The OpenAI-compatible HTTP API: request bodies and their validation (protocol,
http_body, unsupported), the routes and what they do (routes, serving, generation), prompt
encoding, responses, server-sent events, logprobs on the wire, errors in OpenAI's shape,
API keys, and the client the routes call the engine through (engine_client, handles)."""
