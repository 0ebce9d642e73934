"""The process's limit on open descriptors, lifted where a server or a reader needs many.

A server keeps a descriptor per connection (workers and the controller alike: every rank may
keep one), and a same-host reader or worker one per mapped shared region; 1024, a common soft
default, is too few for either. Imports nothing of distbatch.
"""

from __future__ import annotations

import resource

# Descriptors this process asks for: connections, and each mapped region holds one (Python's
# mmap keeps a dup).
WANTED_OPEN_FILES = 65536


def raise_open_file_limit() -> int:
    """Lift this process's soft limit on open descriptors towards `WANTED_OPEN_FILES` (never past
    the hard limit). Returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = WANTED_OPEN_FILES if hard == resource.RLIM_INFINITY else min(WANTED_OPEN_FILES, hard)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError):
            pass
    return WANTED_OPEN_FILES if soft == resource.RLIM_INFINITY else soft
