"""ninfer's front ends: the CLI, the terminal chat, model registry and launch profiles."""
__version__ = "0.1.0"
