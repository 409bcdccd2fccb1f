"""Tenants over HTTP: keys from a file or the environment, each naming a tenant whose sessions and
cached prompts are its own, with per-tenant series in /metrics. One real `superfluid serve`
process per test, driven with the official `openai` client and raw requests."""

import json
import os
import signal
import time

import openai
import pytest

from superfluid.http.keys import ApiKeys, KeysError
from tests.superfluid.served import Served
from tests.superfluid.test_server import serve_exit

KEYS = {"alice": "sk-alice-0123456789", "bob": "sk-bob-0123456789", "bob2": "sk-bob-rotated-0123456789",
        "default": "sk-default-0123456789"}
PROMPT = "Write one line about the sea. " * 12


def keys_file(path, tenants, mode=0o600):
    lines = []
    for name, keys in tenants.items():
        lines += [f"[tenants.{json.dumps(name)}]", f"keys = {json.dumps(keys)}", ""]
    path.write_text("\n".join(lines))
    os.chmod(path, mode)
    return path


def call(server, key, method, path, body=None):
    status, data = server.raw(method, path, None if body is None else json.dumps(body).encode(),
                              {"Authorization": f"Bearer {key}"})
    return status, json.loads(data) if data else None


def cached(client, model, **extra):
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=2,
                                           extra_body=extra or None)
    return reply.usage.prompt_tokens_details.cached_tokens


@pytest.fixture
def two_tenants(tiny_models, tmp_path):
    path = keys_file(tmp_path / "keys.toml", {"alice": [KEYS["alice"]], "bob": [KEYS["bob"], KEYS["bob2"]],
                                              "default": [KEYS["default"]]})
    server = Served(tiny_models["f32"].gguf, tmp_path, "--api-keys-file", str(path))
    yield server
    assert server.stop() == 0


def test_a_tenants_sessions_do_not_exist_for_another_tenant(two_tenants):
    server = two_tenants
    hello = {"messages": [{"role": "user", "content": "hi"}]}
    status, made = call(server, KEYS["alice"], "POST", "/v1/sessions", hello)
    assert status == 201
    session = made["id"]
    status, nobodys = call(server, KEYS["bob"], "GET", "/v1/sessions/no-such-session")
    for method, path, body in (("GET", f"/v1/sessions/{session}", None),
                               ("POST", f"/v1/sessions/{session}/messages", hello),
                               ("POST", f"/v1/sessions/{session}/generate", {"max_tokens": 1}),
                               ("POST", f"/v1/sessions/{session}/fork", None),
                               ("DELETE", f"/v1/sessions/{session}", None)):
        status, theirs = call(server, KEYS["bob"], method, path, body)
        # exactly what an id never made gets: nothing tells bob the session exists
        assert status == 404, (method, path, theirs)
        assert theirs["error"]["message"].replace(session, "ID") == nobodys["error"]["message"].replace(
            "no-such-session", "ID")
    assert call(server, KEYS["bob"], "GET", "/v1/sessions")[1]["data"] == []
    operator = server.raw("GET", "/metrics", headers={"Authorization": f"Bearer {KEYS['default']}"})[1].decode()
    assert 'superfluid_tenant_sessions{tenant="alice"} 1.0' in operator
    assert [s["id"] for s in call(server, KEYS["alice"], "GET", "/v1/sessions")[1]["data"]] == [session]
    assert call(server, KEYS["alice"], "POST", f"/v1/sessions/{session}/generate", {"max_tokens": 1})[0] == 200
    # bob's second key is bob's: a key rotated keeps its tenant's sessions
    _, bobs = call(server, KEYS["bob"], "POST", "/v1/sessions", {})
    assert call(server, KEYS["bob2"], "GET", f"/v1/sessions/{bobs['id']}")[0] == 200
    assert call(server, "sk-nobody", "GET", "/v1/sessions")[0] == 401


