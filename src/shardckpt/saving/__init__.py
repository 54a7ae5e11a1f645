"""The save path: when to save (policy), staging into host memory, writing and committing a step."""
