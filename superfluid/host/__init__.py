"""The host: one model in this process and everything that runs it.

    host.py           Host, the application's handle: the scheduler thread, the pool, the log
    session.py        Session and Generation: what an application holds
    request.py        one generation's request, validated once where it enters
    prompts.py        a one-shot request's prompt, rendered and tokenized on the caller's thread
    sessions.py       the owner of sessions: their state and the records of the session log
    engine_thread.py  the one thread that touches the engine, and the commands that reach it
    scheduler.py      what that thread does with the engine: the queue, admission and the step
    planner.py        what each step carries: a token budget from measured step costs and two targets
    kv.py             the KV manager: where KV is, what moves it, and who gets room
    lane.py           a session's place in the engine (its sequence and cells) and its job
    log.py            the session log: a write-ahead log replayed into each session's state
    log_records.py    the log's records and how each changes a session's state
    log_format.py     how the log lies on disk: self-checking frames, numbered records, private files
    log_repair.py     checking a damaged log and keeping every intact record (superfluid log)
    transfer.py       moving one sequence's state between an engine and the pool
    tenants.py        who owns a session, whose cached KV it may share, each tenant's share under load

and what those use: sampling, stop strings (stream.py), chat templates (chat.py and
conversation_cache.py), counters and their publication (stats.py), errors, and the churn test
mode. Nothing here imports the HTTP face (superfluid.http) or the command line (superfluid.cli).
"""
