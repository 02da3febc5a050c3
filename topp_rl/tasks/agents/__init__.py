"""Example agent functions for `task=agent` (docs/agents.md): plain openai-SDK code, run unchanged against the
run's endpoint or any OpenAI-compatible server."""
