"""A character-level tokenizer that needs no download: printable ASCII plus EOS and PAD."""
from __future__ import annotations

import numpy as np


class CharTokenizer:
    PAD = 0
    EOS = 1
    _OFFSET = 2  # token = ord(c) - 32 + 2 for printable ASCII (32..126); '\n' and others -> ' '

    @property
    def vocab_size(self) -> int:
        return 95 + self._OFFSET

    def encode(self, text: str) -> np.ndarray:
        b = np.frombuffer(text.encode("ascii", "replace"), dtype=np.uint8).astype(np.int64)
        b = np.where((b >= 32) & (b <= 126), b, 32)
        return b - 32 + self._OFFSET

    def decode(self, ids) -> str:
        return "".join(chr(int(i) - self._OFFSET + 32) for i in ids if int(i) >= self._OFFSET)
