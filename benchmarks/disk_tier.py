"""The disk tier: KV that outlives a reboot and ten times what memory holds, side by side with
llama.cpp's llama-server and with the same bytes read plainly from the same disk.

1. After a reboot: a conversation opens with a ~1,500-token document; its next turn is timed
   after a restart that keeps the pool's segment (the memory tier), after a reboot (the segment
   removed, the process restarted, the tier's files evicted from the page cache with
   posix_fadvise(DONTNEED)), and cold (the same size never seen: a prefill). llama-server's next
   turn after its restart is timed too (it keeps nothing). Goals: cold / reboot >= 20, reboot /
   memory <= 3.
2. Restore speed, in process on llama.cpp: a 1,500-token entry read from a cold page cache into
   the pool and imported into a sequence (disk to engine), against a plain sequential read of the
   same file from a cold page cache, alternating. Goal: >= 0.5.
3. Ten times what memory holds: 10N conversations of ~1,500 tokens open, then each comes back
   once, in a shuffled order, with one client: ours with memory for N and the disk for 10N,
   ours with memory for all of them (no disk tier), and llama-server with its RAM prompt cache of
   the same size as our memory (`--cache-ram`). Figures: the returning turns' first-token p50 and
   the prompt tokens each server computed for them. Goal: ours within 3x of all-in-memory, and
   prefilling only the new messages.
4. Decode while the tier writes: streams decoding past checkpoints (each a park the tier writes
   in the background) on serve with the tier and without it, sample by sample. Goal: 1.
5. Documents beside chats while the tier writes: traffic.py's shape that parks the most bytes
   while it computes (three ~1,800-token documents sent together, a one-line chat every second),
   on serve with the tier and without it, round by round (new texts each round, the order of the
   two servers swapped every round). Figures: the documents' wall time, the chats' first token.
   Goal: 1.

    .venv/bin/python benchmarks/disk_tier.py [--quick] [--parts reboot,restore,returning,decode,documents]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import servers, traffic  # noqa: E402
from benchmarks.conversations import turn  # noqa: E402
from benchmarks.harness import Run  # noqa: E402
from benchmarks.texts import text_of  # noqa: E402

GROUP = "disk tier: after a reboot, ten times memory, restore speed, decode beside its writes"
PARTS = ("reboot", "restore", "returning", "decode", "documents")


class DiskSizes(NamedTuple):
    document: int  # tokens of each conversation's opening document
    samples: int  # conversations timed after a restart and a reboot
    memory_conversations: int  # N: what the memory budget holds
    returning: int  # conversations of the returning workload (10N)
    restore_repeat: int
    decode_tokens: int
    decode_repeat: int
    documents_rounds: int  # rounds of the documents shape on each server


FULL = DiskSizes(document=1500, samples=5, memory_conversations=8, returning=80, restore_repeat=7,
                 decode_tokens=512, decode_repeat=5, documents_rounds=4)
QUICK = DiskSizes(document=200, samples=2, memory_conversations=2, returning=6, restore_repeat=2,
                  decode_tokens=64, decode_repeat=1, documents_rounds=1)
CELL_BYTES = 23_040  # SmolLM2-135M's KV per token (30 layers x K and V x 3 heads x 64 x f16)


def drop_page_cache(folder: Path) -> int:
    """Evict every file of `folder` from the page cache (no root needed: they are clean, the tier
    flushes them before it names them); the files."""
    count = 0
    for path in folder.glob("*.kv"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        count += 1
    return count


def own_folder(scratch: str, name: str) -> str:
    """A folder of its own under `scratch` for one server (its session log)."""
    path = Path(scratch) / name
    path.mkdir(exist_ok=True)
    return str(path)


def opening(salt: int, document: int) -> list[dict]:
    """A conversation's first turn: a long document and a question about it."""
    return [{"role": "system", "content": text_of(document, salt=salt)},
            {"role": "user", "content": "What is this document about?"}]


def reply_and_ask(served: servers.Served, messages: list[dict], question: str) -> float:
    """One turn: the first token's seconds; the reply and `question` appended to `messages`."""
    seconds, reply, _ = turn(served, messages)
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": question}]
    return seconds


# ----------------------------------------------------------------------------- 1. after a reboot

