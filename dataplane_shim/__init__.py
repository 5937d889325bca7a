"""In-engine data-plane shim: versioned device tables, version counters, router, adapters."""
