"""Errors the engine raises for bad input; front ends turn them into one-line messages."""
from __future__ import annotations


class NinferError(Exception):
    """A failure with a cause a user can act on.

    `hint` tells the user what to do; front ends print `error: <message>` and `hint: <hint>`.
    """

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint


class UserError(NinferError):
    """Bad input from the user (a path, a flag, a file): exit code 2, HTTP 4xx."""

    exit_code = 2


class ModelFormatError(UserError):
    """A model file or folder that cannot be read as a model ninfer supports."""


class ContextOverflowError(UserError):
    """A prompt plus its requested completion does not fit the context window."""

    def __init__(self, prompt_tokens: int, max_tokens: int, max_context: int) -> None:
        super().__init__(
            f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the context window "
            f"({max_context} tokens)",
            hint="shorten the prompt, lower max_tokens, or use a profile with a larger max_context",
        )
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.max_context = max_context
