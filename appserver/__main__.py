# A Ctrl-C while the CLI imports (a second or so on a slow host) is held until the imports are
# done, then said as one line and exit 130, as a Ctrl-C while `run` or `chat` connects: raised in
# the middle of an import it was a traceback (or a RuntimeError, inside a dataclass being built).
import signal
import sys

_held: list[int] = []
_hold = signal.getsignal(signal.SIGINT) is signal.default_int_handler  # (an ignored SIGINT stays ignored)
if _hold:
    signal.signal(signal.SIGINT, lambda signum, frame: _held.append(signum))

from appserver.cli.main import interrupted, run  # noqa: E402

if _hold:
    signal.signal(signal.SIGINT, signal.default_int_handler)
if _held:
    interrupted(sys.argv[1:])
run()