def after_a_reboot(run: Run, model: Path, sizes: DiskSizes, scratch: str, tick: Callable[[str], None]) -> None:
    """Ours: the next turn after a restart (memory), after a reboot (disk), and cold; llama-server:
    the next turn after its restart."""
    from kvpool import segment

    pool, tier = f"bench-disk-{os.getpid()}", Path(scratch) / "reboot-tier"

    def reboot() -> None:
        if pool in segment.list_pool_names():
            segment.unlink(pool)
        drop_page_cache(tier)

    ours = servers.start_ours(model, None, own_folder(scratch, "reboot"), pool=pool, extra=("--disk-dir", str(tier)))
    memory, disk, cold = [], [], []
    try:
        ours.complete(text_of(32, salt=999), 4)  # one-time costs go here
        for sample in range(sizes.samples):
            messages = opening(5000 + sample, sizes.document)
            reply_and_ask(ours, messages, "Say more.")
            ours.restart()
            memory.append(reply_and_ask(ours, messages, "And then?"))
            ours.restart(between=reboot)
            disk.append(reply_and_ask(ours, messages, "Thank you."))
            cold.append(turn(ours, opening(6000 + sample, sizes.document))[0])
            tick(f"ours: reboot sample {sample + 1}/{sizes.samples}")
        tier_metrics = ours.metrics("superfluid_kv_tier_")
    finally:
        ours.stop()
    peer = servers.start_peer(model, servers.PEER_CONTEXT, extra=("-fa", "on"))
    restarted = []
    try:
        peer.complete(text_of(32, salt=999), 4)
        for sample in range(sizes.samples):
            messages = opening(5000 + sample, sizes.document)
            reply_and_ask(peer, messages, "Say more.")
            peer.restart()
            restarted.append(reply_and_ask(peer, messages, "And then?"))
            tick(f"llama-server: restart sample {sample + 1}/{sizes.samples}")
    finally:
        peer.stop()
    label = f"next turn's first token, {sizes.document}-token conversation"
    run.record(f"ours: {label}, after a restart (memory tier)", memory)
    run.record(f"ours: {label}, after a reboot (disk tier, cold page cache)", disk)
    run.record(f"ours: {label}, cold (prefilled)", cold)
    run.record(f"llama-server: {label}, after a restart", restarted)
    run.ratio("after a reboot: cold / disk tier (goal >= 20)", ours=f"ours: {label}, after a reboot (disk tier, "
              "cold page cache)", baseline=f"ours: {label}, cold (prefilled)", group=GROUP, goal=20)
    run.ratio("after a reboot: llama-server after its restart / ours from disk",
              ours=f"ours: {label}, after a reboot (disk tier, cold page cache)",
              baseline=f"llama-server: {label}, after a restart", group=GROUP)
    run.note("after a reboot: disk tier / memory tier (goal <= 3)",
             round(statistics.median(disk) / statistics.median(memory), 2))
    run.note("after a reboot: ours' tier counters", {k: v for k, v in tier_metrics.items() if "_total" in k})


# ----------------------------------------------------------------------------- 2. restore speed

def restore_speed(run: Run, model: Path, sizes: DiskSizes, scratch: str, tick: Callable[[str], None]) -> None:
    """Disk to engine (read into the pool, verified, then imported) against a plain sequential
    read of the same file, both from a cold page cache, alternating."""
    from benchmarks.restore import prompt_of
    from engines import registry
    from engines.base import StepRequest
    from kvpool import Budget, Pool, segment
    from kvpool.disk import DiskTier
    from superfluid import transfer

    engine = registry.adapter("llamacpp")(model, threads=2, threads_batch=2, n_ctx=4096)
    name, folder = f"bench-restore-{os.getpid()}", Path(scratch) / "restore-tier"
    pool = Pool.create(name, 256 << 20, budget=Budget(256 << 20, None, "benchmark"))
    try:
        pool.attach_disk(DiskTier(folder, 1 << 30, headroom=0))
        identity = engine.describe().identity
        tokens = prompt_of(engine, sizes.document)
        seq = engine.new_sequence()
        engine.step([StepRequest(seq, tokens, "last")])
        info = transfer.export(engine, pool, seq, tokens)
        pool.release(info.id)
        assert pool.wait_spilled(60)
        pool.evict(info.id)
        engine.free_sequence(seq)
        disk_id = pool.lookup(identity, tokens).entry_id
        (entry,) = pool.disk.entries()
        path = folder / f"{entry.name}.kv"
        buffer = bytearray(path.stat().st_size)  # allocated and touched before any timing
        restores, loads, reads = [], [], []
        for _ in range(sizes.restore_repeat):
            drop_page_cache(folder)
            seq = engine.new_sequence()
            start = time.perf_counter()
            loaded = pool.load(disk_id, identity)
            loads.append(time.perf_counter() - start)
            with pool.get(loaded.id, verify=False) as view:
                transfer.import_(engine, seq, view)
            restores.append(time.perf_counter() - start)
            assert engine.length(seq) == len(tokens)
            pool.release(loaded.id)
            pool.evict(loaded.id)
            engine.free_sequence(seq)
            drop_page_cache(folder)
            start = time.perf_counter()
            with open(path, "rb", buffering=0) as f:
                got = f.readinto(buffer)
            reads.append(time.perf_counter() - start)
            assert got == len(buffer)
        tick("restore speed")
    finally:
        pool.close()
        segment.unlink(name)
        engine.close()
    nbytes = entry.file_bytes
    run.record("disk to engine: read into the pool (verified) and imported, cold page cache", restores,
               nbytes=nbytes)
    run.record("disk to pool: read (verified), cold page cache", loads, nbytes=nbytes)
    run.record("plain sequential read of the same file, cold page cache", reads, nbytes=nbytes)
    run.ratio("restore speed: disk to engine / plain read (goal >= 0.5)",
              ours="disk to engine: read into the pool (verified) and imported, cold page cache",
              baseline="plain sequential read of the same file, cold page cache", group=GROUP, goal=0.5)
    run.note("restore speed: bytes of the entry's file", nbytes)


