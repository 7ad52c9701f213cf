#!/usr/bin/env python3
"""A webhook receiver: the someone that alerts reach in the rehearsal. An HTTP server
(python3's http.server, stdlib only) that answers every POST 200 and appends its body,
with the time it came (`received`, Unix seconds), one JSON document a line, to a file; Alertmanager's webhook posts each notification
there (firing and resolved). The rehearsal copies this file to the monitoring machine,
runs it there as a transient unit, and reads the file over SSH.

Bounded: a body over MAX_BODY bytes is answered 413 and not kept; once the file holds
MAX_FILE bytes, notifications are answered 200 and counted, not kept (a line says so).

    webhook.py ADDRESS:PORT FILE
"""

from __future__ import annotations

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

#: Largest notification kept: Alertmanager's for a few dozen alerts is tens of KiB.
MAX_BODY = 1 << 20
#: Most bytes the file may hold: a rehearsal's notifications are a few dozen.
MAX_FILE = 16 << 20


class Receiver(BaseHTTPRequestHandler):
    out: Path
    lock = threading.Lock()
    dropped = 0

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            self.send_response(413)
            self.end_headers()
            return
        body = self.rfile.read(length)
        try:
            doc = json.loads(body)
        except ValueError:
            doc = {"unparsed": body.decode(errors="replace")}
        line = json.dumps({"received": time.time(), "path": self.path, "body": doc}) + "\n"
        with self.lock:
            size = self.out.stat().st_size if self.out.exists() else 0
            with open(self.out, "a") as f:
                if size + len(line) <= MAX_FILE:
                    f.write(line)
                else:
                    Receiver.dropped += 1
                    if Receiver.dropped == 1:
                        f.write(json.dumps({"dropped": "the file is full"}) + "\n")
        self.send_response(200)
        self.end_headers()

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (http.server's name)
        sys.stderr.write(f"webhook: {self.address_string()} {format % args}\n")


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    host, port = sys.argv[1].rsplit(":", 1)
    Receiver.out = Path(sys.argv[2])
    Receiver.out.parent.mkdir(parents=True, exist_ok=True)
    server = ThreadingHTTPServer((host, int(port)), Receiver)
    print(f"webhook: listening on {host}:{port}, writing {Receiver.out}", file=sys.stderr, flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
