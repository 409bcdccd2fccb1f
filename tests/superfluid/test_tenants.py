"""Tenants in the Host: sessions owned by the tenant that made them, KV shared within a tenant (and
a cache salt) only, and each active tenant's share of the wait queue and of the engine's sequences.
Over HTTP (keys naming tenants): tests/superfluid/test_tenant_keys.py."""

import struct

import msgspec
import pytest
import xxhash

from superfluid.host.errors import Overloaded, SessionNotFound
from superfluid.host.log_format import file_header
from superfluid.host.log_records import Tokens
from superfluid.host.request import GenerateRequest, Priority
from superfluid.host.sampling import Sampling
from superfluid.host.tenants import TenantLoad, check_tenant, namespace, salt_digest
from tests.gate import Gate, decode_steps_of, start_together

PROMPT = "The capital of France is Paris. The quick brown fox jumps over the lazy dog. " * 3
ONE_SEQUENCE = {"llamacpp": {"llamacpp_n_seq_max": 1}, "mlx": {"mlx_max_sequences": 1}}
TWO_SEQUENCES = {"llamacpp": {"llamacpp_n_seq_max": 2}, "mlx": {"mlx_max_sequences": 2}}


def cached_tokens(session, max_tokens=2):
    """The prompt tokens `session`'s next generation took from cache."""
    generation = session.generate(max_tokens=max_tokens)
    generation.collect()
    return generation.cached_tokens


@pytest.mark.parametrize("runtime", ["llamacpp"])  # ownership is the host's, not the engine's
def test_a_session_of_one_tenant_does_not_exist_for_another(open_host):
    host = open_host()
    alice = host.session(tenant="alice")
    alice.append_text("Hello")
    as_bob = type(alice)(host, alice.id, "bob")  # bob holding alice's id, as a guessing client would
    never_made = type(alice)(host, "no-such-session", "bob")
    for act in (lambda s: s.info(), lambda s: s.tokens, lambda s: s.append_text("x"), lambda s: s.fork(),
                lambda s: s.generate(max_tokens=1), lambda s: s.trim(0), lambda s: s.pin(), lambda s: s.messages,
                lambda s: s.unpin(), lambda s: s.append_tokens([1]), lambda s: s.append_user("x"),
                lambda s: s.complete(max_tokens=1), lambda s: host.retire(s.id, tenant=s.tenant)):
        with pytest.raises(SessionNotFound) as theirs:
            act(as_bob)
        with pytest.raises(SessionNotFound) as nobodys:
            act(never_made)
        assert str(theirs.value).replace(alice.id, "ID") == str(nobodys.value).replace("no-such-session", "ID")
    with pytest.raises(SessionNotFound):
        host.session(id=alice.id, tenant="bob")
    with pytest.raises(SessionNotFound):
        host.delete(alice.id, tenant="bob")
    assert host.sessions(tenant="bob") == [] and [i.id for i in host.sessions(tenant="alice")] == [alice.id]
    child = alice.fork()
    assert child.tenant == "alice" and host.session(id=child.id, tenant="alice").info().parent == alice.id
    assert alice.tokens == host.session(id=alice.id).tokens  # the embedding application sees every tenant's
    stats = host.stats().tenants
    assert stats["alice"].sessions == 2 and "bob" not in stats


@pytest.mark.parametrize("name", ["", "alice", "team-7.prod_2", "A" * 48])
def test_tenant_names_that_any_key_file_and_metrics_label_can_carry(name):
    assert check_tenant(name) == name


@pytest.mark.parametrize("name", ["-alice", "a b", "a/b", "A" * 49, "é", None, "default"])
def test_a_tenant_name_that_could_not_be_carried_everywhere_is_refused(name):
    with pytest.raises(ValueError, match="letters, digits|names the unnamed tenant"):
        check_tenant(name)


def test_a_salt_is_kept_as_a_digest_and_parts_namespaces():
    digest = salt_digest("my secret salt")
    assert "secret" not in digest and len(digest) == 32 and digest == salt_digest("my secret salt")
    assert namespace("alice", "") == "alice" and namespace("", "") == ""
    assert len({namespace("alice", digest), namespace("alice", ""), namespace("bob", digest)}) == 3
    with pytest.raises(ValueError, match="cache_salt"):
        salt_digest("")
    with pytest.raises(ValueError, match="cache_salt"):
        salt_digest("x" * 1025)


