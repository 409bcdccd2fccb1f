"""API keys and the tenants they name.

A server takes one key (`--api-key`, `SUPERFLUID_API_KEY`), or named tenants' keys from a file
(`--api-keys-file`) or the environment (`SUPERFLUID_API_KEYS`), or none. A request's key says its
tenant (superfluid/host/tenants.py): one key, or none, is the unnamed tenant, as is the tenant
named `default` in a file, which so keeps the sessions logged before tenants existed. A tenant may
have several keys: a key is rotated by adding the new one, moving the clients, then removing the
old one; the tenant, and so its sessions, stay.

The file is TOML, private to its owner (as ssh asks of a key file: one readable by others is
refused, since it holds every tenant's secret):

    [tenants.alice]
    keys = ["sk-alice-2026-12"]

    [tenants.default]            # the sessions from before tenants, and one-key clients
    keys = ["sk-old-single-key"]

The environment's form: `name=key` pairs separated by commas or spaces.

Keys are kept as SHA-256 digests and a request's key is looked up by its digest, so the time a
lookup takes does not depend on how much of a key a guess got right.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tomllib
from pathlib import Path

from superfluid.host.tenants import RESERVED, UNNAMED, check_tenant

DEFAULT_TENANT = RESERVED  # the unnamed tenant's name in a keys file and in /metrics


class KeysError(ValueError):
    """A keys file or variable that cannot be used (the message names the problem and the fix)."""


def label(tenant: str) -> str:
    """A tenant as a person reads it (/metrics, logs): the unnamed one as `default`."""
    return tenant or DEFAULT_TENANT


class ApiKeys:
    """Which tenant each key belongs to."""

    def __init__(self, tenants: dict[str, list[str]], source: str) -> None:
        """`tenants`: each tenant's keys, by name (`default`: the unnamed tenant); `source`: where
        they came from, for messages. KeysError for an empty key, a key given twice, a bad name."""
        self.source = source
        self._by_digest: dict[bytes, str] = {}
        self.tenants: list[str] = []  # every tenant, as the host names them ("" the unnamed)
        for name, keys in tenants.items():
            try:
                tenant = UNNAMED if name == DEFAULT_TENANT else check_tenant(name)
            except ValueError as exc:
                raise KeysError(f"{source}: {exc}") from None
            if tenant == UNNAMED and name != DEFAULT_TENANT:
                raise KeysError(f"{source}: a tenant needs a name (`{DEFAULT_TENANT}` for the unnamed one)")
            if not keys:
                raise KeysError(f"{source}: tenant {name!r} has no key; give it one or remove it")
            for key in keys:
                if not isinstance(key, str) or not key.strip() or key != key.strip():
                    raise KeysError(f"{source}: tenant {name!r} has an empty key, or one with spaces around it")
                digest = _digest(key)
                if digest in self._by_digest:
                    raise KeysError(f"{source}: a key of tenant {name!r} is given twice; each key names one tenant")
                self._by_digest[digest] = tenant
            self.tenants.append(tenant)
        if not self._by_digest:
            raise KeysError(f"{source}: no keys; give at least one, or serve without keys")

    @classmethod
    def single(cls, key: str) -> ApiKeys:
        """One key: the unnamed tenant's."""
        return cls({DEFAULT_TENANT: [key]}, "--api-key")

    @classmethod
    def from_file(cls, path: Path | str) -> ApiKeys:
        """Tenants and keys from a TOML file readable by its owner only."""
        path = Path(path)
        try:
            descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as exc:
            raise KeysError(f"--api-keys-file {path}: {exc.strerror} (it is not followed through a link)") from None
        with os.fdopen(descriptor, "rb") as handle:
            status = os.fstat(handle.fileno())
            if not stat.S_ISREG(status.st_mode):
                raise KeysError(f"--api-keys-file {path}: not a regular file")
            if status.st_mode & 0o077:
                raise KeysError(f"--api-keys-file {path}: readable by others (mode {stat.S_IMODE(status.st_mode):o}); "
                                f"it holds every tenant's key: chmod 600 {path}")
            if status.st_uid != os.getuid():
                raise KeysError(f"--api-keys-file {path}: owned by uid {status.st_uid}, not this user")
            try:
                document = tomllib.load(handle)
            except tomllib.TOMLDecodeError as exc:
                raise KeysError(f"--api-keys-file {path}: not valid TOML ({exc})") from None
        tenants = document.get("tenants")
        unknown = set(document) - {"tenants"}
        if unknown or not isinstance(tenants, dict):
            raise KeysError(f"--api-keys-file {path}: expected only [tenants.NAME] tables, each with keys = [...]")
        listed = {}
        for name, table in tenants.items():
            if not isinstance(table, dict) or set(table) != {"keys"} or not isinstance(table["keys"], list):
                raise KeysError(f"--api-keys-file {path}: [tenants.{name}] must hold exactly `keys = [\"...\"]`")
            listed[name] = table["keys"]
        return cls(listed, f"--api-keys-file {path}")

    @classmethod
    def from_environment(cls, text: str, variable: str) -> ApiKeys:
        """Tenants and keys from `name=key` pairs separated by commas or spaces (one `default=...`
        pair for the unnamed tenant)."""
        tenants: dict[str, list[str]] = {}
        for number, pair in enumerate(text.replace(",", " ").split(), 1):
            name, equals, key = pair.partition("=")
            # (an entry is never quoted in a message: a key given alone would be)
            if not equals or not key.strip("="):
                raise KeysError(f"${variable}: entry {number} is not a name=key pair")
            if name != DEFAULT_TENANT:
                try:
                    check_tenant(name)
                except ValueError:
                    raise KeysError(f"${variable}: entry {number} does not start with a tenant name (1-48 letters, "
                                    "digits, '_', '.' or '-') and '='") from None
            tenants.setdefault(name, []).append(key)
        return cls(tenants, f"${variable}")

    def tenant_of(self, key: str) -> str | None:
        """The tenant whose key `key` is, or None."""
        return self._by_digest.get(_digest(key))


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()
