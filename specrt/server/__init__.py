"""An OpenAI-compatible HTTP server over a generator (plain or speculative).

    specrt serve --artifacts artifacts/SmolLM2-135M-Instruct --draft suffix
    curl localhost:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}]}'

One room per job:

    protocol.py   OpenAI's protocol with no engine: request body -> checked Job (every problem a
                  RequestError in OpenAI's error format naming the field and the fix), pieces ->
                  response body or server-sent events; fields.py: which request fields it takes
    service.py    CompletionService: admission (max_batch slots, max_queue waiting, then 503),
                  the engine thread running the continuous batch, one Ticket per request
    app.py        the FastAPI routes over a service; serve() runs them with uvicorn
    listen.py     the listening socket (a port in use names its holder)
    limits.py     ServerLimits (the CLI shows them without importing the runtime)
    metrics.py    Prometheus counters, the one source of /metrics and /stats
    ray.py        replicas on Ray Serve behind one address

fastapi / uvicorn / ray are imported only where they are used (the `server` and `ray` extras).
"""

import importlib

# name -> module; imported on first use, so `specrt.server.limits` (the CLI's --help) loads
# neither the runtime nor fastapi
_EXPORTS = {
    "create_app": "app",
    "serve": "app",
    "ServerLimits": "limits",
    "bind_socket": "listen",
    "Job": "protocol",
    "Piece": "protocol",
    "RequestError": "protocol",
    "CompletionService": "service",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'specrt.server' has no attribute {name!r}")
    return getattr(importlib.import_module(f"specrt.server.{_EXPORTS[name]}"), name)
