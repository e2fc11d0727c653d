"""Optional API keys.

With no keys configured the gateway is open. Otherwise every HTTP route except
`/health` needs ``Authorization: Bearer <key>``; WebSockets accept the same header or,
because browsers cannot set headers on a WebSocket, a ``?token=<key>`` query parameter.
Keys are compared in constant time so response timing does not leak key prefixes.
"""

from __future__ import annotations

import hmac

from starlette.requests import HTTPConnection

OPEN_PATHS: frozenset[str] = frozenset({"/health"})


class Auth:
    def __init__(self, api_keys: tuple[str, ...] = ()) -> None:
        self._keys: tuple[bytes, ...] = tuple(k.encode() for k in api_keys if k)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def _valid(self, candidate: str | None) -> bool:
        if not candidate:
            return False
        given = candidate.encode()
        # Check every key (no early exit) so timing does not reveal which one matched.
        ok = False
        for key in self._keys:
            ok |= hmac.compare_digest(given, key)
        return ok

    @staticmethod
    def _bearer(conn: HTTPConnection) -> str | None:
        header = conn.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer":
            return None
        return token.strip() or None

    def check_request(self, request: HTTPConnection) -> bool:
        if not self._keys or request.url.path in OPEN_PATHS:
            return True
        return self._valid(self._bearer(request))

    def check_websocket(self, websocket: HTTPConnection) -> bool:
        if not self._keys:
            return True
        return self._valid(self._bearer(websocket)) or self._valid(websocket.query_params.get("token"))
