"""The Host: one model in this process, its scheduler thread, the shared KV pool and the session log.

    host = Host("model.gguf")                     # the runtime follows the file, or runtime="mlx"
    s = host.session(system="You are terse.")
    s.append_user("What is the capital of France?")
    for piece in s.generate(max_tokens=32):
        print(piece.text, end="")
    host.close()                                  # parks every lane, syncs the log, keeps the pool

Every method is safe from any thread: it runs as a command on the scheduler thread, the only one
that touches the engine. A restarted Host with the same `log_dir` and `pool_name` finds every
session where it was committed, and the KV it had parked still in the shared segment.
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import msgspec

from engines import models, registry
from engines.base import Descriptor, Engine, TokenVocabulary
from engines.errors import ModelLoadError
from kvpool import Budget, Pool, PoolError, PoolNotFound, host_memory_available, places, segment
from kvpool.disk import DiskTier
from kvpool.tier_folder import remove_tier
from superfluid.host import sampling as sampler
from superfluid.host.churn import Churn
from superfluid.host.commands import Commands
from superfluid.host.constraints import ConstraintError, Grammars
from superfluid.host.engine_thread import EngineThread
from superfluid.host.errors import HostClosed, TooManyMessages
from superfluid.host.interruption import Arrival
from superfluid.host.log import SessionLog
from superfluid.host.messages import as_dicts
from superfluid.host.chat import TemplateRewrites
from superfluid.host.prompts import PreparedPrompt, PromptBuilder, appended_pieces
from superfluid.host.request import Priority, Prompt
from superfluid.host.policy import Policy
from superfluid.host.scheduler import Scheduler
from superfluid.host.session import Session, SessionInfo
from superfluid.host.stats import Counters, HostStats
from superfluid.host.tenants import UNNAMED, check_tenant, namespace, salt_digest
from superfluid.host.tools import Tools, ToolUse, special_marks

DEFAULT_POOL_BYTES = 512 << 20
CONTEXT_POLICIES = ("error", "stop")
# Renders of appended messages against a session that changed before they were committed; then
# the scheduler thread renders them (a session appended to from several threads at once).
OPTIMISTIC_TRIES = 3
T = TypeVar("T")


def default_log_dir(pool_name: str) -> Path:
    """Where a host keeps its session log unless told: sessions/<pool name> under superfluid's
    cache ($SUPERFLUID_CACHE, else $XDG_CACHE_HOME/superfluid, else ~/.cache/superfluid)."""
    return models.cache_root() / "sessions" / pool_name


class Host:
    """A model hosted in this process, with sessions that share, park and survive in a KV pool."""

    def __init__(self, model: str | os.PathLike, *, runtime: str | None = None, pool_name: str = "superfluid",
                 pool_bytes: int = DEFAULT_POOL_BYTES, log_dir: str | os.PathLike | None = None,
                 log_sync: str = "tick", prefill_budget: int = 512, checkpoint_tokens: int = 256,
                 publish_tokens: int = 256, on_context_full: str = "error", high_watermark: float = 0.9,
                 low_watermark: float = 0.75, max_pinned_fraction: float = 0.5, export_budget: int | None = None,
                 decode_reserve: int = 64, idle_park_seconds: float | None = 5.0, max_waiting: int | None = None,
                 max_wait_seconds: float | None = None, first_token_target: float | None = 1.0,
                 decode_step_target: float | None = 0.5, arrival_wait: float | None = None,
                 stream_interval: float = 0.02,
                 max_sessions: int | None = 1_000_000,
                 max_messages: int | None = 100_000, session_expiry_seconds: float | None = None,
                 disk_tier: bool = True, disk_budget: int | None = None, disk_dir: str | os.PathLike | None = None,
                 engine_factory: Callable[[], Engine] | None = None, churn: Churn | None = None,
                 clock: Callable[[], float] = time.monotonic, **runtime_options: Any) -> None:
        """Load `model` with `runtime` (default: the one the file calls for), attach or create the
        pool `pool_name`, replay the session log in `log_dir`. Runtime options are passed as
        `<runtime>_<option>=value` (for example llamacpp_threads=2, mlx_prefill_chunk=256).

        Load: a generation is admitted when its uncached prompt plus `decode_reserve` cells fit
        in the engine's free cells, else it waits; idle lanes are parked into the pool after
        `idle_park_seconds` (None: only when room is needed); beyond `max_waiting` generations
        waiting, or after `max_wait_seconds` without starting, a generation is refused with
        Overloaded (None: no limit). Each step is planned as a token budget: a decode token for
        every decoding lane, then prompt chunks (at most `prefill_budget` tokens), as many as the
        measured step costs fit in `first_token_target` seconds (what a request arriving during
        a step waits before its prompt goes first), and in `decode_step_target` seconds while a
        lane decodes for a reader of its tokens as they come (what its next token waits; a
        generation read whole, as `Session.complete` reads it, does not bind it); None: no bound.
        While requests whose short prompts go before the prompts being fed keep arriving, steps
        run in pieces and such a request waits for the piece in flight; with `arrival_wait`
        seconds, where the engine can stop a forward part-way (llama.cpp on plain KV), a step or
        piece with more than that left is stopped for it, throwing away what it did (a sooner
        first token for such requests, bought with prefill; None: only a step or piece barely
        begun, in its first quarter, is stopped).
        A generation's first text reaches its reader as soon as it is sampled, its end as soon
        as it is written, and the pieces between together, at most every `stream_interval`
        seconds (each wake of a reader costs the step in flight; 0: every step's pieces at once).
        Limits, each far past what a real conversation meets: `max_sessions` sessions kept
        (TooManySessions beyond), `max_messages` messages in one prompt or one append
        (TooManyMessages); `session_expiry_seconds` deletes a session idle that long (nothing
        logged for it since, or since this host started), never a pinned one; None: no limit,
        and the default for expiry (sessions are promised to survive).
        Disk tier: with `disk_tier` (the default), parked KV is also written in the background to
        `disk_dir` (default: disk/<pool_name> under superfluid's cache), within `disk_budget`
        bytes (None: a tenth of that file system, at most half of its free space), so that it
        outlives the memory budget, a restart and a reboot; deleting or expiring a session erases
        its entries there. `engine_factory` opens
        an engine that is not in the registry (an adapter of your own); `model` and `runtime` then
        only name it. `churn` is a test mode that parks and preempts on purpose at every tick and
        checks the KV bookkeeping as it goes (see superfluid.host.churn.Churn); outputs do not change.
        `clock` gives the seconds that idle parking, generation timeouts and `max_wait_seconds`
        are measured in (monotonic; a test passes one it moves itself)."""
        if max_messages is not None and (not isinstance(max_messages, int) or max_messages < 1):
            raise ValueError(f"max_messages={max_messages!r}: must be a whole number >= 1, or None for no cap")
        self.max_messages = max_messages
        self.runtime = runtime or (registry.runtime_for(model) if engine_factory is None else "custom")
        options = _runtime_options(self.runtime, runtime_options) if engine_factory is None else {}
        policy = _policy(prefill_budget=prefill_budget, first_token_target=first_token_target,
                         decode_step_target=decode_step_target, arrival_wait=arrival_wait,
                         stream_interval=stream_interval,
                         checkpoint_tokens=checkpoint_tokens,
                         publish_tokens=publish_tokens, on_context_full=on_context_full,
                         decode_reserve=decode_reserve, idle_park_seconds=idle_park_seconds, max_waiting=max_waiting,
                         max_wait_seconds=max_wait_seconds, watermarks=(high_watermark, low_watermark),
                         max_pinned_fraction=max_pinned_fraction, max_sessions=max_sessions,
                         session_expiry_seconds=session_expiry_seconds, churn=churn)
        if engine_factory is None:
            adapter = registry.adapter(self.runtime)
            engine_factory = lambda: adapter(model, **options)  # noqa: E731
        self._log = SessionLog(log_dir or default_log_dir(pool_name), log_sync)
        self._counters = Counters()
        if disk_budget is not None and (not isinstance(disk_budget, int) or disk_budget < 0):
            raise ValueError(f"disk_budget={disk_budget!r}: must be bytes >= 0, or None for the default")
        disk = DiskSettings(Path(disk_dir) if disk_dir is not None else places.disk_folder(pool_name),
                            disk_budget) if disk_tier else None
        self._scheduler = Scheduler(engine_factory, lambda descriptor: _open_pool(pool_name, pool_bytes, descriptor,
                                                                                  export_budget, disk),
                                    self._log, self._counters, policy, clock=clock)
        self._thread = EngineThread(self._scheduler)
        try:
            self._thread.start()
        except BaseException:
            self._log.close()
            raise
        self.descriptor = self._scheduler.descriptor
        self.pool = self._scheduler.pool
        self.commands = Commands(self._thread)
        # Prompts are built on the caller's thread where the engine has a tokenizer for any
        # thread (both runtimes do); an adapter without one tokenizes on the scheduler thread.
        engine = self._scheduler.engine
        self._tokenizes_anywhere = callable(getattr(engine, "tokenizer", None))
        self.prompts = PromptBuilder(self.descriptor, engine.tokenizer() if self._tokenizes_anywhere else engine)
        self._marks: dict[str, int] | None = None  # the tool call formats' marks that are special tokens
        text = engine.tokenizer() if self._tokenizes_anywhere else engine
        # constraints are compiled on the callers' threads, against the tokenizer's vocabulary
        self.grammars = Grammars(lambda: _vocabulary_of(text), lambda s: text.tokenize(s, special=False),
                                 self.descriptor.eos_tokens, self.descriptor.vocab_size)
        try:
            self.call(self.commands.recover)
        except BaseException:
            self.close()
            raise

    # ----------------------------------------------------------------------------- public

    def call(self, command: Callable[..., T], *args: Any, arrival: Arrival | None = None, **keywords: Any) -> T:
        """Run one of `self.commands` (or any callable that must touch the engine) with `args` and
        `keywords` on the scheduler thread, and return its result or raise its error. Safe from
        any thread. `arrival`: the command starts a request of this class and prompt length,
        which may stop the step in flight if it would go first (superfluid/host/interruption.py)."""
        return self._thread.call(functools.partial(command, **keywords) if keywords else command, *args,
                                 arrival=arrival)

    def submit(self, command: Callable[..., T], *args: Any, arrival: Arrival | None = None,
               **keywords: Any) -> concurrent.futures.Future:
        """`call` without waiting: queue the command on the scheduler thread and return its
        future (`asyncio.wrap_future` awaits it in an event loop). HostClosed if the host is
        closed; a future the scheduler never answers (it failed as the command came in) is
        found by `alive()`."""
        return self._thread.submit(functools.partial(command, **keywords) if keywords else command, *args,
                                   arrival=arrival)

    def alive(self) -> bool:
        """True while the scheduler thread runs (False once closed or failed)."""
        return self._thread.alive()

    def prepare(self, prompt: Prompt, *, tenant: str = UNNAMED, cache_salt: str | None = None) -> PreparedPrompt:
        """`prompt` (chat messages or a text) rendered and tokenized for a one-shot request
        (`commands.start_request`) of `tenant` and `cache_salt`, on the calling thread: a long
        conversation costs its caller, never the scheduler thread everyone waits on; so does
        reading its cached KV back from the disk tier where memory no longer holds it (the
        scheduler then imports it from memory). ChatError for messages the template refuses;
        TooManyMessages past `max_messages`."""
        self._check_messages(len(prompt.messages))
        space = namespace(check_tenant(tenant), salt_digest(cache_salt))
        if self._tokenizes_anywhere:
            prepared = self.prompts.build(prompt, space)
        else:
            prepared = self.call(self.prompts.build, prompt, space)
        warmed = self._scheduler.kv.warming.warm([*prepared.tokens, *prepared.opening], space)
        return prepared if warmed is None else msgspec.structs.replace(prepared, warmed=warmed)

    def tool_use(self, tools: Any, choice: Any = None, parallel: bool | None = None) -> ToolUse:
        """How a generation may call `tools` (OpenAI's `tools`, `tool_choice` and
        `parallel_tool_calls`: ToolUse.of), in the model's own format; made on the calling thread.
        ToolError naming what is wrong."""
        if self._marks is None:  # (the vocabulary's: the same every time)
            self._marks = special_marks(self.prompts.tokenize)
        return self.prompts.template.tool_use(tools, choice, parallel, self._marks)

    def append_messages(self, session_id: str, messages: Sequence[Any], *, tenant: str | None = None) -> None:
        """Chat messages (messages.ChatMessage, (role, content) pairs, or dicts in OpenAI's shape,
        with tool calls and tool results) appended to an idle session in turn, rendered and
        tokenized on the calling thread, so a long conversation or a long message costs its
        caller, not the scheduler thread: the session's messages are read, the new ones rendered
        against them, and the tokens committed only if the session did not change meanwhile
        (else rendered again). A template that rewrites earlier turns, or an adapter without a
        tokenizer for any thread, renders them on the scheduler thread instead. `tenant`: the
        session must be that tenant's (see `session`)."""
        messages = as_dicts(messages)  # (ChatError for a malformed one, before anything is sent)
        self._check_messages(len(messages))
        if self._tokenizes_anywhere:
            for _ in range(OPTIMISTIC_TRIES):
                version, before, tools = self.call(self.commands.chat_view, session_id, tenant=tenant)
                try:
                    pieces = appended_pieces(self.prompts.template, self.prompts.tokenize, before, messages, tools)
                except TemplateRewrites:
                    break
                if self.call(self.commands.append_rendered, session_id, version, messages, pieces, tenant=tenant):
                    return
        self.call(self.commands.append_messages, session_id, messages, tenant=tenant)

    def _check_messages(self, count: int) -> None:
        if self.max_messages is not None and count > self.max_messages:
            raise TooManyMessages(f"{count} messages in one request; this host takes at most {self.max_messages} "
                                  "(max_messages, serve's --max-messages): send fewer, or raise the cap")

    def session(self, *, id: str | None = None, system: str | None = None, priority: str = "default",
                tenant: str | None = None, cache_salt: str | None = None, tools: Any = None,
                **sampling: Any) -> Session:
        """A new session (sampling defaults: temperature, top_k, top_p, min_p, repetition_penalty,
        seed), or with `id` alone the existing one of that id (also after a restart).

        `tenant` (an application serving several users or customers): the session is that
        tenant's, and the Session acts as it: to another tenant the session does not exist, and
        its prompts share cached KV only with its own tenant's sessions (with `cache_salt`, only
        with sessions made with the same salt; superfluid/host/tenants.py). None: a new session
        is the unnamed tenant's, and an existing one is found whoever owns it.

        `tools` (OpenAI's list of functions, or a tools.Tools): what its conversation offers the
        model, rendered by the chat template (described in a system message where the template
        takes none) and kept in the log; `Session.generate(tool_choice=...)` lets the model call
        them (superfluid/host/tools.py). ToolError naming what is wrong with them."""
        if id is not None and system is None and not sampling and cache_salt is None and tools is None:
            self.call(self.commands.info, id, tenant=tenant)  # SessionNotFound if there is none (of the tenant)
            return Session(self, id, tenant)
        priority = str(Priority.named(priority))  # ValueError naming the classes
        settings = sampler.Sampling(**sampling)
        created = self.call(self.commands.create, id, system, settings, priority,
                            tenant=UNNAMED if tenant is None else tenant, cache_salt=cache_salt,
                            tools=None if tools is None else Tools.of(tools))
        return Session(self, created, tenant)

    def sessions(self, *, tenant: str | None = None) -> list[SessionInfo]:
        """Every session the log holds, or `tenant`'s only."""
        return self.call(self.commands.list, tenant=tenant)

    def delete(self, session_id: str, *, tenant: str | None = None) -> None:
        """Remove a session (cancelling its generation) and erase its parked KV, from the pool
        (what nobody holds) and from the disk tier; KV a fork of it still starts from stays.
        `retire` keeps the KV cached instead. `tenant`: the session must be that tenant's."""
        self.call(self.commands.delete, session_id, tenant=tenant)

    def retire(self, session_id: str, *, tenant: str | None = None) -> None:
        """Park a session's KV in the pool (cached for any later request with the same prefix),
        then delete the session: what a server does with a request's session when it is done.
        `tenant`: the session must be that tenant's."""
        self.call(self.commands.retire, session_id, tenant=tenant)

    def stats(self) -> HostStats:
        """Counters for tests and benchmarks, as they are now (read on the scheduler thread, so
        it waits for the step in progress)."""
        return self.call(self.commands.stats)

    def published_stats(self) -> HostStats:
        """The statistics as the scheduler last published them, without waiting for it: at most
        about 0.1 s old while the engine is busy, and current after every command and every ended
        generation (published before the caller or the generation's reader hears of it). What a
        server's /health and /metrics read (HostClosed once the scheduler has stopped)."""
        published = self._scheduler.publisher.latest
        if published is None or not self.alive():
            raise HostClosed("the host is closed" + (f" (its scheduler failed: {self._thread.error})"
                                                     if self._thread.error else ""))
        return published

    def close(self, *, remove_pool: bool = False) -> None:
        """Park every live lane, sync and close the log, release the engine and the pool. Its
        segment and disk tier stay for the next Host unless `remove_pool` (then parked KV is gone,
        from memory and disk, and a restarted Host prefills its sessions from the log). Idempotent."""
        thread = self._thread
        closed = False
        if thread.error is None and thread.alive():
            try:
                self.call(self.commands.close)
                closed = True
            except HostClosed:
                pass  # it failed meanwhile: closed below as a failed one
            finally:
                thread.stop()
                thread.join()
        if not closed:  # the scheduler failed: what it could not close, once it has ended
            thread.join()
            self._log.close()
            try:
                self.pool.close()  # idempotent
            except PoolError:
                pass  # views left open by the failed scheduler: the segment stays for the next Host
        if remove_pool and self.pool.name in segment.list_pool_names():
            segment.unlink(self.pool.name)
        if remove_pool and self.pool.disk is not None:
            remove_tier(self.pool.disk.folder)

    def __enter__(self) -> Host:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _vocabulary_of(tokenizer: Any) -> TokenVocabulary:
    """The tokenizer's vocabulary for a grammar engine; ConstraintError for an adapter without one."""
    vocabulary = getattr(tokenizer, "vocabulary", None)
    if vocabulary is None:
        raise ConstraintError("this engine's tokenizer does not give its vocabulary (Tokenizer.vocabulary): "
                              "it cannot constrain a generation")
    return vocabulary()


def _policy(**settings: Any) -> Policy:
    """The scheduler's policy from the Host's arguments; ValueError naming a bad one."""
    if settings["on_context_full"] not in CONTEXT_POLICIES:
        raise ValueError(f"on_context_full={settings['on_context_full']!r}: use one of {', '.join(CONTEXT_POLICIES)}")
    for name in ("prefill_budget", "checkpoint_tokens", "publish_tokens", "decode_reserve"):
        value = settings[name]
        if not isinstance(value, int) or value < (0 if name == "decode_reserve" else 1):
            raise ValueError(f"{name}={value!r}: must be a whole number >= {0 if name == 'decode_reserve' else 1}")
    if settings["max_waiting"] is not None and (not isinstance(settings["max_waiting"], int) or settings["max_waiting"] < 1):
        raise ValueError(f"max_waiting={settings['max_waiting']!r}: must be a whole number >= 1, or None for no limit")
    if settings["max_sessions"] is not None and (not isinstance(settings["max_sessions"], int)
                                                 or settings["max_sessions"] < 1):
        raise ValueError(f"max_sessions={settings['max_sessions']!r}: must be a whole number >= 1, or None for no cap")
    for name in ("idle_park_seconds", "max_wait_seconds", "first_token_target", "decode_step_target",
                 "arrival_wait", "session_expiry_seconds"):
        if settings[name] is not None and not settings[name] >= 0:
            raise ValueError(f"{name}={settings[name]!r}: must be seconds >= 0, or None")
    interval = settings["stream_interval"]
    if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not 0 <= interval < math.inf:
        raise ValueError(f"stream_interval={interval!r}: must be seconds >= 0 (0: every step's pieces at once)")
    if settings["churn"] is not None and not isinstance(settings["churn"], Churn):
        raise TypeError(f"churn={settings['churn']!r}: give a superfluid.host.churn.Churn, or None")
    low, high = settings["watermarks"][1], settings["watermarks"][0]
    if not 0 < low <= high <= 1 or not 0 <= settings["max_pinned_fraction"] <= 1:
        raise ValueError(f"watermarks must satisfy 0 < low ({low}) <= high ({high}) <= 1, and "
                         f"max_pinned_fraction ({settings['max_pinned_fraction']}) lie in [0, 1]")
    return Policy(**settings)


class DiskSettings(NamedTuple):
    """Where a host's disk tier lives, and its budget (None: the default for that disk)."""

    folder: Path
    budget: int | None


def _open_pool(name: str, size: int, descriptor: Descriptor, export_budget: int | None,
               disk: DiskSettings | None) -> Pool:
    """The pool `name` (attached, or created), with its disk tier behind it when `disk` is given."""
    pool = _attach_or_create(name, size, descriptor, export_budget)
    if disk is not None:
        try:
            pool.attach_disk(DiskTier(disk.folder, disk.budget))
        except BaseException:
            pool.close()
            raise
    return pool


def _attach_or_create(name: str, size: int, descriptor: Descriptor, export_budget: int | None) -> Pool:
    """Attach pool `name`, or create it once the model and its KV cache are loaded (so the memory
    check sees what they took)."""
    try:
        return Pool.attach(name)
    except PoolNotFound:
        left = host_memory_available()
        if size > left:
            raise ModelLoadError(f"the KV pool ({size / 2**30:.2f} GiB) does not fit in the {left / 2**30:.2f} GiB "
                                 "of memory left once the model and its KV cache are loaded; give a smaller "
                                 "pool_bytes (--pool-bytes) or a smaller context") from None
        budget = None if export_budget is None else Budget(int(export_budget), None, "set by export_budget")
        return Pool.create(name, size, device=descriptor.device, budget=budget)


def _runtime_options(runtime: str, given: dict[str, Any]) -> dict[str, Any]:
    """`<runtime>_<name>` keyword arguments as the runtime's options; others refused by name."""
    options = {}
    for key, value in given.items():
        owner = next((r for r in registry.RUNTIMES if key.startswith(f"{r}_")), None)
        if owner is None:
            raise TypeError(f"Host() got an unexpected keyword argument {key!r} (runtime options are written "
                            f"<runtime>_<option>, for example {runtime}_...)")
        if owner != runtime:
            raise ValueError(f"option {key} is for the {owner} runtime; this host runs {runtime}")
        options[key[len(owner) + 1:]] = value
    return options

