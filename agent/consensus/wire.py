"""RoutingTable <-> consensus_pb2.RoutingTable: one encoder and one decoder (checking the content hash on the
way in), shared with the shim in dataplane_shim.certify and re-exported here for the agent."""

from __future__ import annotations

from dataplane_shim.certify import TableWireError as TableWireError
from dataplane_shim.certify import table_from_pb as table_from_pb
from dataplane_shim.certify import table_to_pb as table_to_pb
