"""The versions of every format that crosses a process or a restart, and the one compatibility rule.

Rule: release N interoperates with release N-1 in one cluster, both ways (a rolling upgrade runs them side by
side, one node at a time; a node may go back to N-1). What a release meets that is newer than it knows and
that it cannot read, it refuses with an error naming both versions; it never reads it as something else.

Formats and how each is versioned:

- gRPC between agents (Gossip, Consensus), the admin service and the shim link (`WIRE_VERSION`): every
  call carries the caller's version in the `emoe-wire` metadata and every answer the server's (releases
  before versions send none: version 1). An agent serves and accepts answers only within one version of its
  own (`wire_refusal`); beyond that a call is refused with FAILED_PRECONDITION naming both versions (health
  and reflection, which standard clients call, are never refused). Messages change by protobuf's rules only:
  a new field takes a new number (never a reused or renumbered one) and means nothing where unset, so an
  older reader, which skips it, reads the rest as before; a new RPC is answered UNIMPLEMENTED by an older
  server, which the caller must take as "not supported there" (never as a failure of the other calls); a
  change of meaning takes a new field or a new RPC, never an old one.
- Capabilities within a wire version: an agent answers with `CONTROL_SIGNED_KEY` when it signs the control
  records it accepts (agent/consensus/controlnode.py); a peer's answer without it says the peer runs a release
  before that, whose voter name may then stand unsigned in a certified control record (a rolling upgrade).
- The signed load window (agent/gossip/windowguard.py `window_payload`): fields 1 to 13 are signed one by one, as
  they always were; any later field, known to the signer or not, is signed as the bytes of its encoding, so
  an agent verifies the windows of a release that added fields it does not know (and a relay cannot add
  any). Such a field must be a scalar, bytes or a repeated scalar (a map has no canonical encoding).
- The consensus log (agent/storage/store.py, `STORE_FORMAT`): framed records of a kind each. A log of format 1 holds
  kinds 1 to 4 and no format record; a later format is announced by a format record before any record of
  it. A log with a format record above `STORE_FORMAT`, or a whole record (its crc checks) of a kind this
  release does not know, was written by a newer release: the store refuses to open it (StoreNewer, naming
  both), and neither truncates nor changes it. So a new record kind needs no new format (an older release
  refuses the log at its first record of that kind, and reads it while there is none: a downgrade works
  until the new kind is used); a new format is for records of an existing kind that change meaning, and it
  makes every log the newer release opens unreadable to older ones.
- The data_dir (agent/storage/datadir.py, `DATADIR_FORMAT`): its layout (LOCK, IDENTITY, the log and its mark) is
  named by the `FORMAT` file (absent: 1). An agent refuses a data_dir of a newer format naming both.
- The log's high-water mark carries its own magic (`EMK1`); a mark of another magic is not read (a warning;
  the cut-log check is skipped once), never misread.
- Configuration files are not versioned: a key a release does not know stops it at start, naming the key.
  During a rolling upgrade, keep the configs to the keys the older release knows until every node runs the
  newer one.
"""

from __future__ import annotations

WIRE_KEY = "emoe-wire"  # gRPC metadata: the caller's (and the answering server's) wire version
WIRE_VERSION = 2  # 1: the releases before versions (they send none); 2: this one
# A capability within a wire version: an agent that signs the control records it accepts answers every call
# with this metadata key (value "1"); a peer whose answer lacks it runs a release before control signatures
CONTROL_SIGNED_KEY = "emoe-control-signed"
STORE_FORMAT = 1  # the consensus log's record format (no format record: 1)
DATADIR_FORMAT = 1  # the data_dir's layout (no FORMAT file: 1)


def wire_of(value: str | bytes | None) -> int:
    """A peer's wire version from its `emoe-wire` metadata value (absent: a release before versions, 1); -1
    when it is not a positive integer."""
    if value is None:
        return 1
    text = value.decode("ascii", "replace") if isinstance(value, bytes) else value
    return int(text) if text.isdigit() and 0 < int(text) < 1 << 31 else -1


def wire_refusal(peer: int, who: str) -> str:
    """Why this release cannot talk to `who` at wire version `peer` ("" when it can: within one version)."""
    if abs(peer - WIRE_VERSION) <= 1:
        return ""
    if peer < 0:
        return f"{who} sent a wire version that is not a positive integer ({WIRE_KEY} metadata)"
    newer = "newer" if peer > WIRE_VERSION else "older"
    return (f"{who} speaks wire version {peer}, this agent {WIRE_VERSION}: releases more than one version "
            f"apart do not interoperate ({who} is {newer}); upgrade one release at a time")
