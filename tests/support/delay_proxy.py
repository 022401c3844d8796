"""A TCP proxy that holds every chunk it forwards for a fixed delay, each way, in order (toxiproxy's latency
toxic): the link delay this kernel cannot give (it has no netem). Used on the weight server's host by
tests/support/chaos_net.py, where nftables drops packets at random on the same link: the loss is real, on the
TCP connections between the clients and this proxy; the delay is per chunk, so TCP's window sees the link's
round trip without it (bulk transfers are slowed less than by a delay on every packet).

    python -m tests.support.delay_proxy --listen 0.0.0.0:8001 --to 127.0.0.1:9001 --delay-ms 200
"""

from __future__ import annotations

import argparse
import asyncio
import time


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    """Copy `reader` to `writer`, each chunk `delay_s` after it was read; bounded (a full queue stops reading,
    so the sender's TCP window fills as on a slow link)."""
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(maxsize=64)

    async def deliver() -> None:
        while (item := await queue.get())[1]:
            due, data = item
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            writer.write(data)
            await writer.drain()
        writer.close()

    sender = asyncio.create_task(deliver())
    try:
        while data := await reader.read(65536):
            await queue.put((time.monotonic() + delay_s, data))
    except ConnectionError:
        pass
    finally:
        await queue.put((time.monotonic() + delay_s, b""))
        await asyncio.gather(sender, return_exceptions=True)


async def serve(listen: tuple[str, int], to: tuple[str, int], delay_s: float) -> None:
    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(*to)
        except OSError:
            client_w.close()
            return
        await asyncio.gather(pipe(client_r, server_w, delay_s), pipe(server_r, client_w, delay_s),
                             return_exceptions=True)

    server = await asyncio.start_server(handle, *listen, reuse_address=True)
    async with server:
        await server.serve_forever()


def address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--listen", type=address, required=True, help="HOST:PORT")
    ap.add_argument("--to", type=address, required=True, help="HOST:PORT")
    ap.add_argument("--delay-ms", type=float, required=True, help="each way")
    args = ap.parse_args()
    asyncio.run(serve(args.listen, args.to, args.delay_ms / 1000))


if __name__ == "__main__":
    main()
