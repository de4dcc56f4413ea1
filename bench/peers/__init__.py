"""rayinfer against its peers in one run: vLLM's CPU build (server and offline),
transformers serve, designs of the app side by side, and the goals read off those tables."""
