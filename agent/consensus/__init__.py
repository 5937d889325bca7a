"""Quorum commit of versioned routing tables: one single-decree Paxos slot per table version.

paxos.py holds the sans-IO acceptor/proposer/certificate logic, node.py drives it over a Transport and a
Clock, wire.py converts RoutingTable <-> consensus_pb2.RoutingTable.
"""
