"""Engine-call envelopes before and while the batch is imported: the engine host asks
`loaded_batch_class()` on every call, from any thread, while another may be importing it."""

from __future__ import annotations

import json
import sys
import types

import pytest

from distbatch.batch.calls import BATCH_MODULE, decode_call, encode_call, loaded_batch_class
from distbatch.batch.memory import DistributedBatchMemory


def test_the_batch_class_is_found_once_its_module_is_loaded() -> None:
    assert loaded_batch_class() is DistributedBatchMemory


def test_a_module_still_being_imported_has_no_batch_class_yet(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another thread's import puts the module in sys.modules before the class exists: no value
    can be a batch yet, so the answer is None, not an AttributeError (a worker answered 500)."""
    monkeypatch.setitem(sys.modules, BATCH_MODULE, types.ModuleType(BATCH_MODULE))
    assert loaded_batch_class() is None


def test_an_unloaded_batch_module_has_no_batch_class(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, BATCH_MODULE)
    assert loaded_batch_class() is None


def test_json_values_travel_without_the_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, BATCH_MODULE)
    body = encode_call([1, "two"], {"three": [3.0, None]})
    args, kwargs = decode_call(json.loads(body))
    assert args == [1, "two"] and kwargs == {"three": [3.0, None]}
    assert BATCH_MODULE not in sys.modules
