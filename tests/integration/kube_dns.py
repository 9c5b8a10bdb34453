"""A cluster DNS for tests: the A records a headless Service gives its pods
(`<pod>.<service>.<namespace>.svc.cluster.local`), served over UDP on loopback,
with a TTL of 0 so that a pod recreated at a new IP is found there at once.

Callers reach it by naming it as the DNS authority of their gRPC targets
(`dns://127.0.0.1:PORT/name:port`), which gRPC's c-ares resolver honours; the
machine's resolver is never touched. Only what gRPC asks is answered: A queries
for the names held, an empty answer for their other types, NXDOMAIN otherwise.
"""

from __future__ import annotations

import socket
import struct
import threading

_A, _IN = 1, 1


class ClusterDns:
    def __init__(self) -> None:
        self.records: dict[str, str] = {}
        self.queries = 0
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, name="cluster-dns", daemon=True)
        self._thread.start()

    def set(self, name: str, ip: str) -> None:
        self.records[name.lower().rstrip(".")] = ip

    def target(self, name: str, port: int) -> str:
        """The gRPC target that resolves `name` here."""
        return f"dns://127.0.0.1:{self.port}/{name}:{port}"

    def close(self) -> None:
        self._sock.close()

    def _serve(self) -> None:
        while True:
            try:
                query, peer = self._sock.recvfrom(512)
            except OSError:
                return  # closed
            try:
                self._sock.sendto(self._answer(query), peer)
            except (OSError, ValueError, IndexError, struct.error):
                continue  # a malformed query: no answer, as a real server may do

    def _answer(self, query: bytes) -> bytes:
        self.queries += 1
        qid, _flags, qdcount = struct.unpack(">HHH", query[:6])
        labels, pos = [], 12
        while query[pos]:
            length = query[pos]
            labels.append(query[pos + 1:pos + 1 + length].decode("ascii"))
            pos += 1 + length
        qtype, _qclass = struct.unpack(">HH", query[pos + 1:pos + 5])
        question = query[12:pos + 5]
        name = ".".join(labels).lower()
        ip = self.records.get(name)
        if ip is None:
            return struct.pack(">HHHHHH", qid, 0x8183, 1, 0, 0, 0) + question  # NXDOMAIN
        answers = b""
        count = 0
        if qtype == _A:
            # A pointer to the question's name, type A, class IN, TTL 0, 4 bytes.
            answers = struct.pack(">HHHIH", 0xC00C, _A, _IN, 0, 4) + socket.inet_aton(ip)
            count = 1
        return struct.pack(">HHHHHH", qid, 0x8180, 1, count, 0, 0) + question + answers
