"""A host that generates until it is killed: run by test_crash.py as a child process.

    python -m tests.superfluid.crash_host MODEL RUNTIME POOL LOG_DIR [chat]

With `chat` the session is a conversation (a user message, then the assistant's turn), so the
kill leaves that turn open.

Prints the session id and its prompt's length, then each token as the generation reports it (so every token printed was
committed to the log first), flushing each line.
"""

import sys

from superfluid import Host

model, runtime, pool, log_dir = sys.argv[1:5]
options = {"llamacpp_threads": 2, "llamacpp_threads_batch": 2} if runtime == "llamacpp" else {}
host = Host(model, runtime=runtime, pool_name=pool, pool_bytes=64 << 20, log_dir=log_dir, checkpoint_tokens=16,
            **options)
session = host.session(temperature=0.8, seed=3)
if sys.argv[5:] == ["chat"]:
    session.append_message("user", "Tell me about Paris.")
else:
    session.append_text("The capital of France is Paris. The quick brown fox")
print(f"session {session.id} {len(session.tokens)}", flush=True)
for piece in session.generate(max_tokens=100_000, ignore_eos=True):  # runs until it is killed
    print(f"token {piece.token}", flush=True)
