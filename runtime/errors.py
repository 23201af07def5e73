class HiggsError(Exception):
    """A problem the user can fix: the CLI prints its message on one line and exits non-zero."""


class TextError(HiggsError):
    """A problem with the text to speak itself (its speaker tags, a word too long for a segment): the server names
    its `input` field whatever else the request carries."""