def test_cached_prompts_are_shared_within_a_tenant_and_a_cache_salt_only(two_tenants):
    server = two_tenants
    alice, bob = server.client(KEYS["alice"]), server.client(KEYS["bob"])
    assert cached(alice, server.model) == 0
    assert cached(bob, server.model) == 0  # alice's prompt is in the cache, but not bob's to find
    assert cached(bob, server.model) > 0  # his own is
    assert cached(alice, server.model, cache_salt="private-salt") == 0
    assert cached(alice, server.model, cache_salt="private-salt") > 0
    assert cached(alice, server.model) > 0
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        cached(alice, server.model, cache_salt="")
    text = server.raw("GET", "/metrics", headers={"Authorization": f"Bearer {KEYS['alice']}"})[1].decode()
    assert 'superfluid_tenant_requests_total{status="200",tenant="alice"} 4.0' in text
    assert 'superfluid_tenant_requests_total{status="400",tenant="alice"} 1.0' in text
    assert 'tenant="bob"' not in text  # a tenant sees its own series only
    # the operator's key (the unnamed tenant's) sees every tenant's
    text = server.raw("GET", "/metrics", headers={"Authorization": f"Bearer {KEYS['default']}"})[1].decode()
    assert 'superfluid_tenant_requests_total{status="200",tenant="bob"} 2.0' in text
    assert 'superfluid_tenant_requests_total{status="200",tenant="alice"} 5.0' in text  # and her scrape
    completion = [line for line in text.splitlines()
                  if line.startswith('superfluid_tenant_tokens_total{kind="completion",tenant="bob"}')]
    assert completion and 0 < float(completion[0].split()[1]) <= 4


def test_a_rotated_key_keeps_the_tenants_sessions_across_a_restart_and_old_sessions_are_the_default_tenants(
        tiny_models, tmp_path):
    model = tiny_models["f32"].gguf
    single = Served(model, tmp_path, environment={"SUPERFLUID_API_KEY": KEYS["default"]})
    pool = single.pool
    try:
        _, old = call(single, KEYS["default"], "POST", "/v1/sessions", {"system": "from before tenants"})
    finally:
        assert single.stop() == 0
    path = keys_file(tmp_path / "keys.toml", {"alice": [KEYS["alice"]], "default": [KEYS["default"]]})
    first = Served(model, tmp_path, "--api-keys-file", str(path), pool=pool)
    try:
        assert call(first, KEYS["alice"], "GET", f"/v1/sessions/{old['id']}")[0] == 404
        assert call(first, KEYS["default"], "GET", f"/v1/sessions/{old['id']}")[0] == 200
        _, alices = call(first, KEYS["alice"], "POST", "/v1/sessions", {"system": "alice's"})
    finally:
        assert first.stop() == 0
    keys_file(path, {"alice": ["sk-alice-new-0123456789"], "default": [KEYS["default"]]})
    again = Served(model, tmp_path, "--api-keys-file", str(path), pool=pool)
    try:
        assert call(again, "sk-alice-new-0123456789", "GET", f"/v1/sessions/{alices['id']}")[0] == 200
        assert call(again, KEYS["alice"], "GET", f"/v1/sessions/{alices['id']}")[0] == 401
    finally:
        assert again.stop() == 0


def test_keys_from_the_environment(tiny_models, tmp_path):
    server = Served(tiny_models["f32"].gguf, tmp_path,
                    environment={"SUPERFLUID_API_KEYS": f"alice={KEYS['alice']}, bob={KEYS['bob']}"})
    try:
        _, made = call(server, KEYS["alice"], "POST", "/v1/sessions", {})
        assert call(server, KEYS["bob"], "GET", f"/v1/sessions/{made['id']}")[0] == 404
        assert call(server, KEYS["alice"], "GET", f"/v1/sessions/{made['id']}")[0] == 200
    finally:
        assert server.stop() == 0


