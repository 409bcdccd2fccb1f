"""Every comparison superfluid is judged on, in one run on this machine, written where readers look.

    .venv/bin/python benchmarks/suite.py            # SmolLM2-135M, the full sizes (about 75 minutes on 2 cores)
    .venv/bin/python benchmarks/suite.py --quick    # small sizes, into benchmarks/results/quick/ (about 5 minutes)

Measured side by side in the same run, each a median with its range and a ratio to its comparison:

1. restore and share through the pool against numpy memcpy of the same bytes (both engines);
2. our restore against llama-cpp-python's LlamaRAMCache path (save_state / load_state) and mlx-lm's
   LRUPromptCache fetch, at 256, 1,024 and 4,096 tokens;
3. warm against cold time to first token by context, 256 to 4,096 tokens, both engines; 1 and 3
   again on Gemma 3 270M through llama.cpp (a sliding window on 5 of every 6 layers);
4. 16 requests on one 1,000-token prefix at once: prompt tokens evaluated and the time until the
   last answer, `superfluid serve` against llama-cpp-python's server with its cache and without,
   and against llama.cpp's llama-server (its defaults, and 8 slots; built once from the same
   llama.cpp, benchmarks/cpp_server.py);
5. aggregate decode tokens/s with 1, 2, 4 and 8 requests at once, against those servers (no cache)
   and against llama.cpp's own batched step alone (the bound);
6. an interactive session's time to first token behind 8 background sessions, against idle;
7. memory: the pool's bytes per cached token against the price it computed (they must agree);
8. under load, against llama-cpp-python's server on 4,096 cells and llama-server (both ways):
   decode beside 6 idle 2,000-token sessions, a chat's first token behind 8 agents with 1,800-token prompts, 32 clients at once;
9. the HTTP layer: decode tokens/s through `superfluid serve` against the same Host in-process at
   1, 2, 4 and 8 requests at once, and /health beside 1,000 half-open connections;
10. conversations against those servers: the next turn after a 1,500-token first turn, warm,
    after a restart of the server and cold; a 40-turn conversation's late first token;
11. two `superfluid serve` workers behind sglang-router: prompt tokens prefilled and first token
    of a concurrent mixed load, its cache-aware policy against round-robin.

Writes, into --out-dir (default docs/): benchmarks.json (the run, with the machine), benchmarks.png
(the plot), and the tables into benchmarks.md between its markers. It then compares the ratios
with the last committed benchmarks.json (benchmarks/regression.py) and says which moved.
Exit status: 0; 1 when the stored and priced bytes disagree, or (with --fail-on-regression) a
ratio got worse; 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import (conversations, decode_bound, host_ratios, load, over_http, report, restore,  # noqa: E402
                        routing, sampling, servers, ttft)
from benchmarks.harness import Run  # noqa: E402
from benchmarks.regression import compare  # noqa: E402
from engines import models  # noqa: E402
from kvpool import segment  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
INTERACTIVE = "interactive first token behind background sessions, against idle"
GEMMA = "llama.cpp, Gemma 3"


@dataclass(frozen=True)
class Sizes:
    """How big each comparison is."""

    lengths: tuple[int, ...]  # restore comparisons, tokens
    restore_repeat: int
    contexts: tuple[int, ...]  # warm/cold first token, tokens
    ttft_repeat_short: int  # samples at contexts up to 1,024
    ttft_repeat_long: int  # samples past 1,024
    burst_requests: int
    burst_prefix: int
    burst_repeat: int
    concurrency: tuple[int, ...]
    decode_tokens: int
    decode_repeat: int
    background: int
    interactive_repeat: int
    load: load.LoadSizes
    conversations: conversations.ConversationSizes
    routing: routing.RoutingSizes
    sampling_calls: int  # tokens sampled per figure

    def ttft_repeat(self, context: int) -> int:
        """Samples at one context length (the long ones cost minutes each on 2 cores)."""
        return self.ttft_repeat_short if context <= 1024 else self.ttft_repeat_long

    def steps(self, engines: int, models: int) -> int:
        """Progress-bar steps the run takes with `engines` engine-level runs (runtimes and models)
        and `models` models sampled from."""
        per_engine = len(self.lengths) + sum(self.ttft_repeat(c) for c in self.contexts)
        # bursts: ours, llama-cpp-python's with its cache and without, llama-server and with 8 slots;
        # decode on all but llama-cpp-python's with its cache
        servers = 5 * self.burst_repeat + 4 * len(self.concurrency)
        http = len(self.concurrency) + 1  # HTTP against in-process, /health beside half-open connections
        talks = len(conversations.SERVERS) * (self.conversations.samples + 1)  # second turns, a long conversation
        routed = len(routing.POLICIES)
        sampled = len(sampling.SETTINGS) * models
        return (engines * per_engine + servers + http + talks + routed + sampled
                + 2 + 3 * 4 + 1)  # + decode bound, interactive, 3 load shapes x 4, the agents again with --arrival-wait


FULL = Sizes(lengths=(256, 1024, 4096), restore_repeat=7, contexts=(256, 512, 1024, 2048, 4096), ttft_repeat_short=3,
             ttft_repeat_long=2, burst_requests=16, burst_prefix=1000, burst_repeat=2, concurrency=(1, 2, 4, 8),
             decode_tokens=128, decode_repeat=2, background=8, interactive_repeat=5, load=load.FULL,
             conversations=conversations.FULL, routing=routing.FULL, sampling_calls=200)
QUICK = Sizes(lengths=(64, 128), restore_repeat=3, contexts=(64, 128), ttft_repeat_short=1, ttft_repeat_long=1,
              burst_requests=4, burst_prefix=128, burst_repeat=1, concurrency=(1, 2), decode_tokens=8, decode_repeat=1,
              background=2, interactive_repeat=2, load=load.QUICK,
              conversations=conversations.QUICK, routing=routing.QUICK, sampling_calls=10)


def last_committed(path: Path) -> dict | None:
    """The run committed at `path` in git's HEAD (or the file as it is, outside a checkout)."""
    try:
        relative = path.resolve().relative_to(ROOT)
        shown = subprocess.run(["git", "show", f"HEAD:{relative.as_posix()}"], cwd=ROOT, capture_output=True,
                               text=True, check=True)
        return json.loads(shown.stdout)
    except (ValueError, OSError, subprocess.CalledProcessError, json.JSONDecodeError):
        pass
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def remove_own_pools() -> list[str]:
    """Unlink every pool this process's benchmarks named (bench-...-<pid>[-n]) that is still there
    (each part removes its own; this is for a run that was interrupted)."""
    mine = re.compile(rf"bench-[a-z-]+-{os.getpid()}(-\d+)?")
    removed = [name for name in segment.list_pool_names() if mine.fullmatch(name)]
    for name in removed:
        segment.unlink(name)
    return removed


