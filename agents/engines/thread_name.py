"""Name the calling thread for the operating system (``top -H``, ``/proc/<pid>/task/<tid>/comm``).

Python's thread names stay inside Python; the kernel's name of a thread is the
process's until the thread sets its own (Linux ``prctl(PR_SET_NAME)``, at most
15 bytes). ``shoal bench vllm-serve`` tells an engine's model thread from the
agent's event loop by this name. Elsewhere than Linux it does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys

__all__ = ["name_os_thread"]

_PR_SET_NAME = 15


def name_os_thread(name: str) -> None:
    """Give the calling thread ``name`` (cut to 15 bytes) in the kernel's thread list; best effort."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