def test_a_keys_file_that_cannot_be_trusted_or_read_is_a_usage_error(tiny_models, tmp_path):
    model = str(tiny_models["f32"].gguf)
    shared = keys_file(tmp_path / "shared.toml", {"alice": [KEYS["alice"]]}, mode=0o644)
    done = serve_exit(model, "--api-keys-file", str(shared))
    assert done.returncode == 2 and "readable by others" in done.stderr and "chmod 600" in done.stderr
    assert KEYS["alice"] not in done.stderr  # a key never goes to a log
    private = keys_file(tmp_path / "private.toml", {"alice": [KEYS["alice"]]})
    done = serve_exit(model, "--api-keys-file", str(private), "--api-key", "another")
    assert done.returncode == 2 and "use one" in done.stderr


@pytest.mark.parametrize("tenants, message", [
    ({"alice": []}, "has no key"),
    ({"alice": [""]}, "empty key"),
    ({"alice": ["k1"], "bob": ["k1"]}, "given twice"),
    ({"a b": ["k1"]}, "tenant name"),
])
def test_keys_that_cannot_name_tenants_are_refused_naming_the_problem(tmp_path, tenants, message):
    with pytest.raises(KeysError, match=message):
        ApiKeys.from_file(keys_file(tmp_path / "keys.toml", tenants))


def test_keys_files_of_other_shapes_and_environment_pairs_are_refused_without_echoing_a_key(tmp_path):
    path = tmp_path / "keys.toml"
    path.write_text('[tenants.alice]\nkey = "sk-1"\n')
    os.chmod(path, 0o600)
    with pytest.raises(KeysError, match="exactly `keys"):
        ApiKeys.from_file(path)
    link = tmp_path / "link.toml"
    link.symlink_to(keys_file(tmp_path / "real.toml", {"alice": ["sk-1"]}))
    with pytest.raises(KeysError, match="link"):
        ApiKeys.from_file(link)
    for text, number in (("alice=sk-1 sk-secret-without-a-name", 2), ("c2stc2VjcmV0==", 1), ("sk/secret+1==", 1)):
        # (a base64 key alone ends in '=': neither it nor a part of it may become a tenant or a message)
        with pytest.raises(KeysError, match=f"entry {number} ") as refused:
            ApiKeys.from_environment(text, "SUPERFLUID_API_KEYS")
        assert "secret" not in str(refused.value) and "c2st" not in str(refused.value)
    keys = ApiKeys.from_environment("alice=sk-1,default=sk-2", "SUPERFLUID_API_KEYS")
    assert (keys.tenant_of("sk-1"), keys.tenant_of("sk-2"), keys.tenant_of("sk-3")) == ("alice", "", None)


def test_sighup_reads_the_keys_file_again_and_a_file_that_cannot_be_used_keeps_the_keys_in_use(
        tiny_models, tmp_path):
    path = keys_file(tmp_path / "keys.toml", {"alice": [KEYS["alice"]]})
    server = Served(tiny_models["f32"].gguf, tmp_path, "--api-keys-file", str(path))
    try:
        _, made = call(server, KEYS["alice"], "POST", "/v1/sessions", {})
        keys_file(path, {"alice": ["sk-alice-new-0123456789"]})  # rotated without a restart
        server.process.send_signal(signal.SIGHUP)
        wait_for(lambda: "keys read again" in server.stderr())
        assert call(server, "sk-alice-new-0123456789", "GET", f"/v1/sessions/{made['id']}")[0] == 200
        assert call(server, KEYS["alice"], "GET", "/v1/sessions")[0] == 401
        os.chmod(path, 0o644)
        server.process.send_signal(signal.SIGHUP)
        wait_for(lambda: "the keys in use are kept" in server.stderr())
        assert "chmod 600" in server.stderr()
        assert call(server, "sk-alice-new-0123456789", "GET", f"/v1/sessions/{made['id']}")[0] == 200
    finally:
        assert server.stop() == 0


def wait_for(condition, seconds=60):
    """Until `condition()` holds (a signal is handled by the server's event loop, soon after)."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the server never did it"
        time.sleep(0.05)
