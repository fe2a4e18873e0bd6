"""The OpenAI-compatible HTTP API over the real runtime (`dualpath serve`).

- `engine`  `ServingEngine`: an emulated cluster (`runtime.Cluster`) and the dispatcher thread
            that routes its results to concurrent requests (`Generation`).
- `api`     request validation, OpenAI response and stream objects, the HTTP server.
"""

from dualpath.serve.api import ApiError, make_server, parse_request
from dualpath.serve.engine import GenerateRequest, ServeError, ServingEngine

__all__ = ["ApiError", "GenerateRequest", "ServeError", "ServingEngine", "make_server",
           "parse_request"]
