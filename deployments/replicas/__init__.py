"""The Serve deployments and their processes: the Ingress (the HTTP routes), the engine
replica (engine_deployment), the tokenizer replica, and the engine process's runtime and
CPU binding."""
