"""One `superfluid serve` among several behind a router: its name, the sessions it owns, and what a
router asks a worker.

A session lives where its log and KV are, so a request for it must reach that one worker. A
worker started with a name (`--worker-name`) mints its session ids as `<name>.<hex>`: any proxy
can route `/v1/sessions/<name>.…` to that worker by the path alone, nothing moves when workers
are added (as consistent hashing would move keys), and a request that reached the wrong worker
is answered 421 naming the right one. Every response carries the name in `X-Superfluid-Worker`.

sglang-router, the cache-aware router this is tested behind, learns about a worker from
`GET /server_info` and `GET /model_info`, and its power-of-two policy polls `GET /get_load`;
the payloads here are the fields it reads.
"""

from __future__ import annotations

import re
import uuid

from superfluid.http import api

HEADER = "X-Superfluid-Worker"
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def check_name(name: str) -> str:
    """`name` if it can head a session id and a proxy's backend name; ValueError saying what it may hold."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"a worker name is 1 to 64 letters, digits, '-' or '_' (it heads this worker's session "
                         f"ids, which proxies route by), not {name!r}")
    return name


def new_session_id(worker: str | None) -> str | None:
    """A fresh id for a session this worker creates (None without a name: the Host mints a plain one)."""
    return f"{worker}.{uuid.uuid4().hex}" if worker else None


def owner_of(session_id: str) -> str | None:
    """The worker a session id names (None for an id minted without a worker name)."""
    name, dot, _ = session_id.partition(".")
    return name if dot and _NAME.fullmatch(name) else None


def misdirected(session_id: str, worker: str | None) -> api.ApiError | None:
    """The 421 for a session this worker does not hold but whose id names another worker
    (None where the id names this worker or none)."""
    owner = owner_of(session_id)
    if worker is None or owner is None or owner == worker:
        return None
    return api.ApiError(421, f"session {session_id} belongs to worker `{owner}`; this is worker `{worker}`. Route "
                        f"/v1/sessions/{owner}.* to {owner} (docs/scaling.md)", param="session",
                        code="misdirected_request")


def server_info(model_name: str, version: str, stats) -> dict:
    """GET /server_info: what sglang-router reads when a worker registers. The served name keys its
    per-model routing; no model path is given, since the router would load a tokenizer from it
    (from a model hub, for a name), and it needs none to route HTTP requests."""
    return {"served_model_name": model_name, "model_id": model_name, "version": version,
            "max_total_tokens": stats.cells_total, "engine": "superfluid"}


def model_info(runtime: str) -> dict:
    """GET /model_info: the model generates text (the router asks whether it embeds or classifies)."""
    return {"is_generation": True, "model_type": runtime}


def load(stats) -> list[dict]:
    """GET /get_load, in SGLang's shape (one entry per data-parallel rank; one here): requests
    running and waiting, and the tokens held in the engine's KV cells, which is the load
    sglang-router's power-of-two policy compares."""
    return [{"dp_rank": 0, "num_reqs": stats.generating, "num_waiting_reqs": stats.waiting,
             "num_tokens": stats.cells_used}]
