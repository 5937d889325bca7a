"""A signed load window of a newer release, carrying fields this one does not know, verifies here (they are
signed as the bytes of their encoding, agent/gossip/windowguard.py), survives relaying, and a relay cannot add one."""

from __future__ import annotations

from pathlib import Path

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import Message

from agent.consensus.signing import VoteSigner
from agent.gossip.windowguard import WindowGuard, later_fields, window_payload
from agent.security import write_dev_certs
from elasticmoe.v1 import gossip_pb2 as gpb


def _newer_window_class() -> type[Message]:
    """LoadWindow as a newer release might define it: two fields this release does not know."""
    fdp = descriptor_pb2.FileDescriptorProto()
    gpb.DESCRIPTOR.CopyToProto(fdp)
    fdp.name = "newer/gossip.proto"  # (in a pool of its own)
    msg = next(m for m in fdp.message_type if m.name == "LoadWindow")
    F = descriptor_pb2.FieldDescriptorProto
    msg.field.add(name="future", number=900, type=F.TYPE_UINT32, label=F.LABEL_OPTIONAL)
    msg.field.add(name="future_blob", number=901, type=F.TYPE_BYTES, label=F.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("elasticmoe.v1.LoadWindow"))  # type: ignore[no-any-return]


def test_a_window_with_fields_this_release_does_not_know_verifies_and_a_relay_cannot_add_one(tmp_path: Path) -> None:
    write_dev_certs(tmp_path, ["n1"])
    signer = VoteSigner.from_cert_dir(tmp_path, "n1")
    Newer = _newer_window_class()
    fields = dict(node_id="n1", incarnation=1, window_seq=5, layers=1, experts=2, counts=b"\x01" * 8, steps=10,
                  samples=b"zz", sample_every=10)
    new = Newer(**fields, future=7, future_blob=b"later")
    new.signature = signer.sign_window(window_payload(new))  # type: ignore[arg-type]  # as the newer release signs
    new.certificate = signer.cert_der
    here = gpb.LoadWindow.FromString(new.SerializeToString())  # what this release receives: 900, 901 unknown
    assert later_fields(here) and window_payload(here) == window_payload(new)  # type: ignore[arg-type]
    relayed = gpb.PushRequest(from_node="n2", windows=[here])  # relayed by this release, then received again
    again = gpb.PushRequest.FromString(relayed.SerializeToString()).windows[0]
    assert again.SerializeToString() == here.SerializeToString()
    guard = WindowGuard(signer)
    assert guard.accept(again, 1, None) and guard.refused_total == 0
    forged = gpb.LoadWindow.FromString(here.SerializeToString() + b"\x80\x01\x01")  # a relay adds field 16
    assert not guard.accept(forged, 1, None) and guard.refused_total == 1
    # a window of this release (no later fields) signs as the releases before: no trailer in its payload
    mine = gpb.LoadWindow(**fields)
    assert later_fields(mine) == b"" and b"\x00later" not in window_payload(mine)
