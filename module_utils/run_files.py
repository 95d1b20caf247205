# -*- coding: utf-8 -*-
"""The run folder's files on the host, written the one way every module writes them."""

from __future__ import annotations

import os


def write_private(path, text):
    """Write text to path, mode 0600, through a temporary file beside it renamed over it: a
    reader (or a controller that died mid-write) sees the old file or the new one, never part."""
    temporary = "%s.tmp-%d" % (path, os.getpid())
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.rename(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise
