"""Who is calling the router: API keys, tenants and roles, and the cache salt a tenant's requests get.

``up --api-keys FILE`` names every key, one per line, and optionally its
tenant's share and limits at admission (``router.tenant_limits``)::

    # key                              tenant   role   settings
    sk-4f0c9a...                       acme     user   weight=2 max_inflight=8 tokens_per_s=20000
    sk-77e1b2...                       ops      admin

Blank lines and ``#`` comments are skipped; a tenant's settings are given on
one of its keys (the others leave them out) or alike on each; a key is any run of non-space
characters (``secrets.token_urlsafe(32)`` makes a good one). Keys are compared
in constant time (``hmac.compare_digest``, against every key, so the time
says nothing about which one nearly matched).

Isolation comes from the cache salt, which the server derives: every request
of tenant ``t`` is salted ``tenant:t`` (``tenant:t/s`` when the client sent
``cache_salt`` ``s``), so no block of one tenant ever has the hash of another's,
in the ledgers, the index, probes and routing alike; a client cannot name
another tenant's salt. Without keys the router is open, as before, and a
client's salt is used as given.
"""
from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kvledger.router.tenant_limits import NO_LIMITS, TenantLimits, parse_limits

Role = Literal["user", "admin"]
ROLES: tuple[Role, ...] = ("user", "admin")


class AuthError(Exception):
    """No key, or a key that is not in the file (HTTP 401)."""


class ForbiddenError(Exception):
    """A key whose role may not do this (HTTP 403)."""


@dataclass(frozen=True, slots=True)
class Caller:
    tenant: str | None
    """``None``: the router has no keys, and everyone is one tenant."""
    role: Role
    limits: TenantLimits = NO_LIMITS
    """The tenant's share and limits at admission (``router.admission``)."""

    def salt(self, cache_salt: str | None) -> str | None:
        """The salt this caller's request is hashed with (see the module docstring)."""
        if self.tenant is None:
            return cache_salt
        return f"tenant:{self.tenant}" + ("" if cache_salt is None else f"/{cache_salt}")

    def require(self, role: Role) -> None:
        if role == "admin" and self.role != "admin":
            raise ForbiddenError(f"tenant {self.tenant!r} has the role {self.role!r}; this needs an admin key")


OPEN = Caller(None, "admin")
"""The caller of a router without keys."""


@dataclass(frozen=True, slots=True)
class _Key:
    secret: bytes
    caller: Caller


class ApiKeys:
    """The keys of ``up --api-keys`` (see the module docstring for the file's format)."""

    def __init__(self, keys: dict[str, Caller]) -> None:
        if not keys:
            raise ValueError("an API key file needs at least one key")
        self._keys = [_Key(k.encode(), c) for k, c in keys.items()]

    @classmethod
    def load(cls, path: str | Path) -> ApiKeys:
        """Read a key file; a ``ValueError`` names the line that is wrong."""
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as e:
            raise ValueError(f"api_keys: cannot read {p}: {e.strerror}") from None
        lines: dict[str, tuple[str, Role]] = {}
        limits: dict[str, tuple[int, TenantLimits]] = {}
        for n, line in enumerate(text.splitlines(), 1):
            fields = line.split("#", 1)[0].split()
            if not fields:
                continue
            if len(fields) < 3 or fields[2] not in ROLES:
                raise ValueError(f"api_keys: {p} line {n}: expected 'KEY TENANT ROLE [NAME=VALUE ...]' with ROLE "
                                 f"user or admin, got {len(fields)} field(s)")
            key, tenant, role = fields[:3]
            if key in lines:
                raise ValueError(f"api_keys: {p} line {n}: a key is listed twice")
            try:
                own = parse_limits(fields[3:]) if fields[3:] else None
            except ValueError as e:
                raise ValueError(f"api_keys: {p} line {n}: {e}") from None
            if own is not None:
                first, known = limits.setdefault(tenant, (n, own))
                if known != own:
                    name = next(f for f in TenantLimits.__dataclass_fields__ if getattr(known, f) != getattr(own, f))
                    raise ValueError(f"api_keys: {p} line {n}: {name}: tenant {tenant!r} has {name}="
                                     f"{getattr(known, name)} on line {first}; its keys must agree (or set it once)")
            lines[key] = tenant, role  # type: ignore[assignment]
        return cls({key: Caller(tenant, role, limits[tenant][1] if tenant in limits else NO_LIMITS)
                    for key, (tenant, role) in lines.items()})

    def caller(self, key: str | None) -> Caller:
        """The caller a key belongs to; ``AuthError`` for none or an unknown one."""
        if not key:
            raise AuthError("no API key: send 'Authorization: Bearer KEY'")
        given = key.encode()
        found = None
        for k in self._keys:   # every key, whatever matched: constant time in which one did
            if hmac.compare_digest(given, k.secret):
                found = k.caller
        if found is None:
            raise AuthError("the API key is not valid")
        return found

    def __len__(self) -> int:
        return len(self._keys)


def is_loopback(host: str) -> bool:
    """Whether an address to bind reaches this machine only (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:   # a host name: it may resolve anywhere
        return False
