"""Write files so readers never see half of one: temp file, fsync, rename."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_text_atomically(path: str | os.PathLike[str], text: str) -> Path:
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    tmp.replace(target)
    return target


def write_json_atomically(path: str | os.PathLike[str], data: Any) -> Path:
    return write_text_atomically(path, json.dumps(data, separators=(",", ":")))
