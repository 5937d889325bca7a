"""The exit statuses of every `emoe` command: one scheme, so that a script can tell a refusal from a typo
from an agent it cannot reach (README's CLI section says the same)."""

from __future__ import annotations

OK = 0
# the command ran and what it asked for failed or was refused: a proposal, drain or restore refused, a commit
# not installed within --install-timeout, a version the agent does not hold, an agent that answers that it
# is not serving, a store found corrupt, a load replay whose agents never closed a window
FAILED = 1
# usage or bad input, found before anything changed: an unknown option, an out-of-range number, a bad
# address, an unreadable config, trace or certificate directory, a request the agent calls invalid
USAGE = 2
# no answer from the agent: connection refused or closed, TLS handshake failed, nothing within --timeout
UNREACHABLE = 3
INTERRUPTED = 130  # Ctrl-C (128 + SIGINT), as the shell reports it
# stdout's reader went away (`emoe status --json | head -1`): 128 + SIGPIPE, what the shell reports for cat,
# seq or git cut off the same way, so `set -o pipefail` scripts already treat it as theirs. Not 0: the
# output was not all delivered; not 1: that means the command itself failed.
CLOSED_PIPE = 141

EPILOG = ("exit status: 0 ok; 1 what was asked failed or was refused; 2 usage or bad input (nothing changed); "
          "3 the agent could not be reached (refused, closed, TLS failed, no answer within --timeout); "
          "130 interrupted; 141 stdout's reader went away")
