"""The method table: "Service/Method" -> (request class, reply class) for every peer-to-peer RPC.

Built from the generated descriptors of proto/elasticmoe/v1/{gossip,consensus}.proto, so a method added to
either service appears here (and on the wire) without editing this file. Both transports use it: the real
one to register generic handlers and (de)serialise, the simulated one to copy messages through bytes.
"""

from __future__ import annotations

from types import ModuleType

from google.protobuf.message import Message

from elasticmoe.v1 import consensus_pb2, gossip_pb2

MessageClass = type[Message]

# short service name -> (generated module, full protobuf service name)
_SERVICES: dict[str, ModuleType] = {"Gossip": gossip_pb2, "Consensus": consensus_pb2}


def _build() -> tuple[dict[str, tuple[MessageClass, MessageClass]], dict[str, str]]:
    methods: dict[str, tuple[MessageClass, MessageClass]] = {}
    full: dict[str, str] = {}
    for short, mod in _SERVICES.items():
        svc = mod.DESCRIPTOR.services_by_name[short]
        full[short] = svc.full_name
        for m in svc.methods:
            req = getattr(mod, m.input_type.name)
            rep = getattr(mod, m.output_type.name)
            methods[f"{short}/{m.name}"] = (req, rep)
    return methods, full


METHODS, SERVICE_FULL_NAMES = _build()


def lookup(method: str) -> tuple[MessageClass, MessageClass]:
    """(request class, reply class) of "Service/Method"; KeyError naming the method if unknown."""
    try:
        return METHODS[method]
    except KeyError:
        raise KeyError(f"unknown method {method!r}: expected one of {sorted(METHODS)}") from None


def grpc_path(method: str) -> str:
    """"Gossip/Probe" -> "/elasticmoe.v1.Gossip/Probe"."""
    service, _, name = method.partition("/")
    return f"/{SERVICE_FULL_NAMES[service]}/{name}"
