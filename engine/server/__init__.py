"""The HTTP front end: OpenAI- and Anthropic-compatible routes over the Engine (FastAPI + uvicorn)."""