# ----------------------------------------------------------------------------- 3. ten times memory

def returning_users(run: Run, model: Path, sizes: DiskSizes, scratch: str, tick: Callable[[str], None]) -> None:
    """10N conversations open, then each comes back once (shuffled), on the three servers."""
    conversation = int((sizes.document + 64) * CELL_BYTES * 1.1)  # a conversation's KV with its framing
    memory = sizes.memory_conversations * conversation
    everything = sizes.returning * conversation
    # the host sheds cached KV past 90% of its budget down to 75% (its watermarks): the run that
    # holds everything gets a budget whose low watermark holds all of it
    roomy = int(everything / 0.75)
    size = lambda n: str(n)  # noqa: E731
    starts = {
        "ours, memory for N, disk for 10N": lambda: servers.start_ours(
            model, None, own_folder(scratch, "returning-disk"), pool=f"bench-ret-{os.getpid()}", extra=(
                "--pool-bytes", size(int(memory * 1.05)), "--export-budget", size(memory),
                "--disk-dir", str(Path(scratch) / "returning-tier"), "--disk-budget", size(everything))),
        "ours, everything in memory": lambda: servers.start_ours(
            model, None, own_folder(scratch, "returning-memory"), pool=f"bench-mem-{os.getpid()}", extra=(
                "--pool-bytes", size(int(roomy * 1.05)), "--export-budget", size(roomy), "--disk-tier", "no")),
        "llama-server, RAM cache of our memory": lambda: servers.start_peer(
            model, servers.PEER_CONTEXT, extra=("-fa", "on", "--cache-ram", str(max(1, memory >> 20)))),
    }
    order = list(range(sizes.returning))
    random.Random(7).shuffle(order)
    p50s = {}
    for label, start in starts.items():
        served = start()
        try:
            served.complete(text_of(32, salt=999), 4)
            conversations = []
            for c in range(sizes.returning):
                messages = opening(8000 + c, sizes.document)
                reply_and_ask(served, messages, "Say more about its second part.")
                conversations.append(messages)
                if c % 10 == 9:
                    tick(f"{label}: {c + 1}/{sizes.returning} opened")
            before = served.counts()["prompt"]
            firsts = [turn(served, conversations[c])[0] for c in order]
            computed = served.counts()["prompt"] - before
            tick(f"{label}: returned")
        finally:
            served.stop()
        run.record(f"{label}: returning turn's first token", firsts)
        run.note(f"{label}: prompt tokens computed for the {sizes.returning} returning turns", int(computed))
        p50s[label] = statistics.median(firsts)
    ours, everything_label, peer = starts
    run.ratio("ten times memory: ours from disk / everything in memory, first token p50 (goal <= 3)",
              ours=f"{everything_label}: returning turn's first token", baseline=f"{ours}: returning turn's first token",
              group=GROUP)
    run.ratio("ten times memory: llama-server / ours from disk, first token p50",
              ours=f"{ours}: returning turn's first token", baseline=f"{peer}: returning turn's first token",
              group=GROUP)


# ----------------------------------------------------------------------------- 4. decode beside writes

def with_and_without(model: Path, scratch: str, part: str, running: list[servers.Served]) -> None:
    """Start serve with the tier (in a folder of `scratch`) and without it, both up at once, into
    `running` (the caller stops them, also when the second fails to start)."""
    running.append(servers.start_ours(model, None, own_folder(scratch, f"{part}-on"),
                                      pool=f"bench-{part}-on-{os.getpid()}",
                                      extra=("--disk-dir", str(Path(scratch) / f"{part}-tier"))))
    running.append(servers.start_ours(model, None, own_folder(scratch, f"{part}-off"),
                                      pool=f"bench-{part}-off-{os.getpid()}", extra=("--disk-tier", "no")))


