"""The aggregator's backends, one folder each (docs/architecture.md, "Folders and layers")."""