def test_kv_is_shared_within_a_tenant_and_a_salt_only_in_the_engine_and_in_the_pool(open_host, tmp_path):
    host = open_host()
    first = host.session(tenant="alice")
    first.append_text(PROMPT)
    assert cached_tokens(first) == 0
    # in the engine: alice's lane holds the prompt
    bob = host.session(tenant="bob")
    bob.append_text(PROMPT)
    assert cached_tokens(bob) == 0  # neither alice's lane nor anything of hers
    salted = host.session(tenant="alice", cache_salt="s1")
    salted.append_text(PROMPT)
    assert cached_tokens(salted) == 0
    again = host.session(tenant="alice")
    again.append_text(PROMPT)
    assert cached_tokens(again) > 0
    kept = first.tokens
    host.close()
    # in the pool, after a restart: the namespace is kept in each entry, the tenant in the log
    host = open_host()
    assert host.stats().lanes == 0
    late_bob = host.session(tenant="carol")
    late_bob.append_text(PROMPT)
    assert cached_tokens(late_bob) == 0
    salted_again = host.session(tenant="alice", cache_salt="s1")
    salted_again.append_text(PROMPT)
    assert cached_tokens(salted_again) > 0
    with pytest.raises(SessionNotFound):
        host.session(id=first.id, tenant="bob")
    assert host.session(id=first.id, tenant="alice").tokens == kept


@pytest.mark.parametrize("runtime", ["llamacpp"])
def test_sessions_logged_before_tenants_belong_to_the_unnamed_tenant(open_host, tmp_path):
    # the opening record as superfluid wrote it before tenants: no tenant, no salt
    older = msgspec.defstruct("Opened", [("session", str), ("created", float), ("sampling", Sampling),
                                         ("priority", str), ("parent", str | None, None)], tag="open")
    frames = [file_header(1)]
    for record in (older("old", 1.0, Sampling(), "default"), Tokens("old", 0, [5, 6, 7])):
        payload = msgspec.msgpack.encode(record)
        frames.append(struct.pack("<IQ", len(payload), xxhash.xxh3_64_intdigest(payload)) + payload)
    directory = tmp_path / "old-log"
    directory.mkdir(mode=0o700)
    (directory / "sessions.log").write_bytes(b"".join(frames))
    host = open_host(log_dir=directory)
    assert host.session(id="old", tenant="").tokens == [5, 6, 7]
    with pytest.raises(SessionNotFound):
        host.session(id="old", tenant="alice")
    assert [i.id for i in host.sessions(tenant="")] == ["old"]


def outcomes(futures, running):
    """What each queued generation came to ("ran" or "refused"), once `running` is cancelled."""
    generations = []
    for future in futures:
        try:
            generations.append(future.result())
        except Overloaded:
            generations.append(None)
    running.cancel()
    return ["refused" if g is None else g.collect() is not None and "ran" for g in generations]


def test_each_active_tenant_gets_its_share_of_a_full_wait_queue(open_host, runtime):
    gate = Gate(decode_steps_of(lanes=1, count=2))  # alice's first generation holds the one sequence
    host = open_host(gate=gate, max_waiting=2, **ONE_SEQUENCE[runtime])
    sessions = {}
    for name, count in (("alice", 4), ("bob", 2)):
        for i in range(count):
            sessions[name, i] = host.session(tenant=name, seed=i)
            sessions[name, i].append_text(f"{name} says {i}")
    running = sessions["alice", 0].generate(max_tokens=400, ignore_eos=True)
    gate.wait_reached()
    # queued while the step is held, run in this order: alice 1 and 2 wait (the queue is full),
    # alice 3 is refused, bob 0 still gets in (his share), bob 1 is refused (his share is taken)
    order = [("alice", 1), ("alice", 2), ("alice", 3), ("bob", 0), ("bob", 1)]
    futures = [host.submit(host.commands.generate, sessions[key].id, GenerateRequest.of(max_tokens=2))
               for key in order]
    gate.open()
    assert outcomes(futures, running) == ["ran", "ran", "refused", "ran", "refused"]
    tenants = host.stats().tenants
    assert tenants["bob"].rejected == 1 and tenants["alice"].rejected == 1


def test_one_tenant_alone_is_refused_at_the_limit_as_before(open_host, runtime):
    gate = Gate(decode_steps_of(lanes=1, count=2))
    host = open_host(gate=gate, max_waiting=2, **ONE_SEQUENCE[runtime])
    sessions = [host.session(seed=i) for i in range(4)]
    for i, session in enumerate(sessions):
        session.append_text(f"says {i}")
    running = sessions[0].generate(max_tokens=400, ignore_eos=True)
    gate.wait_reached()
    futures = [host.submit(host.commands.generate, s.id, GenerateRequest.of(max_tokens=2)) for s in sessions[1:]]
    gate.open()
    assert outcomes(futures, running) == ["ran", "ran", "refused"]
    assert host.stats().tenants[""].rejected == 1


