"""The one exception type that the CLI turns into a single line and exit status 2."""


class KvevalError(Exception):
    """Bad input from the user: a config, a name, a path, a size.

    The message is one line that names what is wrong and what to do about it. The CLI prints it without a
    traceback and exits with status 2; library callers can catch it like any other exception.
    """
