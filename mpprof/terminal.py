"""Text that is safe to print on a terminal.

Run names (directory names), layer names and file contents are untrusted:
an ANSI escape sequence in a run name could clear the screen, retitle the
window or hide a line. Everything the command line prints that comes from
a logdir passes through `printable`.
"""

from __future__ import annotations


def printable(text: object) -> str:
    """`text` with every control character written as a Python escape.

    Control and formatting characters (ESC, BEL, CR, newline, DEL, the C1
    controls, bidirectional overrides, line separators) become `\\x1b`,
    `\\n`, `\\u202e`, ...; printable characters and spaces stay as they are.

    Args:
        text: anything; non-strings are converted with `str()` first.
    """
    return "".join(
        c if c.isprintable() or c == " " else c.encode("unicode_escape").decode("ascii")
        for c in str(text)
    )