def run_all(sizes: Sizes, model: Path, runtimes: list[str], name: str, progress, second: Path | None = None) -> Run:
    """Every comparison, ticking `progress` (a tqdm bar) as each step ends; the engine-level ones
    also on `second` (Gemma 3 270M) through llama.cpp when given."""
    run = Run(name)
    run.note("model", model.name)
    if second is not None:
        run.note("second model", second.name)

    def tick(step: str) -> None:
        progress.set_postfix_str(step, refresh=False)
        progress.update(1)

    for runtime in runtimes:
        progress.set_description(f"restore ({ttft.NAMES[runtime]})")
        restore.bench_engine(run, runtime, model, list(sizes.lengths), sizes.restore_repeat, tick)
    for runtime in runtimes:
        progress.set_description(f"first token ({ttft.NAMES[runtime]})")
        ttft.bench_engine(run, runtime, model, list(sizes.contexts), sizes.ttft_repeat, tick)
    if second is not None:  # a second family: a sliding window on most layers (llama.cpp's iSWA memory)
        progress.set_description(f"restore ({GEMMA})")
        restore.bench_engine(run, "llamacpp", second, list(sizes.lengths), sizes.restore_repeat, tick, label=GEMMA)
        progress.set_description(f"first token ({GEMMA})")
        ttft.bench_engine(run, "llamacpp", second, list(sizes.contexts), sizes.ttft_repeat, tick, label=GEMMA)
    progress.set_description("servers")
    servers.bench(run, model, requests=sizes.burst_requests, prefix=sizes.burst_prefix,
                  counts=list(sizes.concurrency), tokens=sizes.decode_tokens, repeat=sizes.decode_repeat,
                  burst_repeat=sizes.burst_repeat, tick=tick)
    decode_bound.bench(run, model, list(sizes.concurrency), steps=32, repeat=sizes.decode_repeat, group=servers.DECODE,
                       ours=lambda count: f"{servers.OURS}: decode tokens/s, {count} at once", tick=tick)
    progress.set_description("sampling")
    sampling.bench(run, {"SmolLM2": model, **({"Gemma 3 270M": second} if second is not None else {})},
                   calls=sizes.sampling_calls, repeat=sizes.decode_repeat + 1, tick=tick)
    progress.set_description("HTTP against in-process")
    over_http.bench(run, model, list(sizes.concurrency), sizes.decode_tokens, sizes.decode_repeat, tick)
    progress.set_description("interactive")
    hosts = host_ratios.Hosts(model)
    try:
        host_ratios.bench_interactive(run, hosts, sizes.background, sizes.interactive_repeat, group=INTERACTIVE)
    finally:
        hosts.close()
    tick("interactive")
    progress.set_description("under load")
    load.bench(run, model, sizes.load, tick)
    progress.set_description("conversations")
    conversations.bench(run, model, sizes.conversations, tick)
    progress.set_description("two workers behind a router")
    routing.bench(run, model, sizes.routing, tick)
    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (what the tests run)")
    parser.add_argument("--out-dir", type=Path, help="where benchmarks.{json,png,md} go (default: docs/, or "
                                                     "benchmarks/results/quick/ with --quick)")
    parser.add_argument("--model", type=Path, help="a GGUF file (default: SmolLM2-135M-Instruct from PyPI)")
    parser.add_argument("--runtimes", default="llamacpp,mlx", help="engines for the engine-level comparisons")
    parser.add_argument("--second-model", type=Path, help="a GGUF of another family for the engine-level "
                        "comparisons on llama.cpp (default: Gemma 3 270M from PyPI)")
    parser.add_argument("--no-second-model", action="store_true", help="the first model only")
    parser.add_argument("--fail-on-regression", action="store_true", help="exit 1 when a ratio got worse")
    args = parser.parse_args(argv)
    runtimes = [r for r in args.runtimes.split(",") if r]
    unknown = set(runtimes) - set(ttft.NAMES)
    if unknown or not runtimes:
        parser.error(f"--runtimes: {', '.join(sorted(unknown)) or 'none given'}; use llamacpp, mlx or both")
    from tqdm import tqdm

    sizes = QUICK if args.quick else FULL
    out_dir = args.out_dir or (ROOT / "benchmarks" / "results" / "quick" if args.quick else ROOT / "docs")
    model = args.model or models.default_model(progress=print)
    second = None if args.no_second_model else Path(args.second_model or models.gemma3_model(progress=print))
    from benchmarks import cpp_server

    cpp_server.find_or_build(progress=print)  # before the bar: a first build takes minutes, and may fail
    try:
        engines = len(runtimes) + (second is not None)
        with tqdm(total=sizes.steps(engines, 1 + (second is not None)), unit="step", dynamic_ncols=True) as progress:
            run = run_all(sizes, Path(model), runtimes, "bench-quick" if args.quick else "bench", progress, second)
    finally:
        remove_own_pools()
    result = run.as_dict()
    json_path = out_dir / "benchmarks.json"
    previous = last_committed(json_path)
    movements = compare(result, previous) if previous and previous.get("name") == result["name"] else []
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    image = report.plot(result, out_dir / "benchmarks.png", ttft.GROUP)
    page = report.write_page(out_dir / "benchmarks.md", report.markdown(result, movements, image.name))
    print(run.table())
    for m in movements:
        if m.verdict != "steady":
            print(f"moved: {m.verdict:>6}  {m.label}: {m.before:.3f} -> {m.after:.3f}")
    print(f"written: {json_path}, {image}, {page}")
    disagreements = restore.price_disagreements(run)
    for line in disagreements:
        print(f"stored and priced bytes disagree: {line}", file=sys.stderr)
    worse = args.fail_on_regression and any(m.verdict == "worse" for m in movements)
    return 1 if disagreements or worse else 0


if __name__ == "__main__":
    sys.exit(main())
