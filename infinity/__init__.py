"""Serving engine for embedding models: the front end, its configuration and supervisor.

The child processes live in the sibling package `workers`.
"""

__version__ = "0.1.0"
