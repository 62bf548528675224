"""The command line's checks of what it is given: prompts, prompt files, intervals and output paths.

Each is refused by name at parse time, before a model is loaded or a frame shown: a
PROMPT that is not UTF-8 (a terminal in another encoding gives Python surrogate
escapes); a ``--batch`` file that is not a regular file (a FIFO would block the read
for ever, ``/dev/zero`` never ends), larger than :data:`MAX_BATCH_BYTES`, not UTF-8
or without a prompt; an interval that is NaN, infinite or out of range
(``time.sleep`` would raise after the first frame); a ``--snapshot`` path whose
directory is missing or not writable (else found only when the snapshot is
written, after the whole run).
"""

import math
import os
import stat
from typing import Any, List, Optional, Tuple, Union

import click

MAX_BATCH_BYTES = 16 << 20   # a --batch file: far more prompts than a cache holds sequences at once


def utf8_failure(text: str) -> Optional[Tuple[int, Optional[int]]]:
    """Where ``text`` (a str from the command line) is not UTF-8: ``(index, byte)`` of its first surrogate escape
    (the byte it stands for, or None for a lone surrogate of another origin), or None when it is valid."""
    try:
        text.encode()
        return None
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        return exc.start, code - 0xDC00 if 0xDC80 <= code <= 0xDCFF else None


def _not_utf8(what, failure):
    index, byte = failure
    found = f"byte {byte:#04x}" if byte is not None else "a lone surrogate"
    return f"{what} is not UTF-8 text ({found} at character {index}): give UTF-8 text"


class Utf8Text(click.ParamType):
    """A str argument that must be valid UTF-8 (no surrogate escapes)."""

    name = "text"

    def convert(self, value: str, param: Optional[click.Parameter], ctx: Optional[click.Context]) -> str:
        """``value`` itself; a usage error where it is not UTF-8."""
        failure = utf8_failure(value)
        if failure:
            self.fail(_not_utf8("the prompt", failure), param, ctx)
        return value


class PromptFile(click.ParamType):
    """A regular file of prompts, one a line, read whole (at most :data:`MAX_BATCH_BYTES`), as UTF-8: converts to
    the list of its non-blank lines, stripped."""

    name = "file"

    def convert(self, value: Union[str, List[str]], param: Optional[click.Parameter],
                ctx: Optional[click.Context]) -> List[str]:
        """The prompts of the file named ``value`` (a list, already converted, as it is); a usage error for a
        file that is missing, not regular, too large, not UTF-8 or without a prompt."""
        if isinstance(value, list):
            return value
        try:
            fd = os.open(value, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO opens at once, to be refused below
        except OSError as exc:
            self.fail(f"{value}: {exc.strerror}", param, ctx)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                self.fail(f"{value} is not a regular file (a FIFO, a device or a directory): give a file of "
                          "prompts", param, ctx)
            if info.st_size > MAX_BATCH_BYTES:
                self.fail(f"{value} has {info.st_size} bytes, more than {MAX_BATCH_BYTES}: split it", param, ctx)
            with os.fdopen(os.dup(fd), "rb") as f:
                data = f.read(MAX_BATCH_BYTES + 1)
        finally:
            os.close(fd)
        if len(data) > MAX_BATCH_BYTES:  # it grew since fstat
            self.fail(f"{value} has more than {MAX_BATCH_BYTES} bytes: split it", param, ctx)
        try:
            text = data.decode()
        except UnicodeDecodeError as exc:
            self.fail(f"{value} is not UTF-8 text (byte {data[exc.start]:#04x} at byte {exc.start})", param, ctx)
        prompts = [line.strip() for line in text.splitlines() if line.strip()]
        if not prompts:
            self.fail(f"{value} has no prompts", param, ctx)
        return prompts


class Seconds(click.FloatRange):
    """An interval in seconds within a range; NaN (which compares false with every bound) refused too."""

    name = "seconds"

    def convert(self, value: Any, param: Optional[click.Parameter], ctx: Optional[click.Context]) -> float:
        """``value`` (a str or a number) as a float within the range; a usage error for NaN."""
        seconds = super().convert(value, param, ctx)
        if math.isnan(seconds):
            self.fail(f"{value} is not a number of seconds", param, ctx)
        return seconds


def check_output_path(path: str, option: str) -> None:
    """Refuse (a usage error for ``option``) a file path whose directory is missing or not writable."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise click.BadParameter(f"directory {directory} does not exist", param_hint=f"'{option}'")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise click.BadParameter(f"directory {directory} is not writable", param_hint=f"'{option}'")
