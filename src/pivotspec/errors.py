"""User-facing errors: the CLI prints them as one line on stderr and exits with code 2."""


class UsageError(Exception):
    """Bad input from the user (path, argument, file). The message names the problem and the fix."""
