"""A small RESP2 client for bulk values: SET from, and GET straight into, the caller's buffers.

A value made of many buffers is sent with `socket.sendmsg` (one iovec per buffer) and received
with `socket.recvmsg_into` into the buffers it belongs in, so each byte is copied once by the
kernel and never by Python. Only SET and GET (plus AUTH/SELECT on connect) are spoken here;
everything else goes through redis-py.

The server is treated as an untrusted peer: reply lines are at most 64 KiB, bulk lengths at most
512 MiB (Redis' own limit), a value of an unexpected size is read and dropped 1 MiB at a time,
nothing is evaluated. Each command (a whole pipelined batch) must finish within `timeout_s`:
every socket call gets what is left of that deadline, so a server dripping bytes cannot hold a
call longer. After any error the connection is closed, never reused (the stream may be out of
sync).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from kvx.plugins.storage.backends.vectored import advance, byte_views, iov_max

LINE_MAX = 64 << 10  # longest reply line accepted (without its CRLF)
BULK_MAX = 512 << 20  # Redis' limit on a string value
DISCARD_CHUNK = 1 << 20  # an unwanted value is read and dropped this much at a time
ERROR_TEXT_MAX = 200  # a server error message is quoted up to this many characters


class RespReplyError(RuntimeError):
    """The server answered a command with an error reply (`-ERR ...`). For a pipelined
    batch, raised once every reply was read: `failed` maps the index of each key answered
    with an error to its message, and `sizes` holds GET's results for the other keys."""

    def __init__(
        self,
        command: str,
        message: str,
        failed: dict[int, str] | None = None,
        sizes: list[int | None] | None = None,
    ) -> None:
        super().__init__(f"{command} failed: {message}")
        self.command = command
        self.message = message
        self.failed = failed or {}
        self.sizes = sizes or []


class RespProtocolError(ConnectionError):
    """The server's bytes are not the RESP reply expected (the connection is closed)."""


def _quote(text: bytes) -> str:
    return text[:ERROR_TEXT_MAX].decode("utf-8", errors="replace")


