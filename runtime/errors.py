class HiggsError(Exception):
    """A problem the user can fix: the CLI prints its message on one line and exits non-zero."""
