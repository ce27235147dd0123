"""Files replaced whole: a reader, or a run killed meanwhile, sees the old file or the new one, never
half of one. The new content goes to a temporary file beside the target, which is then renamed over
it (a rename within one directory is atomic on POSIX file systems)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator


@contextlib.contextmanager
def replacing(path: str | os.PathLike, durable: bool = False) -> Iterator[str]:
    """A temporary path beside ``path`` for the block to write. When the block ends without an error
    the file replaces ``path``, with the mode a new file gets under the umask (and flushed to disk
    first if ``durable``); otherwise it is removed."""
    path = os.fspath(path)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=f".{os.path.basename(path)}.",
                               suffix=".tmp")
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~umask())  # mkstemp's 0600 would hide the file from the run's other users
        if durable:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_text(path: str | os.PathLike, text: str) -> None:
    """``path`` replaced whole by ``text`` (UTF-8)."""
    with replacing(path) as tmp, open(tmp, "w", encoding="utf-8") as file:
        file.write(text)


def umask() -> int:
    """The process's umask (reading it means setting it: set back at once)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask
