"""The Serve deployments and their processes: the Ingress (the routes in a deployment of
their own), the engine replica (engine_deployment; engine_server for `ingress: engine`),
the tokenizer replica, and the engine process's runtime and CPU binding."""
