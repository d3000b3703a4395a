"""Tracebacks made short: the original exception of an error text, and a folded log stream.

A ClientApp's exception reaches the server wrapped in Ray's and Flower's tracebacks (tens of
lines per client and message); ``original_exception`` recovers "Type: message". The launchers
show the run's stream through ``StreamFilter``, which folds every traceback into one line
naming its original exception; the full stream stays in the launcher's log file, and
``--debug`` shows it unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Callable

MAX_ERROR_CHARS = 300
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*): (.+)$")
_FLOWER_ERROR = re.compile(r"^<class '([\w.]+)'>:<'(.*)'>$", re.DOTALL)  # ClientApp error form
_WRAPPERS = ("flwr.", "ray.", "ray::", "Exception")
# A line that starts a new log record (Flower's, ours, Ray's worker prefix, our launchers').
_RECORD = re.compile(r"^(?:(?:INFO|WARNING|ERROR|DEBUG)\b\s*:?\s*|\(\w+ pid=\d+\)|\[\w+|error:)")
_STARTS = ("Traceback (most recent call last):", "An exception was raised when processing")


def strip_ansi(text: str) -> str:
    """``text`` without terminal colour codes."""
    return _ANSI.sub("", text)


def original_exception(text: str) -> str:
    """The original exception in an error text or traceback, as "Type: message".

    The first "module.Type: message" line that is not one of Ray's or Flower's wrappers is the
    exception that was raised; without one, Flower's "Message: ..." or the last line is used.
    """
    text = strip_ansi(text).strip()
    flower = _FLOWER_ERROR.match(text)
    if flower and "\n" not in flower.group(2):
        return f"{flower.group(1).rsplit('.', 1)[-1]}: {flower.group(2)}"[:MAX_ERROR_CHARS]
    for line in text.splitlines():
        match = _EXCEPTION_LINE.match(line.strip())
        if match and not match.group(1).startswith(_WRAPPERS):
            return f"{match.group(1).rsplit('.', 1)[-1]}: {match.group(2)}"[:MAX_ERROR_CHARS]
    if "Message: " in text:
        return text.rsplit("Message: ", 1)[1].strip().rstrip("'>").strip()[:MAX_ERROR_CHARS]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return (lines[-1] if lines else text)[:MAX_ERROR_CHARS]


class StreamFilter:
    """Passes log lines through, folding each traceback into one line naming its exception.

    A traceback starts at "Traceback (most recent call last):" (or Flower's "An exception was
    raised when processing a message", which is shown) and lasts until a line that starts a new
    log record and is not itself part of the error; ``folded`` counts them.
    """

    def __init__(self, write: Callable[[str], None], debug: bool = False) -> None:
        self.write = write
        self.debug = debug
        self.folded = 0
        self._hidden: list[str] | None = None

    def feed(self, line: str) -> None:
        """Show ``line`` (without its newline) unless it belongs to a traceback."""
        text = line.rstrip("\n")
        if self.debug:
            self.write(text)
            return
        plain = strip_ansi(text)
        if self._hidden is not None:
            if not _starts_record(plain):
                self._hidden.append(plain)
                return
            self.close()
        if _STARTS[0] in plain:
            self._hidden = [plain]
            return
        self.write(text)
        if _STARTS[1] in plain:
            self._hidden = []

    def close(self) -> None:
        """End a traceback still open (at the end of the stream): show its one-line summary."""
        if self._hidden is None:
            return
        hidden, self._hidden = self._hidden, None
        if any(line.strip() for line in hidden):
            self.folded += 1
            self.write(f"    [traceback folded] {original_exception(chr(10).join(hidden))}")


def _starts_record(plain: str) -> bool:
    """A line that begins a new log record rather than continuing an error's text."""
    match = _RECORD.match(plain)
    if not match:
        return False
    rest = plain[match.end() :].lstrip()
    return not rest.startswith(("Traceback", "ray::", "File "))
