"""A user-space TCP relay on 127.0.0.1 that delays every chunk by a fixed one-way latency in each direction: a
wide-area link's round trip without netem (this kernel has none). Used by benchmarks/speculative.py: each peer is
announced at its relay's address, so the client's streams and the peers' server-to-server pushes all cross one.

Run (by hand): `python -m benchmarks.delay_relay --target 127.0.0.1:PORT --rtt-ms 100` prints `relaying ADDRESS`.
Ordering is kept per direction; bandwidth is not limited. The relay's own cost is ~0.1 ms per chunk on loopback.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time


class DelayRelay:
    """Listens on 127.0.0.1:<free port>, forwards to `target` (host:port) holding each chunk `one_way_s`."""

    def __init__(self, target: str, one_way_s: float) -> None:
        self.target_host, port = target.rsplit(":", 1)
        self.target_port, self.one_way_s = int(port), one_way_s
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"relay-{target}", daemon=True)
        self.address = ""

    def start(self) -> DelayRelay:
        self._thread.start()
        self._ready.wait(10)
        return self

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._accept, "127.0.0.1", 0))
        self.address = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        self._ready.set()
        self._loop.run_forever()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Read chunks as they come; a second task writes each one `one_way_s` after it arrived, in order."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        sender = asyncio.ensure_future(self._send(queue, writer))
        try:
            while chunk := await reader.read(1 << 16):
                queue.put_nowait((time.monotonic() + self.one_way_s, chunk))
        except (ConnectionError, OSError):
            pass
        queue.put_nowait((time.monotonic() + self.one_way_s, b""))
        await sender

    @staticmethod
    async def _send(queue: asyncio.Queue[tuple[float, bytes]], writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                due, chunk = await queue.get()
                await asyncio.sleep(max(due - time.monotonic(), 0.0))
                if not chunk:
                    break
                writer.write(chunk)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True, help="host:port to relay to")
    parser.add_argument("--rtt-ms", type=float, default=100.0)
    ns = parser.parse_args()
    relay = DelayRelay(ns.target, ns.rtt_ms / 2000).start()
    print(f"relaying {relay.address}", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
