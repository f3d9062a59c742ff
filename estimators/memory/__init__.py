"""From a trace to bytes: the caching-allocator model, workspaces, snapshots, timelines."""
