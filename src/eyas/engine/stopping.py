"""When a generation ends: EOS ids, stop strings, max new tokens.

The context limit is not checked here: the decoding loops bound each round so that it can never
be passed (see ``speculative.py``).
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

from eyas.engine.errors import RequestError
from eyas.engine.stats import STOP_EOS, STOP_MAX_NEW_TOKENS, STOP_STRING


class StopCriteria:
    """Checked after every emitted token; ``check`` returns the stop reason or None.

    Like HF ``generate``, the token that triggers a stop (the EOS token, the token completing a
    stop string) is kept in the output. Stop strings are searched in the decoded text of the last
    ``len(longest stop string) + 8`` tokens, so each check is O(1) in the output length (a stop
    string spanning more tokens than characters is not found; byte-level tokenizers produce at
    least one character per token except for partial UTF-8 sequences).
    """

    def __init__(self, max_new_tokens: int, eos_token_ids: Iterable[int] = (),
                 stop_strings: Sequence[str] = (), decode: Callable[[list[int]], str] | None = None) -> None:
        self.max_new_tokens = max_new_tokens
        self.eos = {int(t) for t in eos_token_ids}
        self.stop_strings = [s for s in stop_strings if s]
        if self.stop_strings and decode is None:
            raise RequestError("stop_strings need a decode function (token ids -> text)")
        self.decode = decode
        self.window = max((len(s) for s in self.stop_strings), default=0) + 8

    def check(self, out: list[int]) -> str | None:
        if out and out[-1] in self.eos:
            return STOP_EOS
        if self.stop_strings:
            tail = self.decode(out[-self.window:])  # type: ignore[misc]
            if any(s in tail for s in self.stop_strings):
                return STOP_STRING
        if len(out) >= self.max_new_tokens:
            return STOP_MAX_NEW_TOKENS
        return None
