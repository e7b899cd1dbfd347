"""The bodies of the CLI verbs: each module takes plain arguments, does one command's work end to end, and raises
``KvevalError`` for bad input. ``kveval/cli.py`` only parses arguments and calls them."""
