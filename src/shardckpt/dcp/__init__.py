"""The DCP codec: the checked writer, the checked reader, the load planner. Knows no tier."""
