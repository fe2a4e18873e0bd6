"""The HTTP floor under both OpenAI-compatible front ends, `dualpath serve` (`serve.api`)
and `dualpath route` (`integrations.vllm.router.app`); torch-free, it imports only `core`.

- `api_error`   `ApiError` / `bad_request` in OpenAI's error shape, and the FastAPI handlers
- `guard`       ASGI middleware: the API key (`OPEN_PATHS` open), the body limit (413) and
                the body deadline (408); the ASGI type aliases
- `server`      `ServerConfig`, `bind`, `HttpServer`: uvicorn with the guard, a deadline for
                each request's head and kept-alive connections closed when idle
- `exposition`  Prometheus families labelled by model and the `/metrics` response
"""

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
"""uvicorn's log levels a server takes (here, so a CLI offers them without importing uvicorn)."""