class RespConnection:
    """One TCP connection to a Redis server, for pipelined batches of SET or GET."""

    def __init__(
        self,
        host: str,
        port: int,
        db: int = 0,
        username: str | None = None,
        password: str | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        self.address = f"{host}:{port}"
        self.timeout_s = timeout_s
        self._iov_max = iov_max()
        self._buf = bytearray(LINE_MAX + 2)  # read-ahead: a reply line and what follows it
        self._view = memoryview(self._buf)
        self._start = self._end = 0  # unread bytes are _buf[_start:_end]
        self._scratch: memoryview | None = None  # where unwanted values are dropped
        self._deadline = 0.0  # time.monotonic() by which the current command must finish
        try:
            sock = socket.create_connection((host, port), timeout=timeout_s)
        except TimeoutError:
            raise TimeoutError(
                f"connecting to Redis at {self.address} timed out after {timeout_s}s"
            ) from None
        except OSError as exc:
            raise ConnectionError(f"cannot connect to Redis at {self.address}: {exc}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock: socket.socket | None = sock
        try:
            if password:
                self._simple_command("AUTH", *([username] if username else []), password)
            if db:
                self._simple_command("SELECT", str(db))
        except RespReplyError as exc:
            raise ConnectionError(
                f"Redis at {self.address} refused {exc.command}: {exc.message}"
            ) from None

    @property
    def closed(self) -> bool:
        return self._sock is None

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def set_vectored(
        self, items: Sequence[tuple[str, Sequence[memoryview]]], ttl_s: int | None
    ) -> None:
        """`SET key <concatenated buffers> [EX ttl_s]` for every item, in one pipelined batch;
        raise (naming the key and the server's message) unless every reply is +OK."""
        if ttl_s is not None and (not isinstance(ttl_s, int) or ttl_s <= 0):
            raise ValueError(f"ttl_s must be a positive number of seconds or None, not {ttl_s!r}")
        if not items:
            return
        with self._io("SET") as sock:
            self._send(sock, self._set_parts(items, ttl_s))
            failed: dict[int, str] = {}
            for i, (key, _) in enumerate(items):
                line = self._read_line(sock)
                if line == b"+OK":
                    continue
                if line[:1] != b"-":
                    raise RespProtocolError(
                        f"Redis at {self.address} answered SET {key!r} with {_quote(line)!r}, "
                        "not +OK"
                    )
                failed[i] = _quote(line[1:])
            if failed:
                first = min(failed)
                raise RespReplyError(f"SET {items[first][0]!r}", failed[first], failed)

    def get_vectored(
        self, keys: Sequence[str], buffers: Sequence[Sequence[memoryview]]
    ) -> list[int | None]:
        """`GET` every key in one pipelined batch: per key its stored size (None if absent).
        A value exactly as long as the key's buffers is received straight into them, in
        order; any other value leaves them untouched."""
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffer lists; one per key")
        if not keys:
            return []
        targets = [byte_views(parts) for parts in buffers]
        if any(v.readonly for views in targets for v in views):
            raise ValueError("get_vectored needs writable buffers; a read-only one was given")
        request = b"".join(
            b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(k), k)
            for k in (key.encode() for key in keys)
        )
        sizes: list[int | None] = []
        failed: dict[int, str] = {}
        with self._io("GET") as sock:
            self._budget(sock)
            sock.sendall(request)
            for i, (key, views) in enumerate(zip(keys, targets, strict=True)):
                line = self._read_line(sock)
                if line[:1] == b"-":
                    failed[i] = _quote(line[1:])
                    sizes.append(None)
                    continue
                size = self._bulk_length(key, line)
                sizes.append(size)
                if size is None:
                    continue
                if size == sum(v.nbytes for v in views):
                    self._recv_into(sock, views)
                else:
                    self._discard(sock, size)
                self._expect_crlf(sock)
            if failed:
                first = min(failed)
                raise RespReplyError(f"GET {keys[first]!r}", failed[first], failed, sizes)
        return sizes

    # -- requests ------------------------------------------------------------------------------

    def _simple_command(self, *args: str) -> None:
        """Send one command and expect +OK (an error reply raises RespReplyError)."""
        encoded = [a.encode() for a in args]
        request = b"*%d\r\n" % len(encoded) + b"".join(
            b"$%d\r\n%s\r\n" % (len(a), a) for a in encoded
        )
        with self._io(args[0]) as sock:
            self._budget(sock)
            sock.sendall(request)
            line = self._read_line(sock)
            if line[:1] == b"-":
                raise RespReplyError(args[0], _quote(line[1:]))
            if line != b"+OK":
                raise RespProtocolError(
                    f"Redis at {self.address} answered {args[0]} with {_quote(line)!r}, not +OK"
                )

    @staticmethod
    def _set_parts(
        items: Sequence[tuple[str, Sequence[memoryview]]], ttl_s: int | None
    ) -> list[memoryview]:
        """The SET commands as a list of views: the caller's buffers between small encoded
        pieces (the framing after one value and before the next is one piece)."""
        argc = 3 if ttl_s is None else 5
        ttl = b"" if ttl_s is None else str(ttl_s).encode()
        suffix = b"\r\n" + (b"$2\r\nEX\r\n$%d\r\n%s\r\n" % (len(ttl), ttl) if ttl else b"")
        parts: list[memoryview] = []
        framing = bytearray()
        for key, buffers in items:
            views = byte_views(buffers)
            k = key.encode()
            total = sum(v.nbytes for v in views)
            framing += b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (argc, len(k), k, total)
            if views:
                parts.append(memoryview(framing))
                parts.extend(views)
                framing = bytearray()
            framing += suffix
        parts.append(memoryview(framing))
        return parts

    def _send(self, sock: socket.socket, parts: list[memoryview]) -> None:
        """Send every part in order, at most IOV_MAX per sendmsg, resuming after partial
        sends (`parts` is consumed)."""
        i = 0
        while i < len(parts):
            self._budget(sock)
            sent = sock.sendmsg(parts[i : i + self._iov_max])
            i = advance(parts, i, sent)

    # -- replies -------------------------------------------------------------------------------

    def _fill(self, sock: socket.socket) -> None:
        """Receive more bytes into the read-ahead buffer (moving unread ones to its start)."""
        if self._start:
            unread = self._end - self._start
            self._buf[:unread] = self._buf[self._start : self._end]
            self._start, self._end = 0, unread
        self._budget(sock)
        n = sock.recv_into(self._view[self._end :])
        if not n:
            raise ConnectionError("the server closed the connection")
        self._end += n

    def _read_line(self, sock: socket.socket) -> bytes:
        """The next reply line, without its CRLF (at most LINE_MAX bytes)."""
        scanned = 0  # bytes after _start already searched for CRLF
        while True:
            at = self._buf.find(b"\r\n", self._start + max(0, scanned - 1), self._end)
            if at >= 0:
                line = bytes(self._view[self._start : at])
                self._start = at + 2
                return line
            scanned = self._end - self._start
            if scanned >= len(self._buf):
                raise RespProtocolError(
                    f"Redis at {self.address} sent a reply line longer than {LINE_MAX} bytes"
                )
            self._fill(sock)

    def _bulk_length(self, key: str, line: bytes) -> int | None:
        """The length a bulk reply line announces (None for `$-1`, a missing key)."""
        digits = line[1:]
        if line[:1] != b"$" or not (digits == b"-1" or digits.isdigit()):
            raise RespProtocolError(
                f"Redis at {self.address} answered GET {key!r} with {_quote(line)!r}, "
                "not a bulk string"
            )
        if digits == b"-1":
            return None
        if len(digits) > 10 or int(digits) > BULK_MAX:
            raise RespProtocolError(
                f"Redis at {self.address} announced a {_quote(digits[:20])}-byte value for "
                f"{key!r}; at most {BULK_MAX} bytes (512 MiB) are allowed"
            )
        return int(digits)

    def _take_buffered(self, views: list[memoryview]) -> int:
        """Copy read-ahead bytes into `views` in order; the index of the first view left
        unfilled (parts of a view are trimmed off in place)."""
        i = 0
        while i < len(views) and self._start < self._end:
            n = min(views[i].nbytes, self._end - self._start)
            views[i][:n] = self._view[self._start : self._start + n]
            self._start += n
            i = advance(views, i, n)
        return i

    def _recv_into(self, sock: socket.socket, views: list[memoryview]) -> None:
        """Receive a value straight into `views` (consumed), after whatever the read-ahead
        holds; bytes arriving after the value land in the read-ahead."""
        i = self._take_buffered(views)
        if i == len(views):
            return
        self._start = self._end = 0  # the read-ahead is empty: all of it can take the spill
        while i < len(views):
            batch = views[i : i + self._iov_max - 1]
            last = i + len(batch) == len(views)
            if last:
                batch.append(self._view)
            self._budget(sock)
            n = sock.recvmsg_into(batch)[0]
            if not n:
                raise ConnectionError("the server closed the connection")
            wanted = sum(v.nbytes for v in batch[:-1]) if last else n
            i = advance(views, i, min(n, wanted))
            self._end = max(0, n - wanted)

    def _discard(self, sock: socket.socket, size: int) -> None:
        """Read and drop a `size`-byte value, at most DISCARD_CHUNK bytes at a time."""
        n = min(size, self._end - self._start)
        self._start += n
        size -= n
        if size and self._scratch is None:
            self._scratch = memoryview(bytearray(DISCARD_CHUNK))
        while size:
            assert self._scratch is not None
            self._budget(sock)
            got = sock.recv_into(self._scratch, min(size, DISCARD_CHUNK))
            if not got:
                raise ConnectionError("the server closed the connection")
            size -= got

    def _expect_crlf(self, sock: socket.socket) -> None:
        while self._end - self._start < 2:
            self._fill(sock)
        if self._view[self._start : self._start + 2] != b"\r\n":
            raise RespProtocolError(f"Redis at {self.address} sent a value without its CRLF")
        self._start += 2

    def _budget(self, sock: socket.socket) -> None:
        """Give the next socket call what is left of the command's deadline."""
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        sock.settimeout(left)

    @contextmanager
    def _io(self, command: str) -> Iterator[socket.socket]:
        """The socket for one exchange, which must end within `timeout_s`; on any error the
        connection is closed, a timeout is a TimeoutError and other socket errors a
        ConnectionError, both naming the server."""
        if self._sock is None:
            raise ConnectionError(f"the connection to Redis at {self.address} is closed")
        self._deadline = time.monotonic() + self.timeout_s
        try:
            yield self._sock
        except TimeoutError:
            self.close()
            raise TimeoutError(
                f"Redis at {self.address} did not answer {command} within {self.timeout_s}s"
            ) from None
        except (RespProtocolError, RespReplyError):
            self.close()
            raise
        except OSError as exc:
            self.close()
            raise ConnectionError(f"{command} on Redis at {self.address} failed: {exc}") from None
        except BaseException:
            self.close()
            raise
