"""The Textual app behind a bare `ninfer` (one module per screen; `app.py` holds the chat screen)."""
