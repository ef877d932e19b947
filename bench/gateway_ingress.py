"""Channel ingress: messages from a (fake) chat platform through the gateway into turns and back.

Starts the loopback fake chat platform and a real `appserver serve --channels fakechat` with the
`echo` agent, sends messages at a steady rate spread over several chats, and prints, per rate:
inbound→submit latency (the ledger's receipt to the server storing the turn) p50/p99, end-to-end
messages/s, and the loss/duplicate/order check. Target (issue 15): p50 ≤ 5 ms.

    .venv/bin/python bench/gateway_ingress.py [--rates 20,100,200] [--seconds 5] [--chats 20]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.fakes.fakechat import FakeChat  # noqa: E402
from tests.support.gateway import channel_server, fakechat_home  # noqa: E402
from tests.support.gateway_load import run_load  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="20,100,200", help="messages per second, comma-separated")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--chats", type=int, default=20)
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    print(f"{'rate/s':>7} {'msgs':>6} {'p50 ms':>8} {'p99 ms':>8} {'done/s':>8} {'drain s':>8}  check")
    worst_p50 = 0.0
    for rate in rates:
        with tempfile.TemporaryDirectory() as tmp, FakeChat() as chat:
            home = fakechat_home(Path(tmp) / "home", chat, chat_rate=100)
            with channel_server(home):
                r = run_load(chat, home, rate=rate, seconds=args.seconds, chats=args.chats)
        ok = not (r.lost or r.duplicated or r.out_of_order) and r.replies == r.sent
        check = "ok" if ok else f"LOST {len(r.lost)} DUP {len(r.duplicated)} ORDER {len(r.out_of_order)}"
        print(
            f"{rate:>7.0f} {r.sent:>6} {r.p50_ms:>8.1f} {r.p99_ms:>8.1f} {r.messages_per_s:>8.1f}"
            f" {r.drain_s:>8.1f}  {check}"
        )
        worst_p50 = max(worst_p50, r.p50_ms)
    print(f"inbound→submit p50 worst {worst_p50:.1f} ms (target ≤ 5 ms): ratio {worst_p50 / 5.0:.2f}× the target")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