def decode_beside_writes(run: Run, model: Path, sizes: DiskSizes, scratch: str,
                         tick: Callable[[str], None]) -> None:
    """Streams decoding past several checkpoints on serve with and without the tier, alternating."""
    running: list[servers.Served] = []
    try:
        with_and_without(model, scratch, "decode", running)
        names = ["ours with the disk tier", "ours without it"]
        for served in running:
            traffic.streamed_tokens(served, "Hello.", 4)
        for count in (1, 4):
            rates: dict[str, list[float]] = {name: [] for name in names}
            for r in range(sizes.decode_repeat):
                for name, served in zip(names, running):
                    prompts = [f"Write about {text_of(8, salt=300 + 10 * r + i)}." for i in range(count)]
                    start = time.perf_counter()
                    with ThreadPoolExecutor(count) as workers:
                        generated = sum(workers.map(lambda p: traffic.streamed_tokens(served, p, sizes.decode_tokens),
                                                    prompts))
                    rates[name].append(generated / (time.perf_counter() - start))
            for name in names:
                run.record(f"{name}: decode tokens/s, {count} at once", rates[name], unit="tok/s")
            run.ratio(f"decode, {count} at once: with the disk tier / without (goal 1)",
                      ours=f"ours with the disk tier: decode tokens/s, {count} at once",
                      baseline=f"ours without it: decode tokens/s, {count} at once", group=GROUP)
            tick(f"decode, {count} at once")
        run.note("decode: the tier's writes meanwhile", running[0].metrics("superfluid_kv_tier_bytes_written"))
        run.note("decode: checkpoints", json.loads(running[0].get("/health")).get("kv", {}))
    finally:
        for served in running:
            served.stop()


def documents_beside_writes(run: Run, model: Path, sizes: DiskSizes, scratch: str,
                            tick: Callable[[str], None]) -> None:
    """traffic.py's documents beside chats on serve with and without the tier, round by round."""
    shape = traffic.FULL if sizes is FULL else traffic.QUICK
    names = ["ours with the disk tier", "ours without it"]
    running: list[servers.Served] = []
    try:
        with_and_without(model, scratch, "documents", running)
        for served in running:
            traffic.chat(served, [{"role": "user", "content": "Hello."}], 4)  # one-time costs go here
        written_before = running[0].metrics("superfluid_kv_tier_bytes_written")
        done: dict[str, list[float]] = {name: [] for name in names}
        waits: dict[str, list[float]] = {name: [] for name in names}
        for r in range(sizes.documents_rounds):
            for name, served in (list(zip(names, running)) if r % 2 == 0 else list(zip(names, running))[::-1]):
                once = Run("documents-round")
                traffic.documents_beside_chats(once, served, shape, salt=1 + r)
                done[name] += once.figures[f"{served.label}: {traffic.label_documents(shape)}"].samples
                waits[name] += once.figures[f"{served.label}: {traffic.CHATS}"].samples
            tick(f"documents beside chats, round {r + 1} of {sizes.documents_rounds}")
        for name in names:
            run.record(f"{name}: documents beside chats, documents done", done[name])
            run.record(f"{name}: the chats' first token", sorted(waits[name]))
        run.ratio("documents beside chats, documents done: without the tier / with it (goal 1)",
                  ours="ours with the disk tier: documents beside chats, documents done",
                  baseline="ours without it: documents beside chats, documents done", group=GROUP)
        run.ratio("the chats' first token: without the tier / with it",
                  ours="ours with the disk tier: the chats' first token",
                  baseline="ours without it: the chats' first token", group=GROUP)
        written = running[0].metrics("superfluid_kv_tier_bytes_written")
        run.note("documents: the tier's writes meanwhile, bytes",
                 {key: written[key] - written_before.get(key, 0) for key in written})
    finally:
        for served in running:
            served.stop()


def main(argv: list[str] | None = None) -> int:
    """Run the parts asked for and print the figures, ratios and notes."""
    from engines import models

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes")
    parser.add_argument("--model", type=Path, help="a GGUF file (default: SmolLM2-135M-Instruct from PyPI)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"which parts, of {', '.join(PARTS)}")
    args = parser.parse_args(argv)
    parts = args.parts.split(",")
    unknown = set(parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
    model = Path(args.model or models.default_model(progress=print))
    sizes = QUICK if args.quick else FULL
    run = Run("bench-disk-tier")
    tick = lambda step: print(step, flush=True)  # noqa: E731
    with tempfile.TemporaryDirectory() as scratch:
        for part, bench in (("reboot", after_a_reboot), ("restore", restore_speed), ("returning", returning_users),
                            ("decode", decode_beside_writes), ("documents", documents_beside_writes)):
            if part in parts:
                bench(run, model, sizes, scratch, tick)
    print(run.table())
    for key, value in run.notes.items():
        print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
