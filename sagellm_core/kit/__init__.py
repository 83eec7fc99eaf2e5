"""What plugin authors build on beyond the hookspecs and value types: base
classes for common plugin shapes and helpers for testing plugins."""
