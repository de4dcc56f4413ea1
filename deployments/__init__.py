"""rayinfer on Ray Serve: the Serve application (app.py, what configs/*.yaml import) and its
parts, by floor: api/ (the OpenAI wire layer), replicas/ (the Serve deployments and what
runs in their processes), routing/ (which engine replica a request goes to, and
autoscaling), observability/ (metrics and logs)."""
