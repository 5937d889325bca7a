"""The per-node ElasticMoE agent: transport, membership, gossip, consensus, store, admin and CLI."""
