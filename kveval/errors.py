"""The one exception type that the CLI turns into a single line and exit status 2."""


class KvevalError(Exception):
    """Bad input from the user: a config, a name, a path, a size.

    The message is one line that names what is wrong and what to do about it. The CLI prints it without a
    traceback and exits with status 2; library callers can catch it like any other exception.
    """


def did_you_mean(word: object, choices, prefix: str = "; did you mean ") -> str:
    """The "did you mean" suffix of every unknown-name error: ``"; did you mean 'seq_len'?"`` for the closest of
    ``choices`` to ``word``, or ``""`` when none is close. A word that begins names of ``choices`` (``int4``:
    ``int4_g32``, ``int4_g64``...) gets those, the first four: the family meant, not the closest spelling
    (``int8``)."""
    import difflib

    word, names = str(word), [str(c) for c in choices]
    family = [c for c in names if word and c.startswith(word) and c != word]
    if len(family) > 1:
        more = f" ({len(family)} in all)" if len(family) > 4 else ""
        return f"{prefix}one of {', '.join(repr(c) for c in family[:4])}{more}?"
    close = family or difflib.get_close_matches(word, names, n=1)
    return f"{prefix}'{close[0]}'?" if close else ""
