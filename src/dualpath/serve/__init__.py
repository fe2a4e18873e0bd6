"""The OpenAI-compatible HTTP API over the real runtime (`dualpath serve`).

- `engine`    `ServingEngine`: an emulated cluster (`runtime.Cluster`) and the dispatcher
              thread that routes its results to concurrent requests (`Generation`).
- `protocol`  the request schemas (pydantic) and their translation into runtime requests.
- `metrics`   `/metrics` in Prometheus text format (vLLM's names and DualPath's own).
- `api`       the FastAPI app (routes, OpenAI response and stream objects) on the
              `dualpath.http` server (API key, body limits, timeouts).
"""

from dualpath.http.api_error import ApiError
from dualpath.http.server import ServerConfig
from dualpath.serve.api import ApiServer, make_app, make_server
from dualpath.serve.engine import GenerateRequest, ServeError, ServingEngine
from dualpath.serve.protocol import parse_request

__all__ = ["ApiError", "ApiServer", "GenerateRequest", "ServeError", "ServerConfig",
           "ServingEngine", "make_app", "make_server", "parse_request"]
