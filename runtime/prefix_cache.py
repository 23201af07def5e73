"""The reference prefix cache: a voice's reference part of the prompt (Prompt.prefix: <|tts|> and its reference
block) prefilled once per engine and kept, so a request in that voice copies the keys and values into its slot and
prefills only the rest. Keyed by Prompt.prefix_key (a digest of the reference's token ids and codes); one cache per
engine, so the engine's identity is part of the key by construction."""

from collections import OrderedDict

DEFAULT_ENTRIES = 16


class PrefixCache:
    """The latest `entries` prefixes' keys and values (least recently used first out); 0 entries: off."""

    def __init__(self, entries: int = DEFAULT_ENTRIES):
        self.kept: OrderedDict[str, object] = OrderedDict()
        self.entries = entries
        self.hits = self.misses = 0

    @property
    def entries(self) -> int:
        return self._entries

    @entries.setter
    def entries(self, entries: int) -> None:
        self._entries = entries
        self._trim()

    def _trim(self) -> None:
        while len(self.kept) > max(self._entries, 0):
            self.kept.popitem(last=False)

    def get(self, key: str):
        value = self.kept.get(key)
        if value is None:
            self.misses += 1
            return None
        self.kept.move_to_end(key)
        self.hits += 1
        return value

    def put(self, key: str, value) -> None:
        if self.entries <= 0:
            return
        self.kept[key] = value
        self.kept.move_to_end(key)
        self._trim()
