"""The HTTP face: an OpenAI-compatible ASGI application around one Host, on uvicorn.

    server.py       the socket and uvicorn, with connection limits (connections.py)
    app.py          routing, auth and the session routes
    keys.py         the API keys and the tenant each names
    api.py          the request bodies, decoded and validated
    completions.py  chat and text completions, whole or streamed
    responses.py    errors (one table from the host's errors to statuses), usage
    metrics.py      /metrics;  worker.py: what a router asks a worker;  logprobs.py: their shapes

It imports the host (superfluid.host) and never the command line.
"""
