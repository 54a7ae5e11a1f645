"""Optional integrations with training frameworks (each imports its framework only when imported itself)."""
