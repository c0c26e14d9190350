#!/usr/bin/env python3
"""Holds N idle connections open against a server: each sends half a request line and waits.

The serving yardstick's disturbance: run it beside `kvlab bench serve --url ...` and compare
the workload's requests/s and p99 TTFT with and without it. A connection the server closes
(its header deadline) is opened again at once, so N stay open the whole time.

  python3 bench/idle_connections.py 127.0.0.1:8000 200 --seconds 60
"""
import argparse
import selectors
import socket
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("address", help="HOST:PORT")
    ap.add_argument("count", type=int)
    ap.add_argument("--seconds", type=float, default=60)
    a = ap.parse_args()
    host, port = a.address.rsplit(":", 1)
    sel = selectors.DefaultSelector()

    def open_one():
        s = socket.create_connection((host, int(port)))
        s.sendall(b"POST /v1/compl")
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)

    for _ in range(a.count):
        open_one()
    reopened = 0
    end = time.monotonic() + a.seconds
    while time.monotonic() < end:
        for key, _ in sel.select(timeout=0.5):
            s = key.fileobj
            try:
                data = s.recv(4096)
            except (BlockingIOError, ConnectionResetError):
                data = b""
            if not data:  # closed (a 408 came first): replace it
                sel.unregister(s)
                s.close()
                open_one()
                reopened += 1
    print("held %d idle connections for %.0f s (%d reopened after the server closed them)"
          % (a.count, a.seconds, reopened))


if __name__ == "__main__":
    main()
