"""The `superfluid` command (main.py): `serve` (serve.py), the runtimes' commands (runtimes.py),
`log check | repair` (log.py), the pool's and the demo. It imports the host and the HTTP face; nothing imports it.
"""
