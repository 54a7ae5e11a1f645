"""Steps to and from other formats: one step exported to a single file, stock DCP directories adopted."""