def test_a_tenant_holding_every_sequence_gives_one_up_to_another_tenant(open_host, runtime, tmp_path):
    gate = Gate(decode_steps_of(lanes=2, count=3))  # both of alice's generations are mid-reply
    host = open_host(gate=gate, **TWO_SEQUENCES[runtime])
    bob = host.session(tenant="bob")  # (made first: once the gate holds the engine, a call would wait on it)
    bob.append_text("Hello")
    sessions = []
    for seed in (1, 2):
        sessions.append(host.session(tenant="alice", temperature=0.8, seed=seed))
        sessions[-1].append_text(PROMPT)
    alices = start_together(host, sessions, GenerateRequest.of(max_tokens=300, ignore_eos=True))
    gate.wait_reached()
    queued = host.submit(host.commands.generate, bob.id, GenerateRequest.of(max_tokens=3), tenant="bob")
    gate.open()
    quick = queued.result()
    quick.collect()
    assert quick.finish_reason == "length" and len(quick.tokens) == 3
    for generation in alices:
        generation.collect()
    assert host.stats().preemptions >= 1  # bob did not wait for a reply of 300 tokens to end
    assert all(len(g.tokens) == 300 for g in alices)
    # alice's replies are what they would have been without bob (a swap is exact)
    lone = open_host(pool_name=f"lone-{runtime}", log_dir=tmp_path / "lone-log")
    for seed, generation in zip((1, 2), alices):
        session = lone.session(temperature=0.8, seed=seed)
        session.append_text(PROMPT)
        alone = session.generate(max_tokens=300, ignore_eos=True)
        alone.collect()
        assert alone.tokens == generation.tokens


class _Lane:
    """What TenantLoad reads of a lane: its tenant, and its generation's class (None: idle)."""

    def __init__(self, tenant, priority=Priority.DEFAULT, generating=True):
        self.state = type("State", (), {"tenant": tenant})()
        self.job = type("Job", (), {"priority": priority})() if generating else None


def test_admission_puts_generations_within_each_tenants_share_of_the_sequences_first():
    load = TenantLoad()
    waiting = [_Lane("alice"), _Lane("alice"), _Lane("alice"), _Lane("bob"), _Lane("carol", Priority.BACKGROUND)]
    for lane in waiting:
        load.started(lane.state.tenant)
    running = [_Lane("alice"), _Lane("alice"), _Lane("bob", generating=False)]
    urgency = {lane: (lane.job.priority, i) for i, lane in enumerate(waiting)}.__getitem__
    order = load.fair_order(waiting, urgency, running, sequences=6)  # three tenants: a share of 2 each
    # alice holds her 2: her waiting ones go after bob's, within the default class; carol's
    # background one stays last (a class is never overtaken by a share)
    assert order == [waiting[3], waiting[0], waiting[1], waiting[2], waiting[4]]
    assert load.owes("bob", "alice", TenantLoad.lanes_held(running + [_Lane("alice")]), sequences=6)
    assert not load.owes("bob", "alice", TenantLoad.lanes_held(running), sequences=6)  # alice holds only her share


def test_a_tenant_at_its_share_is_never_swapped_out_by_a_tenant_at_or_above_its_own():
    # else a short arrival of the tenant above its share swaps out the other's long prompt, which
    # then swaps out one of the first's, and so on at every tick
    load = TenantLoad()
    for tenant in ("alice", "bob"):
        load.started(tenant)
    held = TenantLoad.lanes_held([_Lane("alice"), _Lane("alice"), _Lane("alice"), _Lane("bob")])
    assert load.shields("alice", "bob", held, sequences=4)  # alice holds 3 of 4: bob's one is safe
    assert not load.shields("bob", "alice", held, sequences=4)
    assert not load.shields("alice", "alice", held, sequences=4)


def test_with_one_tenant_active_admission_is_by_urgency_alone():
    load = TenantLoad()
    waiting = [_Lane("alice"), _Lane("alice")]
    for lane in waiting:
        load.started("alice")
    urgency = {waiting[0]: (1, 5), waiting[1]: (1, 2)}.__getitem__
    assert load.fair_order(waiting, urgency, [_Lane("alice")] * 8, sequences=2) == [waiting[1], waiting[0]]
    assert not load.owes("alice", "alice", TenantLoad.lanes_held([_Lane("alice")] * 8), sequences=2)
