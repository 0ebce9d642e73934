"""The controller: which samples are ready, which consumer took them, which rank gets which.

Owns the bookkeeping of streaming pipelines over metadata only: partitions, production and
consumption per task, samplers' answers, checkpoints (`core`), the protocol both controllers
implement (`api`: `ControllerAPI`, which the data loader takes), the controller's HTTP face
(`server`), its client `RemoteController` (`remote`) and the error codes both share
(`http_errors`). May import `distbatch.batch`,
`distbatch.client`, `distbatch.samplers`, `distbatch.serving` and below; never the launchers.
"""

from distbatch.controller.api import ControllerAPI
from distbatch.controller.core import Controller
from distbatch.controller.results import ForgottenNode
from distbatch.errors import ClearInProgressError, SchemaConflictError

__all__ = ["ClearInProgressError", "Controller", "ControllerAPI", "ForgottenNode", "SchemaConflictError"]
