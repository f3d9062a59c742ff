"""From a trace to bytes: events prepared and replayed, the caching-allocator model, workspaces,
snapshots, timelines."""
