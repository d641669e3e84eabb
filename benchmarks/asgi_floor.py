"""The least a front end on uvicorn costs per request: a raw ASGI app that reads the body and
sends a fixed answer, on the front ends' own server settings, under the serving benchmark's load.

    python -m benchmarks.asgi_floor [--conc 64] [--seconds 6]

Serves :func:`app` with uvicorn (the front ends' loop and HTTP protocol:
``service.frontend.server.LOOP``/``HTTP``, one process, no access log), drives it with ``wrk``
posting the serving benchmark's body (one MNIST PNG, multipart, keep-alive, loopback only,
bounded in time) and prints req/s and the server's CPU µs per request, read from ``/proc``.
The answer is as long as ``/v1/predict``'s for that image. No decoding, no engine, no metrics:
what is left is HTTP parsing, the ASGI cycle, the event loop and the socket writes, the floor
under which no change to the request path can take a front end (issue 35, item 6; compare
``python -m benchmarks.profile_serve``'s front-end line; docs/benchmarks.md, "Where a front
end's CPU goes").
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from starlette.types import Receive, Scope, Send

from benchmarks.engine import process_thread_cpu
from benchmarks.serving import BOUNDARY, _free_port, _pngs, multipart, wrk

#: ``/v1/predict``'s answer as sent (the default model's, top 5, for ``examples/digit-3.png``).
ANSWER = (
    b'{"model":"cnn4-lle-vgn-doe-mnist","model_version":"4.0.0","results":[{"prediction":3,"la'
    b'bel":"3","probabilities":[{"label":"3","probability":0.9996430277824402},{"label":"2","p'
    b'robability":0.0003553604183252901},{"label":"0","probability":1.285300072595419e-06},{"l'
    b'abel":"7","probability":1.3454626923703472e-07},{"label":"5","probability":8.09433444715'
    b'0686e-08}],"vgmu":0.00035697221755981445,"snr":1117.5362548828125,"tu":0.001390713732689'
    b'619,"au":0.0012732435716316104,"eu":0.00011747016105800867,"abstain":false,"abstain_k":1'
    b'4.142309954592122,"input_check":"ok"}]}'
)
_HEAD = [(b"content-type", b"application/json"), (b"content-length", str(len(ANSWER)).encode())]


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    """Read the whole body, answer :data:`ANSWER`."""
    if scope["type"] != "http":
        return
    more = True
    while more:
        more = (await receive()).get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": _HEAD})
    await send({"type": "http.response.body", "body": ANSWER})


def serve(port: int) -> None:
    """Run :func:`app` on 127.0.0.1:``port`` as a front end's uvicorn runs (until killed)."""
    import uvicorn

    from service.frontend.server import HTTP, LOOP

    uvicorn.run(app, host="127.0.0.1", port=port, loop=LOOP, http=HTTP, log_level="warning",
                access_log=False)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.asgi_floor")
    parser.add_argument("--conc", type=int, default=64, help="wrk connections")
    parser.add_argument("--seconds", type=float, default=6.0, help="measured seconds")
    parser.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve is not None:
        serve(args.serve)
        return 0
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "benchmarks.asgi_floor", "--serve", str(port)])
    try:
        with tempfile.TemporaryDirectory(prefix="vge-floor-") as tmp:
            body = Path(tmp) / "one.bin"
            body.write_bytes(multipart(_pngs(1)))
            ctype = f"multipart/form-data; boundary={BOUNDARY}"
            url = f"http://127.0.0.1:{port}/v1/predict"
            deadline = time.monotonic() + 30
            while True:  # ready once it accepts connections
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    if time.monotonic() > deadline or server.poll() is not None:
                        raise
                    time.sleep(0.2)
            wrk(url, body, ctype, "", args.conc, 2)  # warm-up
            before = sum(process_thread_cpu(server.pid).values())
            r = wrk(url, body, ctype, "", args.conc, args.seconds)
            used = sum(process_thread_cpu(server.pid).values()) - before
    finally:
        server.kill()
        server.wait()
    print(f"raw ASGI app on uvicorn, c={args.conc}: {r['rps']:,.0f} req/s, p99 {r['p99']:.1f} ms; "
          f"server CPU {used / (r['rps'] * args.seconds) * 1e6:,.0f} µs per request")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
