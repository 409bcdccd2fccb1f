"""llama-cpp-python's own OpenAI server, as shipped, plus a count of the tokens it evaluates.

    python benchmarks/llama_server.py --model M.gguf --port 8001 --n_ctx 4096 --cache true

Runs `llama_cpp.server`'s app (`create_app` with its settings from the same command-line flags
its `python -m llama_cpp.server` takes) under uvicorn, and adds one route, GET /bench/counts:
{"prompt": tokens evaluated as prompts, "decode": tokens evaluated while generating}. The count
wraps `Llama.generate` and `Llama.eval` without changing what they do: the first `eval` of each
`generate` is the part of the prompt the server could not reuse (from its context or its cache).
"""

from __future__ import annotations

import argparse
import threading

import uvicorn
from llama_cpp import Llama
from llama_cpp.server.app import create_app
from llama_cpp.server.cli import add_args_from_model, parse_model_from_args
from llama_cpp.server.settings import ModelSettings, ServerSettings, Settings

COUNTS = {"prompt": 0, "decode": 0, "requests": 0}
_lock = threading.Lock()
_plain_generate, _plain_eval = Llama.generate, Llama.eval


def _generate(self, tokens, *args, **kwargs):
    self._bench_prompt_pending = True
    with _lock:
        COUNTS["requests"] += 1
    yield from _plain_generate(self, tokens, *args, **kwargs)


def _eval(self, tokens):
    kind = "prompt" if getattr(self, "_bench_prompt_pending", False) else "decode"
    self._bench_prompt_pending = False
    with _lock:
        COUNTS[kind] += len(tokens)
    return _plain_eval(self, tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args_from_model(parser, Settings)
    args = parser.parse_args()
    server_settings = parse_model_from_args(ServerSettings, args)
    model_settings = [parse_model_from_args(ModelSettings, args)]
    Llama.generate, Llama.eval = _generate, _eval
    app = create_app(server_settings=server_settings, model_settings=model_settings)

    @app.get("/bench/counts")
    def counts() -> dict:
        with _lock:
            return dict(COUNTS)

    uvicorn.run(app, host=server_settings.host, port=server_settings.port, log_level="warning")


if __name__ == "__main__":
    main()
