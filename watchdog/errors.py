"""The one error type that the CLI turns into a single stderr line and exit code 2."""


class UserError(Exception):
    """Bad input from the user (arguments, config, files): reported as one line, exit code 2."""
