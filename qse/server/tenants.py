"""Tenants: who a key belongs to, and the one rule that turns a client's session id into the conductor's.

    no key, or QSE_API_KEY         one tenant, the lone one: session ids are used as sent
    QSE_API_KEYS_FILE              one `TENANT KEY` pair a line; a tenant may hold several keys
      tenant t (not admin)         its id "x" is the conductor's "t/x"; it reaches only ids under "t/"
      tenant admin                 "x" is "admin/x"; an id with a "/" ("t/x") is taken as is: admin sees all

The namespace is applied once, at the server's boundary (`Tenant.key`), so the conductor, the reader and the
store only ever see distinct ids and need not know about tenants; the client is shown its own id back
(`Tenant.shown`). A tenant's name holds no "/", so "t/..." can never be reached from another tenant's
namespace.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from ..settings import EngineSettings, SettingError

ADMIN = "admin"
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


@dataclass(frozen=True)
class Tenant:
    """One caller's view of the sessions. `name` is empty for the lone tenant of a server without a keys file."""

    name: str

    @property
    def sees_all(self) -> bool:
        return not self.name or self.name == ADMIN

    @property
    def namespace(self) -> str:
        """The prefix of this tenant's own sessions in the conductor (prefix mapping stays inside it)."""
        return f"{self.name}/" if self.name else ""

    def key(self, session_id: str) -> str:
        """The conductor's id of the client's `session_id`."""
        if self.name == ADMIN and "/" in session_id:
            return session_id
        return self.namespace + session_id

    def owns(self, key: str) -> bool:
        """May this tenant see the conductor's session `key`?"""
        return self.sees_all or key.startswith(self.namespace)

    def shown(self, key: str) -> str:
        """The conductor's `key` as this tenant names it (the inverse of `key` on what it owns)."""
        ns = self.namespace
        return key[len(ns):] if ns and key.startswith(ns) else key


LONE = Tenant("")


class Keyring:
    """API keys -> tenants. Keys are kept as sha256 digests: a lookup compares digests, never the keys."""

    def __init__(self, keys: dict[str, Tenant]):
        self._by_digest = {_digest(k.encode()): t for k, t in keys.items()}

    @property
    def is_open(self) -> bool:
        """No key is configured: every caller is the lone tenant."""
        return not self._by_digest

    def tenant(self, token: bytes) -> Tenant | None:
        return self._by_digest.get(_digest(token))

    @classmethod
    def from_settings(cls, settings: EngineSettings) -> "Keyring":
        key = settings.get("QSE_API_KEY")
        path = settings.get("QSE_API_KEYS_FILE")
        if key and path is not None:
            raise SettingError("QSE_API_KEY and QSE_API_KEYS_FILE are both set: set one (the keys file holds "
                               "every tenant's key)")
        if path is not None:
            return cls(read_keys_file(path))
        return cls({key: LONE} if key else {})


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


def read_keys_file(path: Path) -> dict[str, Tenant]:
    """`TENANT KEY` a line (blank lines and # comments skipped). Errors name the line, never a key."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise SettingError(f"QSE_API_KEYS_FILE={str(path)!r} cannot be read: {exc.strerror}") from None
    keys: dict[str, Tenant] = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise SettingError(f"{path}:{lineno}: expected 'TENANT KEY' (two fields), got {len(parts)} fields")
        name, key = parts
        if not _NAME.match(name):
            raise SettingError(f"{path}:{lineno}: tenant {name!r} is not a valid name (1-64 of A-Z a-z 0-9 . _ -)")
        if key in keys:
            raise SettingError(f"{path}:{lineno}: this key is already given to tenant {keys[key].name!r}")
        keys[key] = Tenant(name)
    if not keys:
        raise SettingError(f"{path}: no 'TENANT KEY' line: the server would refuse every request")
    return keys
