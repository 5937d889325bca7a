"""Generated protobuf and gRPC code for the ElasticMoE wire contracts."""
