"""The build: its phases, and the executors that run their work items."""
