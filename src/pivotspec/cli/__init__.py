"""The ``pivotspec`` command line: one module per command group, parsing and printing over the Python API.

``main`` holds the parser and the generate, eval, demo and serve commands; ``labels`` the label and labels
commands; ``classifier`` train-classifier and eval-classifier; ``common`` the flags they share. An entry
point: it imports ``pivotspec.api`` and ``pivotspec.errors`` only, and nothing imports it.
"""

from pivotspec.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
