"""Per-instance agents ("llumlets") and the engines they drive."""
