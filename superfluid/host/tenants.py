"""Tenants: who owns a session, whose prompts may share KV, and each tenant's share under load.

A tenant is a name. The unnamed tenant ("") is the only one of a host used by one application (a
server with one API key or none) and owns every session logged before tenants existed, so such a
host behaves as it did. With several tenants:

- **Sessions are owned.** A session belongs to the tenant that created it (a fork to its parent's);
  to any other tenant it does not exist (SessionNotFound, as for an id never made), so neither its
  existence nor its content can be probed.
- **KV is shared within a tenant only.** A session's *namespace* is its tenant, and a salt its
  creator may add (`cache_salt`, as vLLM takes it) to keep its prompts apart even from its own
  tenant's. A generation starts only from cached KV of its own namespace: a pool entry of the same
  namespace (the pool keeps the namespace in each entry) or a live lane of one. Otherwise the
  number of cached prompt tokens a reply reports would tell a client, token by token, whether its
  guess of another tenant's prompt is right. The salt is kept as a digest: the log and the pool
  never hold the client's secret.
- **Each active tenant gets at least an equal share** of the wait queue and of the engine's
  sequences (`TenantLoad`). A tenant is active while it has a generation waiting or running; with
  one active tenant nothing changes.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from superfluid.host.stats import TenantStats

if TYPE_CHECKING:
    from superfluid.host.lane import Live

UNNAMED = ""
# A name: what a keys file, a metrics label and a log line can all carry as it is. 48 characters
# and a salt's digest (33) fit the 96 bytes a pool entry keeps for its namespace.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,47}")
MAX_SALT = 1024  # characters of a cache_salt


RESERVED = "default"  # how keys files and /metrics name the unnamed tenant: no other tenant may take it


def check_tenant(name: str) -> str:
    """`name` if it can name a tenant (1-48 letters, digits, `_`, `.`, `-`, starting with a
    letter or digit, other than `default`; or "" for the unnamed tenant); ValueError saying what
    it may be otherwise."""
    if name == RESERVED:
        raise ValueError(f"tenant name {RESERVED!r} names the unnamed tenant; pass \"\" for it, or another name")
    if name == UNNAMED or (isinstance(name, str) and _NAME.fullmatch(name)):
        return name
    raise ValueError(f"tenant name {name!r}: use 1-48 letters, digits, '_', '.' or '-', starting with a letter or "
                     "digit")


def salt_digest(cache_salt: str | None) -> str:
    """What a session keeps of its creator's `cache_salt`: a digest (hex), or "" without one.
    ValueError for a salt that is not a non-empty string of at most MAX_SALT characters."""
    if cache_salt is None:
        return ""
    if not isinstance(cache_salt, str) or not 0 < len(cache_salt) <= MAX_SALT:
        raise ValueError(f"cache_salt must be a non-empty string of at most {MAX_SALT} characters")
    return hashlib.blake2b(cache_salt.encode(), digest_size=16).hexdigest()


def namespace(tenant: str, salt: str) -> str:
    """The namespace of a session of `tenant` whose creator's salt has digest `salt` ("" the
    unnamed tenant's without a salt, so sessions and entries from before tenants stay in it)."""
    return f"{tenant}#{salt}" if salt else tenant


class TenantLoad:
    """The tenants with a generation waiting or running, and the shares that follow from them.
    Kept by the scheduler (on its thread): `started` when a generation is queued, `ended` when it
    ends, so no tick walks every generation to count the tenants."""

    def __init__(self) -> None:
        self.generations: Counter[str] = Counter()  # active generations by tenant

    def started(self, tenant: str) -> None:
        """A generation of `tenant` was queued."""
        self.generations[tenant] += 1

    def ended(self, tenant: str) -> None:
        """A generation of `tenant` ended."""
        self.generations[tenant] -= 1
        if self.generations[tenant] <= 0:
            del self.generations[tenant]

    def clear(self) -> None:
        """Every generation ended."""
        self.generations.clear()

    @property
    def contended(self) -> bool:
        """True while more than one tenant is active (only then do shares order anything)."""
        return len(self.generations) > 1

    def share(self, total: int, joining: str | None = None) -> int:
        """An equal share of `total` among the active tenants (and `joining`, when it is not active
        yet): at least 1."""
        active = len(self.generations) + (joining is not None and joining not in self.generations)
        return max(1, total // max(active, 1))

    def may_wait(self, tenant: str, waiting_of_tenant: int, limit: int) -> bool:
        """Whether a generation of `tenant`, which has `waiting_of_tenant` waiting already, may join a
        wait queue that holds `limit` or more: yes while the tenant is below its equal share of it.
        (A queue below its limit takes anyone: the limit is what one tenant may fill alone. Past
        it, each tenant still gets its share, so the queue holds at most its limit and one share
        per active tenant: twice the limit, or the limit and one per tenant where tenants
        outnumber it.)"""
        return waiting_of_tenant < self.share(limit, joining=tenant)

    @staticmethod
    def lanes_held(lanes: Iterable[Live]) -> Counter[str]:
        """Engine sequences running a generation, by tenant."""
        return Counter(live.state.tenant for live in lanes if live.job is not None)

    def owes(self, arrival: str, holder: str, held: Counter[str], sequences: int) -> bool:
        """Whether a waiting generation of tenant `arrival` may take a sequence from one of tenant
        `holder`'s running generations: `arrival` holds less than its equal share of the engine's
        `sequences`, and `holder` more than its own."""
        if not self.contended or arrival == holder:
            return False
        share = self.share(sequences)
        return held[arrival] < share < held[holder]

    def shields(self, arrival: str, holder: str, held: Counter[str], sequences: int) -> bool:
        """Whether `holder`'s running generations are safe from a waiting generation of tenant
        `arrival` whatever their classes: `arrival` holds its equal share of the `sequences` or
        more, and `holder` its share or less."""
        if not self.contended or arrival == holder:
            return False
        share = self.share(sequences)
        return held[arrival] >= share >= held[holder]

    def fair_order(self, waiting: list[Live], urgency: Callable[[Live], tuple], lanes: Iterable[Live],
                   sequences: int) -> list[Live]:
        """`waiting` in admission order: by `urgency` (whose first element is the priority class),
        except that within a class, a tenant's generations beyond its equal share of the engine's
        `sequences` (counting those it runs already) go after every tenant's generations within
        theirs. With one tenant active: by urgency alone."""
        ordered = sorted(waiting, key=urgency)
        if not self.contended:
            return ordered
        share, taken = self.share(sequences), self.lanes_held(lanes)
        beyond: dict[Live, bool] = {}
        for live in ordered:
            tenant = live.state.tenant
            beyond[live] = taken[tenant] >= share
            taken[tenant] += 1
        return sorted(ordered, key=lambda live: (live.job.priority, beyond[live]))  # stable: urgency within


def tenant_stats(active: Iterable[Live], lanes: Iterable[Live], owned: Counter[str],
                 rejected: Counter[str]) -> dict[str, TenantStats]:
    """Each tenant's part of the host: its sessions (`owned`, counted as they change), its
    generations among `active` and its sequences among `lanes` (those only: never every
    session), the generations of it `rejected`."""
    generating, waiting = Counter(), Counter()
    for live in active:
        generating[live.state.tenant] += 1
        waiting[live.state.tenant] += not live.job.started
    held = TenantLoad.lanes_held(lanes)
    return {tenant: TenantStats(owned[tenant], generating[tenant], waiting[tenant], held[tenant], rejected[tenant])
            for tenant in sorted(set(owned) | set(generating) | set(rejected))}
