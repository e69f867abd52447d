"""Errors the user can fix. The CLI prints them as one line and exits with code 2."""


class UserError(ValueError):
    """Bad input from the user (arguments, files, mismatched models): never shown as a traceback."""
